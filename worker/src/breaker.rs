//! A circuit breaker over the handler's outcomes, per worker process: when
//! most recent attempts fail transiently with the same error (a downstream
//! is down), the worker stops calling it for a while instead of hammering
//! it with every entry's attempts. A delivery that comes while it is open
//! fails as its call would have, uncalled, and the entry goes on along its
//! retry schedule: the schedule and its horizon are the same with the
//! breaker as without; only the calls that would fail anyway are spared.
//! After the wait one attempt probes: a success closes the breaker, a
//! failure opens it again for twice as long, up to the schedule's longest
//! delay.
//!
//! Pure: the caller passes the clock, so the transitions are unit-tested.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// Attempts looked at: those of the last [`WINDOW`], at most [`WINDOW_ATTEMPTS`].
const WINDOW: Duration = Duration::from_secs(30);
const WINDOW_ATTEMPTS: usize = 50;
/// The breaker opens on at least this many attempts in the window, ...
const MIN_ATTEMPTS: usize = 10;
/// ... at least this share of them failed transiently, ...
const FAILING_SHARE: f64 = 0.8;
/// ... and at least this share of those failures with the same error.
const SAME_ERROR_SHARE: f64 = 0.5;

/// Whether a handler may run now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Gate {
    Run,
    /// Run, as the one attempt that tells whether the downstream is back.
    Probe,
    /// Do not call the downstream before `until`.
    Wait {
        until: Instant,
        error: String,
    },
}

/// A change of state, for the log.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Transition {
    Opened { failures: usize, attempts: usize, error: String, wait: Duration },
    Closed,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum State {
    Closed,
    Open {
        until: Instant,
        wait: Duration,
        error: String,
    },
    /// One probe is in flight since `since` (one that never answers, its
    /// handler never started, is replaced after a first wait).
    Probing {
        wait: Duration,
        error: String,
        since: Instant,
    },
}

#[derive(Clone, Debug)]
pub struct Breaker {
    /// Per attempt: when, and for a transient failure its error's signature
    /// and the error itself.
    recent: VecDeque<(Instant, Option<(String, String)>)>,
    state: State,
    first_wait: Duration,
    longest_wait: Duration,
}

/// An error with its digits taken out, so "order 41: timeout" and
/// "order 42: timeout" are the same error.
fn signature(error: &str) -> String {
    error.chars().filter(|c| !c.is_ascii_digit()).collect()
}

impl Breaker {
    /// Waits start at `first_wait` and double up to `longest_wait`.
    pub fn new(first_wait: Duration, longest_wait: Duration) -> Self {
        Self { recent: VecDeque::new(), state: State::Closed, first_wait, longest_wait: longest_wait.max(first_wait) }
    }

    pub fn is_open(&self) -> bool {
        self.state != State::Closed
    }

    /// Whether a handler may call the downstream now.
    pub fn gate(&mut self, now: Instant) -> Gate {
        match &self.state {
            State::Closed => Gate::Run,
            State::Open { until, .. } if now < *until => Gate::Wait { until: *until, error: self.error() },
            State::Open { wait, error, .. } => {
                self.state = State::Probing { wait: *wait, error: error.clone(), since: now };
                Gate::Probe
            }
            State::Probing { wait, error, since } if now.saturating_duration_since(*since) >= self.first_wait => {
                self.state = State::Probing { wait: *wait, error: error.clone(), since: now };
                Gate::Probe
            }
            // Others wait for the probe's answer (a first wait at most).
            State::Probing { since, .. } => Gate::Wait { until: *since + self.first_wait, error: self.error() },
        }
    }

    fn error(&self) -> String {
        match &self.state {
            State::Closed => String::new(),
            State::Open { error, .. } | State::Probing { error, .. } => error.clone(),
        }
    }

    /// Records one attempt's outcome: `Err(error)` for a transient failure,
    /// `Ok` for anything the downstream answered (done, permanent,
    /// malformed). `probe`: it was the attempt [`Gate::Probe`] allowed.
    pub fn record(&mut self, now: Instant, outcome: Result<(), &str>, probe: bool) -> Option<Transition> {
        if probe && let State::Probing { wait, error, .. } = &self.state {
            return match outcome {
                Ok(()) => {
                    self.state = State::Closed;
                    self.recent.clear();
                    Some(Transition::Closed)
                }
                Err(_) => {
                    let wait = wait.saturating_mul(2).min(self.longest_wait);
                    self.state = State::Open { until: now + wait, wait, error: error.clone() };
                    None
                }
            };
        }
        self.recent.push_back((now, outcome.err().map(|e| (signature(e), e.to_string()))));
        while self.recent.len() > WINDOW_ATTEMPTS
            || self.recent.front().is_some_and(|(at, _)| now.saturating_duration_since(*at) > WINDOW)
        {
            self.recent.pop_front();
        }
        if self.state != State::Closed || self.recent.len() < MIN_ATTEMPTS {
            return None;
        }
        let failures: Vec<&String> = self.recent.iter().filter_map(|(_, e)| e.as_ref().map(|(sig, _)| sig)).collect();
        let attempts = self.recent.len();
        if (failures.len() as f64) < FAILING_SHARE * attempts as f64 {
            return None;
        }
        let mut counts: std::collections::HashMap<&String, usize> = std::collections::HashMap::new();
        for e in &failures {
            *counts.entry(*e).or_default() += 1;
        }
        let (common, same) = counts.into_iter().max_by_key(|(_, n)| *n)?;
        if (same as f64) < SAME_ERROR_SHARE * failures.len() as f64 {
            return None;
        }
        // Named as it was last said, digits and all.
        let error = self
            .recent
            .iter()
            .rev()
            .find_map(|(_, e)| e.as_ref().filter(|(sig, _)| sig == common).map(|(_, error)| error.clone()))
            .unwrap_or_else(|| common.clone());
        self.state = State::Open { until: now + self.first_wait, wait: self.first_wait, error: error.clone() };
        Some(Transition::Opened { failures: failures.len(), attempts, error, wait: self.first_wait })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn breaker() -> Breaker {
        Breaker::new(Duration::from_secs(1), Duration::from_secs(4))
    }

    #[test]
    fn mostly_failing_with_one_error_opens_it_and_a_probe_decides() {
        let t0 = Instant::now();
        let mut b = breaker();
        for i in 0..9 {
            assert_eq!(b.record(t0, Err(&format!("order {i}: 503")), false), None, "too few attempts yet");
        }
        let opened = b.record(t0, Err("order 9: 503"), false);
        assert!(
            matches!(opened, Some(Transition::Opened { failures: 10, attempts: 10, ref error, .. }) if error == "order 9: 503"),
            "{opened:?}"
        );
        assert!(matches!(b.gate(t0), Gate::Wait { until, .. } if until == t0 + Duration::from_secs(1)));
        // The wait is over: one probe, the others wait for its answer; a
        // probe that never answers is replaced after a first wait.
        let t1 = t0 + Duration::from_secs(1);
        assert_eq!(b.gate(t1), Gate::Probe);
        assert!(matches!(b.gate(t1), Gate::Wait { until, .. } if until == t1 + Duration::from_secs(1)));
        assert_eq!(b.gate(t1 + Duration::from_secs(1)), Gate::Probe, "the lost probe replaced");
        let t1 = t1 + Duration::from_secs(1);
        // It fails: open again, twice as long.
        assert_eq!(b.record(t1, Err("order 10: 503"), true), None);
        assert!(matches!(b.gate(t1), Gate::Wait { until, .. } if until == t1 + Duration::from_secs(2)));
        // An ordinary attempt that ends meanwhile changes nothing.
        assert_eq!(b.record(t1, Err("503"), false), None);
        let t2 = t1 + Duration::from_secs(2);
        assert_eq!(b.gate(t2), Gate::Probe);
        assert_eq!(b.record(t2, Err("503"), true), None);
        let t3 = t2 + Duration::from_secs(4);
        assert_eq!(b.gate(t3), Gate::Probe);
        assert_eq!(b.record(t3, Err("503"), true), None);
        assert!(
            matches!(b.gate(t3), Gate::Wait { until, .. } if until == t3 + Duration::from_secs(4)),
            "capped at the longest wait"
        );
        // Back: the probe succeeds and everything runs again.
        let t4 = t3 + Duration::from_secs(4);
        assert_eq!(b.gate(t4), Gate::Probe);
        assert_eq!(b.record(t4, Ok(()), true), Some(Transition::Closed));
        assert_eq!(b.gate(t4), Gate::Run);
        assert!(!b.is_open());
    }

    #[test]
    fn scattered_failures_or_different_errors_keep_it_closed() {
        let t0 = Instant::now();
        let mut b = breaker();
        // 3 in 10 fail: everyday life.
        for i in 0..30 {
            let outcome = if i % 10 < 3 { Err("timeout") } else { Ok(()) };
            assert_eq!(b.record(t0, outcome, false), None);
        }
        assert_eq!(b.gate(t0), Gate::Run);
        // All fail, each its own way: no single downstream to spare.
        let mut b = breaker();
        for i in 0..20 {
            assert_eq!(b.record(t0, Err(&format!("error kind {}", char::from(b'a' + i))), false), None);
        }
        assert_eq!(b.gate(t0), Gate::Run);
    }

    #[test]
    fn old_attempts_leave_the_window() {
        let t0 = Instant::now();
        let mut b = breaker();
        for _ in 0..9 {
            b.record(t0, Err("503"), false);
        }
        // 31 s later, one more failure: the nine are out of the window.
        assert_eq!(b.record(t0 + Duration::from_secs(31), Err("503"), false), None);
        assert_eq!(b.gate(t0 + Duration::from_secs(31)), Gate::Run);
    }
}
