//! Dead letters: an entry moved to the dead-letter stream atomically with its
//! ack (one script: XADD, then XACK only if the XADD succeeded), carrying why
//! and where it came from.
//!
//! Record format (`docs/dead-letters.md`): the original fields unchanged, plus
//! `streamfleet.*` metadata fields.

use crate::entry::Entry;
use crate::error::StreamError;
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
    /// The handler kept failing transiently until `maxDeliveries`.
    MaxDeliveries,
    /// The handler reported a permanent failure (a business rule said no).
    Permanent,
    /// The entry could not be parsed.
    Malformed,
    /// The entry was pending but its payload had been trimmed or deleted.
    PayloadMissing,
}

impl Reason {
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::MaxDeliveries => "max-deliveries",
            Reason::Permanent => "permanent",
            Reason::Malformed => "malformed",
            Reason::PayloadMissing => "payload-missing",
        }
    }
}

/// XADD the dead letter, and only once that succeeded ack the entry, drop its
/// last error and, for a lost payload, record it (a failing `redis.call`
/// stops the script: a MULTI would ack even when the XADD failed).
/// KEYS: dead-letter stream, stream, last-error hash, payload-lost count and
/// IDs. ARGV: group, entry ID, lost (1/0), last index of the kept IDs, then
/// the dead letter's fields and values.
static DEAD_LETTER: std::sync::LazyLock<redis::Script> = std::sync::LazyLock::new(|| {
    redis::Script::new(
        r"
        local id = redis.call('XADD', KEYS[1], '*', unpack(ARGV, 5))
        redis.call('XACK', KEYS[2], ARGV[1], ARGV[2])
        redis.call('HDEL', KEYS[3], ARGV[2])
        if ARGV[3] == '1' then
            redis.call('HINCRBY', KEYS[4], 'count', 1)
            redis.call('LPUSH', KEYS[5], ARGV[2])
            redis.call('LTRIM', KEYS[5], 0, tonumber(ARGV[4]))
        end
        return id",
    )
});

/// What to record about a dead letter besides the entry itself.
pub struct Letter<'a> {
    pub group: &'a str,
    pub consumer: &'a str,
    pub reason: Reason,
    pub error: &'a str,
    pub business_key: Option<&'a str>,
}

/// Moves `entry` to `dead_letter_stream` and acks it, atomically; also drops
/// its last-error bookkeeping, and records a lost payload in the group's
/// payload-loss record (`payload_loss`). Returns the dead letter's ID.
pub async fn dead_letter<C: ConnectionLike + Send>(
    conn: &mut C,
    dead_letter_stream: &str,
    entry: &Entry,
    letter: &Letter<'_>,
) -> Result<String, StreamError> {
    let now_ms = crate::recovery::now_ms();
    let lost = letter.reason == Reason::PayloadMissing;
    let mut script = DEAD_LETTER.prepare_invoke();
    script
        .key(dead_letter_stream)
        .key(&entry.stream)
        .key(keys::last_error_key(&entry.stream, letter.group))
        .key(crate::payload_loss::count_key(&entry.stream, letter.group))
        .key(crate::payload_loss::ids_key(&entry.stream, letter.group))
        .arg(letter.group)
        .arg(&entry.id)
        .arg(if lost { "1" } else { "0" })
        .arg(crate::payload_loss::LATEST - 1);
    let meta = [
        (F_SOURCE_STREAM, entry.stream.clone()),
        (F_SOURCE_ID, entry.id.clone()),
        (F_GROUP, letter.group.to_string()),
        (F_CONSUMER, letter.consumer.to_string()),
        (F_DELIVERIES, entry.deliveries.to_string()),
        (F_REASON, letter.reason.as_str().to_string()),
        (F_ERROR, letter.error.to_string()),
        (F_AT, now_ms.to_string()),
    ];
    for (k, v) in meta {
        script.arg(k).arg(v);
    }
    if let Some(key) = letter.business_key {
        script.arg(F_BUSINESS_KEY).arg(key);
    }
    for (k, v) in &entry.fields {
        script.arg(k).arg(v.as_slice());
    }
    let id: String = script.invoke_async(conn).await.map_err(|e| StreamError::new("dead-lettering an entry", e))?;
    Ok(id)
}

/// Records the latest handler error of a pending entry, for whoever
/// dead-letters it later (the worker on its last delivery, or the sweep).
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
        .query_async(conn)
        .await
        .map_err(|e| StreamError::new("recording the last error", e))?;
    Ok(())
}

/// The recorded last error of a pending entry, if any.
pub async fn last_error<C: ConnectionLike + Send>(
    conn: &mut C,
    stream: &str,
    group: &str,
    id: &str,
) -> Result<Option<String>, StreamError> {
    redis::cmd("HGET")
        .arg(keys::last_error_key(stream, group))
        .arg(id)
        .query_async(conn)
        .await
        .map_err(|e| StreamError::new("reading the last error", e))
}
