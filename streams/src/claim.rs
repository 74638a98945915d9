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
