//! Prometheus metrics of the operator: per resource (labelled by namespace,
//! name, stream and group, so an alert names all four) the group's health
//! figures, limits and replicas; per controller the reconciles, their
//! duration, and errors by reason.

use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use streamfleet_crd::{Health, StreamConsumerGroup, StreamConsumerGroupStatus};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResourceLabels {
    pub namespace: String,
    pub name: String,
    pub stream: String,
    pub group: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct HealthLabels {
    pub namespace: String,
    pub name: String,
    pub stream: String,
    pub group: String,
    pub health: String,
}

impl ResourceLabels {
    fn with_health(&self, health: Health) -> HealthLabels {
        HealthLabels {
            namespace: self.namespace.clone(),
            name: self.name.clone(),
            stream: self.stream.clone(),
            group: self.group.clone(),
            health: format!("{health:?}"),
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ErrorLabels {
    pub namespace: String,
    pub name: String,
    pub reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BuildLabels {
    pub version: String,
}

const HEALTHS: [Health; 10] = [
    Health::Healthy,
    Health::Lagging,
    Health::Stalled,
    Health::Stopped,
    Health::Rewound,
    Health::Retrying,
    Health::PoisonForming,
    Health::PayloadLost,
    Health::Unknown,
    Health::Suspended,
];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct WriteLabels {
    pub manager: String,
}

pub struct Metrics {
    registry: Registry,
    writes: Family<WriteLabels, Counter>,
    /// Every resource's figures, rendered at scrape time.
    resources: Arc<ResourceSeries>,
    reconciles: Counter,
    errors: Family<ErrorLabels, Counter>,
    /// The error series each resource has, to drop them when it goes.
    errored: Mutex<std::collections::HashSet<ErrorLabels>>,
    duration: Histogram,
    /// 1 while this process leads (or runs without election).
    leader: Gauge,
}

/// Per-resource gauges: (metric name, help, how to read it from the status).
type Reader = fn(&StreamConsumerGroup, &StreamConsumerGroupStatus) -> Option<i64>;
const GAUGES: [(&str, &str, Reader); 17] = [
    ("streamfleet_delay_objective_seconds", "spec.scaling.delayObjectiveSeconds (absent when unset)", |scg, _| {
        scg.spec.scaling.delay_objective_seconds.map(i64::from)
    }),
    ("streamfleet_group_lag", "Entries not yet delivered to the group (absent when unknown)", |_, s| s.lag),
    ("streamfleet_group_pending", "Entries delivered and not acknowledged", |_, s| s.pending),
    ("streamfleet_group_oldest_pending_idle_seconds", "Idle time of the oldest pending entry", |_, s| {
        s.oldest_pending_idle_seconds.or(s.pending.map(|_| 0))
    }),
    ("streamfleet_group_max_deliveries", "Highest delivery count among the oldest pending entries", |_, s| {
        s.max_delivery_count.or(s.pending.map(|_| 0))
    }),
    ("streamfleet_group_max_deliveries_limit", "Deliveries after which an entry is dead-lettered (spec)", |scg, _| {
        Some(i64::from(scg.spec.recovery.max_deliveries))
    }),
    ("streamfleet_group_min_idle_seconds", "Idle time after which a pending entry may be claimed (spec)", |scg, _| {
        Some(scg.spec.recovery.min_idle_time_ms / 1000)
    }),
    ("streamfleet_group_consumers", "Consumers in the group", |_, s| s.consumers),
    ("streamfleet_group_retrying", "Pending entries waiting for a retry on the schedule", |_, s| {
        s.retrying.as_ref().map(|r| r.entries)
    }),
    (
        "streamfleet_group_retrying_last_attempt",
        "Entries waiting for a retry that is their last (maxDeliveries): dead-lettered if it fails",
        |_, s| s.retrying.as_ref().map(|r| r.on_last_attempt),
    ),
    ("streamfleet_dead_letter_length", "Entries in the dead-letter stream", |_, s| s.dead_letter_length),
    ("streamfleet_stream_length", "Entries in the stream", |_, s| s.stream_length),
    (
        "streamfleet_payload_lost",
        "Pending entries found with their payload gone, ever (absent when unknown)",
        |_, s| s.payload_lost.as_ref().map(|p| p.total),
    ),
    ("streamfleet_payload_lost_unacknowledged", "Lost payloads the user has not acknowledged", |_, s| {
        s.payload_lost.as_ref().map(|p| p.unacknowledged)
    }),
    ("streamfleet_replicas_desired", "Worker replicas the scaling policy asks for", |_, s| {
        s.replicas.as_ref().map(|r| i64::from(r.desired))
    }),
    ("streamfleet_replicas_current", "Worker replicas available", |_, s| {
        s.replicas.as_ref().map(|r| i64::from(r.current))
    }),
    (
        "streamfleet_recovery_failing",
        "1 while the recovery CronJob's last finished run failed, 0 once one succeeded (absent before any finished)",
        |_, s| {
            s.conditions
                .iter()
                .find(|c| c.type_ == crate::conditions::RECOVERY_FAILING)
                .map(|c| i64::from(c.status == "True"))
        },
    ),
];

type RateReader = fn(&StreamConsumerGroupStatus) -> Option<f64>;
const RATES: [(&str, &str, RateReader); 2] = [
    (
        "streamfleet_arrival_rate",
        "Entries added to the stream per second over the last 30 s (absent when unknown)",
        |s| s.throughput.as_ref().map(|t| t.in_per_second),
    ),
    (
        "streamfleet_completion_rate",
        "Entries finished (acked, dead-lettered) per second over the last 30 s (absent when unknown)",
        |s| s.throughput.as_ref().map(|t| t.out_per_second),
    ),
];

fn resource_labels(scg: &StreamConsumerGroup) -> ResourceLabels {
    ResourceLabels {
        namespace: scg.metadata.namespace.clone().unwrap_or_default(),
        name: scg.metadata.name.clone().unwrap_or_default(),
        stream: scg.spec.stream.clone(),
        group: scg.spec.group.clone(),
    }
}

/// One resource's figures. Kept as numbers beside one label set and
/// rendered at scrape time: a series object (with its own copy of the four
/// labels) per figure and resource made the metrics the largest part of
/// the operator's memory in a fleet of thousands.
#[derive(Debug)]
struct Figures {
    labels: ResourceLabels,
    gauges: [Option<i64>; GAUGES.len()],
    rates: [Option<f64>; RATES.len()],
    /// The exact delay of the last inspection (not in the status, which
    /// keeps a time that does not change every poll).
    delay: Option<f64>,
    /// The health classification, once a status was observed (`Some(None)`:
    /// observed, unclassified: every health series 0).
    health: Option<Option<Health>>,
}

/// Every resource's figures, by (namespace, name). Rendered after the
/// registry's own metrics, with help texts ending as theirs do.
#[derive(Debug, Default)]
struct ResourceSeries(Mutex<BTreeMap<(String, String), Figures>>);

const DELAY: (&str, &str) = (
    "streamfleet_delay_seconds",
    "Age of the oldest unfinished entry (pending or undelivered) against Redis TIME, at the last poll (absent when unknown)",
);
const HEALTH: (&str, &str) = ("streamfleet_health", "1 for the resource's current health classification");

impl ResourceSeries {
    /// Changes `scg`'s figures (labelled as its spec is now).
    fn update(&self, scg: &StreamConsumerGroup, change: impl FnOnce(&mut Figures)) {
        let labels = resource_labels(scg);
        let Ok(mut all) = self.0.lock() else { return };
        let figures = all.entry((labels.namespace.clone(), labels.name.clone())).or_insert_with(|| Figures {
            labels: labels.clone(),
            gauges: [None; GAUGES.len()],
            rates: [None; RATES.len()],
            delay: None,
            health: None,
        });
        figures.labels = labels;
        change(figures);
    }
}

/// A gauge's value as the registry's families render it: integers as
/// integers, rates and seconds as floats.
#[derive(Clone, Copy)]
enum Value {
    Integer(i64),
    Float(f64),
}

/// One gauge of every resource that has it; a figure no resource has
/// renders nothing (as a registry's family).
fn encode_gauge(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    series: &[(&ResourceLabels, Value)],
) -> std::fmt::Result {
    if series.is_empty() {
        return Ok(());
    }
    let mut metric = encoder.encode_descriptor(name, &format!("{help}."), None, MetricType::Gauge)?;
    for (labels, value) in series {
        let mut family = metric.encode_family(*labels)?;
        match value {
            Value::Integer(v) => family.encode_gauge(v)?,
            Value::Float(v) => family.encode_gauge(v)?,
        }
    }
    Ok(())
}

impl Collector for ResourceSeries {
    fn encode(&self, mut encoder: DescriptorEncoder) -> std::fmt::Result {
        let Ok(all) = self.0.lock() else { return Ok(()) };
        for (i, (name, help, _)) in GAUGES.iter().enumerate() {
            let series: Vec<_> =
                all.values().filter_map(|f| f.gauges[i].map(|v| (&f.labels, Value::Integer(v)))).collect();
            encode_gauge(&mut encoder, name, help, &series)?;
        }
        for (i, (name, help, _)) in RATES.iter().enumerate() {
            let series: Vec<_> =
                all.values().filter_map(|f| f.rates[i].map(|v| (&f.labels, Value::Float(v)))).collect();
            encode_gauge(&mut encoder, name, help, &series)?;
        }
        let series: Vec<_> = all.values().filter_map(|f| f.delay.map(|v| (&f.labels, Value::Float(v)))).collect();
        encode_gauge(&mut encoder, DELAY.0, DELAY.1, &series)?;
        let observed: Vec<&Figures> = all.values().filter(|f| f.health.is_some()).collect();
        if !observed.is_empty() {
            let mut metric = encoder.encode_descriptor(HEALTH.0, &format!("{}.", HEALTH.1), None, MetricType::Gauge)?;
            for f in observed {
                let current = f.health.flatten();
                for h in HEALTHS {
                    let labels = f.labels.with_health(h);
                    metric.encode_family(&labels)?.encode_gauge(&i64::from(current == Some(h)))?;
                }
            }
        }
        Ok(())
    }
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::default();
        let resources = Arc::new(ResourceSeries::default());
        registry.register_collector(Box::new(resources.clone()));
        let reconciles = Counter::default();
        registry.register("streamfleet_reconciles", "Reconciles run", reconciles.clone());
        let errors = Family::<ErrorLabels, Counter>::default();
        registry.register("streamfleet_reconcile_errors", "Failed reconciles by resource and reason", errors.clone());
        let duration = Histogram::new([0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]);
        registry.register("streamfleet_reconcile_duration_seconds", "Reconcile duration", duration.clone());
        let writes = Family::<WriteLabels, Counter>::default();
        registry.register("streamfleet_api_writes", "Kubernetes API writes by field manager", writes.clone());
        let leader = Gauge::default();
        registry.register("streamfleet_leader", "1 while this operator process leads and reconciles", leader.clone());
        let build = Family::<BuildLabels, Gauge>::default();
        build.get_or_create(&BuildLabels { version: env!("CARGO_PKG_VERSION").into() }).set(1);
        registry.register("streamfleet_build_info", "1, labelled with the operator's version", build);
        Self { registry, writes, resources, reconciles, errors, errored: Mutex::default(), duration, leader }
    }
}

impl Metrics {
    pub fn reconciled(&self, took: Duration) {
        self.reconciles.inc();
        self.duration.observe(took.as_secs_f64());
    }

    pub fn api_write(&self, manager: &str) {
        self.writes.get_or_create(&WriteLabels { manager: manager.to_string() }).inc();
    }

    /// A failed reconcile of `namespace/name`.
    pub fn failed(&self, namespace: &str, name: &str, reason: &str) {
        let labels = ErrorLabels { namespace: namespace.into(), name: name.into(), reason: reason.into() };
        self.errors.get_or_create(&labels).inc();
        if let Ok(mut errored) = self.errored.lock() {
            errored.insert(labels);
        }
    }

    /// Whether this process leads.
    pub fn leading(&self, leading: bool) {
        self.leader.set(i64::from(leading));
    }

    /// Sets the resource's gauges from its status; a figure the status lacks
    /// (an unknown lag, say) is removed rather than reported as zero.
    pub fn observe(&self, scg: &StreamConsumerGroup, status: &StreamConsumerGroupStatus) {
        self.resources.update(scg, |figures| {
            figures.gauges = GAUGES.map(|(_, _, read)| read(scg, status));
            figures.rates = RATES.map(|(_, _, read)| read(status));
            figures.health = Some(status.health);
        });
    }

    /// Sets the resource's delay from this poll's inspection (`None`:
    /// unknown, removed).
    pub fn observe_delay(&self, scg: &StreamConsumerGroup, delay: Option<Duration>) {
        self.resources.update(scg, |figures| figures.delay = delay.map(|d| d.as_secs_f64()));
    }

    /// Drops a deleted resource's series.
    pub fn forget(&self, namespace: &str, name: &str) {
        if let Ok(mut errored) = self.errored.lock() {
            errored.retain(|e| {
                let theirs = e.namespace == namespace && e.name == name;
                if theirs {
                    self.errors.remove(e);
                }
                !theirs
            });
        }
        if let Ok(mut resources) = self.resources.0.lock() {
            resources.remove(&(namespace.to_string(), name.to_string()));
        }
    }

    /// The Prometheus text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        if prometheus_client::encoding::text::encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use streamfleet_crd::ReplicaStatus;

    #[test]
    fn observed_status_is_rendered_and_unknown_lag_is_absent() {
        let m = Metrics::default();
        let mut s = StreamConsumerGroupStatus {
            lag: Some(42),
            pending: Some(3),
            health: Some(Health::Lagging),
            replicas: Some(ReplicaStatus { desired: 4, current: 2, summary: "2/4".into() }),
            throughput: Some(streamfleet_crd::ThroughputStatus {
                in_per_second: 12.5,
                out_per_second: 3.0,
                drains_in_seconds: None,
            }),
            ..Default::default()
        };
        let scg: StreamConsumerGroup = serde_json::from_value(serde_json::json!({
            "apiVersion": "streamfleet.io/v1alpha1", "kind": "StreamConsumerGroup",
            "metadata": {"name": "orders", "namespace": "shop"},
            "spec": {"redis": {"urlSecretRef": {"name": "r", "key": "url"}}, "stream": "orders", "group": "billing",
                     "recovery": {"minIdleTimeMs": 60000, "maxDeliveries": 5},
                     "worker": {"template": {"spec": {"containers": [{"name": "w", "image": "w"}]}}}}
        }))
        .unwrap();
        m.observe(&scg, &s);
        m.reconciled(Duration::from_millis(20));
        m.failed("shop", "orders", "RedisUnreachable");
        let text = m.render();
        let labels = r#"namespace="shop",name="orders",stream="orders",group="billing""#;
        assert!(text.contains(&format!("streamfleet_group_lag{{{labels}}} 42")), "{text}");
        assert!(text.contains(&format!("streamfleet_replicas_desired{{{labels}}} 4")));
        assert!(text.contains(&format!("streamfleet_arrival_rate{{{labels}}} 12.5")), "{text}");
        assert!(text.contains(&format!("streamfleet_completion_rate{{{labels}}} 3.0")), "{text}");
        assert!(text.contains(&format!("streamfleet_group_min_idle_seconds{{{labels}}} 60")));
        assert!(text.contains(&format!("streamfleet_group_max_deliveries_limit{{{labels}}} 5")));
        assert!(text.contains(&format!(r#"streamfleet_health{{{labels},health="Lagging"}} 1"#)));
        assert!(text.contains(&format!(r#"streamfleet_health{{{labels},health="Healthy"}} 0"#)));
        assert!(!text.contains("_count{"), "no gauge named like a histogram's count: {text}");
        assert!(
            text.contains(
                r#"streamfleet_reconcile_errors_total{namespace="shop",name="orders",reason="RedisUnreachable"} 1"#
            ),
            "{text}"
        );
        assert!(text.contains(&format!("streamfleet_build_info{{version=\"{}\"}} 1", env!("CARGO_PKG_VERSION"))));
        assert!(text.contains("streamfleet_leader 0"), "{text}");
        m.leading(true);
        assert!(m.render().contains("streamfleet_leader 1"));
        s.lag = None;
        m.observe(&scg, &s);
        assert!(!m.render().contains("streamfleet_group_lag{"), "unknown lag is not zero");
        s.throughput = None;
        m.observe(&scg, &s);
        assert!(!m.render().contains("streamfleet_arrival_rate{"), "unknown rates are not zero");
        m.observe_delay(&scg, Some(Duration::from_millis(12_345)));
        assert!(m.render().contains(&format!("streamfleet_delay_seconds{{{labels}}} 12.345")), "{}", m.render());
        m.observe_delay(&scg, None);
        assert!(!m.render().contains("streamfleet_delay_seconds{"), "an unknown delay is not zero");
        let now = k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(k8s_openapi::jiff::Timestamp::now());
        crate::conditions::set(
            &mut s.conditions,
            crate::conditions::RECOVERY_FAILING,
            true,
            "LastRunFailed",
            "",
            None,
            &now,
        );
        m.observe(&scg, &s);
        assert!(m.render().contains(&format!("streamfleet_recovery_failing{{{labels}}} 1")), "{}", m.render());
        m.forget("shop", "orders");
        assert!(!m.render().contains(r#"name="orders""#), "{}", m.render());
        assert!(!m.render().contains("streamfleet_group_lag"), "a figure no resource has renders nothing");
    }

    /// `docs/metrics.md` lists every family the operator serves, with its
    /// help text: the table is this render's, so it cannot drift.
    #[test]
    fn the_metrics_document_lists_every_family() {
        // Every family with a series: a family without one renders nothing
        // (a registry's, and the per-resource figures alike).
        let m = Metrics::default();
        let scg: StreamConsumerGroup = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "orders", "namespace": "shop"},
            "spec": {"redis": {"urlSecretRef": {"name": "r", "key": "url"}}, "stream": "orders", "group": "billing",
                     "scaling": {"delayObjectiveSeconds": 30},
                     "worker": {"template": {"spec": {"containers": [{"name": "w", "image": "w"}]}}}}
        }))
        .unwrap();
        let mut status: StreamConsumerGroupStatus = serde_json::from_value(serde_json::json!({
            "lag": 1, "pending": 1, "oldestPendingIdleSeconds": 1, "maxDeliveryCount": 1, "consumers": 1,
            "retrying": {"entries": 1, "onLastAttempt": 1, "atDelivery": []}, "deadLetterLength": 1, "streamLength": 1,
            "payloadLost": {"total": 1, "unacknowledged": 1, "latestIds": []},
            "replicas": {"desired": 1, "current": 1, "summary": "1/1"},
            "throughput": {"inPerSecond": 1.0, "outPerSecond": 1.0}
        }))
        .unwrap();
        let now = k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(k8s_openapi::jiff::Timestamp::now());
        crate::conditions::set(&mut status.conditions, crate::conditions::RECOVERY_FAILING, false, "", "", None, &now);
        m.observe(&scg, &status);
        m.observe_delay(&scg, Some(Duration::from_secs(1)));
        m.failed("shop", "orders", "RedisUnreachable");
        m.api_write("streamfleet-status");
        m.reconciled(Duration::from_millis(1));
        let text = m.render();
        let mut table = String::new();
        let mut help = None;
        for line in text.lines() {
            if let Some(h) = line.strip_prefix("# HELP ") {
                help = h.split_once(' ');
            } else if let (Some(t), Some((name, help))) = (line.strip_prefix("# TYPE "), help.take()) {
                let kind = t.split_once(' ').map_or("", |(_, k)| k);
                let series = if kind == "counter" { format!("{name}_total") } else { name.to_string() };
                let labels = text
                    .lines()
                    .find(|l| l.starts_with(&format!("{series}{{")))
                    .and_then(|l| l.split_once('{'))
                    .and_then(|(_, rest)| rest.split_once('}'))
                    .map(|(labels, _)| labels.split(',').filter_map(|kv| kv.split_once('=')).map(|(k, _)| k).collect())
                    .unwrap_or_else(Vec::<&str>::new)
                    .join(", ");
                table.push_str(&format!("| `{series}` | {kind} | {labels} | {help} |\n"));
            }
        }
        let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/metrics.md")).unwrap();
        assert!(doc.contains(&table), "docs/metrics.md should carry this table:\n{table}");
    }
}
