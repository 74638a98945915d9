//! Hostile resources through the operator: every document that decodes as
//! a `StreamConsumerGroup` (mutated from a valid one: wrong types refused by
//! decoding, but numbers at every edge, unicode and hash tags in names,
//! missing and unknown fields accepted) goes through the validate step, the
//! builders of the Deployment and CronJob, the scaling policy and the
//! health classification (with lag and pending counts of any size, as a
//! server may report them). None may
//! panic. What validation accepts is what the later steps rely on: positive
//! durations and counts, 1–64 shards, a dead-letter stream apart from the
//! stream (in its slot on a cluster), a worker count within the bounds.

// A test fails by panicking.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use streamfleet_crd::testing as hostile_json;

use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use serde_json::Value;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;
use streamfleet_contract::{ParsedEnv, RunMode};
use streamfleet_crd::{RedisMode, StreamConsumerGroup};
use streamfleet_operator::controller::health::{self, HealthMemory};
use streamfleet_operator::controller::scaling::{self, ScalingMemory};
use streamfleet_operator::controller::validate::validate;
use streamfleet_operator::objects::{self, ObjectSettings};
use streamfleet_streams::health::{GroupSnapshot, Lag};
use streamfleet_streams::keys;

fn runner(cases: u32) -> TestRunner {
    let cases = std::env::var("PROPTEST_CASES").ok().and_then(|n| n.parse().ok()).unwrap_or(cases);
    TestRunner::new(Config { cases, failure_persistence: None, ..Config::default() })
}

/// One poll: the lag and pending it observed (`None`: inspection failed),
/// the replicas running, and when (seconds).
type Poll = (Option<(Lag, u64)>, i32, u64);

/// Lag and pending as a poll may observe them, the extremes included.
fn observed() -> impl Strategy<Value = Vec<Poll>> {
    let count = prop_oneof![3 => 0u64..1000, 1 => any::<u64>(), 1 => Just(u64::MAX)];
    let lag = prop_oneof![count.clone().prop_map(Lag::Known), count.clone().prop_map(Lag::AtLeast), Just(Lag::Unknown)];
    let current = prop_oneof![3 => 0i32..20, 1 => any::<i32>()];
    let at_s = 0u64..100_000;
    prop::collection::vec((prop::option::weighted(0.9, (lag, count)), current, at_s), 1..6)
}

/// A group as a poll may see it, its counts from the hostile observation.
fn snapshot(lag: Lag, pending: u64, n: u64) -> GroupSnapshot {
    GroupSnapshot {
        lag,
        pending,
        entries_read: Some(pending.wrapping_mul(n)),
        entries_added: Some(pending.wrapping_mul(n).wrapping_add(n)),
        server_ms: n,
        last_delivered_id: format!("{n}-0"),
        oldest_pending_idle_ms: Some(pending.wrapping_mul(7)),
        max_delivery_count: Some(pending),
        consumers: Vec::new(),
        before_oldest_pending: None,
        stream_length: pending,
        dead_letter_length: n,
        retrying: pending / 2,
        parked: Vec::new(),
        delay: streamfleet_streams::health::Delay::Known(pending.wrapping_mul(n)),
        oldest_unfinished_ms: Some(n),
        working_delay: streamfleet_streams::health::Delay::Known(pending.wrapping_mul(n)),
    }
}

#[test]
fn no_decodable_resource_makes_validation_or_the_builders_panic() {
    let validated = AtomicUsize::new(0);
    let refused = AtomicUsize::new(0);
    let input = (hostile_json::document(), observed());
    let result = runner(1024).run(&input, |(doc, polls): (Value, _)| {
        let Ok(scg) = serde_json::from_value::<StreamConsumerGroup>(doc) else { return Ok(()) };
        let valid = match validate(&scg) {
            Ok(valid) => valid,
            Err(e) => {
                prop_assert_eq!(e.reason(), "InvalidSpec");
                refused.fetch_add(1, Ordering::Relaxed);
                return Ok(());
            }
        };
        validated.fetch_add(1, Ordering::Relaxed);
        let shards = usize::try_from(scg.spec.shards.unwrap_or(1)).unwrap();
        prop_assert!((1..=64).contains(&shards));
        prop_assert_eq!(valid.streams.len(), shards);
        prop_assert_eq!(&valid.streams[0], &valid.stream);
        prop_assert!(valid.min_idle >= Duration::from_millis(1));
        prop_assert!(valid.max_deliveries >= 1 && valid.batch >= 1 && valid.target_per_replica >= 1);
        prop_assert!(valid.poll_interval >= Duration::from_secs(1));
        prop_assert!(valid.streams.iter().all(|s| valid.dead_letter_stream_of(s) != *s));
        if scg.spec.redis.mode == RedisMode::Cluster {
            prop_assert!(valid.streams.iter().all(|s| keys::same_slot(s, &valid.dead_letter_stream_of(s))));
        }
        if let Some(limits) = valid.retention {
            prop_assert!(limits.max_length.is_none_or(|n| n > 0) && limits.max_age_ms.is_none_or(|ms| ms > 0));
        }
        prop_assert!(valid.dead_letter_max_length.is_none_or(|n| n > 0));

        // The owned objects: built or refused, never a panic.
        // What validation accepts, a worker parses back as it was told.
        let rendered = objects::contract_env(&valid, RunMode::Consume, Some(25_000));
        let mut seen = std::collections::BTreeMap::new();
        for e in &rendered {
            let value = match (&e.value, &e.value_from) {
                (Some(v), _) => v.clone(),
                (None, _) => "from-the-pod".to_string(),
            };
            seen.insert(e.name.clone(), value);
        }
        let parsed = ParsedEnv::parse(|k| seen.get(k).cloned());
        prop_assert!(parsed.is_ok(), "{:?}: {:?}", parsed, rendered);
        let mut told = valid.worker_env.options.clone();
        told.drain_timeout_ms = Some(25_000);
        prop_assert_eq!(parsed.map(|p| p.options).ok(), Some(told));
        // What validates builds, or fails naming the worker template (the
        // group and the status go on meanwhile); a resource without a name
        // and uid (the API server gives both) cannot be owned.
        let owned = scg.metadata.uid.is_some() && scg.metadata.name.is_some();
        let built = |r: Result<(), streamfleet_operator::error::Error>| match r {
            Ok(()) => true,
            Err(e) => !owned || (e.reason() == "InvalidSpec" && e.to_string().contains("spec.worker.")),
        };
        prop_assert!(built(objects::worker_deployment(&valid, 3).map(drop)));
        let settings = ObjectSettings {
            operator_image: "streamfleet:test".into(),
            image_pull_secrets: vec!["pull".into()],
            sweep_resources: None,
            sweep_deadline_seconds: Some(600),
            sweep_pod: Default::default(),
            digest_key: Default::default(),
        };
        prop_assert!(built(objects::recovery_cronjob(&valid, &settings).map(drop)));
        let _ = objects::pod_name_prefixes(&scg);

        // The scaling policy and the health over a few polls: replicas within
        // the spec's bounds.
        let mut memory = ScalingMemory::default();
        let mut health_memory = HealthMemory::default();
        let (min, max) = (scg.spec.scaling.min_replicas.max(0), scg.spec.scaling.max_replicas);
        for (seen, current, at_s) in polls {
            let snapshot = seen.map(|(lag, pending)| snapshot(lag, pending, at_s));
            if let Some(s) = &snapshot {
                health_memory.record(s, Duration::from_secs(at_s), current > 0);
            }
            let _ = health::classify(&health::Inputs {
                snapshot: snapshot.as_ref(),
                memory: &health_memory,
                min_idle: valid.min_idle,
                max_deliveries: valid.max_deliveries,
                replicas: current,
                payload_lost_unacknowledged: at_s % 2,
                retry_overdue: std::time::Duration::from_secs(at_s % 3),
            });
            let seen_with_retries = seen.map(|(lag, pending)| (lag, pending, pending / 2));
            let decision = scaling::decide(
                &scg.spec.scaling,
                current,
                seen_with_retries,
                &Default::default(),
                Duration::from_secs(at_s),
                &mut memory,
            );
            let held = seen.is_none() || scg.spec.scaling.paused;
            prop_assert!(
                held || decision.replicas == current || decision.replicas <= max.max(min).max(1),
                "{} replicas over the maximum {max}: {}",
                decision.replicas,
                decision.reason
            );
        }
        Ok(())
    });
    if let Err(e) = result {
        panic!("{e}");
    }
    let (validated, refused) = (validated.into_inner(), refused.into_inner());
    eprintln!("{validated} hostile resources validated, {refused} refused by validation");
    assert!(validated > 0 && refused > 0, "the documents should exercise both outcomes");
}
