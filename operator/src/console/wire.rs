//! What the console API sends and takes, as JSON. The CLI prints the same
//! types whether it read them through the API or, break-glass, from Redis.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use streamfleet_streams::dlq::{DeadLetter, Filter};

pub const GROUP: &str = "console.streamfleet.io";
pub const VERSION: &str = "v1alpha1";

/// `/apis/console.streamfleet.io/v1alpha1/namespaces/{ns}/pipelines/{name}`.
pub fn pipeline_path(namespace: &str, name: &str) -> String {
    format!("/apis/{GROUP}/{VERSION}/namespaces/{namespace}/pipelines/{name}")
}

/// One dead letter.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Letter {
    pub dead_letter_stream: String,
    pub id: String,
    /// What `show` and `--ids` take: `<deadLetterStream>@<id>` when the
    /// pipeline has several dead-letter streams (shards), else the ID.
    #[serde(rename = "ref")]
    pub reference: String,
    /// RFC 3339.
    pub at: String,
    pub reason: Option<String>,
    pub source_stream: Option<String>,
    pub source_id: Option<String>,
    pub group: Option<String>,
    pub consumer: Option<String>,
    pub deliveries: Option<u64>,
    pub business_key: Option<String>,
    pub error: Option<String>,
    /// The original fields (lossy UTF-8); only when one letter is asked for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub payload: Option<BTreeMap<String, String>>,
}

impl Letter {
    pub fn of(stream: &str, l: &DeadLetter, reference: String, with_payload: bool) -> Self {
        Self {
            dead_letter_stream: stream.to_string(),
            id: l.id.clone(),
            reference,
            at: rfc3339(l.at_ms),
            reason: l.reason.clone(),
            source_stream: l.source_stream.clone(),
            source_id: l.source_id.clone(),
            group: l.group.clone(),
            consumer: l.consumer.clone(),
            deliveries: l.deliveries,
            business_key: l.business_key.clone(),
            error: l.error.clone(),
            payload: with_payload
                .then(|| l.payload.iter().map(|(k, v)| (k.clone(), String::from_utf8_lossy(v).into_owned())).collect()),
        }
    }
}

/// A page of letters; `continue` reads the next one.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LetterList {
    pub items: Vec<Letter>,
    #[serde(rename = "continue", default, skip_serializing_if = "Option::is_none")]
    pub continue_: Option<String>,
}

/// Counts of the letters a filter matches.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LetterStats {
    pub total: u64,
    pub by_reason: BTreeMap<String, u64>,
    /// Start of the hour (RFC 3339) → count.
    pub by_hour: BTreeMap<String, u64>,
    /// Error signature (the message with numbers as `#`) → count.
    pub by_error: BTreeMap<String, u64>,
    /// False when the count stopped at the read bound: `total` is then a
    /// lower bound (narrow the filter, or use the CLI's break-glass mode).
    pub complete: bool,
}

/// The filter as query parameters and JSON.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct FilterSpec {
    /// Comma-separated reasons.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// RFC 3339 or Unix ms.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub since: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub until: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    /// Text the error contains (case-insensitive).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub to: Option<String>,
}

impl FilterSpec {
    pub fn filter(&self) -> anyhow::Result<Filter> {
        Ok(Filter {
            reasons: self
                .reason
                .iter()
                .flat_map(|r| r.split(','))
                .filter(|r| !r.is_empty())
                .map(String::from)
                .collect(),
            since_ms: self.since.as_deref().map(|t| time_ms("since", t)).transpose()?,
            until_ms: self.until.as_deref().map(|t| time_ms("until", t)).transpose()?,
            business_key: self.key.clone(),
            error_contains: self.error.clone(),
            from: self.from.clone(),
            to: self.to.clone(),
        })
    }
}

/// A replay or purge: which letters (IDs, a filter, or all: exactly one),
/// whether to only count, and the cap.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ActionRequest {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ids: Vec<String>,
    #[serde(default)]
    pub filter: FilterSpec,
    #[serde(default)]
    pub all: bool,
    /// Count what would be done; change nothing.
    #[serde(default)]
    pub dry_run: bool,
    /// Refuse when more letters than this are chosen (default
    /// [`DEFAULT_ACTION_CAP`]): a bulk action is never bigger than asked for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max: Option<u64>,
}

impl ActionRequest {
    /// From a request body, refusing any field it does not know: a
    /// misspelt `dryRun` or filter key must not turn a count into a real
    /// action, nor widen a selection.
    pub fn from_json(body: serde_json::Value) -> Result<Self, String> {
        const TOP: [&str; 5] = ["ids", "filter", "all", "dryRun", "max"];
        const FILTER: [&str; 7] = ["reason", "since", "until", "key", "error", "from", "to"];
        let unknown = |object: Option<&serde_json::Map<String, serde_json::Value>>, known: &[&str], at: &str| {
            object
                .into_iter()
                .flatten()
                .map(|(k, _)| k)
                .find(|k| !known.contains(&k.as_str()))
                .map(|k| format!("{at}{k}"))
        };
        if !body.is_object() {
            return Err("the body is a JSON object".into());
        }
        if let Some(field) = unknown(body.as_object(), &TOP, "")
            .or_else(|| unknown(body.get("filter").and_then(|f| f.as_object()), &FILTER, "filter."))
        {
            return Err(format!("unknown field {field:?}"));
        }
        serde_json::from_value(body).map_err(|e| e.to_string())
    }
}

/// Letters one action takes unless the request raises `max`.
pub const DEFAULT_ACTION_CAP: u64 = 1000;

/// What an action did (or, dry run, would do).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ActionResult {
    pub dry_run: bool,
    /// Letters chosen.
    pub matched: u64,
    /// Letters replayed (requeued) or purged.
    pub done: u64,
    /// Replay only: requeued letters and their new entries.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub requeued: Vec<Requeued>,
    /// Letters left in place, with why.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub skipped: Vec<Skipped>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Requeued {
    pub dead_letter_id: String,
    pub source_stream: String,
    pub new_id: String,
    pub business_key: Option<String>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Skipped {
    pub dead_letter_id: String,
    pub why: String,
}

/// One pending (in-flight) entry.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PendingEntry {
    pub stream: String,
    pub id: String,
    /// The worker pod (consumer) holding it, or a parking consumer.
    pub consumer: String,
    pub idle_ms: u64,
    pub deliveries: u64,
    /// Waiting for its retry after failing at this delivery count.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_after_delivery: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
}

/// A page of pending entries; `continue` reads the next one.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PendingList {
    pub items: Vec<PendingEntry>,
    #[serde(rename = "continue", default, skip_serializing_if = "Option::is_none")]
    pub continue_: Option<String>,
}

/// Which pending entries.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PendingQuery {
    /// Only this consumer's (a pod name).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub consumer: Option<String>,
    /// Only entries idle at least this long (milliseconds).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_idle_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<usize>,
    #[serde(rename = "continue", default, skip_serializing_if = "Option::is_none")]
    pub continue_: Option<String>,
}

/// A pipeline's shards, live from Redis.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ShardList {
    /// Shard 0 first.
    pub items: Vec<Shard>,
}

/// One shard's stream and group, as read at one instant.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Shard {
    pub stream: String,
    /// False while the stream or its group does not exist: no figure below
    /// is then known.
    pub group_exists: bool,
    /// Entries not yet delivered; absent when unknown.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lag: Option<u64>,
    /// The lag is a floor (more entries after the group's position than
    /// counted).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub lag_at_least: bool,
    /// Delivered, not yet acknowledged (those waiting for a retry too).
    pub pending: u64,
    /// Waiting for a retry on the schedule.
    pub retrying: u64,
    /// Age of the oldest unfinished entry; absent when IDs are not times.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delay_seconds: Option<u64>,
    /// Idle time of the oldest pending entry (not waiting for a retry).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub oldest_pending_idle_ms: Option<u64>,
    /// The highest delivery count among the oldest pending entries.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub most_deliveries: Option<u64>,
    pub stream_length: u64,
    pub dead_letters: u64,
    /// The consumers reading it (worker pods, a recovery run).
    pub consumers: Vec<ShardConsumer>,
    /// The entries waiting for a retry, per delivery count they failed at.
    pub retries: Vec<ShardRetry>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ShardConsumer {
    /// The consumer: `<pod name>.<pod UID>` for a worker pod.
    pub name: String,
    /// Entries it holds.
    pub pending: u64,
    /// Since it last read or claimed.
    pub idle_ms: u64,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ShardRetry {
    /// The delivery count they failed at: the next attempt is the one after.
    pub after_delivery: u64,
    pub entries: u64,
    /// The longest any of them has waited so far.
    pub longest_wait_ms: u64,
    /// That entry's last handler error.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
}

/// What a pause or resume did.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Suspension {
    /// `spec.suspend` now.
    pub suspended: bool,
    /// Whether this request changed it.
    pub changed: bool,
}

/// RFC 3339 or Unix milliseconds.
pub fn time_ms(what: &str, text: &str) -> anyhow::Result<u64> {
    use anyhow::Context as _;
    if let Ok(ms) = text.parse::<u64>() {
        return Ok(ms);
    }
    let at: k8s_openapi::jiff::Timestamp =
        text.parse().with_context(|| format!("{what} {text:?}: not RFC 3339 (2026-12-01T10:00:00Z) nor Unix ms"))?;
    u64::try_from(at.as_millisecond()).with_context(|| format!("{what} {text:?}: before 1970"))
}

pub fn rfc3339(ms: u64) -> String {
    i64::try_from(ms)
        .ok()
        .and_then(|ms| k8s_openapi::jiff::Timestamp::from_millisecond(ms).ok())
        .map_or_else(|| ms.to_string(), |t| t.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_are_rfc3339_or_unix_ms() {
        assert_eq!(time_ms("since", "1700000000000").ok(), Some(1_700_000_000_000));
        assert_eq!(time_ms("since", "2023-11-14T22:13:20Z").ok(), Some(1_700_000_000_000));
        let refused = time_ms("since", "yesterday").err().map(|e| e.to_string()).unwrap_or_default();
        assert!(refused.contains("since") && refused.contains("RFC 3339"), "{refused}");
        assert_eq!(rfc3339(1_700_000_000_000), "2023-11-14T22:13:20Z");
    }

    #[test]
    fn an_action_refuses_fields_it_does_not_know() {
        let ok = ActionRequest::from_json(serde_json::json!({"all": true, "dryRun": true, "filter": {"reason": "x"}}));
        assert!(ok.is_ok_and(|r| r.dry_run && r.all));
        let typo = ActionRequest::from_json(serde_json::json!({"all": true, "dry_run": true}));
        assert_eq!(typo.err().as_deref(), Some("unknown field \"dry_run\""));
        let widened = ActionRequest::from_json(serde_json::json!({"filter": {"reasons": "permanent"}}));
        assert_eq!(widened.err().as_deref(), Some("unknown field \"filter.reasons\""));
    }

    #[test]
    fn a_filter_travels_as_a_query_string_and_back() {
        let spec = FilterSpec {
            reason: Some("permanent,malformed".into()),
            error: Some("card declined & more".into()),
            since: Some("2026-12-01T10:00:00Z".into()),
            ..FilterSpec::default()
        };
        let query = serde_urlencoded::to_string(&spec).unwrap_or_default();
        let back: FilterSpec = serde_urlencoded::from_str(&query).unwrap_or_default();
        assert_eq!(back, spec);
        let filter = back.filter().unwrap_or_default();
        assert_eq!(filter.reasons, vec!["permanent", "malformed"]);
        assert_eq!(filter.error_contains.as_deref(), Some("card declined & more"));
    }
}
