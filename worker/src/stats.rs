//! Counters and latency sums a worker keeps, for its metrics endpoint and tests.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

#[derive(Default, Debug)]
pub struct Stats {
    pub processed: AtomicU64,
    pub failed: AtomicU64,
    pub retried: AtomicU64,
    pub dead_lettered: AtomicU64,
    pub suppressed: AtomicU64,
    pub claimed: AtomicU64,
    pub payload_missing: AtomicU64,
    /// Entries done here but claimed by another consumer before the ack.
    pub ownership_lost: AtomicU64,
    /// Replays addressed to another group, acked without running the handler.
    pub foreign_replays: AtomicU64,
    /// Dead letters that could not be written (the entry stays pending).
    pub dead_letter_failed: AtomicU64,
    pub handler_latency: Latency,
    pub ack_latency: Latency,
}

impl Stats {
    pub fn add(&self, counter: &AtomicU64, n: usize) {
        counter.fetch_add(u64::try_from(n).unwrap_or(u64::MAX), Ordering::Relaxed);
    }

    pub fn get(counter: &AtomicU64) -> u64 {
        counter.load(Ordering::Relaxed)
    }

    /// Prometheus text exposition of every counter and latency summary.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let counters = [
            ("processed", "Entries handled and acked", &self.processed),
            ("failed", "Handler attempts that failed (transient, permanent or malformed)", &self.failed),
            ("retried", "In-process retries of transient failures", &self.retried),
            ("dead_lettered", "Entries moved to the dead-letter stream", &self.dead_lettered),
            ("suppressed_duplicates", "Redeliveries acked without running the handler (guard)", &self.suppressed),
            ("claimed", "Idle entries claimed from other consumers", &self.claimed),
            ("payload_missing", "Pending entries found with their payload gone", &self.payload_missing),
            (
                "ownership_lost",
                "Entries done here but claimed by another consumer before the ack",
                &self.ownership_lost,
            ),
        ];
        for (name, help, counter) in counters {
            out.push_str(&format!(
                "# HELP streamfleet_worker_{name} {help}\n# TYPE streamfleet_worker_{name} counter\nstreamfleet_worker_{name}_total {}\n",
                Self::get(counter)
            ));
        }
        for (name, help, latency) in [
            ("handler_seconds", "Handler latency", &self.handler_latency),
            ("ack_seconds", "Ack latency (one pipelined XACK per batch)", &self.ack_latency),
        ] {
            let micros = latency.sum_micros.load(Ordering::Relaxed);
            out.push_str(&format!(
                "# HELP streamfleet_worker_{name} {help}\n# TYPE streamfleet_worker_{name} summary\nstreamfleet_worker_{name}_sum {}\nstreamfleet_worker_{name}_count {}\n",
                micros as f64 / 1e6,
                latency.count.load(Ordering::Relaxed)
            ));
        }
        out
    }

    /// Serves `render()` at `/metrics`, with `/healthz` and `/readyz` (as
    /// `readiness` says), on `listener` until the task is dropped.
    pub async fn serve(
        self: std::sync::Arc<Self>,
        listener: tokio::net::TcpListener,
        readiness: streamfleet_process::Readiness,
    ) -> std::io::Result<()> {
        streamfleet_process::admin::serve(listener, readiness, move || self.render()).await
    }
}

/// Count and sum of observed durations (a Prometheus summary without quantiles).
#[derive(Default, Debug)]
pub struct Latency {
    pub count: AtomicU64,
    pub sum_micros: AtomicU64,
}

impl Latency {
    pub fn observe(&self, d: Duration) {
        self.count.fetch_add(1, Ordering::Relaxed);
        self.sum_micros.fetch_add(u64::try_from(d.as_micros()).unwrap_or(u64::MAX), Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_counters_and_summaries() {
        let s = Stats::default();
        s.add(&s.processed, 3);
        s.add(&s.suppressed, 1);
        s.handler_latency.observe(Duration::from_millis(1500));
        let text = s.render();
        assert!(text.contains("streamfleet_worker_processed_total 3"), "{text}");
        assert!(text.contains("streamfleet_worker_suppressed_duplicates_total 1"));
        assert!(text.contains("streamfleet_worker_handler_seconds_sum 1.5"));
        assert!(text.contains("streamfleet_worker_handler_seconds_count 1"));
    }
}
