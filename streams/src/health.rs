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
    /// Redis commands this inspection sent (for the benchmark).
    pub commands: usize,
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
    let mut commands = 3;

    let mut pipe = redis::pipe();
    pipe.cmd("XPENDING").arg(stream).arg(group).arg("-").arg("+").arg(OLDEST_SAMPLE);
    pipe.cmd("XINFO").arg("CONSUMERS").arg(stream).arg(group);
    let (oldest, consumers): (Vec<(String, String, u64, u64)>, StreamInfoConsumersReply) =
        pipe.query_async(conn).await.map_err(err)?;
    commands += 2;

    let lag = match info.lag {
        Some(n) => Lag::Known(to_u64(n)),
        None => {
            commands += 1;
            count_after(conn, stream, &info.last_delivered_id).await?
        }
    };
    // The PEL is in ID order, so the oldest-ID sample is the one that has waited
    // longest since first delivery; its idle times tell how stuck it is.
    let oldest_pending_idle_ms = oldest.iter().map(|(_, _, idle, _)| *idle).max();
    let max_delivery_count = oldest.iter().map(|(_, _, _, count)| *count).max();
    let before_oldest_pending =
        oldest.first().and_then(|(id, ..)| crate::retention::StreamId::parse(id)).map(|id| id.prev().to_string());
    Ok(Some(GroupSnapshot {
        lag,
        pending: to_u64(info.pending),
        entries_read: info.entries_read.map(to_u64),
        last_delivered_id: info.last_delivered_id,
        oldest_pending_idle_ms,
        max_delivery_count,
        consumers: consumers
            .consumers
            .into_iter()
            .map(|c| ConsumerState { name: c.name, pending: to_u64(c.pending), idle_ms: to_u64(c.idle) })
            .collect(),
        before_oldest_pending,
        stream_length,
        dead_letter_length,
        commands,
    }))
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
