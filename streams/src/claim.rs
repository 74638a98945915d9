//! Claiming idle pending entries (XAUTOCLAIM) and learning their delivery counts.

use crate::entry::{Entry, fields_from_map};
use crate::error::StreamError;
use redis::aio::ConnectionLike;
use redis::streams::{StreamAutoClaimOptions, StreamAutoClaimReply};
use std::collections::HashMap;
use std::time::Duration;

/// One XAUTOCLAIM step.
pub struct Claimed {
    /// Entries now owned by the claiming consumer, delivery counts included.
    pub entries: Vec<Entry>,
    /// Pending IDs whose payload is gone (trimmed or XDEL'd). Redis (7.0+)
    /// has already removed them from the PEL: they must be reported, never
    /// counted as success.
    pub deleted: Vec<String>,
    /// Cursor for the next step; `0-0` once the whole PEL was scanned.
    pub next: String,
}

/// Claims up to `count` entries idle for at least `min_idle`, scanning from `start`.
pub async fn autoclaim<C: ConnectionLike + Send>(
    conn: &mut C,
    stream: &str,
    group: &str,
    consumer: &str,
    min_idle: Duration,
    start: &str,
    count: usize,
) -> Result<Claimed, StreamError> {
    let min_idle_ms = u64::try_from(min_idle.as_millis()).unwrap_or(u64::MAX);
    let reply: StreamAutoClaimReply = redis::cmd("XAUTOCLAIM")
        .arg(stream)
        .arg(group)
        .arg(consumer)
        .arg(min_idle_ms)
        .arg(start)
        .arg(StreamAutoClaimOptions::default().count(count))
        .query_async(conn)
        .await
        .map_err(|e| StreamError::new("claiming idle entries", e))?;
    let ids: Vec<String> = reply.claimed.iter().map(|e| e.id.clone()).collect();
    let counts = delivery_counts(conn, stream, group, &ids).await?;
    let entries = reply
        .claimed
        .into_iter()
        .map(|e| Entry {
            deliveries: counts.get(&e.id).copied().unwrap_or(1),
            stream: stream.to_string(),
            id: e.id,
            fields: fields_from_map(e.map),
        })
        .collect();
    Ok(Claimed { entries, deleted: reply.deleted_ids, next: reply.next_stream_id })
}

/// Takes back up to `count` of `consumer`'s own pending entries after
/// `after` (exclusive; `-` for the start): what a restarted process under the
/// same consumer name read before and never settled. `XCLAIM` to itself
/// returns the entries that still exist; the others are `deleted`. `next` is
/// the last ID looked at, or `0-0` when the PEL holds no more of them.
pub async fn claim_own<C: ConnectionLike + Send>(
    conn: &mut C,
    stream: &str,
    group: &str,
    consumer: &str,
    after: &str,
    count: usize,
) -> Result<Claimed, StreamError> {
    let err = |e| StreamError::new("taking back own pending entries", e);
    let start = if after == "-" { after.to_string() } else { format!("({after}") };
    let pending = crate::consumers::pending_of(conn, stream, group, consumer, &start, count).await?;
    let Some((last, ..)) = pending.last() else {
        return Ok(Claimed { entries: Vec::new(), deleted: Vec::new(), next: "0-0".into() });
    };
    let next = if pending.len() < count { "0-0".to_string() } else { last.clone() };
    let ids: Vec<&String> = pending.iter().map(|(id, ..)| id).collect();
    // A compare-and-set on idleness: an entry someone else claimed since the
    // XPENDING above has a fresh idle time and is left to them.
    let least_idle = pending.iter().map(|(_, _, idle, _)| *idle).min().unwrap_or(0);
    let reply: redis::streams::StreamClaimReply = redis::cmd("XCLAIM")
        .arg(stream)
        .arg(group)
        .arg(consumer)
        .arg(least_idle)
        .arg(&ids)
        .query_async(conn)
        .await
        .map_err(err)?;
    let mut found: HashMap<String, HashMap<String, redis::Value>> =
        reply.ids.into_iter().map(|e| (e.id, e.map)).collect();
    let mut entries = Vec::new();
    let mut missing = Vec::new();
    for (id, _, _, deliveries) in pending {
        match found.remove(&id) {
            // The claim was one more delivery.
            Some(map) => entries.push(Entry {
                stream: stream.to_string(),
                deliveries: deliveries.saturating_add(1),
                fields: fields_from_map(map),
                id,
            }),
            None => missing.push(id),
        }
    }
    // Not claimed: either its payload is gone, or someone else has it now.
    let mut pipe = redis::pipe();
    for id in &missing {
        pipe.cmd("XRANGE").arg(stream).arg(id).arg(id);
    }
    let payloads: Vec<Vec<(String, HashMap<String, redis::Value>)>> =
        if missing.is_empty() { Vec::new() } else { pipe.query_async(conn).await.map_err(err)? };
    let deleted = missing.into_iter().zip(payloads).filter(|(_, p)| p.is_empty()).map(|(id, _)| id).collect();
    Ok(Claimed { entries, deleted, next })
}

/// Delivery counts of `ids`: one pipelined round trip of single-entry
/// extended XPENDING calls, bounded by the batch size.
pub async fn delivery_counts<C: ConnectionLike + Send>(
    conn: &mut C,
    stream: &str,
    group: &str,
    ids: &[String],
) -> Result<HashMap<String, u64>, StreamError> {
    if ids.is_empty() {
        return Ok(HashMap::new());
    }
    let mut pipe = redis::pipe();
    for id in ids {
        pipe.cmd("XPENDING").arg(stream).arg(group).arg(id).arg(id).arg(1);
    }
    let rows: Vec<Vec<(String, String, u64, u64)>> =
        pipe.query_async(conn).await.map_err(|e| StreamError::new("reading delivery counts", e))?;
    Ok(rows.into_iter().flatten().map(|(id, _, _, count)| (id, count)).collect())
}
