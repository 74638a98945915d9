//! The pipelines overview: each pipeline's figures as its status shows them
//! (no Redis read), and a short history of them for sparklines, sampled
//! from a watch of the StreamConsumerGroups the console can see.

use futures::StreamExt as _;
use k8s_openapi::jiff::Timestamp;
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt as _, watcher};
use kube::{Api, Client, ResourceExt as _};
use serde::{Deserialize, Serialize};
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use streamfleet_crd::{Health, StreamConsumerGroup, StreamConsumerGroupStatus};

/// How often a point is taken, and how many are kept (15 minutes).
pub const SAMPLE_EVERY: Duration = Duration::from_secs(10);
pub const POINTS: usize = 90;

/// One pipeline at one moment.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Point {
    /// Unix seconds.
    pub at: i64,
    /// Seconds since the oldest unfinished entry was added; `None` unknown.
    pub delay_seconds: Option<i64>,
    pub lag: Option<i64>,
    pub pending: Option<i64>,
    pub in_per_second: Option<f64>,
    pub out_per_second: Option<f64>,
}

/// A pipeline as the overview shows it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PipelineSummary {
    pub name: String,
    pub stream: String,
    pub group: String,
    /// `Healthy`, `Lagging`, … (`Unknown` before the first reading).
    pub health: String,
    /// The `Ready` condition's status and message.
    pub ready: Option<String>,
    pub ready_message: Option<String>,
    #[serde(flatten)]
    pub now: Point,
    pub replicas_desired: Option<i32>,
    pub replicas_current: Option<i32>,
    pub dead_letters: Option<i64>,
    pub retrying: Option<i64>,
    /// `spec.suspend`: paused, no workers.
    pub suspended: bool,
    /// Oldest first, every [`SAMPLE_EVERY`].
    pub history: Vec<Point>,
}

/// A list as Kubernetes clients expect one (`kind`, `apiVersion`, `items`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PipelineList {
    pub kind: String,
    pub api_version: String,
    pub items: Vec<PipelineSummary>,
}

/// What the overview keeps of a pipeline: its spec's names and its status;
/// not the worker template, managed fields or the last-applied annotation
/// (memory, with thousands of pipelines).
fn slim(scg: &mut StreamConsumerGroup) {
    scg.managed_fields_mut().clear();
    scg.annotations_mut().clear();
    scg.spec.worker.template = Default::default();
}

fn point(scg: &StreamConsumerGroup, now: Timestamp) -> Point {
    let status = scg.status.as_ref();
    let throughput = status.and_then(|s| s.throughput.as_ref());
    Point {
        at: now.as_second(),
        delay_seconds: status.and_then(|s| delay_seconds(s, now)),
        lag: status.and_then(|s| s.lag),
        pending: status.and_then(|s| s.pending),
        in_per_second: throughput.map(|t| t.in_per_second),
        out_per_second: throughput.map(|t| t.out_per_second),
    }
}

/// The delay as the status tells it: the age of the oldest unfinished
/// entry; 0 only when the status says nothing is unfinished (lag and
/// pending read as 0, health known); unknown otherwise (not inspected, IDs
/// that are not times, a failed read), never a made-up 0.
fn delay_seconds(status: &StreamConsumerGroupStatus, now: Timestamp) -> Option<i64> {
    if let Some(t) = &status.oldest_unfinished_time {
        return Some(now.duration_since(t.0).as_secs().max(0));
    }
    let delay_unknown = status.conditions.iter().any(|c| c.type_ == "DelayUnknown" && c.status == "True");
    let health_known = status.health.as_ref().is_some_and(|h| !matches!(h, Health::Unknown));
    let idle = status.lag == Some(0) && status.pending == Some(0);
    (idle && health_known && !delay_unknown).then_some(0)
}

pub fn summary(scg: &StreamConsumerGroup, history: Vec<Point>, now: Timestamp) -> PipelineSummary {
    let status = scg.status.as_ref();
    let ready = status.and_then(|s| s.conditions.iter().find(|c| c.type_ == "Ready"));
    PipelineSummary {
        name: scg.name_any(),
        stream: scg.spec.stream.clone(),
        group: scg.spec.group.clone(),
        health: status
            .and_then(|s| s.health.as_ref())
            .and_then(|h| serde_json::to_value(h).ok())
            .and_then(|v| v.as_str().map(String::from))
            .unwrap_or_else(|| "Unknown".into()),
        ready: ready.map(|c| c.status.clone()),
        ready_message: ready.map(|c| c.message.clone()),
        now: point(scg, now),
        replicas_desired: status.and_then(|s| s.replicas.as_ref()).map(|r| r.desired),
        replicas_current: status.and_then(|s| s.replicas.as_ref()).map(|r| r.current),
        dead_letters: status.and_then(|s| s.dead_letter_length),
        retrying: status.and_then(|s| s.retrying.as_ref()).map(|r| r.entries),
        suspended: scg.spec.suspend,
        history,
    }
}

/// The watched pipelines and their history.
#[derive(Clone)]
pub struct Overview {
    pub store: Store<StreamConsumerGroup>,
    /// uid → points, oldest first.
    history: Arc<Mutex<HashMap<String, VecDeque<Point>>>>,
}

impl Overview {
    /// Starts the watch (of `namespace`, or all) and the sampler; both run
    /// as long as the process.
    pub fn start(client: Client, namespace: Option<&str>) -> Self {
        let api: Api<StreamConsumerGroup> = match namespace {
            Some(ns) => Api::namespaced(client, ns),
            None => Api::all(client),
        };
        let (store, writer) = reflector::store();
        let watch = watcher(api, watcher::Config::default()).default_backoff().modify(slim).reflect(writer).for_each(
            |event| async move {
                if let Err(e) = event {
                    tracing::warn!(error = %e, "watching StreamConsumerGroups for the overview");
                }
            },
        );
        tokio::spawn(watch);
        let overview = Self { store, history: Arc::new(Mutex::new(HashMap::new())) };
        let sampler = overview.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(SAMPLE_EVERY);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
            loop {
                tick.tick().await;
                sampler.sample(Timestamp::now());
            }
        });
        overview
    }

    /// Whether the watch has listed the pipelines once: before that, an
    /// empty overview would say "none" where the truth is "not known yet".
    pub async fn synced(&self) -> bool {
        tokio::time::timeout(Duration::from_millis(1), self.store.wait_until_ready()).await.is_ok_and(|r| r.is_ok())
    }

    /// One point for every pipeline; forgets pipelines gone.
    pub fn sample(&self, now: Timestamp) {
        let pipelines = self.store.state();
        let uids: std::collections::HashSet<String> = pipelines.iter().filter_map(|p| p.uid()).collect();
        let Ok(mut history) = self.history.lock() else { return };
        history.retain(|uid, _| uids.contains(uid));
        for scg in &pipelines {
            let points = history.entry(scg.uid().unwrap_or_default()).or_default();
            points.push_back(point(scg, now));
            while points.len() > POINTS {
                points.pop_front();
            }
        }
    }

    /// The pipelines of `namespace`, by name (only their history copied).
    pub fn list(&self, namespace: &str, now: Timestamp) -> PipelineList {
        let pipelines: Vec<_> =
            self.store.state().into_iter().filter(|scg| scg.namespace().as_deref() == Some(namespace)).collect();
        let history = self.history.lock();
        let mut items: Vec<PipelineSummary> = pipelines
            .iter()
            .map(|scg| {
                let points = history
                    .as_ref()
                    .ok()
                    .and_then(|h| h.get(&scg.uid().unwrap_or_default()).map(|p| p.iter().cloned().collect()));
                summary(scg, points.unwrap_or_default(), now)
            })
            .collect();
        drop(history);
        items.sort_by(|a, b| a.name.cmp(&b.name));
        PipelineList {
            kind: "PipelineList".into(),
            api_version: format!("{}/{}", super::wire::GROUP, super::wire::VERSION),
            items,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scg(status: serde_json::Value) -> StreamConsumerGroup {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "streamfleet.io/v1alpha1", "kind": "StreamConsumerGroup",
            "metadata": {"name": "orders", "namespace": "shop", "uid": "u1"},
            "spec": {"stream": "orders", "group": "billing", "redis": {"urlSecretRef": {"name": "r", "key": "url"}},
                     "worker": {"template": {"spec": {"containers": []}}}},
            "status": status,
        }))
        .unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn a_summary_reads_the_status_and_unknown_stays_unknown() {
        let now: Timestamp = "2026-12-02T10:00:00Z".parse().unwrap_or_else(|e| panic!("{e}"));
        let late = scg(serde_json::json!({
            "oldestUnfinishedTime": "2026-12-02T09:59:00Z", "lag": 40, "pending": 3, "health": "Lagging",
            "throughput": {"inPerSecond": 12.5, "outPerSecond": 10.0},
            "replicas": {"desired": 3, "current": 2, "summary": "2/3"}, "deadLetterLength": 7,
            "conditions": [{"type": "Ready", "status": "True", "reason": "Ok", "message": "fine",
                            "lastTransitionTime": "2026-12-02T09:00:00Z"}],
        }));
        let s = summary(&late, Vec::new(), now);
        assert_eq!((s.health.as_str(), s.now.delay_seconds, s.now.lag), ("Lagging", Some(60), Some(40)));
        assert_eq!((s.now.in_per_second, s.replicas_current, s.dead_letters), (Some(12.5), Some(2), Some(7)));
        assert_eq!(s.ready.as_deref(), Some("True"));
        let unread = summary(&scg(serde_json::json!(null)), Vec::new(), now);
        assert_eq!((unread.health.as_str(), unread.now.delay_seconds, unread.now.lag), ("Unknown", None, None));
        // Not inspected (Redis unreachable): no oldest time, and no made-up 0.
        let failed = summary(&scg(serde_json::json!({"health": "Unknown"})), Vec::new(), now);
        assert_eq!(failed.now.delay_seconds, None);
        let not_times = scg(serde_json::json!({"health": "Healthy", "lag": 0, "pending": 0,
            "conditions": [{"type": "DelayUnknown", "status": "True", "reason": "NotTimes", "message": "",
                            "lastTransitionTime": "2026-12-02T09:00:00Z"}]}));
        assert_eq!(summary(&not_times, Vec::new(), now).now.delay_seconds, None);
        let waiting = summary(&scg(serde_json::json!({"health": "Healthy", "lag": 5, "pending": 0})), Vec::new(), now);
        assert_eq!(waiting.now.delay_seconds, None, "work waits but its age is not known");
        let idle = summary(&scg(serde_json::json!({"health": "Healthy", "lag": 0, "pending": 0})), Vec::new(), now);
        assert_eq!(idle.now.delay_seconds, Some(0), "nothing unfinished: no delay");
    }

    #[test]
    fn the_history_keeps_the_last_points_of_pipelines_that_exist_in_the_namespace_asked() {
        let (store, mut writer) = reflector::store();
        let overview = Overview { store, history: Arc::new(Mutex::new(HashMap::new())) };
        let mut other = scg(serde_json::json!({"health": "Healthy", "lag": 1}));
        other.metadata.namespace = Some("elsewhere".into());
        other.metadata.uid = Some("u2".into());
        writer.apply_watcher_event(&watcher::Event::Apply(scg(serde_json::json!({"health": "Healthy", "lag": 3}))));
        writer.apply_watcher_event(&watcher::Event::Apply(other.clone()));
        let t0: Timestamp = "2026-12-02T10:00:00Z".parse().unwrap_or_else(|e| panic!("{e}"));
        for i in 0..(POINTS as i64 + 5) {
            overview.sample(t0 + std::time::Duration::from_secs(10 * i as u64));
        }
        let list = overview.list("shop", t0);
        assert_eq!(list.items.len(), 1, "only the namespace asked");
        assert_eq!((list.kind.as_str(), list.items[0].history.len()), ("PipelineList", POINTS));
        assert_eq!(list.items[0].history[0].at, t0.as_second() + 50, "the oldest points dropped");
        assert_eq!(list.items[0].history[0].lag, Some(3));
        writer.apply_watcher_event(&watcher::Event::Delete(other));
        overview.sample(t0);
        assert_eq!(
            overview.history.lock().map(|h| h.len()).unwrap_or_default(),
            1,
            "a deleted pipeline's history goes"
        );
    }
}
