//! A pipeline's pending entries across its shards, a page at a time.

use super::wire::{PendingEntry, PendingList, PendingQuery};
use anyhow::Result;
use streamfleet_streams::StreamConnection;
use streamfleet_streams::pending;

/// Entries per page at most.
pub const MAX_PAGE: usize = 500;

/// A page of `group`'s pending entries over `streams` (shard 0 first),
/// resuming from `query.continue` (`stream@id` with shards, else the ID).
pub async fn page(
    conn: &mut StreamConnection,
    streams: &[String],
    group: &str,
    query: &PendingQuery,
) -> Result<PendingList> {
    let (mut resume_stream, mut after) = match query.continue_.as_deref().map(|a| a.split_once('@')) {
        Some(Some((stream, id))) => (Some(stream.to_string()), Some(id.to_string())),
        Some(None) => (None, query.continue_.clone()),
        None => (None, None),
    };
    let limit = query.limit.unwrap_or(50).clamp(1, MAX_PAGE);
    let mut list = PendingList::default();
    for stream in streams {
        if resume_stream.as_ref().is_some_and(|s| s != stream) {
            continue;
        }
        resume_stream = None;
        let left = limit - list.items.len();
        let page = pending::page(
            conn,
            streamfleet_streams::GroupRef::new(stream, group),
            after.take().as_deref(),
            left,
            query.consumer.as_deref(),
            query.min_idle_ms,
        )
        .await?;
        let full = page.len() == left;
        list.items.extend(page.into_iter().map(|p| PendingEntry {
            stream: stream.clone(),
            id: p.id,
            consumer: p.consumer,
            idle_ms: p.idle_ms,
            deliveries: p.deliveries,
            retry_after_delivery: p.retry_after_delivery,
            last_error: p.last_error,
        }));
        if full {
            let last = list.items.last().map(|e| e.id.clone()).unwrap_or_default();
            list.continue_ = Some(if streams.len() > 1 { format!("{stream}@{last}") } else { last });
            break;
        }
    }
    Ok(list)
}
