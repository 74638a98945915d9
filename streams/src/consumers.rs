//! Consumers left behind by pods that no longer exist.

use crate::error::StreamError;
use redis::aio::ConnectionLike;
use std::time::Duration;

/// Makes up to `count` of `consumer`'s pending entries claimable at once, by
/// re-claiming them to the same consumer with an idle time of `min_idle`
/// (`XCLAIM ... IDLE ... JUSTID`: owner and delivery count unchanged). The
/// next XAUTOCLAIM of any live consumer takes them, without waiting out
/// min-idle-time. Returns how many were released now (entries already
/// released earlier are left as they are).
pub async fn release_pending<C: ConnectionLike + Send>(
    conn: &mut C,
    stream: &str,
    group: &str,
    consumer: &str,
    min_idle: Duration,
    count: usize,
) -> Result<usize, StreamError> {
    let err = |e| StreamError::new("releasing a dead consumer's entries", e);
    let pending: Vec<(String, String, u64, u64)> = redis::cmd("XPENDING")
        .arg(stream)
        .arg(group)
        .arg("-")
        .arg("+")
        .arg(count)
        .arg(consumer)
        .query_async(conn)
        .await
        .map_err(err)?;
    let idle_ms = u64::try_from(min_idle.as_millis()).unwrap_or(u64::MAX).saturating_add(1);
    let stale: Vec<&String> = pending.iter().filter(|(_, _, idle, _)| *idle < idle_ms).map(|(id, ..)| id).collect();
    if stale.is_empty() {
        return Ok(0);
    }
    let released: Vec<String> = redis::cmd("XCLAIM")
        .arg(stream)
        .arg(group)
        .arg(consumer)
        .arg(0)
        .arg(&stale)
        .arg("IDLE")
        .arg(idle_ms)
        .arg("JUSTID")
        .query_async(conn)
        .await
        .map_err(err)?;
    Ok(released.len())
}

/// Deletes `consumer` only if it owns no pending entry, atomically: deleting
/// a consumer drops its PEL, which would lose those entries for good.
pub async fn delete_if_empty<C: ConnectionLike + Send>(
    conn: &mut C,
    stream: &str,
    group: &str,
    consumer: &str,
) -> Result<bool, StreamError> {
    let script = redis::Script::new(
        r"
        local owned = redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', 1, ARGV[2])
        if #owned > 0 then return 0 end
        redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[2])
        return 1",
    );
    let deleted: i64 = script
        .key(stream)
        .arg(group)
        .arg(consumer)
        .invoke_async(conn)
        .await
        .map_err(|e| StreamError::new("deleting a dead consumer", e))?;
    Ok(deleted == 1)
}
