//! A group's pending (in-flight) entries for people: who holds each, for
//! how long, after how many deliveries, whether it waits for a retry, and
//! its last handler error. One `XPENDING` page and one `HMGET` per call:
//! bounded whatever the PEL's size.

use crate::error::StreamError;
use crate::group_ref::GroupRef;
use crate::keys;
use crate::retry::parked_deliveries;
use redis::aio::ConnectionLike;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pending {
    pub id: String,
    /// The consumer holding it: a worker pod, or a parking consumer.
    pub consumer: String,
    pub idle_ms: u64,
    pub deliveries: u64,
    /// Parked for a retry after failing at this delivery count.
    pub retry_after_delivery: Option<u64>,
    pub last_error: Option<String>,
}

/// Up to `count` pending entries of `group` after the ID `after` (oldest
/// first), of one consumer if given, idle at least `min_idle_ms` if given.
pub async fn page<C: ConnectionLike + Send>(
    conn: &mut C,
    of: GroupRef<'_>,
    after: Option<&str>,
    count: usize,
    consumer: Option<&str>,
    min_idle_ms: Option<u64>,
) -> Result<Vec<Pending>, StreamError> {
    let GroupRef { stream, group } = of;
    let mut cmd = redis::cmd("XPENDING");
    cmd.arg(stream).arg(group);
    if let Some(idle) = min_idle_ms {
        cmd.arg("IDLE").arg(idle);
    }
    let start = after.map_or_else(|| "-".to_string(), |id| format!("({id}"));
    cmd.arg(start).arg("+").arg(count.max(1));
    if let Some(consumer) = consumer {
        cmd.arg(consumer);
    }
    let entries: Vec<(String, String, u64, u64)> =
        cmd.query_async(conn).await.map_err(|e| StreamError::new("reading pending entries", e))?;
    if entries.is_empty() {
        return Ok(Vec::new());
    }
    let errors: Vec<Option<String>> = redis::cmd("HMGET")
        .arg(keys::last_error_key(stream, group))
        .arg(entries.iter().map(|e| e.0.as_str()).collect::<Vec<_>>())
        .query_async(conn)
        .await
        .map_err(|e| StreamError::new("reading pending entries' last errors", e))?;
    Ok(entries
        .into_iter()
        .zip(errors)
        .map(|((id, consumer, idle_ms, deliveries), last_error)| Pending {
            retry_after_delivery: parked_deliveries(&consumer),
            id,
            consumer,
            idle_ms,
            deliveries,
            last_error,
        })
        .collect())
}
