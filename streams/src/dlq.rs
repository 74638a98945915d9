//! Reading a dead-letter stream for people: letters parsed into their
//! metadata, a filter (reason, time, business key, ID range), pages that
//! resume from a cursor, stats by reason and by hour, and purge. Replay is
//! `replay`, which takes the same filter.

use crate::deadletter::{
    F_AT, F_BUSINESS_KEY, F_CONSUMER, F_DELIVERIES, F_ERROR, F_GROUP, F_REASON, F_SOURCE_ID, F_SOURCE_STREAM, PREFIX,
};
use crate::entry::entries_from_value;
use crate::error::StreamError;
use crate::retention::StreamId;
use redis::aio::ConnectionLike;
use std::collections::BTreeMap;

/// Letters read per `XRANGE`.
const PAGE: usize = 500;
/// IDs per `XDEL`.
const DELETE_CHUNK: usize = 500;
const HOUR_MS: u64 = 3_600_000;

/// One dead letter: its metadata and the original fields.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeadLetter {
    pub id: String,
    pub source_stream: Option<String>,
    pub source_id: Option<String>,
    pub group: Option<String>,
    pub consumer: Option<String>,
    pub deliveries: Option<u64>,
    pub reason: Option<String>,
    pub error: Option<String>,
    pub business_key: Option<String>,
    /// Unix milliseconds; from the letter's ID when the field is missing.
    pub at_ms: u64,
    /// The entry's own fields, unchanged.
    pub payload: Vec<(String, Vec<u8>)>,
}

impl DeadLetter {
    pub fn parse(id: String, fields: Vec<(String, Vec<u8>)>) -> Self {
        let text = |k: &str| fields.iter().find(|(f, _)| f == k).map(|(_, v)| String::from_utf8_lossy(v).into_owned());
        let id_ms = StreamId::parse(&id).map_or(0, |i| i.ms);
        Self {
            source_stream: text(F_SOURCE_STREAM),
            source_id: text(F_SOURCE_ID),
            group: text(F_GROUP),
            consumer: text(F_CONSUMER),
            deliveries: text(F_DELIVERIES).and_then(|d| d.parse().ok()),
            reason: text(F_REASON),
            error: text(F_ERROR),
            business_key: text(F_BUSINESS_KEY),
            at_ms: text(F_AT).and_then(|t| t.parse().ok()).unwrap_or(id_ms),
            payload: fields.into_iter().filter(|(k, _)| !k.starts_with(PREFIX)).collect(),
            id,
        }
    }
}

/// Which letters. Empty fields match everything.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Filter {
    /// Any of these reasons (`permanent`, `malformed`, `max-deliveries`, `retries-exhausted`, `payload-missing`, `crashed-worker`).
    pub reasons: Vec<String>,
    /// Dead-lettered at or after (Unix ms).
    pub since_ms: Option<u64>,
    /// Dead-lettered before (Unix ms).
    pub until_ms: Option<u64>,
    pub business_key: Option<String>,
    /// The handler's error contains this text (case-insensitive).
    pub error_contains: Option<String>,
    /// Inclusive ID range of the dead-letter stream (`-` / `+` when absent).
    pub from: Option<String>,
    pub to: Option<String>,
}

impl Filter {
    pub fn matches(&self, letter: &DeadLetter) -> bool {
        (self.reasons.is_empty() || letter.reason.as_ref().is_some_and(|r| self.reasons.contains(r)))
            && self.since_ms.is_none_or(|since| letter.at_ms >= since)
            && self.until_ms.is_none_or(|until| letter.at_ms < until)
            && self.business_key.as_ref().is_none_or(|k| letter.business_key.as_ref() == Some(k))
            && self.error_contains.as_ref().is_none_or(|text| {
                letter.error.as_ref().is_some_and(|e| e.to_lowercase().contains(&text.to_lowercase()))
            })
    }

    /// The `XRANGE` bounds to scan: the ID range, narrowed by the time range
    /// (a letter's ID is the time it was written, never before its
    /// dead-lettered-at field, so `since` bounds the start exactly; `until`
    /// is not used to stop early, letters written late are still checked).
    pub fn scan_range(&self) -> (String, String) {
        let from = self.from.clone().unwrap_or_else(|| "-".into());
        let from = match (self.since_ms, StreamId::parse(&from)) {
            (Some(since), Some(id)) if since > id.ms => format!("{since}-0"),
            (Some(since), None) if from == "-" => format!("{since}-0"),
            _ => from,
        };
        (from, self.to.clone().unwrap_or_else(|| "+".into()))
    }
}

/// A page of matching letters and where the next one starts (`None`: the end).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Page {
    pub letters: Vec<DeadLetter>,
    /// Pass as `after` to read on.
    pub next: Option<String>,
}

/// Up to `limit` letters matching `filter`, after the cursor `after` (an ID).
pub async fn page<C: ConnectionLike + Send>(
    conn: &mut C,
    stream: &str,
    filter: &Filter,
    after: Option<&str>,
    limit: usize,
) -> Result<Page, StreamError> {
    page_bounded(conn, stream, filter, after, limit, usize::MAX).await
}

/// [`page`], reading at most about `max_scanned` letters (whole `XRANGE`
/// pages): a selective filter over a long stream then returns fewer letters
/// and a cursor to read on, instead of reading the whole stream for one view.
pub async fn page_bounded<C: ConnectionLike + Send>(
    conn: &mut C,
    stream: &str,
    filter: &Filter,
    after: Option<&str>,
    limit: usize,
    max_scanned: usize,
) -> Result<Page, StreamError> {
    let (from, to) = filter.scan_range();
    let mut scanned = 0usize;
    let mut start = match after {
        Some(id) => format!("({id}"),
        None => from,
    };
    let mut letters = Vec::new();
    loop {
        let batch = read(conn, stream, &start, &to).await?;
        let n = batch.len();
        let Some(last) = batch.last().map(|l| l.id.clone()) else {
            return Ok(Page { letters, next: None });
        };
        for letter in batch {
            if filter.matches(&letter) {
                letters.push(letter);
                if letters.len() == limit {
                    let next = letters.last().map(|l| l.id.clone());
                    return Ok(Page { letters, next });
                }
            }
        }
        if n < PAGE {
            return Ok(Page { letters, next: None });
        }
        scanned += n;
        if scanned >= max_scanned {
            return Ok(Page { letters, next: Some(last) });
        }
        start = format!("({last}");
    }
}

/// Every letter matching `filter`.
pub async fn all<C: ConnectionLike + Send>(
    conn: &mut C,
    stream: &str,
    filter: &Filter,
) -> Result<Vec<DeadLetter>, StreamError> {
    Ok(page(conn, stream, filter, None, usize::MAX).await?.letters)
}

/// One letter by ID.
pub async fn show<C: ConnectionLike + Send>(
    conn: &mut C,
    stream: &str,
    id: &str,
) -> Result<Option<DeadLetter>, StreamError> {
    Ok(read(conn, stream, id, id).await?.into_iter().next())
}

async fn read<C: ConnectionLike + Send>(
    conn: &mut C,
    stream: &str,
    from: &str,
    to: &str,
) -> Result<Vec<DeadLetter>, StreamError> {
    let reply: redis::Value = redis::cmd("XRANGE")
        .arg(stream)
        .arg(from)
        .arg(to)
        .arg("COUNT")
        .arg(PAGE)
        .query_async(conn)
        .await
        .map_err(|e| StreamError::new("reading dead letters", e))?;
    let letters = entries_from_value(reply).map_err(|e| StreamError::new("reading dead letters", e.into()))?;
    Ok(letters.into_iter().map(|(id, fields)| DeadLetter::parse(id, fields)).collect())
}

/// Trims `stream` to its newest `cap` letters (exactly, not `~`: the cap is
/// what the user asked to keep); returns how many were dropped.
pub async fn cap<C: ConnectionLike + Send>(conn: &mut C, stream: &str, cap: u64) -> Result<u64, StreamError> {
    redis::cmd("XTRIM")
        .arg(stream)
        .arg("MAXLEN")
        .arg(cap)
        .query_async(conn)
        .await
        .map_err(|e| StreamError::new("capping the dead-letter stream", e))
}

/// Drops the letters of `stream` dead-lettered more than `max_age` ago, by
/// their IDs against the server's clock (`XTRIM MINID`, exact); returns how
/// many were dropped.
pub async fn expire<C: ConnectionLike + Send>(
    conn: &mut C,
    stream: &str,
    max_age: std::time::Duration,
) -> Result<u64, StreamError> {
    redis::Script::new(
        r"
        local t = redis.call('TIME')
        local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
        local before = now - tonumber(ARGV[1])
        if before <= 0 then return 0 end
        return redis.call('XTRIM', KEYS[1], 'MINID', string.format('%.0f', before))",
    )
    .key(stream)
    .arg(crate::millis(max_age))
    .invoke_async(conn)
    .await
    .map_err(|e| StreamError::new("dropping expired dead letters", e))
}

/// Counts by reason and by hour.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    pub total: u64,
    /// Reason (`unknown` when the letter has none) → count.
    pub by_reason: BTreeMap<String, u64>,
    /// Start of the hour (Unix ms, UTC) → count.
    pub by_hour: BTreeMap<u64, u64>,
    /// Error signature ([`error_signature`]) → count: one line per kind of
    /// failure, whatever the IDs and numbers in each message.
    pub by_signature: BTreeMap<String, u64>,
}

/// What kind of failure an error message is: the message with every run of
/// digits (IDs, amounts, ports, hex) replaced by `#`, cut to 200 bytes, so
/// "order 17 timed out after 3000 ms" and "order 912 timed out after 3001
/// ms" group together.
pub fn error_signature(error: &str) -> String {
    let mut out = String::new();
    let mut in_number = false;
    for c in error.chars() {
        let digitish = c.is_ascii_digit() || (in_number && c.is_ascii_hexdigit());
        if digitish {
            if !in_number {
                out.push('#');
            }
        } else {
            out.push(c);
        }
        in_number = digitish;
        if out.len() >= 200 {
            break;
        }
    }
    out
}

impl Stats {
    pub fn add(&mut self, letter: &DeadLetter) {
        self.total += 1;
        *self.by_reason.entry(letter.reason.clone().unwrap_or_else(|| "unknown".into())).or_default() += 1;
        *self.by_hour.entry(letter.at_ms - letter.at_ms % HOUR_MS).or_default() += 1;
        let signature = letter.error.as_deref().map_or_else(|| "(no error)".into(), error_signature);
        *self.by_signature.entry(signature).or_default() += 1;
    }

    pub fn of<'a>(letters: impl IntoIterator<Item = &'a DeadLetter>) -> Self {
        let mut stats = Self::default();
        for letter in letters {
            stats.add(letter);
        }
        stats
    }
}

/// Deletes letters by ID; returns how many were there.
pub async fn purge<C: ConnectionLike + Send>(conn: &mut C, stream: &str, ids: &[String]) -> Result<u64, StreamError> {
    let mut deleted = 0;
    for chunk in ids.chunks(DELETE_CHUNK) {
        let n: u64 = redis::cmd("XDEL")
            .arg(stream)
            .arg(chunk)
            .query_async(conn)
            .await
            .map_err(|e| StreamError::new("purging dead letters", e))?;
        deleted += n;
    }
    Ok(deleted)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_that_differ_only_in_numbers_share_a_signature() {
        assert_eq!(
            error_signature("order 17 timed out after 3000 ms"),
            error_signature("order 912 timed out after 3001 ms")
        );
        assert_eq!(error_signature("order 17 timed out"), "order # timed out");
        assert_eq!(error_signature("id 0x1f3a failed"), "id #x# failed");
        assert_ne!(error_signature("card declined"), error_signature("card expired"));
        assert!(error_signature(&"x".repeat(5000)).len() <= 200);
    }

    #[test]
    fn error_text_filters_ignore_case() {
        let mut l = letter("1-0", "permanent", None, 1);
        l.error = Some("Card DECLINED by issuer".into());
        let f = |t: &str| Filter { error_contains: Some(t.into()), ..Filter::default() };
        assert!(f("declined").matches(&l));
        assert!(!f("expired").matches(&l));
        l.error = None;
        assert!(!f("declined").matches(&l));
    }

    fn letter(id: &str, reason: &str, key: Option<&str>, at_ms: u64) -> DeadLetter {
        let mut fields = vec![
            (F_REASON.to_string(), reason.as_bytes().to_vec()),
            (F_AT.to_string(), at_ms.to_string().into_bytes()),
            ("order_id".to_string(), b"42".to_vec()),
        ];
        if let Some(key) = key {
            fields.push((F_BUSINESS_KEY.to_string(), key.as_bytes().to_vec()));
        }
        DeadLetter::parse(id.into(), fields)
    }

    #[test]
    fn a_letter_keeps_its_payload_apart_from_its_metadata() {
        let l = letter("1000-0", "permanent", Some("o-1"), 1000);
        assert_eq!(l.payload, vec![("order_id".to_string(), b"42".to_vec())]);
        assert_eq!((l.reason.as_deref(), l.business_key.as_deref(), l.at_ms), (Some("permanent"), Some("o-1"), 1000));
        let bare = DeadLetter::parse("7200000-3".into(), Vec::new());
        assert_eq!(bare.at_ms, 7_200_000, "no dead-lettered-at field: the ID's time");
    }

    #[test]
    fn the_filter_takes_every_condition_together() {
        let f = Filter {
            reasons: vec!["permanent".into(), "malformed".into()],
            since_ms: Some(1000),
            until_ms: Some(2000),
            business_key: Some("o-1".into()),
            ..Filter::default()
        };
        assert!(f.matches(&letter("1500-0", "malformed", Some("o-1"), 1500)));
        assert!(!f.matches(&letter("1500-0", "max-deliveries", Some("o-1"), 1500)), "reason");
        assert!(!f.matches(&letter("2000-0", "permanent", Some("o-1"), 2000)), "until is exclusive");
        assert!(!f.matches(&letter("999-0", "permanent", Some("o-1"), 999)), "since");
        assert!(!f.matches(&letter("1500-0", "permanent", Some("o-2"), 1500)), "key");
        assert!(!f.matches(&letter("1500-0", "permanent", None, 1500)), "no key");
        assert!(Filter::default().matches(&letter("1-0", "anything", None, 1)));
    }

    #[test]
    fn the_time_range_narrows_the_scan_never_past_the_id_range() {
        let since = Filter { since_ms: Some(5000), ..Filter::default() };
        assert_eq!(since.scan_range(), ("5000-0".into(), "+".into()));
        let later_id = Filter { since_ms: Some(5000), from: Some("9000-1".into()), ..Filter::default() };
        assert_eq!(later_id.scan_range().0, "9000-1", "the later of the two starts");
        let earlier_id = Filter { since_ms: Some(5000), from: Some("10-0".into()), ..Filter::default() };
        assert_eq!(earlier_id.scan_range().0, "5000-0");
        assert_eq!(Filter::default().scan_range(), ("-".into(), "+".into()));
    }

    #[test]
    fn stats_count_by_reason_and_by_hour() {
        let letters = [
            letter("1-0", "permanent", None, 10),
            letter("2-0", "permanent", None, HOUR_MS + 5),
            letter("3-0", "malformed", None, HOUR_MS + 6),
        ];
        let s = Stats::of(&letters);
        assert_eq!(s.total, 3);
        assert_eq!(s.by_reason, BTreeMap::from([("malformed".into(), 1), ("permanent".into(), 2)]));
        assert_eq!(s.by_hour, BTreeMap::from([(0, 1), (HOUR_MS, 2)]));
    }
}
