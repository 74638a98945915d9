//! Hostile JSON for the decoding properties of a `StreamConsumerGroup`:
//! random JSON trees, and a full, valid resource with random mutations
//! (fields removed, values of the wrong type, numbers at the edges of every
//! integer type, huge floats, unicode and control characters, hash tags,
//! unknown fields). For property tests, here and in the operator
//! (`crd/tests/decoding_props.rs`, `operator/tests/validate_props.rs`):
//! the `testing` feature, never in a build users run.

use proptest::prelude::*;
use proptest::sample::Index;
use serde_json::{Value, json};

/// Names the decoders know, so random objects sometimes hit real fields.
pub const FIELDS: &[&str] = &[
    "apiVersion",
    "kind",
    "metadata",
    "name",
    "namespace",
    "uid",
    "spec",
    "status",
    "redis",
    "urlSecretRef",
    "url",
    "username",
    "passwordSecretRef",
    "clientCertSecretRef",
    "key",
    "mode",
    "tls",
    "caSecretRef",
    "stream",
    "group",
    "shards",
    "startId",
    "worker",
    "template",
    "containers",
    "containerName",
    "concurrency",
    "handlerTimeoutSeconds",
    "scaling",
    "minReplicas",
    "maxReplicas",
    "targetPerReplica",
    "activationThreshold",
    "scaleDownStabilizationSeconds",
    "cooldownSeconds",
    "pollIntervalSeconds",
    "paused",
    "recovery",
    "schedule",
    "minIdleTimeMs",
    "maxDeliveries",
    "batchSize",
    "deadLetterStream",
    "deadLetterMaxLength",
    "retention",
    "maxLength",
    "maxAgeSeconds",
    "deletionPolicy",
    "suspend",
    "conditions",
    "lag",
    "pending",
    "health",
    "payloadLost",
    "lastRecovery",
    "shards",
    "replicas",
];

/// Strings that mean something somewhere in the spec.
pub const STRINGS: &[&str] = &[
    "",
    "orders",
    "orders:1",
    "{orders}:dead",
    "{orders}",
    "{",
    "}",
    "{}",
    "{{a}}",
    "$",
    "0",
    "-",
    "1700000000000-0",
    "99999999999999999999-99999999999999999999",
    "Standalone",
    "Cluster",
    "Retain",
    "Delete",
    "Sweep",
    "Worker",
    "Healthy",
    "*/5 * * * *",
    "61 25 * * *",
    "ünïcödé-流れ-🚀",
    "\u{0}\u{7f}\u{202e}",
    "redis://u:secret@10.0.0.1:6379/0",
    "2024-01-01T00:00:00Z",
];

const FLOATS: &[f64] = &[1e308, -1e308, 0.5, -0.0, 1e-308, 9.007_199_254_740_993e15];

/// Integers at the edges of the spec's bounds and of i32 / i64.
const EDGES: &[i64] = &[
    0,
    1,
    -1,
    2,
    64,
    65,
    1000,
    1001,
    i32::MAX as i64,
    i32::MAX as i64 + 1,
    i32::MIN as i64,
    i32::MIN as i64 - 1,
    i64::MAX,
    i64::MIN,
];

pub fn leaf() -> impl Strategy<Value = Value> {
    prop_oneof![
        1 => Just(Value::Null),
        1 => any::<bool>().prop_map(Value::Bool),
        2 => any::<i64>().prop_map(|n| json!(n)),
        1 => any::<u64>().prop_map(|n| json!(n)),
        3 => prop::sample::select(EDGES).prop_map(|n| json!(n)),
        1 => Just(json!(u64::MAX)),
        1 => any::<f64>().prop_filter_map("finite", |f| serde_json::Number::from_f64(f).map(Value::Number)),
        1 => prop::sample::select(FLOATS).prop_map(|f| json!(f)),
        2 => any::<String>().prop_map(Value::String),
        3 => prop::sample::select(STRINGS).prop_map(|s| json!(s)),
        1 => (1usize..5000).prop_map(|n| json!("x".repeat(n))),
    ]
}

fn key() -> impl Strategy<Value = String> {
    prop_oneof![3 => prop::sample::select(FIELDS).prop_map(str::to_string), 1 => any::<String>()]
}

/// Any JSON value.
pub fn tree() -> impl Strategy<Value = Value> {
    leaf().prop_recursive(4, 48, 6, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..5).prop_map(Value::Array),
            prop::collection::vec((key(), inner), 0..6)
                .prop_map(|kv| Value::Object(kv.into_iter().collect::<serde_json::Map<_, _>>())),
        ]
    })
}

/// A valid resource, every field of the spec set, and a status.
pub fn base() -> Value {
    json!({
        "apiVersion": "streamfleet.io/v1alpha1",
        "kind": "StreamConsumerGroup",
        "metadata": {"name": "pipeline", "namespace": "shop", "uid": "0a1b2c", "generation": 3},
        "spec": {
            "redis": {
                "urlSecretRef": {"name": "redis", "key": "url"},
                "mode": "Standalone",
                "tls": {"caSecretRef": {"name": "redis-ca", "key": "ca.pem"}}
            },
            "stream": "orders",
            "group": "billing",
            "shards": 1,
            "startId": "0",
            "worker": {
                "template": {
                    "metadata": {"labels": {"app": "billing"}},
                    "spec": {
                        "terminationGracePeriodSeconds": 30,
                        "containers": [
                            {"name": "sidecar", "image": "proxy"},
                            {"name": "worker", "image": "worker:1", "env": [{"name": "STREAMFLEET_GROUP", "value": "mine"}],
                             "resources": {"limits": {"cpu": "500m", "memory": "128Mi"}}}
                        ]
                    }
                },
                "containerName": "worker",
                "concurrency": 8,
                "handlerTimeoutSeconds": 120
            },
            "scaling": {
                "minReplicas": 1, "maxReplicas": 10, "targetPerReplica": 100, "activationThreshold": 5,
                "scaleDownStabilizationSeconds": 60, "cooldownSeconds": 300, "pollIntervalSeconds": 10, "paused": false
            },
            "recovery": {
                "schedule": "*/5 * * * *", "minIdleTimeMs": 60000, "maxDeliveries": 5, "batchSize": 100,
                "deadLetterStream": "{orders}:dead", "deadLetterMaxLength": 1000, "mode": "Sweep"
            },
            "retention": {"maxLength": 100000, "maxAgeSeconds": 86400},
            "deletionPolicy": "Delete",
            "suspend": false
        },
        "status": {
            "observedGeneration": 3,
            "conditions": [{"type": "Ready", "status": "True", "reason": "Healthy", "message": "ok",
                            "lastTransitionTime": "2024-01-01T00:00:00Z"}],
            "lag": 3, "pending": 2, "oldestPendingIdleSeconds": 4, "maxDeliveryCount": 1, "consumers": 2,
            "consumerPending": [{"name": "c1", "pending": 2}],
            "streamLength": 10, "deadLetterLength": 1,
            "replicas": {"desired": 2, "current": 2, "summary": "2/2"},
            "health": "Healthy",
            "lastRecovery": {"time": "2024-01-01T00:00:00Z", "claimed": 1, "deadLettered": 0, "payloadLost": 0},
            "payloadLost": {"total": 1, "unacknowledged": 1, "latestIds": ["1-0"]},
            "resumeId": "1-0",
            "shards": [{"stream": "orders", "lag": 3, "pending": 2, "deadLetterLength": 1}]
        }
    })
}

/// Every JSON pointer into `value`, the root excluded.
pub fn pointers(value: &Value) -> Vec<String> {
    fn walk(value: &Value, at: String, out: &mut Vec<String>) {
        match value {
            Value::Object(map) => {
                for (k, v) in map {
                    let p = format!("{at}/{}", k.replace('~', "~0").replace('/', "~1"));
                    out.push(p.clone());
                    walk(v, p, out);
                }
            }
            Value::Array(items) => {
                for (i, v) in items.iter().enumerate() {
                    let p = format!("{at}/{i}");
                    out.push(p.clone());
                    walk(v, p, out);
                }
            }
            _ => {}
        }
    }
    let mut out = Vec::new();
    walk(value, String::new(), &mut out);
    out
}

#[derive(Clone, Debug)]
pub enum Mutation {
    Remove(Index),
    /// The same type, a hostile value: a number at an edge, another string
    /// (or any string), the other boolean.
    Edge(Index, Index, String),
    /// Replaced by a leaf: often the wrong type, or the right one at an edge.
    Leaf(Index, Value),
    /// Replaced by any JSON.
    Tree(Index, Value),
    /// An unknown (or duplicate-looking) field added to an object.
    Add(Index, String, Value),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        2 => any::<Index>().prop_map(Mutation::Remove),
        5 => (any::<Index>(), any::<Index>(), any::<String>()).prop_map(|(at, pick, s)| Mutation::Edge(at, pick, s)),
        2 => (any::<Index>(), leaf()).prop_map(|(at, v)| Mutation::Leaf(at, v)),
        1 => (any::<Index>(), tree()).prop_map(|(at, v)| Mutation::Tree(at, v)),
        1 => (any::<Index>(), key(), leaf()).prop_map(|(at, k, v)| Mutation::Add(at, k, v)),
    ]
}

/// Applies `mutation` to `doc` at one of its current pointers.
pub fn apply(doc: &mut Value, mutation: &Mutation) {
    let at = |i: &Index, doc: &Value| {
        let all = pointers(doc);
        (!all.is_empty()).then(|| all[i.index(all.len())].clone())
    };
    match mutation {
        Mutation::Remove(i) => {
            let Some(p) = at(i, doc) else { return };
            let (parent, last) = p.rsplit_once('/').unwrap_or(("", &p));
            let last = last.replace("~1", "/").replace("~0", "~");
            match doc.pointer_mut(parent) {
                Some(Value::Object(map)) => {
                    map.remove(&last);
                }
                Some(Value::Array(items)) => {
                    if let Ok(n) = last.parse::<usize>()
                        && n < items.len()
                    {
                        items.remove(n);
                    }
                }
                _ => {}
            }
        }
        Mutation::Edge(i, pick, any) => {
            let Some(p) = at(i, doc) else { return };
            let Some(slot) = doc.pointer_mut(&p) else { return };
            *slot = match slot {
                Value::Number(_) => json!(EDGES[pick.index(EDGES.len())]),
                Value::String(_) if pick.index(4) == 0 => json!(any),
                Value::String(_) => json!(STRINGS[pick.index(STRINGS.len())]),
                Value::Bool(b) => json!(!*b),
                _ => return,
            };
        }
        Mutation::Leaf(i, v) | Mutation::Tree(i, v) => {
            let Some(p) = at(i, doc) else { return };
            if let Some(slot) = doc.pointer_mut(&p) {
                *slot = v.clone();
            }
        }
        Mutation::Add(i, k, v) => {
            let Some(p) = at(i, doc) else { return };
            if let Some(Value::Object(map)) = doc.pointer_mut(&p) {
                map.insert(k.clone(), v.clone());
            }
        }
    }
}

/// The valid resource with 1–6 mutations applied.
pub fn mutated() -> impl Strategy<Value = Value> {
    prop::collection::vec(mutation(), 1..=6).prop_map(|mutations| {
        let mut doc = base();
        for m in &mutations {
            apply(&mut doc, m);
        }
        doc
    })
}

/// Hostile documents: mostly mutated resources, some anything at all.
pub fn document() -> impl Strategy<Value = Value> {
    prop_oneof![
        6 => mutated(),
        1 => tree(),
        1 => tree().prop_map(|spec| {
            let mut doc = base();
            doc["spec"] = spec;
            doc
        }),
    ]
}
