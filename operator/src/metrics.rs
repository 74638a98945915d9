//! Prometheus metrics of the operator: per resource (labelled by namespace
//! and name) the group's health figures and replicas; per controller the
//! reconciles, their duration, and errors by reason.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use std::time::Duration;
use streamfleet_crd::{Health, StreamConsumerGroupStatus};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResourceLabels {
    pub namespace: String,
    pub name: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct HealthLabels {
    pub namespace: String,
    pub name: String,
    pub health: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    pub reason: String,
}

const HEALTHS: [Health; 6] =
    [Health::Healthy, Health::Backlogged, Health::Stalled, Health::PoisonForming, Health::PayloadLost, Health::Unknown];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct WriteLabels {
    pub manager: String,
}

pub struct Metrics {
    registry: Registry,
    writes: Family<WriteLabels, Counter>,
    gauges: Vec<(&'static str, Family<ResourceLabels, Gauge>)>,
    health: Family<HealthLabels, Gauge>,
    reconciles: Counter,
    errors: Family<ReasonLabels, Counter>,
    duration: Histogram,
}

/// Per-resource gauges: (metric name, help, how to read it from the status).
type Reader = fn(&StreamConsumerGroupStatus) -> Option<i64>;
const GAUGES: [(&str, &str, Reader); 11] = [
    ("streamfleet_group_lag", "Entries not yet delivered to the group (absent when unknown)", |s| s.lag),
    ("streamfleet_group_pending", "Entries delivered and not acknowledged", |s| s.pending),
    ("streamfleet_group_oldest_pending_idle_seconds", "Idle time of the oldest pending entry", |s| {
        s.oldest_pending_idle_seconds.or(s.pending.map(|_| 0))
    }),
    ("streamfleet_group_max_delivery_count", "Highest delivery count among the oldest pending entries", |s| {
        s.max_delivery_count.or(s.pending.map(|_| 0))
    }),
    ("streamfleet_group_consumers", "Consumers in the group", |s| s.consumers),
    ("streamfleet_dead_letter_length", "Entries in the dead-letter stream", |s| s.dead_letter_length),
    ("streamfleet_stream_length", "Entries in the stream", |s| s.stream_length),
    ("streamfleet_payload_lost", "Pending entries found with their payload gone, ever (absent when unknown)", |s| {
        s.payload_lost.as_ref().map(|p| p.total)
    }),
    ("streamfleet_payload_lost_unacknowledged", "Lost payloads the user has not acknowledged", |s| {
        s.payload_lost.as_ref().map(|p| p.unacknowledged)
    }),
    ("streamfleet_replicas_desired", "Worker replicas the scaling policy asks for", |s| {
        s.replicas.as_ref().map(|r| i64::from(r.desired))
    }),
    ("streamfleet_replicas_current", "Worker replicas available", |s| {
        s.replicas.as_ref().map(|r| i64::from(r.current))
    }),
];

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::default();
        let mut gauges = Vec::new();
        for (name, help, _) in GAUGES {
            let family = Family::<ResourceLabels, Gauge>::default();
            registry.register(name, help, family.clone());
            gauges.push((name, family));
        }
        let health = Family::<HealthLabels, Gauge>::default();
        registry.register("streamfleet_health", "1 for the resource's current health classification", health.clone());
        let reconciles = Counter::default();
        registry.register("streamfleet_reconciles", "Reconciles run", reconciles.clone());
        let errors = Family::<ReasonLabels, Counter>::default();
        registry.register("streamfleet_reconcile_errors", "Failed reconciles by reason", errors.clone());
        let duration = Histogram::new([0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]);
        registry.register("streamfleet_reconcile_duration_seconds", "Reconcile duration", duration.clone());
        let writes = Family::<WriteLabels, Counter>::default();
        registry.register("streamfleet_api_writes", "Kubernetes API writes by field manager", writes.clone());
        Self { registry, writes, gauges, health, reconciles, errors, duration }
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

    pub fn failed(&self, reason: &str) {
        self.errors.get_or_create(&ReasonLabels { reason: reason.to_string() }).inc();
    }

    /// Sets the resource's gauges from its status; a figure the status lacks
    /// (an unknown lag, say) is removed rather than reported as zero.
    pub fn observe(&self, namespace: &str, name: &str, status: &StreamConsumerGroupStatus) {
        let labels = ResourceLabels { namespace: namespace.into(), name: name.into() };
        for ((_, family), (_, _, read)) in self.gauges.iter().zip(GAUGES) {
            match read(status) {
                Some(v) => {
                    family.get_or_create(&labels).set(v);
                }
                None => {
                    family.remove(&labels);
                }
            }
        }
        for h in HEALTHS {
            let l = HealthLabels { namespace: namespace.into(), name: name.into(), health: format!("{h:?}") };
            self.health.get_or_create(&l).set(i64::from(status.health == Some(h)));
        }
    }

    /// Drops a deleted resource's series.
    pub fn forget(&self, namespace: &str, name: &str) {
        let labels = ResourceLabels { namespace: namespace.into(), name: name.into() };
        for (_, family) in &self.gauges {
            family.remove(&labels);
        }
        for h in HEALTHS {
            self.health.remove(&HealthLabels {
                namespace: namespace.into(),
                name: name.into(),
                health: format!("{h:?}"),
            });
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
            health: Some(Health::Backlogged),
            replicas: Some(ReplicaStatus { desired: 4, current: 2, summary: "2/4".into() }),
            ..Default::default()
        };
        m.observe("shop", "orders", &s);
        m.reconciled(Duration::from_millis(20));
        m.failed("RedisUnreachable");
        let text = m.render();
        assert!(text.contains(r#"streamfleet_group_lag{namespace="shop",name="orders"} 42"#), "{text}");
        assert!(text.contains(r#"streamfleet_replicas_desired{namespace="shop",name="orders"} 4"#));
        assert!(text.contains(r#"streamfleet_health{namespace="shop",name="orders",health="Backlogged"} 1"#));
        assert!(text.contains(r#"streamfleet_health{namespace="shop",name="orders",health="Healthy"} 0"#));
        assert!(text.contains(r#"streamfleet_reconcile_errors_total{reason="RedisUnreachable"} 1"#));
        s.lag = None;
        m.observe("shop", "orders", &s);
        assert!(!m.render().contains("streamfleet_group_lag{"), "unknown lag is not zero");
        m.forget("shop", "orders");
        assert!(!m.render().contains(r#"name="orders""#));
    }
}
