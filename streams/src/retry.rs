//! Retries on a schedule, kept in the PEL.
//!
//! An entry whose handler failed transiently is *parked*: claimed (`XCLAIM …
//! JUSTID`, its delivery count unchanged) to the group's parking consumer
//! for its delivery count, `streamfleet:retry:<n>`, with an idle time chosen
//! so that it reaches that consumer's threshold, [`Schedule::threshold`]`(n)`,
//! when its next attempt is due. A claim takes it back only then: its ID
//! and delivery count stay what they are (the count is the retry count),
//! no second stream, no mover. The claim finds due entries in a due-time
//! index beside the stream (`keys::retry_due_key`, written with the park,
//! a mirror of the PEL's delivery times, [`INDEX_SPAN_MS`]) and checks each
//! against the PEL, so a page of due entries costs what a page of idle
//! ones does however many wait, and a schedule changed since applies to
//! entries already parked, as with the scan; entries parked without the
//! index are found by `XPENDING … IDLE threshold … streamfleet:retry:<n>`
//! and indexed page by page.
//!
//! Every parking consumer holds entries with one delivery count, so they
//! share one threshold; the entry's own delay (with jitter, cut short at
//! its `retryFor` horizon) is in the idle time it is parked with: `threshold
//! − delay`. A parked entry has no holder: the claim rules for live holders
//! (`claim::claim_rules_lua`) do not apply to it, the reaper never touches
//! its consumer (no pod is named `streamfleet:…`), and the health snapshot
//! counts it as retrying, not stuck.

use crate::entry::Entry;
use crate::error::StreamError;
use redis::aio::ConnectionLike;
use std::time::Duration;

/// Parking consumers are named this, then the delivery count of the
/// entries they hold. A pod name (a DNS label) never has a colon.
pub const PARKED_PREFIX: &str = "streamfleet:retry:";

/// The parking consumer for entries that failed at delivery `deliveries`.
pub fn parked_consumer(deliveries: u64) -> String {
    format!("{PARKED_PREFIX}{deliveries}")
}

/// The delivery count a parking consumer holds entries at; `None` for
/// any other consumer. The same test as [`consumers_lua`]'s `parked_count`.
pub fn parked_deliveries(consumer: &str) -> Option<u64> {
    let digits = consumer.strip_prefix(PARKED_PREFIX)?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// Lua shared by the scripts that tell parked entries apart:
/// `parked_count(name)` is the delivery count a parking consumer holds
/// entries at, `nil` for any other consumer ([`parked_deliveries`]);
/// `consumers(stream, group)` lists the group's consumers (`name`,
/// `pending`) in Redis's order (by name).
pub(crate) fn consumers_lua() -> String {
    format!(
        r"
        local function parked_count(name)
            local n = string.match(name, '^{PARKED_PREFIX}(%d+)$')
            return n and tonumber(n)
        end
        local function consumers(stream, group)
            local out = {{}}
            for _, c in ipairs(redis.call('XINFO', 'CONSUMERS', stream, group)) do
                local info = {{}}
                for k = 1, #c, 2 do info[c[k]] = c[k + 1] end
                out[#out + 1] = {{ name = info['name'], pending = tonumber(info['pending']) or 0 }}
            end
            return out
        end
        "
    )
}

/// The due-time index (`keys::retry_due_key`) mirrors what the PEL says of
/// each parked entry: its score is the parking consumer's delivery count
/// `n` times [`INDEX_SPAN_MS`] plus the instant its idle time counts from
/// (server ms), so one sorted set holds a range per `n`, and the entries
/// of `n` due under a threshold `T` are the range up to `n · span + now −
/// T`: `XPENDING … IDLE T`, without the walk. Counts from
/// [`INDEX_BUCKETS`] up share the last range.
pub const INDEX_SPAN_MS: u64 = 1 << 42;
/// Ranges in the index: `span · buckets` stays below 2^53, where a Redis
/// score (a double) is still exact to the millisecond.
pub const INDEX_BUCKETS: u64 = 2047;
// The largest score is exact in a double; a range holds server ms to 2109.
const _: () = assert!(INDEX_BUCKETS * INDEX_SPAN_MS + (INDEX_SPAN_MS - 1) < 1 << 53);
const _: () = assert!(INDEX_SPAN_MS > 4_000_000_000_000);

/// Lua shared by the scripts that write or read the due-time index:
/// `bucket(n)`, and `index_score(n, since)` for an entry parked at
/// delivery `n` whose idle time counts from `since` (formatted for ZADD).
pub(crate) fn due_index_lua() -> String {
    format!(
        r"
        local INDEX_SPAN = {INDEX_SPAN_MS}
        local function bucket(n)
            return math.min(n, {INDEX_BUCKETS})
        end
        local function index_score(n, since)
            return string.format('%.0f', bucket(n) * INDEX_SPAN + since)
        end
        "
    )
}

/// How the delay grows from one delivery to the next (the contract's).
pub use streamfleet_contract::Backoff;

/// When a transiently failed entry is tried again, and until when.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Schedule {
    pub backoff: Backoff,
    /// The delay after the first failed delivery.
    pub initial: Duration,
    /// No delay is longer (before jitter).
    pub max: Duration,
    /// Each delay is lengthened by a random 0 to this many percent, so
    /// entries that failed together do not all come back together.
    pub jitter_percent: u32,
    /// No attempt starts later than this after the entry's first failure:
    /// the last delay is cut short to land on it, and an entry that fails
    /// past it is dead-lettered `retries-exhausted`. `None`: only the
    /// delivery count bounds it.
    pub retry_for: Option<Duration>,
}

/// The longest first or largest delay a schedule takes: 7 days.
pub const LONGEST_DELAY: Duration = Duration::from_secs(7 * 24 * 3600);
/// The default delay cap between two attempts: 15 minutes.
pub const DEFAULT_MAX_DELAY: Duration = Duration::from_secs(15 * 60);
/// The default jitter: up to 20% longer.
pub const DEFAULT_JITTER_PERCENT: u32 = 20;

impl Schedule {
    /// The same delay after every failure, no jitter, no `retryFor`.
    pub fn fixed(delay: Duration) -> Schedule {
        Schedule { backoff: Backoff::Fixed, initial: delay, max: delay, jitter_percent: 0, retry_for: None }
    }

    /// A schedule from what a user set (the CRD's `spec.recovery.retry`, or
    /// the env contract), with the defaults for what they did not: the
    /// first delay min-idle-time, the cap [`DEFAULT_MAX_DELAY`] (or the
    /// first delay when longer), the jitter [`DEFAULT_JITTER_PERCENT`].
    /// Delays are kept within [`LONGEST_DELAY`], the jitter within 100%.
    pub fn with_defaults(
        backoff: Backoff,
        initial: Option<Duration>,
        max: Option<Duration>,
        jitter_percent: Option<u32>,
        retry_for: Option<Duration>,
        min_idle: Duration,
    ) -> Schedule {
        // (Never below min-idle-time, even one longer than the cap.)
        let initial = initial.unwrap_or(min_idle).min(LONGEST_DELAY.max(min_idle));
        Schedule {
            backoff,
            initial,
            max: max.unwrap_or(DEFAULT_MAX_DELAY).min(LONGEST_DELAY).max(initial),
            jitter_percent: jitter_percent.unwrap_or(DEFAULT_JITTER_PERCENT).min(100),
            retry_for: retry_for.filter(|d| !d.is_zero()),
        }
    }

    /// The delay after delivery `deliveries` failed, before jitter. Never
    /// overflows: doubling stops at `max`.
    pub fn base(&self, deliveries: u64) -> Duration {
        match self.backoff {
            Backoff::Fixed => self.initial,
            Backoff::Exponential => {
                let mut delay = self.initial;
                for _ in 1..deliveries.max(1) {
                    if delay >= self.max {
                        break;
                    }
                    delay = delay.saturating_mul(2);
                }
                delay.min(self.max)
            }
        }
    }

    /// The longest delay after delivery `deliveries` (jitter at its most):
    /// the idle time at which that delivery's parking consumer releases an
    /// entry.
    pub fn threshold(&self, deliveries: u64) -> Duration {
        let base = self.base(deliveries);
        base.saturating_add(base.mul_f64(f64::from(self.jitter_percent.min(100)) / 100.0))
    }

    /// The delay after delivery `deliveries` failed, for a jitter draw `u`
    /// in `[0, 1)`: between [`Schedule::base`] and [`Schedule::threshold`].
    pub fn delay(&self, deliveries: u64, u: f64) -> Duration {
        let base = self.base(deliveries);
        let extra = self.threshold(deliveries).saturating_sub(base);
        base.saturating_add(extra.mul_f64(u.clamp(0.0, 1.0)))
    }

    /// How long an entry that keeps failing is retried before its last
    /// attempt, when every attempt fails at once: the sum of the delays
    /// (before jitter) up to `max_deliveries`, or `retry_for` when shorter.
    pub fn horizon(&self, max_deliveries: u64) -> Duration {
        let by_count = (1..max_deliveries).map(|n| self.base(n)).fold(Duration::ZERO, Duration::saturating_add);
        self.retry_for.map_or(by_count, |limit| by_count.min(limit))
    }
}

/// The field recording when an entry first failed (ms), for `retryFor`.
pub fn failing_since_field(id: &str) -> String {
    format!("{id}:since")
}

/// What [`park`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Parked {
    /// Parked: tried again after this long.
    Until(Duration),
    /// Its `retryFor` horizon has passed: dead-letter it.
    HorizonPassed,
    /// It is no longer this consumer's (another consumer claimed it, or it
    /// was acked): left as it is.
    NotOurs,
    /// Its payload was trimmed or deleted: recorded lost.
    Lost,
}

/// KEYS: stream, dead-letter stream, loss count, loss IDs, entry records,
/// due-time index. ARGV[1] group, ARGV[2] the consumer named in a loss record, ARGV[3] why,
/// ARGV[4] owner, ARGV[5] ID, ARGV[6] delivery count, ARGV[7] error,
/// ARGV[8] parking consumer, ARGV[9] its threshold ms, ARGV[10] delay ms,
/// ARGV[11] retryFor ms (0: none). Owner-checked: an entry another
/// consumer took since is left alone, its records too; one already parked
/// at this delivery (the script run twice) is left as it is. Returns the
/// delay (ms) it was parked for (or has left), -1 past the horizon, -2 not
/// ours, -3 lost.
static PARK: std::sync::LazyLock<redis::Script> = std::sync::LazyLock::new(|| {
    redis::Script::new(&format!(
        r"{}{}{}
        local id = ARGV[5]
        local p = redis.call('XPENDING', KEYS[1], ARGV[1], id, id, 1)[1]
        if p and p[2] == ARGV[8] and p[4] == tonumber(ARGV[6]) then
            -- Parked already, at this delivery (this script run before, its
            -- reply lost): what is left of its delay.
            return math.max(0, tonumber(ARGV[9]) - p[3])
        end
        if p == nil or p[2] ~= ARGV[4] then return -2 end
        if #redis.call('XRANGE', KEYS[1], id, id) == 0 then
            local refused = lost(id, p[2], KEYS[5])
            if refused then return refused end
            return -3
        end
        local t = redis.call('TIME')
        local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
        redis.call('HSET', KEYS[5], id, ARGV[7], id .. ':run', ARGV[6] .. ':end')
        redis.call('HSETNX', KEYS[5], id .. ':since', string.format('%.0f', now))
        local delay = tonumber(ARGV[10])
        local limit = tonumber(ARGV[11])
        if limit > 0 then
            local left = tonumber(redis.call('HGET', KEYS[5], id .. ':since')) + limit - now
            if left <= 0 then return -1 end
            delay = math.min(delay, left)
        end
        local idle = math.max(0, tonumber(ARGV[9]) - delay)
        redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[8], 0, id, 'IDLE', string.format('%.0f', idle), 'JUSTID')
        redis.call('ZADD', KEYS[6], index_score(tonumber(ARGV[6]), now - idle), id)
        return delay",
        crate::started::redelivery_lua(),
        crate::claim::lost_lua(),
        due_index_lua(),
    ))
});

/// Parks `entry`, which this consumer (`owner`) holds and whose current
/// delivery's handler failed with `error`, until its next attempt is due
/// (its delay drawn from `schedule` with jitter `u`, cut short at its
/// `retryFor` horizon). Also records the error and that the delivery ended
/// (`started`), in the same script.
#[allow(clippy::too_many_arguments)]
pub async fn park<C: ConnectionLike + Send>(
    conn: &mut C,
    entry: &Entry,
    group: &str,
    owner: &str,
    loss: &crate::claim::LossRecord<'_>,
    schedule: &Schedule,
    error: &str,
    u: f64,
) -> Result<Parked, StreamError> {
    let n = entry.deliveries;
    let mut script = crate::claim::prepare(&PARK, &entry.stream, group, loss);
    script
        .key(crate::keys::last_error_key(&entry.stream, group))
        .key(crate::keys::retry_due_key(&entry.stream, group))
        .arg(owner)
        .arg(&entry.id)
        .arg(n)
        .arg(error)
        .arg(parked_consumer(n))
        .arg(crate::millis(schedule.threshold(n)))
        .arg(crate::millis(schedule.delay(n, u)))
        .arg(schedule.retry_for.map_or(0, crate::millis));
    let parked: i64 =
        script.invoke_async(conn).await.map_err(|e| StreamError::new("parking an entry for its retry", e))?;
    Ok(match parked {
        -1 => Parked::HorizonPassed,
        -2 => Parked::NotOurs,
        -3 => Parked::Lost,
        delay => Parked::Until(Duration::from_millis(u64::try_from(delay).unwrap_or(0))),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn schedule(backoff: Backoff) -> Schedule {
        Schedule {
            backoff,
            initial: Duration::from_secs(1),
            max: Duration::from_secs(20),
            jitter_percent: 20,
            retry_for: None,
        }
    }

    #[test]
    fn exponential_doubles_up_to_its_cap_and_never_overflows() {
        let s = schedule(Backoff::Exponential);
        let secs: Vec<u64> = (1..=7).map(|n| s.base(n).as_secs()).collect();
        assert_eq!(secs, vec![1, 2, 4, 8, 16, 20, 20]);
        assert_eq!(s.base(0), Duration::from_secs(1));
        assert_eq!(s.base(u64::MAX), Duration::from_secs(20));
        let huge = Schedule { max: Duration::MAX, ..s };
        assert_eq!(huge.base(200), Duration::MAX);
    }

    #[test]
    fn fixed_is_always_the_initial_delay() {
        let s = schedule(Backoff::Fixed);
        assert!((1..50).all(|n| s.base(n) == Duration::from_secs(1)));
    }

    #[test]
    fn jitter_lengthens_a_delay_by_at_most_its_percentage() {
        let s = schedule(Backoff::Exponential);
        assert_eq!(s.delay(3, 0.0), Duration::from_secs(4));
        assert_eq!(s.threshold(3), Duration::from_millis(4_800));
        for u in [0.0, 0.25, 0.5, 0.999, 1.0, 7.0, -1.0] {
            let d = s.delay(3, u);
            assert!(d >= s.base(3) && d <= s.threshold(3), "{u}: {d:?}");
        }
        let none = Schedule { jitter_percent: 0, ..s.clone() };
        assert_eq!(none.threshold(3), none.base(3));
        let silly = Schedule { jitter_percent: 1_000, ..s };
        assert_eq!(silly.threshold(1), Duration::from_secs(2));
    }

    #[test]
    fn the_horizon_is_the_delays_up_to_the_last_delivery_or_retry_for() {
        let s = schedule(Backoff::Exponential);
        // Deliveries 1..=5: four delays, 1 + 2 + 4 + 8.
        assert_eq!(s.horizon(5), Duration::from_secs(15));
        assert_eq!(s.horizon(1), Duration::ZERO);
        let capped = Schedule { retry_for: Some(Duration::from_secs(10)), ..s };
        assert_eq!(capped.horizon(5), Duration::from_secs(10));
    }

    #[test]
    fn parking_consumers_are_told_apart_from_pods() {
        assert_eq!(parked_consumer(3), "streamfleet:retry:3");
        assert_eq!(parked_deliveries("streamfleet:retry:3"), Some(3));
        assert_eq!(parked_deliveries("orders-worker-abc-1.uid"), None);
        for foreign in ["streamfleet:retry:x", "streamfleet:retry:", "streamfleet:retry:+5", "streamfleet:retry:1.5"] {
            assert_eq!(parked_deliveries(foreign), None, "{foreign}");
        }
        assert!(consumers_lua().contains("'^streamfleet:retry:(%d+)$'"));
    }
}
