//! A worker's counters and distributions, in a `prometheus-client` registry
//! labelled with its group: what it served at `/metrics` and what tests read.
//! The per-group figures the design names: claim rate (`claimed`), ack
//! latency, the delivery-count distribution, dead letters by reason,
//! duplicate suppressions and lost payloads.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use std::borrow::Cow;
use std::time::Duration;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    reason: String,
}

#[derive(Debug)]
pub struct Stats {
    registry: Registry,
    pub processed: Counter,
    pub failed: Counter,
    pub retried: Counter,
    pub parked: Counter,
    pub circuit_waited: Counter,
    pub circuit_open: prometheus_client::metrics::gauge::Gauge,
    /// In-process total (tests, the recovery report); exported by reason as
    /// `streamfleet_worker_dead_letters_total{reason}`.
    pub dead_lettered: Counter,
    dead_letters: Family<ReasonLabels, Counter>,
    pub suppressed: Counter,
    pub claimed: Counter,
    pub payload_missing: Counter,
    /// Entries done here but claimed by another consumer before the ack.
    pub ownership_lost: Counter,
    /// Replays addressed to another group, acked without running the handler.
    pub foreign_replays: Counter,
    /// Dead letters that could not be written (the entry stays pending).
    pub dead_letter_failed: Counter,
    pub handler_latency: Latency,
    pub ack_latency: Latency,
    /// Each entry's delivery count when its handler runs.
    deliveries: Histogram,
}

impl Default for Stats {
    fn default() -> Self {
        Self::for_group("")
    }
}

impl Stats {
    /// Every series carries `group`.
    pub fn for_group(group: &str) -> Self {
        let mut registry = Registry::with_prefix_and_labels(
            "streamfleet_worker",
            std::iter::once((Cow::Borrowed("group"), Cow::Owned(group.to_string()))),
        );
        let mut counter = |name: &str, help: &str| {
            let c = Counter::default();
            registry.register(name, help, c.clone());
            c
        };
        let processed = counter("processed", "Entries handled and acked");
        let failed = counter("failed", "Handler attempts that failed (transient, permanent or malformed)");
        let retried = counter("retried", "In-process retries of transient failures");
        let parked =
            counter("parked", "Transiently failed entries parked for their next attempt on the retry schedule");
        let circuit_waited = counter(
            "circuit_waited",
            "Deliveries not run because the circuit was open: failed uncalled, the entry on along its retry schedule",
        );
        let suppressed = counter("suppressed_duplicates", "Redeliveries acked without running the handler (guard)");
        let claimed = counter("claimed", "Idle entries claimed from other consumers");
        let payload_missing = counter("payloads_lost", "Pending entries found with their payload gone");
        let ownership_lost =
            counter("ownership_lost", "Entries done here but claimed by another consumer before the ack");
        let foreign_replays = counter("foreign_replays", "Replays for another group, acked without running");
        let dead_letter_failed = counter("dead_letter_failed", "Dead letters that could not be written");
        let circuit_open = prometheus_client::metrics::gauge::Gauge::default();
        registry.register(
            "circuit_open",
            "1 while calls are paused because most attempts fail with one error",
            circuit_open.clone(),
        );
        let dead_letters = Family::<ReasonLabels, Counter>::default();
        registry.register("dead_letters", "Entries moved to the dead-letter stream, by reason", dead_letters.clone());
        let latency = |registry: &mut Registry, name: &str, help: &str| {
            let h = Histogram::new([0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]);
            registry.register(name, help, h.clone());
            Latency(h)
        };
        let handler_latency = latency(&mut registry, "handler_duration_seconds", "Handler run time, retries included");
        let ack_latency = latency(&mut registry, "ack_duration_seconds", "Commit time of a flush (marks and acks)");
        let deliveries = Histogram::new([1.0, 2.0, 3.0, 4.0, 5.0, 7.0, 10.0, 20.0]);
        registry.register("deliveries", "Delivery count of each entry when its handler runs", deliveries.clone());
        Self {
            registry,
            processed,
            failed,
            retried,
            parked,
            circuit_waited,
            circuit_open,
            dead_lettered: Counter::default(),
            dead_letters,
            suppressed,
            claimed,
            payload_missing,
            ownership_lost,
            foreign_replays,
            dead_letter_failed,
            handler_latency,
            ack_latency,
            deliveries,
        }
    }

    pub fn add(&self, counter: &Counter, n: usize) {
        counter.inc_by(u64::try_from(n).unwrap_or(u64::MAX));
    }

    pub fn get(counter: &Counter) -> u64 {
        counter.get()
    }

    /// One entry dead-lettered for `reason`.
    pub fn dead_lettered_as(&self, reason: &str) {
        self.dead_lettered.inc();
        self.dead_letters.get_or_create(&ReasonLabels { reason: reason.to_string() }).inc();
    }

    /// An entry about to be handled on its `deliveries`-th delivery.
    pub fn delivered(&self, deliveries: u64) {
        self.deliveries.observe(deliveries as f64);
    }

    /// The OpenMetrics text exposition of every series.
    pub fn render(&self) -> String {
        let mut out = String::new();
        if prometheus_client::encoding::text::encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }

    /// Serves `render()` at `/metrics`, with `/healthz` and `/readyz` (as
    /// `readiness` says), on `listener` until the task is dropped.
    #[cfg(feature = "admin")]
    pub async fn serve(
        self: std::sync::Arc<Self>,
        listener: tokio::net::TcpListener,
        readiness: streamfleet_process::Readiness,
    ) -> std::io::Result<()> {
        streamfleet_process::admin::serve(listener, readiness, move || self.render()).await
    }
}

/// A latency distribution (seconds).
#[derive(Debug)]
pub struct Latency(Histogram);

impl Latency {
    pub fn observe(&self, d: Duration) {
        self.0.observe(d.as_secs_f64());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_counters_and_distributions_labelled_with_the_group() {
        let s = Stats::for_group("billing");
        s.add(&s.processed, 3);
        s.add(&s.suppressed, 1);
        s.dead_lettered_as("permanent");
        s.dead_lettered_as("permanent");
        s.dead_lettered_as("malformed");
        s.delivered(1);
        s.delivered(4);
        s.handler_latency.observe(Duration::from_millis(1500));
        let text = s.render();
        assert!(text.contains(r#"streamfleet_worker_processed_total{group="billing"} 3"#), "{text}");
        assert!(text.contains(r#"streamfleet_worker_suppressed_duplicates_total{group="billing"} 1"#));
        assert!(text.contains(r#"streamfleet_worker_dead_letters_total{group="billing",reason="permanent"} 2"#));
        assert!(text.contains(r#"streamfleet_worker_handler_duration_seconds_sum{group="billing"} 1.5"#));
        assert!(text.contains(r#"streamfleet_worker_deliveries_bucket{group="billing",le="3.0"} 1"#), "{text}");
        assert!(text.contains(r#"streamfleet_worker_deliveries_count{group="billing"} 2"#));
        assert!(text.ends_with("# EOF\n"), "OpenMetrics");
        assert_eq!(Stats::get(&s.dead_lettered), 3);
    }
}
