//! The console API's routes. Every pipeline route authenticates the caller
//! (see [`super::auth`]), authorizes them twice with their own RBAC (`get`
//! on the StreamConsumerGroup, and the console verb on the subresource), then
//! reads or acts through one shared Redis connection per endpoint.

use super::auth::{Access, Caller, FrontProxy, allowed};
use super::letters::{Action, Letters, Refusal, VIEW_SCAN_LIMIT};
use super::tls::Peer;
use super::wire::{
    ActionRequest, ActionResult, FilterSpec, GROUP, Letter, LetterList, LetterStats, PendingList, PendingQuery,
    ShardList, Suspension, VERSION,
};
use crate::events::{EventPublisher, EventType};
use axum::extract::{ConnectInfo, Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use kube::{Api, Client, Resource as _, ResourceExt as _};
use serde::Deserialize;
use serde_json::json;
use std::sync::Arc;
use streamfleet_crd::StreamConsumerGroup;
use streamfleet_streams::Connections;

pub struct Console {
    pub client: Client,
    pub overview: super::overview::Overview,
    pub front_proxy: FrontProxy,
    pub connections: Connections,
    pub events: EventPublisher,
}

pub fn router(console: Arc<Console>) -> Router {
    let base = format!("/apis/{GROUP}/{VERSION}");
    let pipeline = format!("{base}/namespaces/{{namespace}}/pipelines/{{name}}");
    Router::new()
        .route("/apis", get(group_list))
        .route(&format!("/apis/{GROUP}"), get(group))
        .route(&base, get(resources))
        .route(&format!("{base}/namespaces/{{namespace}}/pipelines"), get(pipelines))
        .route(&format!("{pipeline}/deadletters"), get(list_letters))
        .route(&format!("{pipeline}/deadletters/{{id}}"), get(show_letter))
        .route(&format!("{pipeline}/payloads/{{id}}"), get(show_payload))
        .route(&format!("{pipeline}/deadletterstats"), get(letter_stats))
        .route(&format!("{pipeline}/pending"), get(list_pending))
        .route(&format!("{pipeline}/shards"), get(list_shards))
        .route(&format!("{pipeline}/replay"), post(|s, p, h, path, body| act(s, p, h, path, body, Action::Replay)))
        .route(&format!("{pipeline}/purge"), post(|s, p, h, path, body| act(s, p, h, path, body, Action::Purge)))
        .route(&format!("{pipeline}/pause"), post(|s, p, h, path, body| suspend(s, p, h, path, body, true)))
        .route(&format!("{pipeline}/resume"), post(|s, p, h, path, body| suspend(s, p, h, path, body, false)))
        .layer(axum::middleware::from_fn_with_state(console.clone(), request_log))
        .with_state(console)
}

/// The parameters the console takes, which alone are logged by name.
const QUERY_NAMES: [&str; 12] = [
    "reason",
    "since",
    "until",
    "key",
    "error",
    "from",
    "to",
    "limit",
    "continue",
    "consumer",
    "minIdleMs",
    "pipeline",
];

/// A query's known parameter names, and how many parts it has besides
/// (never their text: a malformed or unknown part can be a value).
fn query_names(query: &str) -> String {
    let parts: Vec<&str> = query.split('&').filter(|p| !p.is_empty()).collect();
    let known: Vec<&str> = parts
        .iter()
        .filter_map(|p| p.split_once('=').map(|(name, _)| name))
        .filter(|name| QUERY_NAMES.contains(name))
        .collect();
    match parts.len() - known.len() {
        0 => known.join(","),
        other => format!("{} (+{other} other)", known.join(",")),
    }
}

/// One log line per request: who (when the API server vouched for them),
/// what, the answer and how long it took. Never a body, and of the query
/// only its parameter names: a filter's values (a business key, an error
/// text) and a letter's payload can be personal data.
async fn request_log(
    State(console): State<Arc<Console>>,
    ConnectInfo(peer): ConnectInfo<Peer>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let started = std::time::Instant::now();
    let user = console.front_proxy.caller(&peer, request.headers()).map(|c| c.user);
    let method = request.method().clone();
    let path = request.uri().path().to_string();
    let query = query_names(request.uri().query().unwrap_or_default());
    let response = next.run(request).await;
    tracing::info!(
        user = user.as_deref().unwrap_or("-"),
        %method,
        path,
        query,
        status = response.status().as_u16(),
        ms = streamfleet_streams::millis(started.elapsed()),
        "request"
    );
    response
}

/// An error as the API server reports one (a `Status`), so `kubectl get
/// --raw` and the CLI show its message.
#[derive(Debug)]
pub struct ApiError {
    code: StatusCode,
    reason: &'static str,
    message: String,
}

impl ApiError {
    fn new(code: StatusCode, reason: &'static str, message: impl Into<String>) -> Self {
        Self { code, reason, message: message.into() }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = json!({
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": self.message, "reason": self.reason, "code": self.code.as_u16(),
        });
        (self.code, Json(body)).into_response()
    }
}

/// Anything unexpected: logged in full here, said briefly to the caller
/// (an error from Redis or a Secret can name what the caller must not see).
fn internal(what: &str, e: &anyhow::Error) -> ApiError {
    tracing::warn!(error = format!("{e:#}"), "{what}");
    ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "ServiceUnavailable",
        format!("{what} failed; the console's log says why"),
    )
}

fn refused(e: anyhow::Error) -> ApiError {
    match e.downcast_ref::<Refusal>() {
        Some(r @ Refusal::OverCap { .. }) => ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, "Invalid", r.to_string()),
        Some(r) => ApiError::new(StatusCode::BAD_REQUEST, "BadRequest", r.to_string()),
        None => internal("reading the dead letters", &e),
    }
}

const SCG: Access =
    Access { verb: "get", group: "streamfleet.io", resource: "streamconsumergroups", subresource: None };
const LIST_SCG: Access =
    Access { verb: "list", group: "streamfleet.io", resource: "streamconsumergroups", subresource: None };
const LIST_PIPELINES: Access = Access { verb: "list", group: GROUP, resource: "pipelines", subresource: None };
/// Pausing changes the resource's spec: the user must be allowed to.
const PATCH_SCG: Access =
    Access { verb: "patch", group: "streamfleet.io", resource: "streamconsumergroups", subresource: None };

const fn console_access(verb: &'static str, subresource: &'static str) -> Access {
    Access { verb, group: GROUP, resource: "pipelines", subresource: Some(subresource) }
}

struct Opened {
    caller: Caller,
    scg: StreamConsumerGroup,
    target: super::pipeline::Target,
    letters: Letters,
}

impl Console {
    /// The caller the API server vouches for, or 401.
    fn authenticate(&self, peer: &Peer, headers: &HeaderMap) -> Result<Caller, ApiError> {
        self.front_proxy.caller(peer, headers).ok_or_else(|| {
            ApiError::new(
                StatusCode::UNAUTHORIZED,
                "Unauthorized",
                "reach the console through the Kubernetes API server (kubectl get --raw, kubectl proxy)",
            )
        })
    }

    /// Whether the caller may do every one of `checks` in `namespace` (on
    /// `name`, or on every object without one), each asked of the API
    /// server; 403 naming the first refused.
    async fn authorize(
        &self,
        caller: &Caller,
        namespace: &str,
        name: Option<&str>,
        checks: &[&Access],
    ) -> Result<(), ApiError> {
        let asked = checks.iter().map(|access| allowed(&self.client, caller, access, namespace, name));
        let answers = futures::future::join_all(asked).await;
        for (answer, wanted) in answers.into_iter().zip(checks) {
            let (ok, why) = answer.map_err(|e| internal("authorizing the request", &e))?;
            if !ok {
                let resource = match wanted.subresource {
                    Some(sub) => format!("{}/{sub}", wanted.resource),
                    None => wanted.resource.to_string(),
                };
                let why = if why.is_empty() { String::new() } else { format!(": {why}") };
                return Err(ApiError::new(
                    StatusCode::FORBIDDEN,
                    "Forbidden",
                    format!(
                        "User {:?} cannot {} resource {resource:?} in API group {:?} in the namespace {namespace:?}{why}",
                        caller.user, wanted.verb, wanted.group
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Authenticates and authorizes the caller for `access` on the
    /// pipeline, then connects to its Redis.
    async fn open(
        &self,
        peer: &Peer,
        headers: &HeaderMap,
        namespace: &str,
        name: &str,
        access: Access,
    ) -> Result<Opened, ApiError> {
        let caller = self.authenticate(peer, headers)?;
        self.authorize(&caller, namespace, Some(name), &[&SCG, &access]).await?;
        let scg = Api::<StreamConsumerGroup>::namespaced(self.client.clone(), namespace)
            .get_opt(name)
            .await
            .map_err(|e| internal("reading the StreamConsumerGroup", &e.into()))?
            .ok_or_else(|| {
                ApiError::new(
                    StatusCode::NOT_FOUND,
                    "NotFound",
                    format!("streamconsumergroups.streamfleet.io {name:?} not found in {namespace:?}"),
                )
            })?;
        let target = super::pipeline::redis_of(&self.client, &scg).await.map_err(|e| {
            ApiError::new(StatusCode::CONFLICT, "Conflict", format!("{namespace}/{name} cannot be read: {e}"))
        })?;
        let conn = self
            .connections
            .get(&target.endpoint)
            .await
            .map_err(|e| internal("connecting to the pipeline's Redis", &e.into()))?;
        let letters = Letters { conn, streams: target.dead_letter_streams() };
        Ok(Opened { caller, scg, target, letters })
    }
}

async fn group_list() -> Json<serde_json::Value> {
    Json(json!({"kind": "APIGroupList", "apiVersion": "v1", "groups": [group_json()]}))
}

async fn group() -> Json<serde_json::Value> {
    Json(group_json())
}

fn group_json() -> serde_json::Value {
    let version = json!({"groupVersion": format!("{GROUP}/{VERSION}"), "version": VERSION});
    json!({"kind": "APIGroup", "apiVersion": "v1", "name": GROUP, "versions": [version], "preferredVersion": version})
}

/// Discovery: what RBAC rules name (`pipelines/<subresource>` with `get`
/// or `create`).
async fn resources() -> Json<serde_json::Value> {
    let resource = |name: &str, kind: &str, verbs: &[&str]| json!({"name": name, "singularName": "", "namespaced": true, "kind": kind, "verbs": verbs});
    Json(json!({
        "kind": "APIResourceList", "apiVersion": "v1", "groupVersion": format!("{GROUP}/{VERSION}"),
        "resources": [
            resource("pipelines", "Pipeline", &["list"]),
            resource("pipelines/deadletters", "DeadLetterList", &["get"]),
            resource("pipelines/payloads", "DeadLetter", &["get"]),
            resource("pipelines/deadletterstats", "DeadLetterStats", &["get"]),
            resource("pipelines/pending", "PendingList", &["get"]),
            resource("pipelines/shards", "ShardList", &["get"]),
            resource("pipelines/replay", "DeadLetterAction", &["create"]),
            resource("pipelines/purge", "DeadLetterAction", &["create"]),
            resource("pipelines/pause", "PipelineAction", &["create"]),
            resource("pipelines/resume", "PipelineAction", &["create"]),
        ],
    }))
}

/// The web console (a browser asking for HTML), or the namespace's
/// pipelines with their figures and history (JSON): from the watch, no
/// Redis read.
async fn pipelines(
    State(console): State<Arc<Console>>,
    ConnectInfo(peer): ConnectInfo<Peer>,
    headers: HeaderMap,
    Path(namespace): Path<String>,
) -> Result<Response, ApiError> {
    let caller = console.authenticate(&peer, &headers)?;
    let wants_html = headers.get(axum::http::header::ACCEPT).and_then(|a| a.to_str().ok()).is_some_and(|a| {
        a.split(',').next().is_some_and(|first| first.trim().to_ascii_lowercase().starts_with("text/html"))
    });
    if wants_html {
        return Ok(super::ui::page());
    }
    console.authorize(&caller, &namespace, None, &[&LIST_SCG, &LIST_PIPELINES]).await?;
    if !console.overview.synced().await {
        return Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "ServiceUnavailable",
            "the console has not listed the pipelines yet (starting, or it may not list StreamConsumerGroups: see its log)",
        ));
    }
    let list = console.overview.list(&namespace, k8s_openapi::jiff::Timestamp::now());
    // One URL, two representations: caches must tell them apart.
    let headers = [(axum::http::header::VARY, "Accept"), (axum::http::header::CACHE_CONTROL, "no-store")];
    Ok((headers, Json(list)).into_response())
}

#[derive(Deserialize)]
struct ListQuery {
    #[serde(flatten)]
    filter: FilterSpec,
    limit: Option<usize>,
    #[serde(rename = "continue")]
    continue_: Option<String>,
}

fn bad_filter(e: anyhow::Error) -> ApiError {
    ApiError::new(StatusCode::BAD_REQUEST, "BadRequest", format!("{e:#}"))
}

async fn list_letters(
    State(console): State<Arc<Console>>,
    ConnectInfo(peer): ConnectInfo<Peer>,
    headers: HeaderMap,
    Path((namespace, name)): Path<(String, String)>,
    Query(query): Query<ListQuery>,
) -> Result<Json<LetterList>, ApiError> {
    let filter = query.filter.filter().map_err(bad_filter)?;
    let access = console_access("get", "deadletters");
    let mut opened = console.open(&peer, &headers, &namespace, &name, access).await?;
    let limit = query.limit.unwrap_or(50).clamp(1, 500);
    let list = opened.letters.list(&filter, query.continue_.as_deref(), limit, VIEW_SCAN_LIMIT).await;
    list.map(Json).map_err(refused)
}

async fn show_letter(
    State(console): State<Arc<Console>>,
    ConnectInfo(peer): ConnectInfo<Peer>,
    headers: HeaderMap,
    Path((namespace, name, id)): Path<(String, String, String)>,
) -> Result<Json<Letter>, ApiError> {
    one_letter(&console, &peer, &headers, &namespace, &name, &id, false).await
}

/// One letter with its payload: the original fields may carry personal
/// data, so reading them is a right of its own (`pipelines/payloads`),
/// which the ready-made `view` role does not have.
async fn show_payload(
    State(console): State<Arc<Console>>,
    ConnectInfo(peer): ConnectInfo<Peer>,
    headers: HeaderMap,
    Path((namespace, name, id)): Path<(String, String, String)>,
) -> Result<Json<Letter>, ApiError> {
    one_letter(&console, &peer, &headers, &namespace, &name, &id, true).await
}

async fn one_letter(
    console: &Console,
    peer: &Peer,
    headers: &HeaderMap,
    namespace: &str,
    name: &str,
    id: &str,
    with_payload: bool,
) -> Result<Json<Letter>, ApiError> {
    let access = console_access("get", if with_payload { "payloads" } else { "deadletters" });
    let mut opened = console.open(peer, headers, namespace, name, access).await?;
    let letter = opened.letters.show(id, with_payload).await.map_err(refused)?;
    letter.map(Json).ok_or_else(|| {
        ApiError::new(StatusCode::NOT_FOUND, "NotFound", format!("no dead letter {id:?} in {namespace}/{name}"))
    })
}

async fn letter_stats(
    State(console): State<Arc<Console>>,
    ConnectInfo(peer): ConnectInfo<Peer>,
    headers: HeaderMap,
    Path((namespace, name)): Path<(String, String)>,
    Query(filter): Query<FilterSpec>,
) -> Result<Json<LetterStats>, ApiError> {
    let filter = filter.filter().map_err(bad_filter)?;
    let access = console_access("get", "deadletterstats");
    let mut opened = console.open(&peer, &headers, &namespace, &name, access).await?;
    opened.letters.stats(&filter, VIEW_SCAN_LIMIT).await.map(Json).map_err(refused)
}

async fn list_pending(
    State(console): State<Arc<Console>>,
    ConnectInfo(peer): ConnectInfo<Peer>,
    headers: HeaderMap,
    Path((namespace, name)): Path<(String, String)>,
    Query(query): Query<PendingQuery>,
) -> Result<Json<PendingList>, ApiError> {
    let mut opened = console.open(&peer, &headers, &namespace, &name, console_access("get", "pending")).await?;
    let spec = &opened.target.spec;
    let page = super::in_flight::page(&mut opened.letters.conn, &spec.streams, &spec.group, &query).await;
    page.map(Json).map_err(|e| internal("reading the pending entries", &e))
}

/// Each shard with its consumers and the entries waiting for a retry.
async fn list_shards(
    State(console): State<Arc<Console>>,
    ConnectInfo(peer): ConnectInfo<Peer>,
    headers: HeaderMap,
    Path((namespace, name)): Path<(String, String)>,
) -> Result<Json<ShardList>, ApiError> {
    let mut opened = console.open(&peer, &headers, &namespace, &name, console_access("get", "shards")).await?;
    let shards = super::shards::list(&mut opened.letters.conn, &opened.target.spec).await;
    shards.map(Json).map_err(|e| internal("reading the shards", &e))
}

/// Sets `spec.suspend` (no workers, no recovery runs; the group and its
/// entries stay). The user needs the console verb and `patch` on the
/// resource; the console writes the field under its own field manager and
/// records an Event naming the user. A JSON body (`{}`) is required, as for
/// every action (CSRF).
async fn suspend(
    State(console): State<Arc<Console>>,
    ConnectInfo(peer): ConnectInfo<Peer>,
    headers: HeaderMap,
    Path((namespace, name)): Path<(String, String)>,
    Json(body): Json<serde_json::Value>,
    to: bool,
) -> Result<Json<Suspension>, ApiError> {
    if body.as_object().is_none_or(|o| !o.is_empty()) {
        return Err(ApiError::new(StatusCode::BAD_REQUEST, "BadRequest", "the body is an empty JSON object: {}"));
    }
    let (verb, word, reason) =
        if to { ("pause", "paused", "PipelinePaused") } else { ("resume", "resumed", "PipelineResumed") };
    let caller = console.authenticate(&peer, &headers)?;
    console.authorize(&caller, &namespace, Some(&name), &[&SCG, &PATCH_SCG, &console_access("create", verb)]).await?;
    let api = Api::<StreamConsumerGroup>::namespaced(console.client.clone(), &namespace);
    let scg =
        api.get_opt(&name).await.map_err(|e| internal("reading the StreamConsumerGroup", &e.into()))?.ok_or_else(
            || {
                ApiError::new(
                    StatusCode::NOT_FOUND,
                    "NotFound",
                    format!("streamconsumergroups.streamfleet.io {name:?} not found in {namespace:?}"),
                )
            },
        )?;
    if scg.spec.suspend == to {
        return Ok(Json(Suspension { suspended: to, changed: false }));
    }
    let patch = serde_json::json!({"spec": {"suspend": to}});
    let params = kube::api::PatchParams { field_manager: Some("streamfleet-console".into()), ..Default::default() };
    api.patch(&name, &params, &kube::api::Patch::Merge(&patch))
        .await
        .map_err(|e| internal(&format!("setting spec.suspend to {to}"), &e.into()))?;
    let note = format!("{} {word} the pipeline through the console", caller.user);
    if let Err(e) = console.events.publish(&scg.object_ref(&()), EventType::Normal, reason, verb, &note).await {
        tracing::warn!(error = %e, "recording the action as an Event");
    }
    tracing::info!(user = %caller.user, pipeline = %format!("{namespace}/{name}"), action = verb, "pipeline action");
    Ok(Json(Suspension { suspended: to, changed: true }))
}

/// A replay or purge. The body must be JSON (a browser cannot send that
/// cross-site without a CORS preflight, which nothing here answers: the
/// CSRF guard). The action runs to its end even if the caller goes away,
/// and is recorded as an Event naming the user, also when it fails part way.
async fn act(
    State(console): State<Arc<Console>>,
    ConnectInfo(peer): ConnectInfo<Peer>,
    headers: HeaderMap,
    Path((namespace, name)): Path<(String, String)>,
    Json(body): Json<serde_json::Value>,
    action: Action,
) -> Result<Json<ActionResult>, ApiError> {
    let request =
        ActionRequest::from_json(body).map_err(|e| ApiError::new(StatusCode::BAD_REQUEST, "BadRequest", e))?;
    let subresource = match action {
        Action::Replay => "replay",
        Action::Purge => "purge",
    };
    let opened = console.open(&peer, &headers, &namespace, &name, console_access("create", subresource)).await?;
    let task = tokio::spawn(run_action(console.clone(), opened, action, request));
    task.await.map_err(|e| internal("the action", &anyhow::anyhow!("{e}")))?.map(Json)
}

async fn run_action(
    console: Arc<Console>,
    mut opened: Opened,
    action: Action,
    request: ActionRequest,
) -> Result<ActionResult, ApiError> {
    let (subresource, done_word, reason) = match action {
        Action::Replay => ("replay", "replayed", "DeadLettersReplayed"),
        Action::Purge => ("purge", "purged", "DeadLettersPurged"),
    };
    let user = opened.caller.user.clone();
    let outcome = opened.letters.act(action, &request).await;
    let (result, failure) = match outcome {
        Ok(result) => (result, None),
        // Refused before anything was done: the caller's to fix, no record.
        Err(interrupted) if interrupted.error.downcast_ref::<Refusal>().is_some() => {
            return Err(refused(interrupted.error));
        }
        Err(interrupted) => (interrupted.result, Some(interrupted.error)),
    };
    tracing::info!(
        %user, pipeline = %format!("{}/{}", opened.scg.namespace().unwrap_or_default(), opened.scg.name_any()),
        action = subresource, dry_run = request.dry_run, matched = result.matched, done = result.done,
        failed = failure.is_some(), "dead-letter action"
    );
    if !request.dry_run {
        let (type_, note) = match &failure {
            None => (
                EventType::Normal,
                format!(
                    "{user} {done_word} {} of {} dead letters chosen through the console",
                    result.done, result.matched
                ),
            ),
            Some(_) => (
                EventType::Warning,
                format!(
                    "{user}'s {subresource} through the console stopped on an error after {} of {} dead letters",
                    result.done, result.matched
                ),
            ),
        };
        let regarding = opened.scg.object_ref(&());
        if let Err(e) = console.events.publish(&regarding, type_, reason, subresource, &note).await {
            tracing::warn!(error = %e, "recording the action as an Event");
        }
    }
    match failure {
        None => Ok(result),
        Some(e) => Err(internal(&format!("the {subresource} (after {} done)", result.done), &e)),
    }
}

#[cfg(test)]
mod tests {
    use super::query_names;

    #[test]
    fn the_request_log_names_known_parameters_and_never_a_value() {
        assert_eq!(query_names("reason=permanent&error=card%20declined&limit=50"), "reason,error,limit");
        assert_eq!(query_names(""), "");
        // A bare word, an encoded '=', an unknown name: counted, not shown.
        assert_eq!(query_names("o-42&error%3Dcard=x&reason=a&secret=1"), "reason (+3 other)");
    }
}
