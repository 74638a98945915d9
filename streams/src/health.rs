//! Group health inspection in a bounded number of commands, whatever the PEL
//! size, in two round trips: `XLEN` of the dead-letter stream and one script
//! reading the group at one instant (`XINFO GROUPS`, Redis `TIME`, a bounded
//! `XRANGE` after the last delivered ID that counts the lag from IDs,
//! `XPENDING - + N` for the N oldest pending entries, `XLEN`); then `XINFO
//! CONSUMERS`. With entries parked for a retry, one or two more.
//! The counting `XRANGE` copies up to [`LAG_COUNT_BOUND`] + 1 entries inside
//! Redis on every poll while the group is behind.

use crate::error::StreamError;
use crate::group_ref::GroupRef;
use redis::aio::ConnectionLike;
use redis::streams::StreamInfoConsumersReply;

/// How many of the oldest pending entries are inspected for idle time and
/// delivery counts.
pub const OLDEST_SAMPLE: usize = 10;
/// The longest XRANGE used to count lag when Redis reports it as NULL.
pub const LAG_COUNT_BOUND: usize = 1000;

/// Where the lag figure came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lag {
    /// Reported by `XINFO GROUPS`, or counted exactly after it was NULL.
    Known(u64),
    /// NULL in Redis and more entries after the last delivered ID than the
    /// counting bound: at least this many.
    AtLeast(u64),
    /// NULL and not countable.
    Unknown,
}

impl Lag {
    /// The lag of several streams together: known only if every part is.
    pub fn sum(parts: impl IntoIterator<Item = Lag>) -> Lag {
        parts.into_iter().fold(Lag::Known(0), |total, part| match (total, part) {
            (Lag::Unknown, _) | (_, Lag::Unknown) => Lag::Unknown,
            (Lag::Known(a), Lag::Known(b)) => Lag::Known(a.saturating_add(b)),
            (a, b) => Lag::AtLeast(a.floor().unwrap_or(0).saturating_add(b.floor().unwrap_or(0))),
        })
    }

    /// A floor usable for scaling up; `None` when nothing is known.
    pub fn floor(self) -> Option<u64> {
        match self {
            Lag::Known(n) | Lag::AtLeast(n) => Some(n),
            Lag::Unknown => None,
        }
    }

    /// The lag from the entries counted after the group's last delivered ID
    /// (up to [`LAG_COUNT_BOUND`] + 1) and from what `XINFO GROUPS` reports:
    /// the count when within the bound, whatever Redis says (its read
    /// counter is not kept exact on a promoted replica, nor across
    /// deletions); beyond it, Redis's figure when it agrees the lag is
    /// beyond, else a floor.
    pub fn by_ids(counted: u64, reported: Option<u64>) -> Lag {
        let bound = to_u64(LAG_COUNT_BOUND);
        match reported {
            _ if counted <= bound => Lag::Known(counted),
            Some(n) if n > bound => Lag::Known(n),
            _ => Lag::AtLeast(bound + 1),
        }
    }

    /// Zero only when known to be zero.
    pub fn is_known_zero(self) -> bool {
        self == Lag::Known(0)
    }
}

/// The ID time at or after which an ID is taken for a time: 2001-09-09. A
/// producer's explicit IDs (`1-0`, `2-0`, …) fall far below it.
pub const EARLIEST_TIME_ID_MS: u64 = 1_000_000_000_000;
/// How far ahead of the server's clock an ID may be and still be read as
/// a time (delay 0): a failover to a primary whose clock is a little behind.
pub const CLOCK_SKEW_MS: u64 = 60_000;

/// How late a group is: the age of its oldest unfinished entry (the oldest
/// pending, parked or not, or else the first not yet delivered) by the
/// server's clock. An auto-generated stream ID is the primary's clock in
/// milliseconds when the entry was added, so this is exact to the
/// millisecond, and known even when the lag is not.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Delay {
    /// Milliseconds; 0 when nothing is unfinished.
    Known(u64),
    /// The oldest unfinished entry's ID is not a time (a producer sets
    /// explicit IDs): the delay cannot be read from IDs.
    NotTimes,
}

/// The time (ID milliseconds) of the oldest of `ids` (the oldest pending and
/// the first undelivered; empty or absent for none), when it is a time.
pub fn oldest_time(now_ms: u64, ids: [Option<&str>; 2]) -> Result<Option<u64>, Delay> {
    let oldest =
        ids.into_iter().flatten().filter(|id| !id.is_empty()).filter_map(crate::retention::StreamId::parse).min();
    match oldest {
        None => Ok(None),
        Some(id) if id.ms < EARLIEST_TIME_ID_MS || id.ms > now_ms.saturating_add(CLOCK_SKEW_MS) => Err(Delay::NotTimes),
        Some(id) => Ok(Some(id.ms)),
    }
}

impl Delay {
    /// The delay at `now_ms` (Redis `TIME`) of the oldest of `ids` (the
    /// oldest pending and the first undelivered; empty or absent for none).
    pub fn of(now_ms: u64, ids: [Option<&str>; 2]) -> Delay {
        match oldest_time(now_ms, ids) {
            Ok(None) => Delay::Known(0),
            Ok(Some(ms)) => Delay::Known(now_ms.saturating_sub(ms)),
            Err(not_times) => not_times,
        }
    }

    /// The delay of several shards together: the worst; not times if any is not.
    pub fn worst(parts: impl IntoIterator<Item = Delay>) -> Delay {
        parts.into_iter().fold(Delay::Known(0), |worst, part| match (worst, part) {
            (Delay::Known(a), Delay::Known(b)) => Delay::Known(a.max(b)),
            _ => Delay::NotTimes,
        })
    }

    /// Milliseconds, when known.
    pub fn ms(self) -> Option<u64> {
        match self {
            Delay::Known(ms) => Some(ms),
            Delay::NotTimes => None,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConsumerState {
    pub name: String,
    pub pending: u64,
    pub idle_ms: u64,
}

/// One inspection of a group. The default is an empty group at rest (no
/// entry, nothing pending, lag and delay 0): what fixtures start from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupSnapshot {
    pub lag: Lag,
    pub pending: u64,
    /// The group's read counter, for progress detection.
    pub entries_read: Option<u64>,
    /// Entries ever added to the stream, when Redis can tell (its read
    /// counter plus its lag, both reported: how Redis derives the lag).
    pub entries_added: Option<u64>,
    /// The server's clock (`TIME`, milliseconds) when this was read.
    pub server_ms: u64,
    pub last_delivered_id: String,
    /// Idle time of the oldest pending entry (milliseconds).
    pub oldest_pending_idle_ms: Option<u64>,
    /// Highest delivery count among the oldest pending entries.
    pub max_delivery_count: Option<u64>,
    pub consumers: Vec<ConsumerState>,
    /// The ID before the oldest pending entry (`None` when nothing is pending).
    pub before_oldest_pending: Option<String>,
    pub stream_length: u64,
    pub dead_letter_length: u64,
    /// Entries parked for a retry on the schedule (`retry`): pending, but
    /// waiting by design, so neither in the oldest sample nor among the
    /// consumers.
    pub retrying: u64,
    /// Per delivery count, the entries waiting for their retry.
    pub parked: Vec<ParkedState>,
    /// How late the group is ([`Delay`]).
    pub delay: Delay,
    /// When the oldest unfinished entry was added (its ID's milliseconds,
    /// the primary's clock): `None` when nothing is unfinished or its ID is
    /// not a time. Unlike the delay, it stays put while nothing moves.
    pub oldest_unfinished_ms: Option<u64>,
    /// The same, leaving out entries parked for a retry: the lateness more
    /// workers could shorten.
    pub working_delay: Delay,
}

impl Default for GroupSnapshot {
    fn default() -> Self {
        GroupSnapshot {
            lag: Lag::Known(0),
            pending: 0,
            entries_read: Some(0),
            entries_added: Some(0),
            server_ms: 0,
            last_delivered_id: "0-0".into(),
            oldest_pending_idle_ms: None,
            max_delivery_count: None,
            consumers: Vec::new(),
            before_oldest_pending: None,
            stream_length: 0,
            dead_letter_length: 0,
            retrying: 0,
            parked: Vec::new(),
            delay: Delay::Known(0),
            oldest_unfinished_ms: None,
            working_delay: Delay::Known(0),
        }
    }
}

/// The entries parked after failing at one delivery count (`retry`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParkedState {
    /// The delivery count they failed at: their next attempt is `deliveries + 1`.
    pub deliveries: u64,
    pub entries: u64,
    /// The longest idle time among the first [`PARKED_SAMPLE`] of them
    /// (by ID): the next of them due is due at the parking threshold
    /// less this.
    pub most_idle_ms: u64,
    /// That entry's last error.
    pub last_error: Option<String>,
}

/// How many entries of each parking consumer are looked at for the next due.
pub const PARKED_SAMPLE: usize = 100;

/// KEYS: stream, entry records. ARGV: group, sample size. Per parking
/// consumer with entries: its delivery count, its entries, the longest idle
/// time among its first entries and that entry's last error ('' for none).
static PARKED_SUMMARY: std::sync::LazyLock<redis::Script> = std::sync::LazyLock::new(|| {
    redis::Script::new(&format!(
        r"{}
        local out = {{}}
        for _, c in ipairs(consumers(KEYS[1], ARGV[1])) do
            local n = parked_count(c.name)
            if n and c.pending > 0 then
                local most, id = -1, nil
                for _, p in ipairs(redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', tonumber(ARGV[2]), c.name)) do
                    if p[3] > most then most, id = p[3], p[1] end
                end
                local error = id and redis.call('HGET', KEYS[2], id) or false
                out[#out + 1] = {{ n, c.pending, math.max(most, 0), error or '' }}
            end
        end
        return out",
        crate::retry::consumers_lua()
    ))
});

impl GroupSnapshot {
    /// One view of a group over the shards of a pipeline (shard 0 first):
    /// counts summed, the worst oldest-idle time and delivery count, the
    /// consumers merged by name, and shard 0's positions (where a vanished
    /// group resumes). `None` for no parts.
    pub fn merge(parts: &[GroupSnapshot]) -> Option<GroupSnapshot> {
        let first = parts.first()?;
        let mut consumers: Vec<ConsumerState> = Vec::new();
        for c in parts.iter().flat_map(|p| &p.consumers) {
            match consumers.iter_mut().find(|m| m.name == c.name) {
                Some(m) => {
                    m.pending = m.pending.saturating_add(c.pending);
                    m.idle_ms = m.idle_ms.min(c.idle_ms);
                }
                None => consumers.push(c.clone()),
            }
        }
        // Saturating: the counts are what the servers reported, whatever they are.
        let total = |count: fn(&GroupSnapshot) -> u64| parts.iter().map(count).fold(0, u64::saturating_add);
        Some(GroupSnapshot {
            lag: Lag::sum(parts.iter().map(|p| p.lag)),
            pending: total(|p| p.pending),
            entries_read: parts.iter().try_fold(0, |sum: u64, p| p.entries_read.map(|n| sum.saturating_add(n))),
            entries_added: parts.iter().try_fold(0, |sum: u64, p| p.entries_added.map(|n| sum.saturating_add(n))),
            server_ms: first.server_ms,
            last_delivered_id: first.last_delivered_id.clone(),
            oldest_pending_idle_ms: parts.iter().filter_map(|p| p.oldest_pending_idle_ms).max(),
            max_delivery_count: parts.iter().filter_map(|p| p.max_delivery_count).max(),
            consumers,
            before_oldest_pending: first.before_oldest_pending.clone(),
            stream_length: total(|p| p.stream_length),
            dead_letter_length: total(|p| p.dead_letter_length),
            retrying: total(|p| p.retrying),
            parked: merge_parked(parts.iter().flat_map(|p| &p.parked)),
            delay: Delay::worst(parts.iter().map(|p| p.delay)),
            // Unknown if any shard's IDs are not times, like the delay.
            oldest_unfinished_ms: if parts.iter().any(|p| p.delay == Delay::NotTimes) {
                None
            } else {
                parts.iter().filter_map(|p| p.oldest_unfinished_ms).min()
            },
            working_delay: Delay::worst(parts.iter().map(|p| p.working_delay)),
        })
    }
}

/// The parked entries of several shards per delivery count: counts summed,
/// the most idle (and its error) kept.
fn merge_parked<'a>(parts: impl Iterator<Item = &'a ParkedState>) -> Vec<ParkedState> {
    let mut merged: Vec<ParkedState> = Vec::new();
    for p in parts {
        match merged.iter_mut().find(|m| m.deliveries == p.deliveries) {
            Some(m) => {
                m.entries = m.entries.saturating_add(p.entries);
                if p.most_idle_ms > m.most_idle_ms {
                    m.most_idle_ms = p.most_idle_ms;
                    m.last_error.clone_from(&p.last_error);
                }
            }
            None => merged.push(p.clone()),
        }
    }
    merged.sort_by_key(|p| p.deliveries);
    merged
}

/// KEYS: stream. ARGV: group, lag counting bound, oldest sample size. One
/// instant of the group (`false` when the stream or group does not exist):
/// Redis `TIME` in milliseconds; the group's pending count, last delivered
/// ID, read counter and lag as `XINFO GROUPS` reports them (-1 for NULL);
/// the entries after the last delivered ID, counted up to the bound plus
/// one, and the first of them; the stream's length; and the oldest pending
/// entries (`XPENDING - + N`).
static POSITIONS: std::sync::LazyLock<redis::Script> = std::sync::LazyLock::new(|| {
    redis::Script::new(
        r"
        local groups = redis.pcall('XINFO', 'GROUPS', KEYS[1])
        if groups.err then
            if string.find(groups.err, 'no such key') then return false end
            return redis.error_reply(groups.err)
        end
        local g = nil
        for _, row in ipairs(groups) do
            local fields = {}
            for i = 1, #row, 2 do fields[row[i]] = row[i + 1] end
            if fields['name'] == ARGV[1] then g = fields end
        end
        if not g then return false end
        local t = redis.call('TIME')
        local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
        local last = g['last-delivered-id']
        local after = redis.call('XRANGE', KEYS[1], '(' .. last, '+', 'COUNT', tonumber(ARGV[2]) + 1)
        local first = after[1] and after[1][1] or ''
        local oldest = redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', tonumber(ARGV[3]))
        return { now, g['pending'], last, g['entries-read'] or -1, g['lag'] or -1,
                 #after, first, redis.call('XLEN', KEYS[1]), oldest }",
    )
});

/// What [`POSITIONS`] returns.
type Positions = (u64, u64, String, i64, i64, u64, String, u64, Vec<Pending>);

/// Inspects `group` on `stream`. `Ok(None)`: the group (or stream) does not exist.
pub async fn inspect<C: ConnectionLike + Send>(
    conn: &mut C,
    of: GroupRef<'_>,
    dead_letter_stream: &str,
) -> Result<Option<GroupSnapshot>, StreamError> {
    let GroupRef { stream, group } = of;
    let err = |e| StreamError::new("inspecting the group", e);
    let mut positions = POSITIONS.prepare_invoke();
    positions.key(stream).arg(group).arg(LAG_COUNT_BOUND).arg(OLDEST_SAMPLE);
    // The dead letters first: an entry dead-lettered between the two reads
    // shows as neither pending nor dead for a poll, never as both.
    let mut pipe = redis::pipe();
    pipe.cmd("XLEN").arg(dead_letter_stream);
    pipe.invoke_script(&positions);
    let first: redis::RedisResult<(u64, Option<Positions>)> = match pipe.query_async(conn).await {
        Err(e) if e.code() == Some("NOSCRIPT") => {
            positions.load_async(conn).await.map_err(err)?;
            pipe.query_async(conn).await
        }
        other => other,
    };
    let (dead_letter_length, positions) = first.map_err(err)?;
    let Some((
        now_ms,
        pending,
        last_delivered_id,
        entries_read,
        reported_lag,
        after,
        first_undelivered,
        length,
        oldest,
    )) = positions
    else {
        return Ok(None);
    };

    let consumers: StreamInfoConsumersReply =
        redis::cmd("XINFO").arg("CONSUMERS").arg(stream).arg(group).query_async(conn).await.map_err(err)?;
    let (parked, consumers): (Vec<_>, Vec<_>) = consumers
        .consumers
        .into_iter()
        .map(|c| ConsumerState { name: c.name, pending: to_u64(c.pending), idle_ms: to_u64(c.idle) })
        .partition(|c| crate::retry::parked_deliveries(&c.name).is_some());
    let retrying = parked.iter().map(|c| c.pending).fold(0, u64::saturating_add);
    // Where a recreated group resumes: before the oldest pending entry,
    // parked or not (a parked entry is unfinished work too). The same entry
    // (or the first undelivered one) is the oldest unfinished: the delay.
    let oldest_pending_id = oldest.first().map(|(id, ..)| id.clone());
    let before_oldest_pending =
        oldest_pending_id.as_deref().and_then(crate::retention::StreamId::parse).map(|id| id.prev().to_string());
    let unfinished = [oldest_pending_id.as_deref(), Some(first_undelivered.as_str())];
    let delay = Delay::of(now_ms, unfinished);
    let oldest_unfinished_ms = oldest_time(now_ms, unfinished).ok().flatten();
    let (oldest, parked) = if retrying == 0 {
        (oldest, Vec::new())
    } else {
        (oldest_unparked(conn, stream, group, oldest, &consumers).await?, parked_summary(conn, stream, group).await?)
    };
    let working_delay =
        Delay::of(now_ms, [oldest.first().map(|(id, ..)| id.as_str()), Some(first_undelivered.as_str())]);

    // The PEL is in ID order, so the oldest-ID sample is the one that has waited
    // longest since first delivery; its idle times tell how stuck it is.
    let oldest_pending_idle_ms = oldest.iter().map(|(_, _, idle, _)| *idle).max();
    let max_delivery_count = oldest.iter().map(|(_, _, _, count)| *count).max();
    Ok(Some(GroupSnapshot {
        lag: Lag::by_ids(after, u64::try_from(reported_lag).ok()),
        pending,
        entries_read: u64::try_from(entries_read).ok(),
        entries_added: u64::try_from(entries_read)
            .ok()
            .zip(u64::try_from(reported_lag).ok())
            .map(|(r, l)| r.saturating_add(l)),
        server_ms: now_ms,
        last_delivered_id,
        oldest_pending_idle_ms,
        max_delivery_count,
        consumers,
        before_oldest_pending,
        stream_length: length,
        dead_letter_length,
        retrying,
        parked,
        delay,
        oldest_unfinished_ms,
        working_delay,
    }))
}

/// Per delivery count, the entries parked for a retry ([`PARKED_SUMMARY`]).
async fn parked_summary<C: ConnectionLike + Send>(
    conn: &mut C,
    stream: &str,
    group: &str,
) -> Result<Vec<ParkedState>, StreamError> {
    let rows: Vec<(u64, u64, u64, String)> = PARKED_SUMMARY
        .key(stream)
        .key(crate::keys::last_error_key(stream, group))
        .arg(group)
        .arg(PARKED_SAMPLE)
        .invoke_async(conn)
        .await
        .map_err(|e| StreamError::new("inspecting entries waiting for a retry", e))?;
    let mut parked: Vec<ParkedState> = rows
        .into_iter()
        .map(|(deliveries, entries, most_idle_ms, error)| ParkedState {
            deliveries,
            entries,
            most_idle_ms,
            last_error: (!error.is_empty()).then_some(error),
        })
        .collect();
    parked.sort_by_key(|p| p.deliveries);
    Ok(parked)
}

/// One `XPENDING` row: ID, owner, idle ms, delivery count.
type Pending = (String, String, u64, u64);

/// The oldest pending entries not parked for a retry: the group's sample
/// without parked ones when it still has [`OLDEST_SAMPLE`] of them, else
/// the oldest of each consumer's own (one more round trip).
async fn oldest_unparked<C: ConnectionLike + Send>(
    conn: &mut C,
    stream: &str,
    group: &str,
    sample: Vec<Pending>,
    consumers: &[ConsumerState],
) -> Result<Vec<Pending>, StreamError> {
    let unparked = |rows: Vec<Pending>| -> Vec<Pending> {
        rows.into_iter().filter(|(_, owner, ..)| crate::retry::parked_deliveries(owner).is_none()).collect()
    };
    let sample = unparked(sample);
    let holding: Vec<&ConsumerState> = consumers.iter().filter(|c| c.pending > 0).collect();
    if sample.len() >= OLDEST_SAMPLE || holding.is_empty() {
        return Ok(sample);
    }
    let mut pipe = redis::pipe();
    for c in &holding {
        pipe.cmd("XPENDING").arg(stream).arg(group).arg("-").arg("+").arg(OLDEST_SAMPLE).arg(&c.name);
    }
    let per_consumer: Vec<Vec<Pending>> =
        pipe.query_async(conn).await.map_err(|e| StreamError::new("inspecting the group", e))?;
    let mut rows: Vec<Pending> = per_consumer.into_iter().flatten().collect();
    rows.sort_by_key(|(id, ..)| crate::retention::StreamId::parse(id));
    rows.truncate(OLDEST_SAMPLE);
    Ok(rows)
}

fn to_u64(n: usize) -> u64 {
    u64::try_from(n).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn part(lag: Lag, pending: u64, idle: Option<u64>, consumers: &[(&str, u64, u64)]) -> GroupSnapshot {
        GroupSnapshot {
            lag,
            pending,
            entries_read: Some(pending),
            entries_added: Some(pending * 2),
            server_ms: 5,
            last_delivered_id: format!("{pending}-0"),
            oldest_pending_idle_ms: idle,
            max_delivery_count: idle.map(|i| i / 100),
            consumers: consumers
                .iter()
                .map(|(name, pending, idle_ms)| ConsumerState {
                    name: (*name).into(),
                    pending: *pending,
                    idle_ms: *idle_ms,
                })
                .collect(),
            before_oldest_pending: Some(format!("{pending}-1")),
            stream_length: 10,
            dead_letter_length: 1,
            retrying: 2,
            parked: vec![ParkedState {
                deliveries: 1,
                entries: 2,
                most_idle_ms: pending * 10,
                last_error: Some(format!("e{pending}")),
            }],
            delay: Delay::Known(pending * 1000),
            oldest_unfinished_ms: Some(1_000_000 + pending),
            working_delay: Delay::Known(pending * 500),
        }
    }

    #[test]
    fn shards_merge_into_totals_with_the_worst_figures_and_shard_zeros_positions() {
        let merged = GroupSnapshot::merge(&[
            part(Lag::Known(3), 2, Some(500), &[("a", 2, 40)]),
            part(Lag::Known(4), 5, Some(900), &[("a", 1, 10), ("b", 4, 70)]),
            part(Lag::Known(0), 0, None, &[]),
        ])
        .unwrap();
        assert_eq!((merged.lag, merged.pending, merged.entries_read), (Lag::Known(7), 7, Some(7)));
        assert_eq!((merged.oldest_pending_idle_ms, merged.max_delivery_count), (Some(900), Some(9)));
        assert_eq!((merged.stream_length, merged.dead_letter_length, merged.retrying), (30, 3, 6));
        let parked = ParkedState { deliveries: 1, entries: 6, most_idle_ms: 50, last_error: Some("e5".into()) };
        assert_eq!(merged.parked, vec![parked], "counts summed, the most idle kept with its error");
        assert_eq!((merged.last_delivered_id.as_str(), merged.before_oldest_pending.as_deref()), ("2-0", Some("2-1")));
        let a = merged.consumers.iter().find(|c| c.name == "a").unwrap();
        assert_eq!((a.pending, a.idle_ms), (3, 10));
        assert_eq!(merged.consumers.len(), 2);
        assert_eq!(merged.delay, Delay::Known(5000), "the worst shard's delay");
        assert_eq!(merged.oldest_unfinished_ms, Some(1_000_000), "the oldest shard's oldest");
        let mut explicit = part(Lag::Known(0), 1, None, &[]);
        explicit.delay = Delay::NotTimes;
        let merged = GroupSnapshot::merge(&[part(Lag::Known(0), 2, None, &[]), explicit]).unwrap();
        assert_eq!((merged.delay, merged.oldest_unfinished_ms), (Delay::NotTimes, None), "unknown, not a time");
        assert!(GroupSnapshot::merge(&[]).is_none());
    }

    #[test]
    fn lag_is_known_only_when_every_shard_knows_it() {
        assert_eq!(Lag::sum([Lag::Known(1), Lag::Known(2)]), Lag::Known(3));
        assert_eq!(Lag::sum([Lag::Known(1), Lag::AtLeast(1000)]), Lag::AtLeast(1001));
        assert_eq!(Lag::sum([Lag::Known(1), Lag::Unknown, Lag::AtLeast(5)]), Lag::Unknown);
    }

    #[test]
    fn lag_is_counted_from_ids_within_the_bound_whatever_redis_reports() {
        let bound = LAG_COUNT_BOUND as u64;
        // A promoted replica's phantom: Redis says 1471, nothing follows the last delivered ID.
        assert_eq!(Lag::by_ids(0, Some(1471)), Lag::Known(0));
        assert_eq!(Lag::by_ids(15, None), Lag::Known(15), "NULL in Redis, counted");
        assert_eq!(Lag::by_ids(bound, Some(3)), Lag::Known(bound));
        assert_eq!(Lag::by_ids(bound + 1, Some(5000)), Lag::Known(5000), "beyond the bound, Redis agrees");
        assert_eq!(Lag::by_ids(bound + 1, Some(bound)), Lag::AtLeast(bound + 1), "Redis disagrees: a floor");
        assert_eq!(Lag::by_ids(bound + 1, None), Lag::AtLeast(bound + 1));
    }

    #[test]
    fn delay_is_the_age_of_the_oldest_unfinished_id_by_the_servers_clock() {
        let now = 1_796_000_000_000;
        let at = |ms: u64| format!("{ms}-3");
        let (pending, undelivered) = (at(now - 4_000), at(now - 9_000));
        assert_eq!(Delay::of(now, [Some(&pending), Some(&undelivered)]), Delay::Known(9_000), "the older of the two");
        assert_eq!(Delay::of(now, [Some(&pending), Some("")]), Delay::Known(4_000));
        assert_eq!(Delay::of(now, [None, Some(&undelivered)]), Delay::Known(9_000));
        assert_eq!(Delay::of(now, [None, Some("")]), Delay::Known(0), "nothing unfinished");
        // Same millisecond, several entries: the sequence does not count.
        assert_eq!(Delay::of(now, [Some(&at(now)), None]), Delay::Known(0));
        // An ID a little ahead of this clock (a failover to a primary behind): no delay, no wrap.
        assert_eq!(Delay::of(now, [Some(&at(now + CLOCK_SKEW_MS)), None]), Delay::Known(0));
        // Explicit IDs: not a time, never a number.
        assert_eq!(Delay::of(now, [Some("42-0"), None]), Delay::NotTimes);
        assert_eq!(Delay::of(now, [Some(&at(EARLIEST_TIME_ID_MS - 1)), None]), Delay::NotTimes);
        assert_eq!(Delay::of(now, [Some(&at(now + CLOCK_SKEW_MS + 1)), None]), Delay::NotTimes);
        // The oldest decides even when the other is a time.
        assert_eq!(Delay::of(now, [Some("7-0"), Some(&undelivered)]), Delay::NotTimes);
    }

    #[test]
    fn shards_delay_is_the_worst_and_unreadable_if_any_is() {
        assert_eq!(Delay::worst([Delay::Known(3), Delay::Known(9), Delay::Known(0)]), Delay::Known(9));
        assert_eq!(Delay::worst([Delay::Known(3), Delay::NotTimes]), Delay::NotTimes);
        assert_eq!(Delay::worst([]), Delay::Known(0));
    }
}
