//! Group health inspection in a bounded number of commands, whatever the PEL
//! size: two pipelined round trips — `XINFO GROUPS` (lag, pending, read
//! counter, last delivered ID), `XLEN` of the stream and of the dead-letter
//! stream; then `XPENDING - + N` (the N oldest pending entries: idle times,
//! delivery counts) and `XINFO CONSUMERS` — plus one bounded `XRANGE` only
//! when Redis reports the lag as NULL.

use crate::error::StreamError;
use redis::aio::ConnectionLike;
use redis::streams::{StreamInfoConsumersReply, StreamInfoGroupsReply};

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

    /// Zero only when known to be zero.
    pub fn is_known_zero(self) -> bool {
        self == Lag::Known(0)
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConsumerState {
    pub name: String,
    pub pending: u64,
    pub idle_ms: u64,
}

/// One inspection of a group.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupSnapshot {
    pub lag: Lag,
    pub pending: u64,
    /// The group's read counter, for progress detection.
    pub entries_read: Option<u64>,
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
            last_delivered_id: first.last_delivered_id.clone(),
            oldest_pending_idle_ms: parts.iter().filter_map(|p| p.oldest_pending_idle_ms).max(),
            max_delivery_count: parts.iter().filter_map(|p| p.max_delivery_count).max(),
            consumers,
            before_oldest_pending: first.before_oldest_pending.clone(),
            stream_length: total(|p| p.stream_length),
            dead_letter_length: total(|p| p.dead_letter_length),
            retrying: total(|p| p.retrying),
            parked: merge_parked(parts.iter().flat_map(|p| &p.parked)),
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

/// Inspects `group` on `stream`. `Ok(None)`: the group (or stream) does not exist.
pub async fn inspect<C: ConnectionLike + Send>(
    conn: &mut C,
    stream: &str,
    group: &str,
    dead_letter_stream: &str,
) -> Result<Option<GroupSnapshot>, StreamError> {
    let err = |e| StreamError::new("inspecting the group", e);
    let mut pipe = redis::pipe();
    pipe.cmd("XINFO").arg("GROUPS").arg(stream);
    pipe.cmd("XLEN").arg(stream);
    pipe.cmd("XLEN").arg(dead_letter_stream);
    let first: redis::RedisResult<(StreamInfoGroupsReply, u64, u64)> = pipe.query_async(conn).await;
    let (groups, stream_length, dead_letter_length) = match first {
        Ok(r) => r,
        Err(e) if e.to_string().contains("no such key") => return Ok(None),
        Err(e) => return Err(err(e)),
    };
    let Some(info) = groups.groups.into_iter().find(|g| g.name == group) else {
        return Ok(None);
    };

    let mut pipe = redis::pipe();
    pipe.cmd("XPENDING").arg(stream).arg(group).arg("-").arg("+").arg(OLDEST_SAMPLE);
    pipe.cmd("XINFO").arg("CONSUMERS").arg(stream).arg(group);
    let (oldest, consumers): (Vec<Pending>, StreamInfoConsumersReply) = pipe.query_async(conn).await.map_err(err)?;
    let (parked, consumers): (Vec<_>, Vec<_>) = consumers
        .consumers
        .into_iter()
        .map(|c| ConsumerState { name: c.name, pending: to_u64(c.pending), idle_ms: to_u64(c.idle) })
        .partition(|c| crate::retry::parked_deliveries(&c.name).is_some());
    let retrying = parked.iter().map(|c| c.pending).fold(0, u64::saturating_add);
    // Where a recreated group resumes: before the oldest pending entry,
    // parked or not (a parked entry is unfinished work too).
    let before_oldest_pending =
        oldest.first().and_then(|(id, ..)| crate::retention::StreamId::parse(id)).map(|id| id.prev().to_string());
    let (oldest, parked) = if retrying == 0 {
        (oldest, Vec::new())
    } else {
        (oldest_unparked(conn, stream, group, oldest, &consumers).await?, parked_summary(conn, stream, group).await?)
    };

    let lag = match info.lag {
        Some(n) => Lag::Known(to_u64(n)),
        None => count_after(conn, stream, &info.last_delivered_id).await?,
    };
    // The PEL is in ID order, so the oldest-ID sample is the one that has waited
    // longest since first delivery; its idle times tell how stuck it is.
    let oldest_pending_idle_ms = oldest.iter().map(|(_, _, idle, _)| *idle).max();
    let max_delivery_count = oldest.iter().map(|(_, _, _, count)| *count).max();
    Ok(Some(GroupSnapshot {
        lag,
        pending: to_u64(info.pending),
        entries_read: info.entries_read.map(to_u64),
        last_delivered_id: info.last_delivered_id,
        oldest_pending_idle_ms,
        max_delivery_count,
        consumers,
        before_oldest_pending,
        stream_length,
        dead_letter_length,
        retrying,
        parked,
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

/// Counts entries after `last_delivered` with one bounded XRANGE.
async fn count_after<C: ConnectionLike + Send>(
    conn: &mut C,
    stream: &str,
    last_delivered: &str,
) -> Result<Lag, StreamError> {
    let ids: redis::RedisResult<Vec<(String, redis::Value)>> = redis::cmd("XRANGE")
        .arg(stream)
        .arg(format!("({last_delivered}"))
        .arg("+")
        .arg("COUNT")
        .arg(LAG_COUNT_BOUND + 1)
        .query_async(conn)
        .await;
    Ok(match ids {
        Ok(ids) if ids.len() > LAG_COUNT_BOUND => Lag::AtLeast(to_u64(LAG_COUNT_BOUND)),
        Ok(ids) => Lag::Known(to_u64(ids.len())),
        Err(e) => {
            tracing::debug!(error = %e, "counting lag");
            Lag::Unknown
        }
    })
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
        assert!(GroupSnapshot::merge(&[]).is_none());
    }

    #[test]
    fn lag_is_known_only_when_every_shard_knows_it() {
        assert_eq!(Lag::sum([Lag::Known(1), Lag::Known(2)]), Lag::Known(3));
        assert_eq!(Lag::sum([Lag::Known(1), Lag::AtLeast(1000)]), Lag::AtLeast(1001));
        assert_eq!(Lag::sum([Lag::Known(1), Lag::Unknown, Lag::AtLeast(5)]), Lag::Unknown);
    }
}
