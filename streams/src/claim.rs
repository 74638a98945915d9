//! Claiming idle pending entries (XAUTOCLAIM) and learning their delivery counts.

use crate::entry::{Entry, fields_from_map};
use crate::error::StreamError;
use redis::aio::ConnectionLike;
use redis::streams::StreamAutoClaimReply;
use std::collections::HashMap;
use std::time::Duration;

/// One XAUTOCLAIM step.
pub struct Claimed {
    /// Entries now owned by the claiming consumer, delivery counts included.
    pub entries: Vec<Entry>,
    /// Pending IDs whose payload is gone (trimmed or XDEL'd), already
    /// recorded as lost (dead letter and loss record) and dropped from the PEL
    /// by the same script that found them.
    pub deleted: Vec<String>,
    /// Cursor for the next step; `0-0` once the whole PEL was scanned.
    pub next: String,
}

/// Where a claim records the pending IDs it finds without a payload: the
/// dead-letter stream and the group's payload-loss record, written by the
/// same script that drops the ID from the PEL (never after it: a crash in
/// between would lose it without a word).
pub struct LossRecord<'a> {
    pub dead_letter_stream: &'a str,
    /// Named in the dead letter as the consumer that met the loss.
    pub consumer: &'a str,
    pub why: &'a str,
}

/// Lua shared by the claim scripts: `lost(id)` writes the payload-missing
/// dead letter and the loss record, then acks the ID. KEYS: stream,
/// dead-letter stream, loss count, loss IDs. ARGV[1] group, ARGV[2] the
/// consumer recorded, ARGV[3] why.
fn lost_lua() -> String {
    use crate::deadletter::*;
    format!(
        r"
        local function lost(id)
            local t = redis.call('TIME')
            local at = t[1] .. string.format('%03d', math.floor(tonumber(t[2]) / 1000))
            redis.call('XADD', KEYS[2], '*', '{F_SOURCE_STREAM}', KEYS[1], '{F_SOURCE_ID}', id,
                '{F_GROUP}', ARGV[1], '{F_CONSUMER}', ARGV[2], '{F_DELIVERIES}', '0',
                '{F_REASON}', 'payload-missing', '{F_ERROR}', ARGV[3], '{F_AT}', at)
            redis.call('HINCRBY', KEYS[3], 'count', 1)
            redis.call('LPUSH', KEYS[4], id)
            redis.call('LTRIM', KEYS[4], 0, {latest})
            redis.call('XACK', KEYS[1], ARGV[1], id)
        end
        ",
        latest = crate::payload_loss::LATEST - 1
    )
}

/// XAUTOCLAIM, with the IDs it dropped recorded in the same script.
/// ARGV[4] claimer, ARGV[5] min idle, ARGV[6] start, ARGV[7] count.
static AUTOCLAIM: std::sync::LazyLock<redis::Script> = std::sync::LazyLock::new(|| {
    redis::Script::new(&format!(
        r"{}
        local reply = redis.call('XAUTOCLAIM', KEYS[1], ARGV[1], ARGV[4], ARGV[5], ARGV[6], 'COUNT', ARGV[7])
        for _, id in ipairs(reply[3] or {{}}) do lost(id) end
        return reply",
        lost_lua()
    ))
});

/// XCLAIM of given IDs the claimer still owns (its own take-back, or the
/// release of a dead consumer's entries to itself), those without a payload
/// recorded as lost first (an XCLAIM would drop them silently). ARGV[4]
/// claimer and expected owner, ARGV[5] min idle,
/// ARGV[6] IDLE to set ('' to leave), ARGV[7] '1' for JUSTID, then the IDs.
/// Returns the XCLAIM reply and the IDs found lost.
static CLAIM_IDS: std::sync::LazyLock<redis::Script> = std::sync::LazyLock::new(|| {
    redis::Script::new(&format!(
        r"{}
        local existing, gone = {{}}, {{}}
        for i = 8, #ARGV do
            local id = ARGV[i]
            local p = redis.call('XPENDING', KEYS[1], ARGV[1], id, id, 1)[1]
            -- Only entries the claimer still owns: one another consumer took
            -- since the caller looked is theirs now.
            if p ~= nil and p[2] == ARGV[4] then
                if #redis.call('XRANGE', KEYS[1], id, id) > 0 then
                    existing[#existing + 1] = id
                else
                    lost(id)
                    gone[#gone + 1] = id
                end
            end
        end
        local claimed = {{}}
        for from = 1, #existing, 500 do
            local args = {{'XCLAIM', KEYS[1], ARGV[1], ARGV[4], ARGV[5]}}
            for i = from, math.min(from + 499, #existing) do args[#args + 1] = existing[i] end
            if ARGV[6] ~= '' then
                args[#args + 1] = 'IDLE'
                args[#args + 1] = ARGV[6]
            end
            if ARGV[7] == '1' then args[#args + 1] = 'JUSTID' end
            for _, c in ipairs(redis.call(unpack(args))) do claimed[#claimed + 1] = c end
        end
        return {{claimed, gone}}",
        lost_lua()
    ))
});

fn prepare<'a>(
    script: &'a redis::Script,
    stream: &str,
    group: &str,
    loss: &LossRecord<'_>,
) -> redis::ScriptInvocation<'a> {
    let mut invocation = script.prepare_invoke();
    invocation
        .key(stream)
        .key(loss.dead_letter_stream)
        .key(crate::payload_loss::count_key(stream, group))
        .key(crate::payload_loss::ids_key(stream, group))
        .arg(group)
        .arg(loss.consumer)
        .arg(loss.why);
    invocation
}

/// Claims up to `count` entries idle for at least `min_idle`, scanning from
/// `start`. IDs whose payload is gone are recorded in `loss` by the same
/// script and returned as `deleted`.
#[allow(clippy::too_many_arguments)]
pub async fn autoclaim<C: ConnectionLike + Send>(
    conn: &mut C,
    stream: &str,
    group: &str,
    consumer: &str,
    loss: &LossRecord<'_>,
    min_idle: Duration,
    start: &str,
    count: usize,
) -> Result<Claimed, StreamError> {
    let min_idle_ms = u64::try_from(min_idle.as_millis()).unwrap_or(u64::MAX);
    let mut script = prepare(&AUTOCLAIM, stream, group, loss);
    script.arg(consumer).arg(min_idle_ms).arg(start).arg(count);
    let reply: StreamAutoClaimReply =
        script.invoke_async(conn).await.map_err(|e| StreamError::new("claiming idle entries", e))?;
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

/// How [`claim_ids`] claims.
pub struct ClaimIds<'a> {
    pub consumer: &'a str,
    /// Only entries idle at least this long (ms) are taken.
    pub min_idle_ms: u64,
    /// Sets the claimed entries' idle time (`XCLAIM … IDLE`).
    pub set_idle_ms: Option<u64>,
    /// `JUSTID`: no payloads returned, delivery counts unchanged.
    pub just_id: bool,
}

/// `XCLAIM` of `ids`, the ones without a payload recorded in `loss` (and
/// acked) by the same script. Returns the raw claim reply and the lost IDs.
pub async fn claim_ids<C: ConnectionLike + Send>(
    conn: &mut C,
    stream: &str,
    group: &str,
    loss: &LossRecord<'_>,
    how: &ClaimIds<'_>,
    ids: &[&str],
) -> Result<(redis::Value, Vec<String>), StreamError> {
    let mut script = prepare(&CLAIM_IDS, stream, group, loss);
    script
        .arg(how.consumer)
        .arg(how.min_idle_ms)
        .arg(how.set_idle_ms.map(|ms| ms.to_string()).unwrap_or_default())
        .arg(if how.just_id { "1" } else { "0" })
        .arg(ids);
    script.invoke_async(conn).await.map_err(|e| StreamError::new("claiming entries", e))
}

/// Takes back up to `count` of `consumer`'s own pending entries after
/// `after` (exclusive; `-` for the start): what a restarted process under the
/// same consumer name read before and never settled. Those whose payload is
/// gone are recorded in `loss` and returned as `deleted`. `next` is the last
/// ID looked at, or `0-0` when the PEL holds no more of them.
#[allow(clippy::too_many_arguments)]
pub async fn claim_own<C: ConnectionLike + Send>(
    conn: &mut C,
    stream: &str,
    group: &str,
    consumer: &str,
    loss: &LossRecord<'_>,
    after: &str,
    count: usize,
) -> Result<Claimed, StreamError> {
    let start = if after == "-" { after.to_string() } else { format!("({after}") };
    let pending = crate::consumers::pending_of(conn, stream, group, consumer, &start, count).await?;
    let Some((last, ..)) = pending.last() else {
        return Ok(Claimed { entries: Vec::new(), deleted: Vec::new(), next: "0-0".into() });
    };
    let next = if pending.len() < count { "0-0".to_string() } else { last.clone() };
    let ids: Vec<&str> = pending.iter().map(|(id, ..)| id.as_str()).collect();
    // A compare-and-set on idleness: an entry someone else claimed since the
    // XPENDING above has a fresh idle time and is left to them.
    let least_idle = pending.iter().map(|(_, _, idle, _)| *idle).min().unwrap_or(0);
    let how = ClaimIds { consumer, min_idle_ms: least_idle, set_idle_ms: None, just_id: false };
    let (reply, deleted) = claim_ids(conn, stream, group, loss, &how, &ids).await?;
    let reply: redis::streams::StreamClaimReply = redis::FromRedisValue::from_redis_value(reply)
        .map_err(|e| StreamError::new("taking back own pending entries", e.into()))?;
    let mut found: HashMap<String, HashMap<String, redis::Value>> =
        reply.ids.into_iter().map(|e| (e.id, e.map)).collect();
    let entries = pending
        .into_iter()
        .filter_map(|(id, _, _, deliveries)| {
            // The claim was one more delivery.
            found.remove(&id).map(|map| Entry {
                stream: stream.to_string(),
                deliveries: deliveries.saturating_add(1),
                fields: fields_from_map(map),
                id,
            })
        })
        .collect();
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
