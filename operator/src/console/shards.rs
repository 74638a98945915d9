//! A pipeline's shards and their consumers, live from Redis: per shard one
//! inspection of its group ([`health::inspect`], a bounded number of
//! commands whatever the PEL's size), as the controller reads it.

use super::wire::{Shard, ShardConsumer, ShardList, ShardRetry};
use crate::controller::validate::ValidSpec;
use anyhow::Result;
use streamfleet_streams::StreamConnection;
use streamfleet_streams::health::{self, GroupSnapshot, Lag};

pub async fn list(conn: &mut StreamConnection, spec: &ValidSpec) -> Result<ShardList> {
    let mut items = Vec::with_capacity(spec.streams.len());
    for stream in &spec.streams {
        let snapshot = health::inspect(conn, spec.group_on(stream), &spec.dead_letter_stream_of(stream)).await?;
        items.push(shard(stream, snapshot.as_ref()));
    }
    Ok(ShardList { items })
}

/// A shard as people read it: unknown figures absent, never 0.
fn shard(stream: &str, snapshot: Option<&GroupSnapshot>) -> Shard {
    let Some(s) = snapshot else {
        return Shard { stream: stream.to_string(), ..Shard::default() };
    };
    let (lag, lag_at_least) = match s.lag {
        Lag::Known(n) => (Some(n), false),
        Lag::AtLeast(n) => (Some(n), true),
        Lag::Unknown => (None, false),
    };
    Shard {
        stream: stream.to_string(),
        group_exists: true,
        lag,
        lag_at_least,
        pending: s.pending,
        retrying: s.retrying,
        delay_seconds: s.delay.ms().map(|ms| ms / 1000),
        oldest_pending_idle_ms: s.oldest_pending_idle_ms,
        most_deliveries: s.max_delivery_count,
        stream_length: s.stream_length,
        dead_letters: s.dead_letter_length,
        consumers: s
            .consumers
            .iter()
            .map(|c| ShardConsumer { name: c.name.clone(), pending: c.pending, idle_ms: c.idle_ms })
            .collect(),
        retries: s
            .parked
            .iter()
            .map(|p| ShardRetry {
                after_delivery: p.deliveries,
                entries: p.entries,
                longest_wait_ms: p.most_idle_ms,
                last_error: p.last_error.clone(),
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use streamfleet_streams::health::{ConsumerState, Delay, ParkedState};

    #[test]
    fn a_missing_group_shows_nothing_as_known() {
        let s = shard("orders", None);
        assert!(!s.group_exists && s.lag.is_none() && s.delay_seconds.is_none(), "{s:?}");
    }

    #[test]
    fn unknown_stays_unknown_and_a_floor_says_so() {
        let snapshot = GroupSnapshot {
            lag: Lag::AtLeast(1001),
            delay: Delay::NotTimes,
            pending: 3,
            retrying: 1,
            consumers: vec![ConsumerState { name: "w-1".into(), pending: 2, idle_ms: 40 }],
            parked: vec![ParkedState { deliveries: 2, entries: 1, most_idle_ms: 900, last_error: Some("503".into()) }],
            ..GroupSnapshot::default()
        };
        let s = shard("orders", Some(&snapshot));
        assert_eq!((s.lag, s.lag_at_least, s.delay_seconds), (Some(1001), true, None));
        assert_eq!(s.consumers[0].name, "w-1");
        assert_eq!((s.retries[0].after_delivery, s.retries[0].last_error.as_deref()), (2, Some("503")));
        let unknown = GroupSnapshot { lag: Lag::Unknown, ..GroupSnapshot::default() };
        assert_eq!(shard("orders", Some(&unknown)).lag, None);
    }
}
