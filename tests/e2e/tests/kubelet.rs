//! The kubelet stand-in behaves like a kubelet where our timings depend on
//! it: a pod takes a warm image start to run, a force delete still sends
//! SIGTERM and gives the kubelet's minimum grace before SIGKILL, crashes back
//! off 10 s then 20 s, failed startup and liveness probes restart the
//! container, and `activeDeadlineSeconds` fails the pod. Real processes
//! (`testproc`) record what happened to them.

// A test fails by panicking.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use anyhow::Result;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{DeleteParams, PostParams};
use kube::{Api, Client};
use std::path::Path;
use std::time::{Duration, Instant};
use streamfleet_testbed::{TestBed, eventually};

const T: Duration = Duration::from_secs(60);

/// A pod running `testproc` with `args`, recording into `dir`; `extra` is
/// merged into the container (probes) and `pod_spec` into the pod spec.
fn testproc_pod(name: &str, dir: &Path, args: &[&str], extra: serde_json::Value, pod_spec: serde_json::Value) -> Pod {
    let mut container = serde_json::json!({
        "name": "main", "image": "streamfleet/testproc", "args": args,
        "env": [
            {"name": "TESTPROC_DIR", "value": dir.display().to_string()},
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        ],
    });
    merge(&mut container, extra);
    let mut spec = serde_json::json!({"containers": [container], "terminationGracePeriodSeconds": 30});
    merge(&mut spec, pod_spec);
    serde_json::from_value(serde_json::json!({"metadata": {"name": name}, "spec": spec})).unwrap()
}

fn merge(into: &mut serde_json::Value, from: serde_json::Value) {
    if let (Some(into), serde_json::Value::Object(from)) = (into.as_object_mut(), from) {
        into.extend(from);
    }
}

fn container_status(p: &Pod) -> Option<&k8s_openapi::api::core::v1::ContainerStatus> {
    p.status.as_ref()?.container_statuses.as_ref()?.first()
}

fn starts(dir: &Path, name: &str) -> Vec<u64> {
    std::fs::read_to_string(dir.join(format!("{name}.starts")))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.parse().ok())
        .collect()
}

fn alive(pid: u32) -> bool {
    // A zombie is dead for our purpose: the stand-in reaps it moments later.
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| !s.contains(") Z "))
}

async fn setup(prefix: &str) -> Result<(Client, streamfleet_testbed::TestNamespace, Api<Pod>)> {
    let bed = TestBed::shared()?;
    let client = bed.client().await?;
    let ns = bed.namespace(&client, prefix).await?;
    let pods = Api::namespaced(client.clone(), &ns.name);
    // The namespace's default ServiceAccount comes from the controller manager.
    let sas: Api<k8s_openapi::api::core::v1::ServiceAccount> = Api::namespaced(client.clone(), &ns.name);
    eventually("the default ServiceAccount", T, || async { Ok(sas.get_opt("default").await?) }).await?;
    Ok((client, ns, pods))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_starts_like_a_warm_image_and_a_force_delete_still_terms_then_kills_after_the_minimum_grace() -> Result<()>
{
    let (_client, _ns, pods) = setup("e2e-kubelet-delete").await?;
    let dir = tempfile::tempdir()?;
    let created = Instant::now();
    pods.create(
        &PostParams::default(),
        &testproc_pod("polite", dir.path(), &["run"], serde_json::json!({}), serde_json::json!({})),
    )
    .await?;
    eventually("polite running", T, || async {
        Ok(container_status(&pods.get("polite").await?).is_some_and(|s| s.ready).then_some(()))
    })
    .await?;
    let took = created.elapsed();
    assert!(took >= Duration::from_secs(1), "a pod ran {took:?} after creation: faster than a warm image start");
    // Ready is reported at the spawn; the process handles SIGTERM once its
    // start record exists.
    eventually("polite's start record", T, || async { Ok(dir.path().join("polite.start").exists().then_some(())) })
        .await?;

    // A force delete: the object is gone at once, the process still gets
    // SIGTERM and ends on its own.
    let force = DeleteParams { grace_period_seconds: Some(0), ..DeleteParams::default() };
    pods.delete("polite", &force).await?;
    assert!(pods.get_opt("polite").await?.is_none(), "a force-deleted pod is gone from the API at once");
    eventually("polite got SIGTERM", T, || async { Ok(dir.path().join("polite.sigterm").exists().then_some(())) })
        .await?;

    // A process that ignores SIGTERM is SIGKILLed after the kubelet's minimum grace of 2 s.
    pods.create(
        &PostParams::default(),
        &testproc_pod("stubborn", dir.path(), &["ignore-term"], serde_json::json!({}), serde_json::json!({})),
    )
    .await?;
    let pid = eventually("stubborn running", T, || async {
        let p = pods.get("stubborn").await?;
        Ok(container_status(&p).filter(|s| s.ready).and(streamfleet_testbed::kubelet::container_pid(&p, "main")))
    })
    .await?;
    eventually("stubborn's start record", T, || async { Ok(dir.path().join("stubborn.start").exists().then_some(())) })
        .await?;
    let deleted = Instant::now();
    pods.delete("stubborn", &force).await?;
    eventually("stubborn got SIGTERM", T, || async { Ok(dir.path().join("stubborn.sigterm").exists().then_some(())) })
        .await?;
    assert!(alive(pid), "SIGKILLed before the minimum grace");
    eventually("stubborn SIGKILLed", T, || async { Ok((!alive(pid)).then_some(())) }).await?;
    let lived = deleted.elapsed();
    assert!(
        lived >= Duration::from_secs(2) && lived < Duration::from_secs(5),
        "SIGKILL {lived:?} after a force delete; the kubelet's minimum grace is 2 s"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crashing_container_backs_off_10s_then_20s_in_crash_loop_back_off() -> Result<()> {
    let (_client, _ns, pods) = setup("e2e-kubelet-crash").await?;
    let dir = tempfile::tempdir()?;
    pods.create(
        &PostParams::default(),
        &testproc_pod("crasher", dir.path(), &["exit", "1"], serde_json::json!({}), serde_json::json!({})),
    )
    .await?;
    let waiting = eventually("CrashLoopBackOff shown", T, || async {
        let p = pods.get("crasher").await?;
        let s = container_status(&p).cloned();
        let reason = s.as_ref().and_then(|s| s.state.as_ref()?.waiting.as_ref()?.reason.clone());
        Ok(s.filter(|s| s.restart_count >= 1 && reason.as_deref() == Some("CrashLoopBackOff")))
    })
    .await?;
    let last = waiting.last_state.and_then(|s| s.terminated).map(|t| t.exit_code);
    assert_eq!(last, Some(1));
    eventually("three starts", Duration::from_secs(90), || async {
        Ok((starts(dir.path(), "crasher").len() >= 3).then_some(()))
    })
    .await?;
    let s = starts(dir.path(), "crasher");
    let gaps: Vec<u64> = s.windows(2).map(|w| w[1] - w[0]).collect();
    // Each restart waits out its back-off plus a container start (1 s).
    assert!((10_000..13_500).contains(&gaps[0]), "first restart after {} ms, expected 10 s back-off", gaps[0]);
    assert!((20_000..23_500).contains(&gaps[1]), "second restart after {} ms, expected 20 s back-off", gaps[1]);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_startup_and_liveness_probes_restart_the_container_and_a_deadline_fails_the_pod() -> Result<()> {
    let (_client, _ns, pods) = setup("e2e-kubelet-probes").await?;
    let dir = tempfile::tempdir()?;
    let tcp = |port: u16| serde_json::json!({"tcpSocket": {"port": port}, "periodSeconds": 1, "failureThreshold": 2});
    let create = |name: &'static str, args: &'static [&'static str], extra, spec| {
        let pod = testproc_pod(name, dir.path(), args, extra, spec);
        let pods = pods.clone();
        async move { pods.create(&PostParams::default(), &pod).await }
    };
    // Serves on 8080; every probe passes, it stays up and ready.
    create(
        "healthy",
        &["listen", "8080"],
        serde_json::json!({"startupProbe": tcp(8080), "livenessProbe": tcp(8080), "readinessProbe": tcp(8080)}),
        serde_json::json!({}),
    )
    .await?;
    // Liveness on a port nothing serves: killed (SIGTERM first) and restarted.
    create("unlive", &["listen", "8080"], serde_json::json!({"livenessProbe": tcp(8081)}), serde_json::json!({}))
        .await?;
    // Never starts: its readiness probe would pass, but never runs.
    create(
        "unstarted",
        &["listen", "8080"],
        serde_json::json!({"startupProbe": tcp(8081), "readinessProbe": tcp(8080)}),
        serde_json::json!({}),
    )
    .await?;
    // Exec probes run their command, with the container's environment: a
    // liveness command that fails restarts the container, a readiness
    // command that needs the container's variable passes.
    let exec = |script: &str| serde_json::json!({"exec": {"command": ["sh", "-c", script]}, "periodSeconds": 1, "failureThreshold": 2});
    create("exec-unlive", &["run"], serde_json::json!({"livenessProbe": exec("exit 3")}), serde_json::json!({}))
        .await?;
    create(
        "exec-ready",
        &["run"],
        serde_json::json!({"readinessProbe": exec("test -d \"$TESTPROC_DIR\""), "livenessProbe": exec("true")}),
        serde_json::json!({}),
    )
    .await?;
    // A pod past its activeDeadlineSeconds fails with DeadlineExceeded.
    create(
        "overdue",
        &["run"],
        serde_json::json!({}),
        serde_json::json!({"activeDeadlineSeconds": 3, "restartPolicy": "Never"}),
    )
    .await?;

    for name in ["unlive", "unstarted", "exec-unlive"] {
        let s = eventually(&format!("{name} restarted by its probe"), T, || async {
            Ok(container_status(&pods.get(name).await?).filter(|s| s.restart_count >= 1).cloned())
        })
        .await?;
        assert!(!s.ready, "{name} is ready");
        assert!(dir.path().join(format!("{name}.sigterm")).exists(), "{name} was killed without SIGTERM");
    }
    let s = container_status(&pods.get("unstarted").await?).cloned().unwrap();
    assert_eq!(s.started, Some(false), "a container whose startup probe never passed is not started");
    let overdue = eventually("overdue failed", T, || async {
        Ok(pods.get("overdue").await?.status.filter(|s| s.phase.as_deref() == Some("Failed")))
    })
    .await?;
    assert_eq!(overdue.reason.as_deref(), Some("DeadlineExceeded"));
    assert!(dir.path().join("overdue.sigterm").exists(), "a pod past its deadline is stopped with SIGTERM first");
    let healthy = container_status(&pods.get("healthy").await?).cloned().unwrap();
    assert!(healthy.ready && healthy.started == Some(true), "{healthy:?}");
    assert_eq!(healthy.restart_count, 0, "passing probes restarted the container");
    let ready = eventually("exec-ready ready", T, || async {
        Ok(container_status(&pods.get("exec-ready").await?).filter(|s| s.ready).cloned())
    })
    .await?;
    assert_eq!(ready.restart_count, 0, "a passing exec liveness probe restarted the container");
    Ok(())
}
