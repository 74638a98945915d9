//! Consumers left behind by pods that no longer exist.

use crate::error::StreamError;
use crate::group_ref::ConsumerRef;
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
    who: ConsumerRef<'_>,
    start: &str,
    count: usize,
) -> Result<Vec<PendingEntry>, StreamError> {
    let ConsumerRef { stream, group, consumer } = who;
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

/// How often a live worker tells Redis it is alive, whether or not it has
/// anything in hand ([`heartbeat`]), from a thread its handlers cannot
/// block. Often, because a dead worker's entries wait [`SILENT_FOR`] before
/// they are released: one script per stream every half second.
pub const HEARTBEAT_EVERY: Duration = Duration::from_millis(500);

/// How long a consumer must have been silent before it may be declared
/// dead: four heartbeats missed.
pub const SILENT_FOR: Duration = Duration::from_secs(2);

/// A silence of the whole group longer than this (no consumer beat or
/// renewed a hold: two heartbeats missed by every one of them) means no
/// holder could renew meanwhile: the server stalled (a slow `fsync` under
/// `appendfsync always`, a long script, a paused VM) or every worker was
/// away. Claims then wait min-idle-time before taking entries last renewed
/// before it ([`silence_lua`]).
pub const GROUP_SILENCE: Duration = Duration::from_millis(1000);
const _: () = assert!(GROUP_SILENCE.as_millis() == 2 * HEARTBEAT_EVERY.as_millis());

/// Lua shared by every script that records a consumer alive and by the
/// claim rules: `silence_ended(epoch_key, alive_key, now)` returns when the
/// group's last silence longer than [`GROUP_SILENCE`] ended and a bound on
/// when it began, as far as claims know (the server's ms; `0, 0` for none),
/// and records them beside the server epoch (`resumed:<alive key>`,
/// `quiet-from:<alive key>`) when this call is the first to see it: no beat
/// in the alive registry within the silence, and some beat at or after the
/// last silence recorded (a group nobody beats in any more is one silence,
/// not one per look; a group nobody ever beat in has none). The bound on
/// its start is the oldest of those beats: no later than the silence's
/// real start. Whoever runs first after a stall sees it (a heartbeat, a
/// hold, a claim), before the next beat hides it; every script that
/// records a consumer alive checks first. Times ahead of the server's clock
/// (a clock stepped back) count as now. Only commands the ACL already
/// grants.
pub fn silence_lua() -> String {
    format!(
        r"
        local function silence_ended(epoch_key, alive_key, now)
            local rf, qf = 'resumed:' .. alive_key, 'quiet-from:' .. alive_key
            local seen = redis.call('HMGET', epoch_key, rf, qf)
            local resumed = math.min(tonumber(seen[1] or '0') or 0, now)
            local quiet_from = math.min(tonumber(seen[2] or '0') or 0, resumed)
            local recent = redis.call('ZRANGEBYSCORE', alive_key, string.format('(%.0f', now - {silence}), '+inf', 'LIMIT', 0, 1)
            if #recent == 0 then
                local since = redis.call('ZRANGEBYSCORE', alive_key, string.format('%.0f', resumed), '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
                if #since > 0 then
                    quiet_from = math.min(tonumber(since[2]) or 0, now)
                    redis.call('HSET', epoch_key, rf, string.format('%.0f', now), qf, string.format('%.0f', quiet_from))
                    return now, quiet_from
                end
            end
            return resumed, quiet_from
        end
        ",
        silence = GROUP_SILENCE.as_millis()
    )
}

/// KEYS: the group's alive registry, its dead-consumer registry, the
/// stream's server epoch. ARGV: consumer. Records that the consumer is
/// alive now (the server's ms), after noting a silence of the whole group
/// it ends ([`silence_lua`]), and takes it out of the dead registry if it
/// was declared dead while it lived (its guard marks count again).
static HEARTBEAT: std::sync::LazyLock<redis::Script> = std::sync::LazyLock::new(|| {
    redis::Script::new(&format!(
        r"{}
        local t = redis.call('TIME')
        local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
        silence_ended(KEYS[3], KEYS[1], now)
        redis.call('ZADD', KEYS[1], string.format('%.0f', now), ARGV[1])
        return redis.call('ZREM', KEYS[2], ARGV[1])",
        silence_lua()
    ))
});

/// Tells `stream`'s group that `consumer` is alive now (`keys::alive_key`).
/// Returns whether it had been declared dead (and no longer is).
pub async fn heartbeat<C: ConnectionLike + Send>(conn: &mut C, who: ConsumerRef<'_>) -> Result<bool, StreamError> {
    let ConsumerRef { stream, group, consumer } = who;
    let revived: i64 = HEARTBEAT
        .key(crate::keys::alive_key(stream, group))
        .key(crate::keys::dead_consumers_key(stream, group))
        .key(crate::keys::server_epoch_key(stream))
        .arg(consumer)
        .invoke_async(conn)
        .await
        .map_err(|e| StreamError::new("recording this consumer alive", e))?;
    Ok(revived > 0)
}

/// KEYS: alive registry, dead registry. ARGV: consumer, silent-for ms,
/// keep-dead-for ms. Declares the consumer dead unless it was alive within
/// silent-for (by the server's clock); trims old declarations. Returns 1
/// when declared.
static DECLARE_DEAD: std::sync::LazyLock<redis::Script> = std::sync::LazyLock::new(|| {
    redis::Script::new(
        r"
        local t = redis.call('TIME')
        local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
        local alive_at = tonumber(redis.call('ZSCORE', KEYS[1], ARGV[1]) or '')
        if alive_at and now - alive_at < tonumber(ARGV[2]) then return 0 end
        redis.call('ZADD', KEYS[2], string.format('%.0f', now), ARGV[1])
        redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', string.format('(%.0f', now - tonumber(ARGV[3])))
        return 1",
    )
});

/// Declares `consumer` dead (its pod is gone): its idempotency-guard marks
/// are void from now on (`keys::dead_consumers_key`); old declarations
/// expire. Not when it told Redis it was alive within [`SILENT_FOR`]
/// ([`heartbeat`]): `XINFO CONSUMERS` idle time is no proof of death (on
/// Redis 7.0 an idle reader's empty reads do not refresh it), and a pod
/// missing from a cache is no proof either. Returns whether it was declared.
pub async fn declare_dead<C: ConnectionLike + Send>(conn: &mut C, who: ConsumerRef<'_>) -> Result<bool, StreamError> {
    let ConsumerRef { stream, group, consumer } = who;
    let declared: i64 = DECLARE_DEAD
        .key(crate::keys::alive_key(stream, group))
        .key(crate::keys::dead_consumers_key(stream, group))
        .arg(consumer)
        .arg(crate::millis(SILENT_FOR))
        .arg(crate::millis(DEAD_FOR))
        .invoke_async(conn)
        .await
        .map_err(|e| StreamError::new("declaring a consumer dead", e))?;
    Ok(declared == 1)
}

/// Makes up to `count` of `consumer`'s pending entries claimable at once, by
/// re-claiming them to the same consumer with an idle time of `min_idle`
/// (`XCLAIM ... IDLE ... JUSTID`: owner and delivery count unchanged). The
/// next XAUTOCLAIM of any live consumer takes them, without waiting out
/// min-idle-time; the consumer is declared dead first ([`declare_dead`]), so
/// its idempotency-guard marks do not hold them up either. Returns how many were released now (entries already
/// released earlier are left as they are). Entries idle for less than a
/// read's proof of the hold lasts ([`crate::started::hold_proof_window`])
/// are left for a later call: a process still running behind a deleted pod
/// may have just read them, and acts on them without a look at its PEL
/// (`started::HeldSince`); a dead consumer's entries are idle for
/// [`SILENT_FOR`] at least.
pub async fn release_pending<C: ConnectionLike + Send>(
    conn: &mut C,
    who: ConsumerRef<'_>,
    dead_letter_stream: &str,
    min_idle: Duration,
    count: usize,
) -> Result<Released, StreamError> {
    let ConsumerRef { stream, group, consumer } = who;
    let pending = pending_of(conn, who, "-", count).await?;
    let idle_ms = crate::millis(min_idle).saturating_add(1);
    // First void its guard marks, so whoever claims its entries does not
    // wait them out; a consumer still alive is left alone.
    if !declare_dead(conn, who).await? {
        return Ok(Released { alive: true, ..Released::default() });
    }
    let fresh_ms = crate::millis(crate::started::hold_proof_window(min_idle));
    let stale: Vec<&str> = pending
        .iter()
        .filter(|(_, _, idle, _)| *idle >= fresh_ms && *idle < idle_ms)
        .map(|(id, ..)| id.as_str())
        .collect();
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
    let claimed = crate::claim::claim_ids(conn, crate::GroupRef::new(stream, group), &loss, &how, &stale).await?;
    let lost = claimed.lost;
    let released: Vec<String> = redis::FromRedisValue::from_redis_value(claimed.reply)
        .map_err(|e| StreamError::new("releasing a dead consumer's entries", e.into()))?;
    Ok(Released { released: released.len(), payload_lost: lost.len(), alive: false })
}

/// What releasing a dead consumer's entries did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Released {
    /// Entries made claimable now.
    pub released: usize,
    /// Entries whose payload was gone: recorded as lost and dead-lettered.
    pub payload_lost: usize,
    /// The consumer told Redis it was alive within [`SILENT_FOR`]: nothing
    /// was released, it was not declared dead.
    pub alive: bool,
}

/// Deletes `consumer` only if it owns no pending entry, atomically: deleting
/// a consumer drops its PEL, which would lose those entries for good.
pub async fn delete_if_empty<C: ConnectionLike + Send>(
    conn: &mut C,
    who: ConsumerRef<'_>,
) -> Result<bool, StreamError> {
    let ConsumerRef { stream, group, consumer } = who;
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
