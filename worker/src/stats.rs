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
