//! The reconciler's API steps against a mocked API server (tower-test, as
//! kube-rs's controller-rs tests its reconciler): which requests a step
//! sends, to where, with what body, and which it does not send at all — in
//! milliseconds, with no control plane. The same behaviour against a real
//! kube-apiserver is in `tests/e2e`; these pin the requests themselves.

use super::act::publish;
use super::decide::PlannedEvent;
use super::fixtures::scg;
use super::{Context, finalizer, status};
use crate::events::EventType;
use http::{Method, Request, Response};
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::Client;
use kube::client::Body;
use serde_json::{Value, json};
use std::time::Duration;
use streamfleet_crd::{DeletionPolicy, StreamConsumerGroup, StreamConsumerGroupStatus};
use tower_test::mock::{Handle, pair};

type ApiServer = Handle<Request<Body>, Response<Body>>;

fn mocked() -> (Context, ApiServer) {
    let (service, server) = pair::<Request<Body>, Response<Body>>();
    (Context::for_tests(Client::new(service, "default")), server)
}

/// One request as the API server saw it.
#[derive(Debug)]
struct Seen {
    method: Method,
    path: String,
    query: String,
    content_type: String,
    body: Value,
}

/// Serves the next request, answering `reply` (200).
async fn serve(server: &mut ApiServer, reply: &Value) -> Seen {
    let (request, respond) = server.next_request().await.expect("a request");
    let content_type =
        request.headers().get(http::header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or_default().to_string();
    let (method, uri) = (request.method().clone(), request.uri().clone());
    let bytes = request.into_body().collect_bytes().await.expect("the request's body");
    let body = if bytes.is_empty() { Value::Null } else { serde_json::from_slice(&bytes).expect("a JSON body") };
    let reply = serde_json::to_vec(reply).expect("a JSON reply");
    respond.send_response(Response::builder().body(Body::from(reply)).expect("a response"));
    Seen {
        method,
        path: uri.path().to_string(),
        query: uri.query().unwrap_or_default().to_string(),
        content_type,
        body,
    }
}

/// Nothing (more) reaches the API server for a while: run beside the steps
/// that must send nothing, so a request fails the test rather than hang it.
async fn no_request(server: &mut ApiServer) {
    let next = tokio::time::timeout(Duration::from_millis(200), server.next_request()).await;
    assert!(!matches!(next, Ok(Some(_))), "an API request where none was due");
}

const RESOURCE: &str = "/apis/streamfleet.io/v1alpha1/namespaces/shop/streamconsumergroups/orders";

fn resource(policy: DeletionPolicy, finalizers: &[&str]) -> StreamConsumerGroup {
    let mut r = scg();
    r.spec.deletion_policy = policy;
    r.metadata.resource_version = Some("7".into());
    r.metadata.finalizers = Some(finalizers.iter().map(|f| f.to_string()).collect());
    r
}

fn writes(ctx: &Context, manager: &str) -> usize {
    let wanted = format!("streamfleet_api_writes_total{{manager=\"{manager}\"}} ");
    ctx.metrics.render().lines().find_map(|l| l.strip_prefix(&wanted)?.parse().ok()).unwrap_or(0)
}

#[tokio::test]
async fn the_finalizer_is_added_by_a_compare_and_swap_when_the_policy_is_delete() {
    let (ctx, mut server) = mocked();
    let r = resource(DeletionPolicy::Delete, &["other.io/keep"]);
    let reply = serde_json::to_value(&r).unwrap();
    let (synced, seen) = tokio::join!(finalizer::sync(&r, &ctx), serve(&mut server, &reply));
    synced.unwrap();
    assert_eq!((&seen.method, seen.path.as_str()), (&Method::PATCH, RESOURCE));
    assert_eq!(seen.content_type, "application/merge-patch+json");
    // Another controller's finalizer is kept; the resourceVersion makes a
    // concurrent edit a conflict rather than a lost update.
    assert_eq!(
        seen.body,
        json!({"metadata": {"finalizers": ["other.io/keep", finalizer::FINALIZER], "resourceVersion": "7"}})
    );
    assert_eq!(writes(&ctx, "finalizer"), 1);
    no_request(&mut server).await;
}

#[tokio::test]
async fn the_finalizer_is_removed_alone_when_the_policy_is_retain() {
    let (ctx, mut server) = mocked();
    let r = resource(DeletionPolicy::Retain, &[finalizer::FINALIZER, "other.io/keep"]);
    let reply = serde_json::to_value(&r).unwrap();
    let (synced, seen) = tokio::join!(finalizer::sync(&r, &ctx), serve(&mut server, &reply));
    synced.unwrap();
    assert_eq!((&seen.method, seen.path.as_str()), (&Method::PATCH, RESOURCE));
    assert_eq!(seen.body, json!({"metadata": {"finalizers": ["other.io/keep"], "resourceVersion": "7"}}));
}

#[tokio::test]
async fn a_finalizer_already_as_the_policy_wants_costs_no_request() {
    let (ctx, mut server) = mocked();
    let (has, hasnt) =
        (resource(DeletionPolicy::Delete, &[finalizer::FINALIZER]), resource(DeletionPolicy::Retain, &[]));
    let (synced, ()) = tokio::join!(
        async { (finalizer::sync(&has, &ctx).await, finalizer::sync(&hasnt, &ctx).await) },
        no_request(&mut server)
    );
    synced.0.unwrap();
    synced.1.unwrap();
    assert_eq!(writes(&ctx, "finalizer"), 0);
}

fn status_with_lag(lag: i64) -> StreamConsumerGroupStatus {
    serde_json::from_value(json!({"lag": lag, "pending": 2})).unwrap()
}

#[tokio::test]
async fn a_changed_status_is_applied_once_by_its_own_field_manager() {
    let (ctx, mut server) = mocked();
    let r = resource(DeletionPolicy::Retain, &[]);
    let new = status_with_lag(5);
    let mut reply = r.clone();
    reply.status = Some(new.clone());
    let reply = serde_json::to_value(&reply).unwrap();
    let (written, seen) = tokio::join!(status::write(&ctx, &r, new.clone()), serve(&mut server, &reply));
    written.unwrap();
    assert_eq!((&seen.method, seen.path.as_str()), (&Method::PATCH, format!("{RESOURCE}/status").as_str()));
    assert_eq!(seen.content_type, "application/apply-patch+yaml");
    assert!(
        seen.query.contains("fieldManager=streamfleet-status")
            && seen.query.contains("force=true")
            && seen.query.contains("fieldValidation=Ignore"),
        "{seen:?}"
    );
    assert_eq!(
        seen.body,
        json!({"apiVersion": "streamfleet.io/v1alpha1", "kind": "StreamConsumerGroup", "status": {"lag": 5, "pending": 2}})
    );
    assert_eq!(writes(&ctx, "streamfleet-status"), 1);
    // The next pass comes before the watch shows the write (same cached
    // resourceVersion): nothing is written again.
    // Once the cache shows it, an unchanged status is not written either.
    let mut seen_by_cache = r.clone();
    seen_by_cache.metadata.resource_version = Some("8".into());
    seen_by_cache.status = Some(new.clone());
    let (written, ()) = tokio::join!(
        async { (status::write(&ctx, &r, new.clone()).await, status::write(&ctx, &seen_by_cache, new).await) },
        no_request(&mut server)
    );
    written.0.unwrap();
    written.1.unwrap();
    assert_eq!(writes(&ctx, "streamfleet-status"), 1);
}

#[tokio::test]
async fn a_pass_before_the_watch_shows_a_write_does_not_restamp_its_conditions() {
    // Under load the next pass (an owned object's event) comes a second
    // later, still on the cached resource without the write: its conditions
    // get new transition times, and nothing else is new.
    let (ctx, mut server) = mocked();
    let r = resource(DeletionPolicy::Retain, &[]);
    let stamped = |second: i64| {
        let mut status = status_with_lag(0);
        let at = k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
            k8s_openapi::jiff::Timestamp::from_second(second).unwrap(),
        );
        crate::conditions::set(&mut status.conditions, "Ready", true, "Reconciled", "ready", Some(1), &at);
        status
    };
    let mut reply = r.clone();
    reply.status = Some(stamped(10));
    let reply = serde_json::to_value(&reply).unwrap();
    let (written, _) = tokio::join!(status::write(&ctx, &r, stamped(10)), serve(&mut server, &reply));
    written.unwrap();
    let (written, ()) = tokio::join!(status::write(&ctx, &r, stamped(11)), no_request(&mut server));
    written.unwrap();
    assert_eq!(writes(&ctx, "streamfleet-status"), 1);
    // A changed condition is news, whatever its time.
    let mut changed = stamped(11);
    changed.conditions[0].message = "ready again".into();
    let (written, seen) = tokio::join!(status::write(&ctx, &r, changed), serve(&mut server, &reply));
    written.unwrap();
    assert_eq!(seen.method, Method::PATCH);
    assert_eq!(writes(&ctx, "streamfleet-status"), 2);
}

#[tokio::test]
async fn a_repeated_event_is_one_event_with_a_series_and_a_new_note_a_new_event() {
    let (ctx, mut server) = mocked();
    let r = resource(DeletionPolicy::Retain, &[]);
    let event = |note: &str| PlannedEvent {
        type_: EventType::Warning,
        reason: "PayloadLost",
        action: "Reconcile",
        note: note.to_string(),
    };
    let created = serde_json::to_value(Event {
        metadata: ObjectMeta { name: Some("orders.1".into()), namespace: Some("shop".into()), ..ObjectMeta::default() },
        ..Event::default()
    })
    .unwrap();
    let planned = event("2 payloads lost");
    let (_, first) = tokio::join!(publish(&ctx, &r, &planned), serve(&mut server, &created));
    assert_eq!((first.method, first.path.as_str()), (Method::POST, "/apis/events.k8s.io/v1/namespaces/shop/events"));
    assert_eq!(
        (&first.body["type"], &first.body["reason"], &first.body["note"], &first.body["regarding"]["name"]),
        (&json!("Warning"), &json!("PayloadLost"), &json!("2 payloads lost"), &json!("orders"))
    );
    // The same reason and note again: the series of the Event just made.
    let planned = event("2 payloads lost");
    let (_, again) = tokio::join!(publish(&ctx, &r, &planned), serve(&mut server, &created));
    assert_eq!(
        (again.method, again.path.as_str()),
        (Method::PATCH, "/apis/events.k8s.io/v1/namespaces/shop/events/orders.1")
    );
    assert_eq!(again.body["series"]["count"], json!(2));
    // A new note is news: a new Event, not a count on the old one.
    let planned = event("3 payloads lost");
    let (_, news) = tokio::join!(publish(&ctx, &r, &planned), serve(&mut server, &created));
    assert_eq!((news.method, news.body["note"].clone()), (Method::POST, json!("3 payloads lost")));
    no_request(&mut server).await;
}

/// A group that vanished (its stream deleted; the keys beside it stayed) is
/// created again where it was, with one Warning, and without its old
/// entries' records or retry index: an entry delivered again is not judged
/// by a start, a crash count or a business key of its old delivery.
#[tokio::test]
async fn a_vanished_group_is_created_again_without_its_old_entries_records() {
    use redis::AsyncCommands as _;
    let server = streamfleet_testbed::RedisServer::start().await.unwrap();
    let endpoint = streamfleet_streams::Endpoint::new(server.url(), streamfleet_streams::Mode::Standalone);
    let mut conn = streamfleet_streams::StreamConnection::connect(&endpoint).await.unwrap();
    let mut admin = server.connection().await.unwrap();
    let spec = super::validate::validate(&scg()).unwrap();
    let (stream, group) = (spec.stream.clone(), spec.group.clone());
    let records = streamfleet_streams::keys::last_error_key(&stream, &group);
    let recorded = |admin: &mut redis::aio::MultiplexedConnection| {
        let mut admin = admin.clone();
        let records = records.clone();
        async move { admin.hlen::<_, u64>(&records).await.unwrap() }
    };
    streamfleet_streams::ensure_group(&mut admin, &stream, &group, "0").await.unwrap();
    let id: String = admin.xadd(&stream, "5-0", &[("order_id", "o1")]).await.unwrap();
    let opts = redis::streams::StreamReadOptions::default().group(&group, "w1");
    let _: redis::Value = admin.xread_options(&[&stream], &[">"], &opts).await.unwrap();
    let starting = [(id.as_str(), 1, Some("order-1"))];
    streamfleet_streams::started::record_starts(
        &mut admin,
        streamfleet_streams::ConsumerRef::new(&stream, &group, "w1"),
        None,
        &starting,
    )
    .await
    .unwrap();
    assert!(recorded(&mut admin).await > 0);
    let due = streamfleet_streams::keys::retry_due_key(&stream, &group);
    let _: () = admin.zadd(&due, &id, 1).await.unwrap();
    let _: () = admin.del(&stream).await.unwrap();

    let (ctx, mut api) = mocked();
    let event = serde_json::to_value(Event {
        metadata: ObjectMeta { name: Some("orders.1".into()), namespace: Some("shop".into()), ..ObjectMeta::default() },
        ..Event::default()
    })
    .unwrap();
    let r = resource(DeletionPolicy::Retain, &[]);
    let (created, warning) =
        tokio::join!(super::act::create_group(&ctx, &r, &mut conn, &spec, "4-0", true), serve(&mut api, &event));
    created.unwrap();
    assert_eq!((&warning.body["type"], &warning.body["reason"]), (&json!("Warning"), &json!("GroupRecreated")));
    assert_eq!(recorded(&mut admin).await, 0, "the old entries' records are gone with their PEL");
    assert!(!admin.exists::<_, bool>(&due).await.unwrap(), "and so is their retry index");
    let groups: redis::streams::StreamInfoGroupsReply = admin.xinfo_groups(&stream).await.unwrap();
    assert_eq!(groups.groups[0].last_delivered_id, "4-0", "created again where it was");
}

/// The apply step: the pods to go first priced, then the Deployment and the
/// CronJob each applied by its own field manager (server-side apply, forced:
/// the operator owns those fields); a refused CronJob is reported by kind
/// and does not keep the Deployment from being applied.
#[tokio::test]
async fn owned_objects_are_applied_each_by_its_own_field_manager_and_a_refusal_is_named() {
    let (ctx, mut api) = mocked();
    let r = resource(DeletionPolicy::Retain, &[]);
    let spec = super::validate::validate(&scg()).unwrap();
    let owned = super::decide::OwnedObjects {
        deletion_costs: vec![("orders-worker-1".into(), 3)],
        deployment: crate::objects::worker_deployment(&spec, 2).unwrap(),
        cronjob: crate::objects::recovery_cronjob(&spec, &ctx.settings).unwrap(),
    };
    let mut deployment = serde_json::to_value(&owned.deployment).unwrap();
    deployment["status"] = json!({"availableReplicas": 2});
    let server = async {
        let priced =
            serve(&mut api, &json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "orders-worker-1"}})).await;
        let applied = serve(&mut api, &deployment).await;
        // The CronJob is refused.
        let (request, respond) = api.next_request().await.expect("the CronJob's request");
        let path = request.uri().path().to_string();
        let status = json!({"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "Invalid",
                            "message": "CronJob.batch \"orders-recovery\" is invalid", "code": 422});
        respond.send_response(
            Response::builder().status(422).body(Body::from(serde_json::to_vec(&status).unwrap())).unwrap(),
        );
        (priced, applied, path)
    };
    let ((available, refused), (priced, applied, cronjob_path)) =
        tokio::join!(super::act::apply_objects(&ctx, &r, &owned), server);
    assert_eq!((priced.method, priced.path.as_str()), (Method::PATCH, "/api/v1/namespaces/shop/pods/orders-worker-1"));
    assert!(priced.query.contains("fieldManager=streamfleet-pod-deletion-cost"), "{:?}", priced.query);
    assert!(priced.query.contains("fieldValidation=Ignore") && applied.query.contains("fieldValidation=Ignore"));
    assert_eq!(priced.body["metadata"]["annotations"]["controller.kubernetes.io/pod-deletion-cost"], json!("3"));
    assert_eq!(applied.method, Method::PATCH);
    assert!(applied.path.starts_with("/apis/apps/v1/namespaces/shop/deployments/"), "{}", applied.path);
    assert_eq!(applied.content_type, "application/apply-patch+yaml");
    assert!(
        applied.query.contains("fieldManager=streamfleet-worker-deployment") && applied.query.contains("force=true"),
        "{:?}",
        applied.query
    );
    assert_eq!(applied.body["spec"]["replicas"], json!(2));
    assert!(cronjob_path.starts_with("/apis/batch/v1/namespaces/shop/cronjobs/"), "{cronjob_path}");
    assert_eq!(available, 2, "the Deployment's available replicas, as applied");
    assert_eq!(refused.len(), 1);
    assert!(refused[0].to_string().contains("CronJob"), "{}", refused[0]);
    assert_eq!((writes(&ctx, "streamfleet-worker-deployment"), writes(&ctx, "streamfleet-recovery-cronjob")), (1, 0));
    no_request(&mut api).await;
}

/// Under load the watch cache shows an applied object seconds later: the
/// reconcile the Deployment's own event wakes must not apply the CronJob
/// (or the Deployment) again. One the watch saw deleted is applied again,
/// and so is one missing after a relist or for longer than the cache lags.
#[tokio::test]
async fn an_object_applied_a_moment_ago_is_not_applied_again_until_the_watch_sees_it_deleted() {
    use super::act::{MANAGER_CRONJOB, MANAGER_DEPLOYMENT};
    use k8s_openapi::api::apps::v1::Deployment;
    use kube::runtime::watcher::Event as WatchEvent;
    let (ctx, mut api) = mocked();
    let r = resource(DeletionPolicy::Retain, &[]);
    let spec = super::validate::validate(&scg()).unwrap();
    let owned = super::decide::OwnedObjects {
        deletion_costs: Vec::new(),
        deployment: crate::objects::worker_deployment(&spec, 1).unwrap(),
        cronjob: crate::objects::recovery_cronjob(&spec, &ctx.settings).unwrap(),
    };
    let mut deployment = owned.deployment.clone();
    deployment.metadata.uid = Some("d1".into());
    deployment.metadata.namespace = r.metadata.namespace.clone();
    deployment.metadata.owner_references = Some(vec![k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference {
        kind: "StreamConsumerGroup".into(),
        name: r.metadata.name.clone().unwrap(),
        ..Default::default()
    }]);
    let mut reply = serde_json::to_value(&deployment).unwrap();
    reply["status"] = json!({"availableReplicas": 1});
    let cronjob = serde_json::to_value(&owned.cronjob).unwrap();
    let in_time = Duration::from_secs(5);
    let apply = || tokio::time::timeout(in_time, super::act::apply_objects(&ctx, &r, &owned));
    let (applied, (d, c)) =
        tokio::join!(apply(), async { (serve(&mut api, &reply).await, serve(&mut api, &cronjob).await) });
    assert!(applied.unwrap().1.is_empty());
    assert!(d.path.contains("/deployments/") && c.path.contains("/cronjobs/"), "{} {}", d.path, c.path);

    // The caches (empty here) have shown neither yet: nothing is applied,
    // and the Deployment's replicas are the apply's reply's.
    let (applied, ()) = tokio::join!(apply(), no_request(&mut api));
    let (available, refused) = applied.unwrap();
    assert!(refused.is_empty(), "{refused:?}");
    assert_eq!(available, 1, "as the apply's reply said");

    // A late Delete of another (older) Deployment changes nothing.
    let deployments = super::OwnedWatch::new(&ctx.memory, &ctx.relisted, MANAGER_DEPLOYMENT).hook::<Deployment>();
    let mut older = deployment.clone();
    older.metadata.uid = Some("d0".into());
    deployments(&WatchEvent::Delete(older));
    let (applied, ()) = tokio::join!(apply(), no_request(&mut api));
    assert!(applied.unwrap().1.is_empty());

    // The watch sees this Deployment deleted: it is applied again, the CronJob not.
    deployments(&WatchEvent::Delete(deployment.clone()));
    let again = async { serve(&mut api, &reply).await };
    let (applied, again) = tokio::join!(apply(), tokio::time::timeout(in_time, again));
    assert!(applied.unwrap().1.is_empty());
    assert!(again.expect("the Deployment applied again").path.contains("/deployments/"));
    no_request(&mut api).await;

    // A relist ends after the CronJob's apply: its absence is believed.
    let cronjobs = super::OwnedWatch::new(&ctx.memory, &ctx.relisted, MANAGER_CRONJOB);
    cronjobs.hook::<k8s_openapi::api::batch::v1::CronJob>()(&WatchEvent::InitDone);
    let again = async { serve(&mut api, &cronjob).await };
    let (applied, again) = tokio::join!(apply(), tokio::time::timeout(in_time, again));
    assert!(applied.unwrap().1.is_empty());
    assert!(again.expect("the CronJob applied again").path.contains("/cronjobs/"));
    no_request(&mut api).await;

    // Missing for longer than a cache lags: applied again.
    if let Some(applied) =
        ctx.memory.lock().unwrap().get_mut("shop/orders").and_then(|m| m.applied.get_mut(MANAGER_DEPLOYMENT))
    {
        applied.at -= super::CACHE_CATCH_UP;
    }
    let again = async { serve(&mut api, &reply).await };
    let (applied, again) = tokio::join!(apply(), tokio::time::timeout(in_time, again));
    assert!(applied.unwrap().1.is_empty());
    assert!(again.expect("the Deployment applied again").path.contains("/deployments/"));
    no_request(&mut api).await;
    assert_eq!((writes(&ctx, "streamfleet-worker-deployment"), writes(&ctx, "streamfleet-recovery-cronjob")), (3, 2));
}
