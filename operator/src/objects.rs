//! The objects the operator owns, built from a `StreamConsumerGroup` by pure
//! functions: the worker Deployment and the recovery CronJob.

use crate::controller::validate::{ValidSpec, Workload};
use crate::error::Error;
use k8s_openapi::api::apps::v1::{Deployment, DeploymentSpec};
use k8s_openapi::api::batch::v1::{CronJob, CronJobSpec, JobSpec, JobTemplateSpec};
use k8s_openapi::api::core::v1::{
    Capabilities, Container, EnvVar, EnvVarSource, LocalObjectReference, ObjectFieldSelector, PodSpec, PodTemplateSpec,
    ResourceRequirements, SeccompProfile, SecretKeySelector, SecurityContext, Toleration,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};
use kube::ResourceExt as _;
use std::collections::BTreeMap;
use streamfleet_contract as env;
use streamfleet_crd::{RecoveryMode, StreamConsumerGroup};

/// Label carrying the owning resource's name on every object and pod.
pub const GROUP_LABEL: &str = "streamfleet.io/consumer-group";
/// Label telling worker pods from recovery pods.
pub const COMPONENT_LABEL: &str = "app.kubernetes.io/component";

/// Settings of this operator installation that shape the objects.
#[derive(Clone, Debug, Default)]
pub struct ObjectSettings {
    /// The operator's own image, run by `Sweep`-mode recovery Jobs.
    pub operator_image: String,
    /// Pull secrets of that image (the chart's `imagePullSecrets`).
    pub image_pull_secrets: Vec<String>,
    /// The sweep container's resources.
    pub sweep_resources: Option<ResourceRequirements>,
    /// A recovery Job (sweep or `Worker` mode) still running after this many
    /// seconds is stopped; the next run resumes.
    pub sweep_deadline_seconds: Option<i64>,
    /// Where the sweep pods run and what they are annotated with.
    pub sweep_pod: SweepPod,
    /// The key of the Secrets digest on worker pod templates.
    pub digest_key: crate::digest_key::DigestKey,
}

/// The chart's `sweep.podAnnotations`, `nodeSelector` and `tolerations`.
#[derive(Clone, Debug, Default, PartialEq, serde::Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SweepPod {
    #[serde(default)]
    pub annotations: BTreeMap<String, String>,
    #[serde(default)]
    pub node_selector: BTreeMap<String, String>,
    #[serde(default)]
    pub tolerations: Vec<Toleration>,
}

/// Name prefixes of the pods this resource's workloads run (workers and
/// recovery Jobs): the pods whose consumers it may reap.
pub fn pod_name_prefixes(scg: &StreamConsumerGroup) -> [String; 2] {
    [format!("{}-", worker_deployment_name(scg)), format!("{}-", recovery_cronjob_name(scg))]
}

pub fn worker_deployment_name(scg: &StreamConsumerGroup) -> String {
    format!("{}-worker", scg.name_any())
}

pub fn recovery_cronjob_name(scg: &StreamConsumerGroup) -> String {
    format!("{}-recovery", scg.name_any())
}

/// Informational only: a worker pod keeps its template's own.
const NAME_LABEL: &str = "app.kubernetes.io/name";

fn labels(workload: &Workload, component: &str) -> BTreeMap<String, String> {
    BTreeMap::from([
        (NAME_LABEL.to_string(), "streamfleet".to_string()),
        ("app.kubernetes.io/managed-by".to_string(), "streamfleet".to_string()),
        (COMPONENT_LABEL.to_string(), component.to_string()),
        (GROUP_LABEL.to_string(), workload.resource.clone()),
    ])
}

/// Metadata of an object this resource owns: name, namespace, labels, owner.
fn owned_meta(workload: &Workload, name: &str, component: &str) -> Result<ObjectMeta, Error> {
    let owner = workload.owner.clone().ok_or_else(|| Error::Internal("the resource has no uid yet".into()))?;
    Ok(ObjectMeta {
        name: Some(name.to_string()),
        namespace: workload.namespace.clone(),
        labels: Some(labels(workload, component)),
        owner_references: Some(vec![owner]),
        ..ObjectMeta::default()
    })
}

/// The env contract (see `streamfleet_contract`) for a worker or recovery
/// container, as the validated spec says it, in `mode`, with `drain_timeout_ms`
/// for a worker's handlers to finish after SIGTERM.
pub fn contract_env(valid: &ValidSpec, mode: env::RunMode, drain_timeout_ms: Option<u64>) -> Vec<EnvVar> {
    told(valid, mode, drain_timeout_ms)
        .render()
        .into_iter()
        .map(|(name, source)| {
            let from = |source: EnvVarSource| EnvVar { name: name.into(), value: None, value_from: Some(source) };
            match source {
                env::Source::Value(v) => EnvVar { name: name.into(), value: Some(v), value_from: None },
                env::Source::Secret(r) => from(EnvVarSource {
                    secret_key_ref: Some(SecretKeySelector { name: r.secret, key: r.key, optional: Some(false) }),
                    ..EnvVarSource::default()
                }),
                env::Source::PodField(path) => from(EnvVarSource {
                    field_ref: Some(ObjectFieldSelector { field_path: path.into(), api_version: None }),
                    ..EnvVarSource::default()
                }),
            }
        })
        .collect()
}

/// What a container is told: the validated spec's contract, in `mode`.
fn told(valid: &ValidSpec, mode: env::RunMode, drain_timeout_ms: Option<u64>) -> env::WorkerEnv {
    let mut told = valid.worker_env.clone();
    told.options.mode = mode;
    told.options.drain_timeout_ms = drain_timeout_ms;
    told
}

/// The contract's Redis connection variables (`STREAMFLEET_REDIS_URL`,
/// `_USERNAME`, `_PASSWORD`, `_MODE`, `_CA_PEM`, `_CLIENT_*`): the spec's only.
const REDIS_ENV_PREFIX: &str = "STREAMFLEET_REDIS_";

/// What a worker keeps of its grace period for acks and hand-backs after
/// abandoning its handlers.
const DRAIN_MARGIN_MS: i64 = 3_000;

/// The user's pod template with our labels and the env contract injected into
/// the worker container. The user's own env entries of the same names lose:
/// the contract must be what the operator says it is.
fn worker_pod_template(valid: &ValidSpec, component: &str, mode: env::RunMode) -> Result<PodTemplateSpec, Error> {
    let workload = &valid.workload;
    let mut template = workload.template.clone();
    let meta = template.metadata.get_or_insert_with(ObjectMeta::default);
    let pod_labels = meta.labels.get_or_insert_with(BTreeMap::new);
    // The user's own `app.kubernetes.io/name` stays (nothing selects by it);
    // the Deployment's selector and the operator's pod watch need the rest.
    for (key, value) in labels(workload, component) {
        if key == NAME_LABEL {
            pod_labels.entry(key).or_insert(value);
        } else {
            pod_labels.insert(key, value);
        }
    }
    let index = workload.worker_container()?;
    let missing = || Error::Internal("the worker container is missing".into());
    let pod = template.spec.as_mut().ok_or_else(missing)?;
    let container = pod.containers.get_mut(index).ok_or_else(missing)?;
    // Handlers in flight get the grace period less a margin to finish: the
    // rest is handed back before the kubelet's SIGKILL.
    let grace_ms = pod.termination_grace_period_seconds.unwrap_or(30).max(0).saturating_mul(1000);
    let drain_ms = grace_ms.saturating_sub(DRAIN_MARGIN_MS).max(grace_ms / 2);
    let contract = contract_env(valid, mode, u64::try_from(drain_ms).ok());
    let env = container.env.get_or_insert_with(Vec::new);
    // The contract wins, and how to reach Redis is the spec's alone: a
    // password or client key the template sets would reach the workers and
    // not the operator.
    env.retain(|e| !contract.iter().any(|c| c.name == e.name) && !e.name.starts_with(REDIS_ENV_PREFIX));
    env.extend(contract);
    Ok(template)
}

/// The pod-template annotation carrying a digest of the Secret values the
/// workers read at start (`redis_endpoint::secrets_digest`): when one
/// changes, the Deployment rolls its pods, which then read the new value.
pub const SECRETS_DIGEST_ANNOTATION: &str = "streamfleet.io/redis-secrets-digest";

/// Stamps `digest` on `deployment`'s pod template (none: no Secret named).
pub fn stamp_secrets_digest(deployment: &mut Deployment, digest: Option<&str>) {
    let Some(digest) = digest else { return };
    if let Some(spec) = deployment.spec.as_mut() {
        let meta = spec.template.metadata.get_or_insert_with(ObjectMeta::default);
        meta.annotations.get_or_insert_with(BTreeMap::new).insert(SECRETS_DIGEST_ANNOTATION.into(), digest.into());
    }
}

/// The worker Deployment at `replicas`.
pub fn worker_deployment(valid: &ValidSpec, replicas: i32) -> Result<Deployment, Error> {
    let workload = &valid.workload;
    let selector = BTreeMap::from([
        (GROUP_LABEL.to_string(), workload.resource.clone()),
        (COMPONENT_LABEL.to_string(), "worker".to_string()),
    ]);
    Ok(Deployment {
        metadata: owned_meta(workload, &workload.deployment_name, "worker")?,
        spec: Some(DeploymentSpec {
            replicas: Some(replicas),
            selector: LabelSelector { match_labels: Some(selector), match_expressions: None },
            template: worker_pod_template(valid, "worker", env::RunMode::Consume)?,
            ..DeploymentSpec::default()
        }),
        status: None,
    })
}

/// The recovery CronJob: the operator image's `sweep` in `Sweep` mode, the
/// worker template in recovery mode in `Worker` mode.
pub fn recovery_cronjob(valid: &ValidSpec, settings: &ObjectSettings) -> Result<CronJob, Error> {
    let workload = &valid.workload;
    let mut template = match workload.recovery_mode {
        RecoveryMode::Worker => worker_pod_template(valid, "recovery", env::RunMode::Recovery)?,
        RecoveryMode::Sweep => sweep_pod_template(valid, settings),
    };
    if let Some(spec) = template.spec.as_mut() {
        spec.restart_policy = Some("OnFailure".into());
    }
    Ok(CronJob {
        metadata: owned_meta(workload, &workload.cronjob_name, "recovery")?,
        spec: Some(CronJobSpec {
            schedule: workload.schedule.clone(),
            suspend: Some(valid.suspend),
            // Two sweeps racing over one PEL would only contend.
            concurrency_policy: Some("Forbid".into()),
            successful_jobs_history_limit: Some(1),
            failed_jobs_history_limit: Some(1),
            job_template: JobTemplateSpec {
                metadata: Some(ObjectMeta { labels: Some(labels(workload, "recovery")), ..ObjectMeta::default() }),
                spec: Some(JobSpec {
                    backoff_limit: Some(2),
                    // In either mode: under `Forbid` a hung run would block
                    // every later one. The next run resumes where it stopped.
                    active_deadline_seconds: settings.sweep_deadline_seconds,
                    template,
                    ..JobSpec::default()
                }),
            },
            ..CronJobSpec::default()
        }),
        status: None,
    })
}

fn sweep_pod_template(valid: &ValidSpec, settings: &ObjectSettings) -> PodTemplateSpec {
    PodTemplateSpec {
        metadata: Some(ObjectMeta {
            labels: Some(labels(&valid.workload, "recovery")),
            annotations: (!settings.sweep_pod.annotations.is_empty()).then(|| settings.sweep_pod.annotations.clone()),
            ..ObjectMeta::default()
        }),
        spec: Some(PodSpec {
            node_selector: (!settings.sweep_pod.node_selector.is_empty())
                .then(|| settings.sweep_pod.node_selector.clone()),
            tolerations: (!settings.sweep_pod.tolerations.is_empty()).then(|| settings.sweep_pod.tolerations.clone()),
            // The sweep talks only to Redis: no API credentials.
            automount_service_account_token: Some(false),
            image_pull_secrets: (!settings.image_pull_secrets.is_empty()).then(|| {
                settings.image_pull_secrets.iter().map(|name| LocalObjectReference { name: name.clone() }).collect()
            }),
            containers: vec![Container {
                name: "sweep".into(),
                image: Some(settings.operator_image.clone()),
                args: Some(vec!["sweep".into()]),
                env: Some(contract_env(valid, env::RunMode::Recovery, None)),
                resources: settings.sweep_resources.clone(),
                security_context: Some(restricted_security_context()),
                ..Container::default()
            }],
            ..PodSpec::default()
        }),
    }
}

/// The `restricted` Pod Security Standard for containers we define ourselves.
pub fn restricted_security_context() -> SecurityContext {
    SecurityContext {
        allow_privilege_escalation: Some(false),
        read_only_root_filesystem: Some(true),
        run_as_non_root: Some(true),
        capabilities: Some(Capabilities { drop: Some(vec!["ALL".into()]), add: None }),
        seccomp_profile: Some(SeccompProfile { type_: "RuntimeDefault".into(), localhost_profile: None }),
        ..SecurityContext::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use streamfleet_streams::{RunMode, WorkerConfig};

    fn worker_mode() -> StreamConsumerGroup {
        scg(json!({"recovery": {"mode": "Worker"}}))
    }

    fn valid(s: &StreamConsumerGroup) -> ValidSpec {
        crate::controller::validate::validate(s).unwrap()
    }

    fn scg(extra: serde_json::Value) -> StreamConsumerGroup {
        let mut v = json!({
            "apiVersion": "streamfleet.io/v1alpha1", "kind": "StreamConsumerGroup",
            "metadata": {"name": "orders", "namespace": "shop", "uid": "u-1"},
            "spec": {
                "redis": {"urlSecretRef": {"name": "redis", "key": "url"}},
                "stream": "orders", "group": "billing",
                "worker": {"template": {"metadata": {"labels": {"team": "pay"}}, "spec": {"containers": [
                    {"name": "sidecar", "image": "proxy"},
                    {"name": "app", "image": "worker:1", "env": [{"name": "OWN", "value": "1"}, {"name": "STREAMFLEET_GROUP", "value": "spoofed"}, {"name": "STREAMFLEET_REDIS_PASSWORD", "value": "not the spec's"}]}
                ]}}}
            }
        });
        if let (Some(spec), Some(extra)) = (v["spec"].as_object_mut(), extra.as_object()) {
            for (k, val) in extra {
                spec.insert(k.clone(), val.clone());
            }
        }
        serde_json::from_value(v).unwrap()
    }

    fn env_of(c: &Container) -> BTreeMap<String, EnvVar> {
        c.env.iter().flatten().map(|e| (e.name.clone(), e.clone())).collect()
    }

    /// What the test's Secrets hold: a URL under `url`, else text a URL
    /// would need percent-encoded.
    fn secret_value(name: &str, key: &str) -> String {
        if key == "url" { format!("redis://{name}-{key}.example:6379") } else { format!("{name}/{key}: p@ss w%rd\n") }
    }

    /// A container's environment as its process sees it: values with
    /// `$(NAME)` expanded from the entries before them, Secret keys and the
    /// pod's name and UID filled in, as a kubelet does.
    fn resolved_env(c: &Container) -> BTreeMap<String, String> {
        let mut out = BTreeMap::new();
        for e in c.env.iter().flatten() {
            let from = e.value_from.as_ref();
            let value =
                match (&e.value, from.and_then(|f| f.secret_key_ref.as_ref()), from.and_then(|f| f.field_ref.as_ref()))
                {
                    (Some(v), _, _) => out
                        .iter()
                        .fold(v.clone(), |v, (k, known): (&String, &String)| v.replace(&format!("$({k})"), known)),
                    (None, Some(secret), _) => secret_value(&secret.name, &secret.key),
                    (None, None, Some(field)) if field.field_path == "metadata.name" => {
                        "orders-worker-7f9-abcde".into()
                    }
                    (None, None, Some(field)) if field.field_path == "metadata.uid" => "0b1c-uid".into(),
                    _ => continue,
                };
            out.insert(e.name.clone(), value);
        }
        out
    }

    /// The contract's round trip: what the operator renders for a worker,
    /// a Worker-mode recovery run and a sweep is what the worker library
    /// parses, field by field, against the validated spec (sharded or not,
    /// every retry setting, TLS, concurrency).
    #[test]
    fn what_the_operator_renders_is_what_a_worker_parses() {
        let recovery = |mode: &str| {
            json!({"mode": mode, "minIdleTimeMs": 1500, "maxDeliveries": 7, "batchSize": 33,
                   "retry": {"backoff": "Fixed", "initialDelayMs": 2000, "maxDelayMs": 9000, "jitterPercent": 5, "retryForSeconds": 120}})
        };
        let cases = [
            json!({"shards": 3, "recovery": recovery("Worker")}),
            json!({"recovery": recovery("Sweep"), "redis": {"urlSecretRef": {"name": "redis", "key": "url"}, "mode": "Cluster",
                   "tls": {"caSecretRef": {"name": "redis-ca", "key": "ca.crt"}}}}),
            json!({"worker": {"concurrency": 4, "handlerTimeoutSeconds": 300, "prefetch": 12, "template": scg(json!({})).spec.worker.template, "containerName": "app"}}),
            json!({"redis": {"urlSecretRef": {"name": "vault", "key": "url"}, "usernameSecretRef": {"name": "vault", "key": "user"},
                   "passwordSecretRef": {"name": "vault", "key": "password"}}}),
            json!({"redis": {"url": "rediss://redis-master.db:6379", "username": "streamfleet",
                   "passwordSecretRef": {"name": "redis", "key": "redis-password"},
                   "tls": {"caSecretRef": {"name": "redis-ca", "key": "ca.crt"}, "clientCertSecretRef": {"name": "client"}}}}),
        ];
        let settings =
            ObjectSettings { operator_image: "streamfleet/streamfleet:1".into(), ..ObjectSettings::default() };
        let mut rendered = std::collections::BTreeSet::new();
        for case in cases {
            let s = scg(case.clone());
            let valid = crate::controller::validate::validate(&s).unwrap();
            let deployment = worker_deployment(&valid, 1).unwrap();
            let pod = deployment.spec.unwrap().template.spec.unwrap();
            let cronjob = recovery_cronjob(&valid, &settings).unwrap();
            let run = cronjob.spec.unwrap().job_template.spec.unwrap().template.spec.unwrap();
            let worker = pod.containers.iter().find(|c| c.env.iter().flatten().any(|e| e.name == env::GROUP)).unwrap();
            let recovering =
                run.containers.iter().find(|c| c.env.iter().flatten().any(|e| e.name == env::GROUP)).unwrap();
            for (container, mode) in [(worker, RunMode::Consume), (recovering, RunMode::Recovery)] {
                let seen = resolved_env(container);
                rendered.extend(seen.keys().filter(|k| k.starts_with("STREAMFLEET_")).cloned());
                let config = WorkerConfig::from_lookup(|k| seen.get(k).cloned()).unwrap();
                let what = format!("{case} ({mode:?})");
                assert_eq!(config.mode, mode, "{what}");
                assert_eq!((&config.streams, &config.group), (&valid.streams, &valid.group), "{what}");
                assert_eq!(config.consumer, "orders-worker-7f9-abcde.0b1c-uid", "{what}");
                assert_eq!((config.min_idle, config.max_deliveries), (valid.min_idle, valid.max_deliveries), "{what}");
                assert_eq!(config.retry, valid.retry, "{what}");
                assert_eq!(config.batch_size, valid.batch, "{what}");
                for stream in &valid.streams {
                    assert_eq!(
                        config.dead_letter_stream_of(stream),
                        valid.dead_letter_stream_of(stream),
                        "{what}: {stream}"
                    );
                }
                // The workers connect as the operator does: URL, mode,
                // credentials and TLS material alike.
                let values: Vec<_> = crate::redis_endpoint::secret_keys(&valid.redis)
                    .into_iter()
                    .map(|r| {
                        let value = secret_value(&r.name, &r.key).into_bytes();
                        (r, value)
                    })
                    .collect();
                let operators = crate::redis_endpoint::endpoint(&valid.redis, &values).unwrap();
                assert_eq!(config.endpoint, operators, "{what}");
                let cluster = matches!(s.spec.redis.mode, streamfleet_crd::RedisMode::Cluster);
                assert_eq!(config.endpoint.mode == streamfleet_streams::Mode::Cluster, cluster, "{what}");
                assert_eq!(config.endpoint.ca_pem.is_some(), s.spec.redis.tls.is_some(), "{what}");
                let concurrency = s
                    .spec
                    .worker
                    .concurrency
                    .map_or(usize::from(env::DEFAULT_CONCURRENCY), |n| usize::try_from(n).unwrap());
                assert_eq!(config.concurrency, concurrency, "{what}");
                // Every option as the validated spec tells it: an option
                // added to the contract is checked here without a line more.
                assert_eq!(config.options, told(&valid, mode, config.options.drain_timeout_ms).options, "{what}");
            }
        }
        // docs/env-contract.md's table names exactly what is rendered.
        let table: std::collections::BTreeSet<String> = include_str!("../../docs/env-contract.md")
            .lines()
            .filter_map(|l| l.strip_prefix("| `"))
            .filter_map(|l| l.split(" |").next())
            .flat_map(|names| names.split(", ").map(|n| n.trim_matches('`').to_string()).collect::<Vec<_>>())
            .filter(|n| n.starts_with("STREAMFLEET_"))
            .collect();
        assert_eq!(table, rendered, "docs/env-contract.md's table against what the operator renders");
    }

    /// The order of the contract's variables is part of the pod template:
    /// changed, an operator upgrade rolls every worker. Pinned here.
    #[test]
    fn the_contract_is_rendered_in_its_pinned_order() {
        let s = scg(json!({"worker": {"concurrency": 4, "template": scg(json!({})).spec.worker.template},
            "recovery": {"retry": {"initialDelayMs": 70000, "maxDelayMs": 90000, "retryForSeconds": 600}},
            "redis": {"url": "rediss://redis:6379", "username": "u", "passwordSecretRef": {"name": "r", "key": "p"},
                      "tls": {"caSecretRef": {"name": "ca", "key": "ca.crt"}, "clientCertSecretRef": {"name": "client"}}}}));
        let d = worker_deployment(&valid(&s), 1).unwrap();
        let pod = d.spec.unwrap().template.spec.unwrap();
        let rendered: Vec<String> = pod.containers[0]
            .env
            .iter()
            .flatten()
            .filter(|e| e.name.starts_with("STREAMFLEET_"))
            .map(|e| match (&e.value, &e.value_from) {
                (Some(v), _) => format!("{}={v}", e.name),
                (None, Some(from)) => match (&from.secret_key_ref, &from.field_ref) {
                    (Some(r), _) => format!("{}<-{}/{}", e.name, r.name, r.key),
                    (_, Some(f)) => format!("{}<-{}", e.name, f.field_path),
                    _ => unreachable!(),
                },
                _ => unreachable!(),
            })
            .collect();
        let pinned = [
            "STREAMFLEET_REDIS_URL=rediss://redis:6379",
            "STREAMFLEET_REDIS_MODE=Standalone",
            "STREAMFLEET_STREAMS=orders",
            "STREAMFLEET_GROUP=billing",
            "STREAMFLEET_POD_NAME<-metadata.name",
            "STREAMFLEET_POD_UID<-metadata.uid",
            "STREAMFLEET_CONSUMER=$(STREAMFLEET_POD_NAME).$(STREAMFLEET_POD_UID)",
            "STREAMFLEET_MIN_IDLE_MS=60000",
            "STREAMFLEET_MAX_DELIVERIES=10",
            "STREAMFLEET_BATCH_SIZE=100",
            "STREAMFLEET_MODE=consume",
            "STREAMFLEET_RETRY_BACKOFF=Exponential",
            "STREAMFLEET_RETRY_INITIAL_DELAY_MS=70000",
            "STREAMFLEET_RETRY_MAX_DELAY_MS=90000",
            "STREAMFLEET_RETRY_JITTER_PERCENT=20",
            "STREAMFLEET_RETRY_FOR_MS=600000",
            "STREAMFLEET_DEAD_LETTER_STREAM={orders}:dead:billing",
            "STREAMFLEET_REDIS_USERNAME=u",
            "STREAMFLEET_REDIS_PASSWORD<-r/p",
            "STREAMFLEET_REDIS_CA_PEM<-ca/ca.crt",
            "STREAMFLEET_REDIS_CLIENT_CERT_PEM<-client/tls.crt",
            "STREAMFLEET_REDIS_CLIENT_KEY_PEM<-client/tls.key",
            "STREAMFLEET_CONCURRENCY=4",
            "STREAMFLEET_DRAIN_TIMEOUT_MS=27000",
        ];
        assert_eq!(rendered, pinned);
    }

    #[test]
    fn deployment_injects_contract_into_the_named_container_and_keeps_user_fields() {
        let s = scg(json!({"worker": {"containerName": "app", "template": scg(json!({})).spec.worker.template}}));
        let d = worker_deployment(&valid(&s), 3).unwrap();
        assert_eq!(d.metadata.name.as_deref(), Some("orders-worker"));
        let owner = &d.metadata.owner_references.as_ref().unwrap()[0];
        assert_eq!(
            (owner.kind.as_str(), owner.uid.as_str(), owner.controller),
            ("StreamConsumerGroup", "u-1", Some(true))
        );
        let spec = d.spec.unwrap();
        assert_eq!(spec.replicas, Some(3));
        let tmpl = spec.template;
        let labels = tmpl.metadata.unwrap().labels.unwrap();
        assert_eq!(labels["team"], "pay");
        assert_eq!(labels["app.kubernetes.io/name"], "streamfleet", "filled in when the template has none");
        for (k, v) in spec.selector.match_labels.unwrap() {
            assert_eq!(labels[&k], v, "selector label {k} must be on the pods");
        }
        assert_eq!(labels["app.kubernetes.io/managed-by"], "streamfleet", "the operator's pod watch selects by it");
        // The template's own name label stays: nothing selects by it.
        let mut named = scg(json!({})).spec.worker.template;
        named
            .metadata
            .get_or_insert_default()
            .labels
            .get_or_insert_default()
            .insert("app.kubernetes.io/name".into(), "payments".into());
        let s = scg(json!({"worker": {"template": named}}));
        let labels = worker_deployment(&valid(&s), 1).unwrap().spec.unwrap().template.metadata.unwrap().labels.unwrap();
        assert_eq!(labels["app.kubernetes.io/name"], "payments");
        let pod = tmpl.spec.unwrap();
        assert!(pod.containers[0].env.is_none(), "the sidecar is untouched");
        let env = env_of(&pod.containers[1]);
        assert_eq!(env["OWN"].value.as_deref(), Some("1"));
        // How to reach Redis is the spec's alone: what it does not give is
        // set empty, so neither the template's env nor an envFrom supplies it.
        for name in [env::REDIS_USERNAME, env::REDIS_PASSWORD, env::REDIS_CA_PEM, env::REDIS_CLIENT_CERT_PEM] {
            assert_eq!((env[name].value.as_deref(), env[name].value_from.is_none()), (Some(""), true), "{name}");
        }
        assert_eq!(env[env::GROUP].value.as_deref(), Some("billing"), "the contract wins over the user's value");
        assert_eq!(env[env::STREAMS].value.as_deref(), Some("orders"));
        assert_eq!(env[env::DEAD_LETTER_STREAM].value.as_deref(), Some("{orders}:dead:billing"));
        assert_eq!(env[env::MODE].value.as_deref(), Some("consume"));
        let url = env[env::REDIS_URL].value_from.as_ref().unwrap().secret_key_ref.as_ref().unwrap();
        assert_eq!((url.name.as_str(), url.key.as_str()), ("redis", "url"));
        assert!(env[env::REDIS_URL].value.is_none(), "the URL is only referenced, never copied");
        let field = |name: &str| env[name].value_from.as_ref().unwrap().field_ref.as_ref().unwrap().field_path.clone();
        assert_eq!((field(env::POD_NAME), field(env::POD_UID)), ("metadata.name".into(), "metadata.uid".into()));
        let names: Vec<&str> = pod.containers[1].env.as_ref().unwrap().iter().map(|e| e.name.as_str()).collect();
        let at = |n: &str| names.iter().position(|m| *m == n).unwrap();
        assert!(at(env::POD_UID) < at(env::CONSUMER), "declared before the consumer name that expands it");
        assert_eq!(
            env[env::CONSUMER].value.as_deref(),
            Some("$(STREAMFLEET_POD_NAME).$(STREAMFLEET_POD_UID)"),
            "the pod UID makes the consumer name unforgeable"
        );
        assert_eq!(env[env::DRAIN_TIMEOUT_MS].value.as_deref(), Some("27000"), "30 s grace less the margin");
        assert_eq!(env[env::REDIS_CLIENT_KEY_PEM].value.as_deref(), Some(""));
    }

    /// The chart's worker PodMonitor selects labels every worker pod has.
    #[test]
    fn the_charts_worker_pod_monitor_selects_the_worker_pods() {
        let template = include_str!("../../charts/streamfleet/templates/podmonitor.yaml");
        let selector = template.split("matchLabels:").nth(1).unwrap().split("podMetricsEndpoints:").next().unwrap();
        let wanted: Vec<(&str, &str)> =
            selector.lines().filter_map(|l| l.trim().split_once(": ")).map(|(k, v)| (k, v.trim())).collect();
        assert_eq!(wanted.len(), 2, "{selector}");
        let s = scg(json!({}));
        let d = worker_deployment(&valid(&s), 1).unwrap();
        let labels = d.spec.unwrap().template.metadata.unwrap().labels.unwrap();
        for (label, value) in wanted {
            assert_eq!(labels.get(label).map(String::as_str), Some(value), "{label}");
        }
    }

    #[test]
    fn a_sharded_pipeline_tells_workers_every_shard_and_no_shared_dead_letter_stream() {
        let resource = scg(json!({"shards": 3}));
        let d = worker_deployment(&valid(&resource), 1).unwrap();
        let pod = d.spec.unwrap().template.spec.unwrap();
        let env = env_of(&pod.containers[0]);
        assert_eq!(env[env::STREAMS].value.as_deref(), Some("orders,orders:1,orders:2"));
        assert!(!env.contains_key(env::DEAD_LETTER_STREAM), "each shard dead-letters into its own slot");
    }

    #[test]
    fn first_container_is_the_default_target_and_missing_names_are_invalid() {
        let d = worker_deployment(&valid(&scg(json!({}))), 1).unwrap();
        let pod = d.spec.unwrap().template.spec.unwrap();
        assert!(env_of(&pod.containers[0]).contains_key(env::GROUP));
        let bad = scg(json!({"worker": {"containerName": "nope", "template": scg(json!({})).spec.worker.template}}));
        let err = worker_deployment(&valid(&bad), 1).unwrap_err().to_string();
        assert!(err.contains("spec.worker.containerName"), "{err}");
    }

    #[test]
    fn tls_ca_is_referenced_from_its_secret() {
        let s = scg(
            json!({"redis": {"urlSecretRef": {"name": "redis", "key": "url"}, "tls": {"caSecretRef": {"name": "ca", "key": "ca.crt"}}}}),
        );
        let env: BTreeMap<_, _> =
            contract_env(&valid(&s), env::RunMode::Consume, None).into_iter().map(|e| (e.name.clone(), e)).collect();
        let ca = env[env::REDIS_CA_PEM].value_from.as_ref().unwrap().secret_key_ref.as_ref().unwrap();
        assert_eq!((ca.name.as_str(), ca.key.as_str()), ("ca", "ca.crt"));
    }

    #[test]
    fn sweep_cronjob_runs_the_operator_image_without_api_credentials() {
        let settings =
            ObjectSettings { operator_image: "streamfleet/streamfleet:1".into(), ..ObjectSettings::default() };
        let s = scg(json!({"recovery": {"schedule": "*/2 * * * *"}}));
        let cj = recovery_cronjob(&valid(&s), &settings).unwrap();
        let spec = cj.spec.unwrap();
        assert_eq!(spec.schedule, "*/2 * * * *");
        assert_eq!(spec.concurrency_policy.as_deref(), Some("Forbid"));
        let pod = spec.job_template.spec.unwrap().template.spec.unwrap();
        assert_eq!(pod.automount_service_account_token, Some(false));
        assert_eq!(pod.restart_policy.as_deref(), Some("OnFailure"));
        let c = &pod.containers[0];
        assert_eq!(c.image.as_deref(), Some("streamfleet/streamfleet:1"));
        assert_eq!(c.args.as_deref(), Some(&["sweep".to_string()][..]));
        assert_eq!(env_of(c)[env::MODE].value.as_deref(), Some("recovery"));
        assert_eq!(c.security_context.as_ref().unwrap().read_only_root_filesystem, Some(true));
        assert_eq!((pod.image_pull_secrets, c.resources.clone()), (None, None), "none configured");
    }

    #[test]
    fn the_sweep_job_pulls_with_the_operators_secrets_within_its_resources_and_deadline() {
        let resources: ResourceRequirements =
            serde_json::from_value(json!({"requests": {"cpu": "50m"}, "limits": {"memory": "256Mi"}})).unwrap();
        let settings = ObjectSettings {
            operator_image: "registry.example/streamfleet:1".into(),
            image_pull_secrets: vec!["regcred".into()],
            sweep_resources: Some(resources.clone()),
            sweep_deadline_seconds: Some(900),
            sweep_pod: serde_json::from_value(json!({
                "annotations": {"sidecar.istio.io/inject": "false"},
                "nodeSelector": {"pool": "ops"},
                "tolerations": [{"key": "dedicated", "operator": "Exists", "effect": "NoSchedule"}],
            }))
            .unwrap(),
            ..ObjectSettings::default()
        };
        let job =
            recovery_cronjob(&valid(&scg(json!({}))), &settings).unwrap().spec.unwrap().job_template.spec.unwrap();
        assert_eq!(job.active_deadline_seconds, Some(900));
        let annotations = job.template.metadata.as_ref().and_then(|m| m.annotations.clone()).unwrap_or_default();
        assert_eq!(annotations.get("sidecar.istio.io/inject").map(String::as_str), Some("false"));
        let pod = job.template.spec.unwrap();
        assert_eq!(pod.image_pull_secrets, Some(vec![LocalObjectReference { name: "regcred".into() }]));
        assert_eq!(pod.containers[0].resources, Some(resources));
        assert_eq!(pod.node_selector.unwrap_or_default().get("pool").map(String::as_str), Some("ops"));
        assert_eq!(pod.tolerations.unwrap_or_default()[0].key.as_deref(), Some("dedicated"));
        // Worker mode runs the user's template (its own pull secrets), under
        // the same deadline: a hung run must not block every later one.
        let worker = recovery_cronjob(&valid(&worker_mode()), &settings).unwrap();
        let job = worker.spec.unwrap().job_template.spec.unwrap();
        let pod = job.template.spec.unwrap();
        assert_eq!((job.active_deadline_seconds, pod.image_pull_secrets, pod.tolerations), (Some(900), None, None));
    }

    #[test]
    fn worker_mode_recovery_runs_the_worker_template_in_recovery_mode() {
        let settings = ObjectSettings { operator_image: "op".into(), ..ObjectSettings::default() };
        let cj = recovery_cronjob(&valid(&worker_mode()), &settings).unwrap();
        let pod = cj.spec.unwrap().job_template.spec.unwrap().template.spec.unwrap();
        assert_eq!(pod.containers[1].image.as_deref(), Some("worker:1"));
        assert_eq!(env_of(&pod.containers[0])[env::MODE].value.as_deref(), Some("recovery"));
    }
}
