//! Dead letters: an entry moved to the dead-letter stream atomically with its
//! ack (one script: XADD, then XACK only if the XADD succeeded), carrying why
//! and where it came from.
//!
//! Record format (`docs/dead-letters.md`): the original fields unchanged, plus
//! `streamfleet.*` metadata fields.

use crate::entry::Entry;
use crate::error::StreamError;
use crate::group_ref::GroupRef;
use crate::keys;
use redis::aio::ConnectionLike;

pub const F_SOURCE_STREAM: &str = "streamfleet.source-stream";
pub const F_SOURCE_ID: &str = "streamfleet.source-id";
pub const F_GROUP: &str = "streamfleet.group";
pub const F_CONSUMER: &str = "streamfleet.consumer";
pub const F_DELIVERIES: &str = "streamfleet.deliveries";
pub const F_REASON: &str = "streamfleet.reason";
pub const F_ERROR: &str = "streamfleet.error";
pub const F_BUSINESS_KEY: &str = "streamfleet.business-key";
pub const F_AT: &str = "streamfleet.dead-lettered-at";
/// Prefix of every metadata field; replay strips these.
pub const PREFIX: &str = "streamfleet.";

/// Why an entry left the pipeline.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reason {
    /// Delivered `maxDeliveries` times without settling (its deliveries
    /// ended without a verdict: the worker died, or could not record one).
    MaxDeliveries,
    /// The handler kept failing transiently through its whole retry
    /// schedule (`retry`): `maxDeliveries` attempts, or its `retryFor`.
    RetriesExhausted,
    /// The handler reported a permanent failure (a business rule said no).
    Permanent,
    /// The entry could not be parsed.
    Malformed,
    /// The entry was pending but its payload had been trimmed or deleted.
    PayloadMissing,
    /// The worker process died while its handler ran, as many times as the
    /// crash limit (`started`): out of memory, an abort, a segfault.
    CrashedWorker,
}

impl Reason {
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::MaxDeliveries => "max-deliveries",
            Reason::RetriesExhausted => "retries-exhausted",
            Reason::Permanent => "permanent",
            Reason::Malformed => "malformed",
            Reason::PayloadMissing => "payload-missing",
            Reason::CrashedWorker => "crashed-worker",
        }
    }
}

/// Per entry: XADD the dead letter, and only once that succeeded ack the
/// entry, drop its last error and, for a lost payload, record it. A letter
/// that cannot be written (`XADD` refused: out of memory, say) stops the
/// script there: every entry before it is dead-lettered and acked, the
/// failing one neither acked nor lost, the rest untouched, and the script
/// returns the error. (A MULTI would ack even when the XADD failed.) The
/// acks, record deletions and loss counts go out once per call, after the
/// letters.
/// An entry flagged `p` is dead-lettered only while it is still pending: run
/// again (a client re-sending after a lost reply, the sweep and a claim both
/// finding one lost payload) it writes no second letter and counts no second
/// loss; its ID comes back empty. KEYS: dead-letter stream, stream,
/// last-error hash, payload-lost count and IDs. ARGV: group, last index of
/// the kept lost IDs, then per entry: its ID, its flags (`l` lost, `p` only
/// while pending), the number of field and value arguments, and those.
/// Sent as `EVAL` (Redis caches the compiled script; one per batch), so it
/// rides in a pipeline on a cluster too.
static DEAD_LETTER: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    crate::started::record_fields_lua()
        + r"
    -- Lua's unpack takes a few thousand values at most: long lists go in chunks.
    local function call_in_chunks(list, ...)
        for j = 1, #list, 1000 do
            local args = { ... }
            for k = j, math.min(j + 999, #list) do args[#args + 1] = list[k] end
            redis.call(unpack(args))
        end
    end
    local ids, written, fields, lost, seen, failure = {}, {}, {}, {}, {}, nil
    local i = 3
    while i <= #ARGV do
        local id, flags, n = ARGV[i], ARGV[i + 1], tonumber(ARGV[i + 2])
        if string.find(flags, 'p', 1, true)
            and (seen[id] or #redis.call('XPENDING', KEYS[2], ARGV[1], id, id, 1) == 0) then
            ids[#ids + 1] = ''
        else
            local added = redis.pcall('XADD', KEYS[1], '*', unpack(ARGV, i + 3, i + 2 + n))
            if type(added) == 'table' and added.err then
                failure = added
                break
            end
            ids[#ids + 1] = added
            seen[id] = true
            written[#written + 1] = id
            record_fields(id, fields)
            if string.find(flags, 'l', 1, true) then lost[#lost + 1] = id end
        end
        i = i + 3 + n
    end
    -- What was written is acked, its records dropped and its losses
    -- counted, all at once: a few calls per page, not per entry.
    if #written > 0 then
        call_in_chunks(written, 'XACK', KEYS[2], ARGV[1])
        call_in_chunks(fields, 'HDEL', KEYS[3])
    end
    if #lost > 0 then
        redis.call('HINCRBY', KEYS[4], 'count', #lost)
        call_in_chunks(lost, 'LPUSH', KEYS[5])
        redis.call('LTRIM', KEYS[5], 0, tonumber(ARGV[2]))
    end
    if failure then return failure end
    return ids"
});

/// What to record about a dead letter besides the entry itself.
pub struct Letter<'a> {
    pub group: &'a str,
    pub consumer: &'a str,
    pub reason: Reason,
    pub error: &'a str,
    pub business_key: Option<&'a str>,
    /// Write the letter only while the entry is still pending in the group
    /// (a worker's or the sweep's entries): a repeated call writes none.
    /// Off for an entry that was never pending (at-most-once delivery).
    pub while_pending: bool,
}

/// Moves `entry` to `dead_letter_stream` and acks it, atomically; also drops
/// its last-error bookkeeping, and records a lost payload in the group's
/// payload-loss record (`payload_loss`). Returns the dead letter's ID;
/// `None` when the letter asked for a pending entry and it no longer was
/// (already dead-lettered or acknowledged: nothing written).
pub async fn dead_letter<C: ConnectionLike + Send>(
    conn: &mut C,
    dead_letter_stream: &str,
    entry: &Entry,
    letter: &Letter<'_>,
) -> Result<Option<String>, StreamError> {
    let ids: Vec<String> = command(dead_letter_stream, &[(entry, letter)])
        .query_async(conn)
        .await
        .map_err(|e| StreamError::new("dead-lettering an entry", e))?;
    match ids.into_iter().next() {
        Some(id) if id.is_empty() => Ok(None),
        Some(id) => Ok(Some(id)),
        None => {
            let e = redis::RedisError::from((redis::ErrorKind::UnexpectedReturnType, "no dead letter ID"));
            Err(StreamError::new("dead-lettering an entry", e))
        }
    }
}

/// The one command that dead-letters every entry of `letters` (see
/// [`dead_letter`]; each entry atomically): one round trip and one script
/// call for a page of them. Entries of one stream and group; an empty
/// batch makes a command that does nothing.
pub fn command(dead_letter_stream: &str, letters: &[(&Entry, &Letter<'_>)]) -> redis::Cmd {
    let now_ms = crate::recovery::now_ms().to_string();
    let (stream, group) = letters.first().map_or(("", ""), |(e, l)| (e.stream.as_str(), l.group));
    let mut cmd = redis::cmd("EVAL");
    cmd.arg(DEAD_LETTER.as_str())
        .arg(5)
        .arg(dead_letter_stream)
        .arg(stream)
        .arg(keys::last_error_key(stream, group))
        .arg(crate::payload_loss::count_key(stream, group))
        .arg(crate::payload_loss::ids_key(stream, group))
        .arg(group)
        .arg(crate::payload_loss::LATEST - 1);
    for (entry, letter) in letters {
        let lost = letter.reason == Reason::PayloadMissing;
        let deliveries = entry.deliveries.to_string();
        let meta = [
            (F_SOURCE_STREAM, entry.stream.as_str()),
            (F_SOURCE_ID, entry.id.as_str()),
            (F_GROUP, letter.group),
            (F_CONSUMER, letter.consumer),
            (F_DELIVERIES, deliveries.as_str()),
            (F_REASON, letter.reason.as_str()),
            (F_ERROR, letter.error),
            (F_AT, now_ms.as_str()),
        ];
        // A huge entry goes packed: a script passes at most ~8,000 arguments.
        let own: Vec<&(String, Vec<u8>)> = entry.fields.iter().collect();
        let own = crate::entry::field_args(&own);
        let n = 2 * (meta.len() + usize::from(letter.business_key.is_some()) + own.len());
        let flags = match (lost, letter.while_pending) {
            (true, true) => "lp",
            (true, false) => "l",
            (false, true) => "p",
            (false, false) => "",
        };
        cmd.arg(&entry.id).arg(flags).arg(n);
        for (k, v) in meta {
            cmd.arg(k).arg(v);
        }
        if let Some(key) = letter.business_key {
            cmd.arg(F_BUSINESS_KEY).arg(key);
        }
        for (k, v) in &own {
            cmd.arg(k.as_ref()).arg(v.as_ref());
        }
    }
    cmd
}

/// Records the latest handler error of a pending entry, for whoever
/// dead-letters it later (the worker on its last delivery, or the sweep),
/// and that this delivery's handler ended (`started`: the next delivery
/// counts; it was no crash).
pub async fn record_last_error<C: ConnectionLike + Send>(
    conn: &mut C,
    entry: &Entry,
    group: &str,
    error: &str,
) -> Result<(), StreamError> {
    let () = redis::cmd("HSET")
        .arg(keys::last_error_key(&entry.stream, group))
        .arg(&entry.id)
        .arg(error)
        .arg(crate::started::run_field(&entry.id))
        .arg(crate::started::ended(entry.deliveries))
        .query_async(conn)
        .await
        .map_err(|e| StreamError::new("recording the last error", e))?;
    Ok(())
}

/// The recorded last error of a pending entry, if any.
pub async fn last_error<C: ConnectionLike + Send>(
    conn: &mut C,
    of: GroupRef<'_>,
    id: &str,
) -> Result<Option<String>, StreamError> {
    let GroupRef { stream, group } = of;
    redis::cmd("HGET")
        .arg(keys::last_error_key(stream, group))
        .arg(id)
        .query_async(conn)
        .await
        .map_err(|e| StreamError::new("reading the last error", e))
}
