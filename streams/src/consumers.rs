//! Consumers left behind by pods that no longer exist.

use crate::error::StreamError;
use redis::aio::ConnectionLike;
use std::time::Duration;

/// How long a consumer stays in the dead-consumer registry: far longer than
/// any guard mark it may have left.
const DEAD_FOR: Duration = Duration::from_secs(24 * 3600);

/// One pending entry: ID, owner, idle milliseconds, deliveries.
pub type PendingEntry = (String, String, u64, u64);

/// Up to `count` of `consumer`'s pending entries from `start` (an ID, `(ID`
/// for after it, or `-`), oldest first.
pub async fn pending_of<C: ConnectionLike + Send>(
    conn: &mut C,
    stream: &str,
    group: &str,
    consumer: &str,
    start: &str,
    count: usize,
) -> Result<Vec<PendingEntry>, StreamError> {
    redis::cmd("XPENDING")
        .arg(stream)
        .arg(group)
        .arg(start)
        .arg("+")
        .arg(count)
        .arg(consumer)
        .query_async(conn)
        .await
        .map_err(|e| StreamError::new("reading a consumer's pending entries", e))
}

/// Declares `consumer` dead (its pod is gone): its idempotency-guard marks are
/// void from now on (`keys::dead_consumers_key`). Old declarations expire.
pub async fn declare_dead<C: ConnectionLike + Send>(
    conn: &mut C,
    stream: &str,
    group: &str,
    consumer: &str,
) -> Result<(), StreamError> {
    let key = crate::keys::dead_consumers_key(stream, group);
    let now = crate::recovery::now_ms();
    let expired = now.saturating_sub(u64::try_from(DEAD_FOR.as_millis()).unwrap_or(u64::MAX));
    let () = redis::pipe()
        .cmd("ZADD")
        .arg(&key)
        .arg(now)
        .arg(consumer)
        .ignore()
        .cmd("ZREMRANGEBYSCORE")
        .arg(&key)
        .arg("-inf")
        .arg(format!("({expired}"))
        .ignore()
        .query_async(conn)
        .await
        .map_err(|e| StreamError::new("declaring a consumer dead", e))?;
    Ok(())
}

/// Makes up to `count` of `consumer`'s pending entries claimable at once, by
/// re-claiming them to the same consumer with an idle time of `min_idle`
/// (`XCLAIM ... IDLE ... JUSTID`: owner and delivery count unchanged). The
/// next XAUTOCLAIM of any live consumer takes them, without waiting out
/// min-idle-time; the consumer is declared dead first ([`declare_dead`]), so
/// its idempotency-guard marks do not hold them up either. Returns how many were released now (entries already
/// released earlier are left as they are).
pub async fn release_pending<C: ConnectionLike + Send>(
    conn: &mut C,
    stream: &str,
    group: &str,
    consumer: &str,
    dead_letter_stream: &str,
    min_idle: Duration,
    count: usize,
) -> Result<Released, StreamError> {
    let pending = pending_of(conn, stream, group, consumer, "-", count).await?;
    let idle_ms = u64::try_from(min_idle.as_millis()).unwrap_or(u64::MAX).saturating_add(1);
    // First void its guard marks, so whoever claims its entries does not wait them out.
    declare_dead(conn, stream, group, consumer).await?;
    let stale: Vec<&str> =
        pending.iter().filter(|(_, _, idle, _)| *idle < idle_ms).map(|(id, ..)| id.as_str()).collect();
    if stale.is_empty() {
        return Ok(Released::default());
    }
    // XCLAIM drops IDs whose payload is gone from the PEL without a word: the
    // same script records those as lost first.
    let loss = crate::claim::LossRecord {
        dead_letter_stream,
        consumer,
        why: "payload trimmed or deleted while pending (found releasing a dead consumer)",
    };
    let how = crate::claim::ClaimIds { consumer, min_idle_ms: 0, set_idle_ms: Some(idle_ms), just_id: true };
    let claimed = crate::claim::claim_ids(conn, stream, group, &loss, &how, &stale).await?;
    let lost = claimed.lost;
    let released: Vec<String> = redis::FromRedisValue::from_redis_value(claimed.reply)
        .map_err(|e| StreamError::new("releasing a dead consumer's entries", e.into()))?;
    Ok(Released { released: released.len(), payload_lost: lost.len() })
}

/// What releasing a dead consumer's entries did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Released {
    /// Entries made claimable now.
    pub released: usize,
    /// Entries whose payload was gone: recorded as lost and dead-lettered.
    pub payload_lost: usize,
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
