//! Shared fixtures of the controller's table tests.

use super::decide::{Plan, PolicyMemory, Situation, decide};
use super::observe::Observation;
use super::validate::validate;
use crate::objects::ObjectSettings;
use k8s_openapi::api::apps::v1::{Deployment, DeploymentSpec};
use serde_json::json;
use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;
use streamfleet_crd::StreamConsumerGroup;
use streamfleet_streams::health::{ConsumerState, Delay, GroupSnapshot, Lag};
use streamfleet_streams::payload_loss::PayloadLoss;

pub fn scg() -> StreamConsumerGroup {
    serde_json::from_value(json!({
        "apiVersion": "streamfleet.io/v1alpha1", "kind": "StreamConsumerGroup",
        "metadata": {"name": "orders", "namespace": "shop", "uid": "u-1", "generation": 2},
        "spec": {"redis": {"urlSecretRef": {"name": "r", "key": "url"}}, "stream": "s", "group": "g",
                 "scaling": {"minReplicas": 1, "maxReplicas": 5, "targetPerReplica": 100},
                 "worker": {"template": {"spec": {"containers": [{"name": "w", "image": "w"}]}}}}
    }))
    .unwrap()
}

pub fn snapshot(lag: u64, pending: u64, consumers: &[(&str, u64)]) -> GroupSnapshot {
    GroupSnapshot {
        lag: Lag::Known(lag),
        pending,
        entries_read: Some(10),
        entries_added: None,
        last_delivered_id: "10-0".into(),
        oldest_pending_idle_ms: (pending > 0).then_some(1_000),
        max_delivery_count: (pending > 0).then_some(1),
        consumers: consumers
            .iter()
            .map(|(name, pending)| ConsumerState { name: (*name).into(), pending: *pending, idle_ms: 60_000 })
            .collect(),
        before_oldest_pending: (pending > 0).then(|| "4-0".into()),
        stream_length: 1000,
        delay: Delay::Known(if lag + pending > 0 { 3_000 } else { 0 }),
        oldest_unfinished_ms: (lag + pending > 0).then_some(1_796_000_000_000),
        working_delay: Delay::Known(if lag + pending > 0 { 3_000 } else { 0 }),
        ..GroupSnapshot::default()
    }
}

pub fn observed(group: Option<GroupSnapshot>, replicas: Option<i32>) -> Observation {
    Observation {
        shards: vec![("orders".to_string(), group.clone())],
        group,
        last_recovery: None,
        payload_loss: PayloadLoss::default(),
        retention: Vec::new(),
        deployment: replicas.map(|r| {
            Arc::new(Deployment {
                spec: Some(DeploymentSpec { replicas: Some(r), ..DeploymentSpec::default() }),
                ..Deployment::default()
            })
        }),
        cronjob: None,
        recovery_jobs: Vec::new(),
        live_pods: HashSet::from(["orders-worker-a".to_string()]),
        pods: vec![("orders-worker-a".to_string(), None)],
        claimants: Vec::new(),
        safety: streamfleet_streams::version::Safety {
            eviction: streamfleet_streams::version::Eviction::Never,
            persistence: streamfleet_streams::version::Persistence::AppendOnly,
        },
        secrets_digest: Some("0123abcd".into()),
    }
}

pub fn run(scg: &StreamConsumerGroup, observed: &Observation) -> Plan {
    let settings = ObjectSettings { operator_image: "op".into(), ..ObjectSettings::default() };
    let at = Situation { scg, settings: &settings, now: Duration::from_secs(100) };
    decide(&validate(scg).unwrap(), observed, &mut PolicyMemory::default(), &at).unwrap()
}
