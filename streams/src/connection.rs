//! Connections to Redis, standalone or cluster, with timeouts that turn an
//! unreachable server into a prompt error instead of a hang, and a shared
//! cache so every resource that names the same endpoint uses one connection.

use crate::error::StreamError;
use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo};
use redis::{Cmd, ErrorKind, IntoConnectionInfo as _, Pipeline, RedisError, RedisFuture, ServerErrorKind, Value};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Mutex;

const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
const RESPONSE_TIMEOUT: Duration = Duration::from_secs(10);
/// How often a cluster command the server refused unrun is sent again, and
/// the pause before the first resend after a refusal without a redirect
/// (doubling): long enough for a failover to finish or the client to
/// rebuild its slot map.
const CLUSTER_RESENDS: u32 = 4;
const CLUSTER_RESEND_PAUSE: Duration = Duration::from_millis(100);

/// Standalone server or Redis Cluster.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Mode {
    Standalone,
    Cluster,
}

/// Where and how to connect. `url` may carry credentials, `password` and
/// the client key are secrets: none is ever logged.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Endpoint {
    pub url: String,
    pub mode: Mode,
    /// PEM CA bundle for `rediss://` servers signed by a private CA.
    pub ca_pem: Option<Vec<u8>>,
    /// The ACL user, kept apart from the URL (`AUTH <username> <password>`).
    pub username: Option<String>,
    /// The password, kept apart from the URL so that it needs no
    /// percent-encoding. The URL must then carry none of its own.
    pub password: Option<String>,
    /// PEM client certificate and key, for servers that require one.
    pub client_tls: Option<ClientTls>,
}

/// A client certificate and its key, both PEM.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct ClientTls {
    pub cert_pem: Vec<u8>,
    pub key_pem: Vec<u8>,
}

impl Endpoint {
    /// `url` in `mode`, with no credentials or TLS material beside the URL.
    pub fn new(url: impl Into<String>, mode: Mode) -> Self {
        Self { url: url.into(), mode, ca_pem: None, username: None, password: None, client_tls: None }
    }

    /// What redis-rs connects with: the URL, and the credentials kept apart
    /// from it. A password both in the URL and apart is refused: which one
    /// is meant cannot be told.
    fn connection_info(&self) -> Result<redis::ConnectionInfo, RedisError> {
        let info = self.url.as_str().into_connection_info()?;
        let mut settings = info.redis_settings().clone();
        if let Some(password) = &self.password {
            if settings.password().is_some() {
                return Err(RedisError::from((
                    ErrorKind::InvalidClientConfig,
                    "the URL carries a password and a password is given apart from it: keep one",
                )));
            }
            settings = settings.set_password(password);
            if let Some(username) = &self.username {
                settings = settings.set_username(username);
            }
        } else if self.username.is_some() {
            return Err(RedisError::from((ErrorKind::InvalidClientConfig, "a username is given without a password")));
        }
        Ok(info.set_redis_settings(settings))
    }

    /// Whether `self` and `other` name the same server (host, port and
    /// database, in the same mode), whoever authenticates to it and however
    /// the URL is spelt. URLs that do not parse are compared as written.
    pub fn same_server(&self, other: &Endpoint) -> bool {
        let server = |e: &Endpoint| {
            e.url.as_str().into_connection_info().ok().map(|i| (i.addr().to_string(), i.redis_settings().db()))
        };
        self.mode == other.mode
            && match (server(self), server(other)) {
                (Some(a), Some(b)) => a == b,
                _ => self.url == other.url,
            }
    }

    fn certificates(&self) -> Option<redis::TlsCertificates> {
        (self.ca_pem.is_some() || self.client_tls.is_some()).then(|| redis::TlsCertificates {
            client_tls: self
                .client_tls
                .as_ref()
                .map(|c| redis::ClientTlsConfig { client_cert: c.cert_pem.clone(), client_key: c.key_pem.clone() }),
            root_cert: self.ca_pem.clone(),
        })
    }
}

impl std::fmt::Debug for ClientTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClientTls(<pem>)")
    }
}

impl std::fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Endpoint")
            .field("url", &crate::error::redact(&self.url))
            .field("mode", &self.mode)
            .field("ca_pem", &self.ca_pem.as_ref().map(|_| "<pem>"))
            // Like the URL's user: a name from a Secret is not for logs.
            .field("username", &self.username.as_ref().map(|_| "<redacted>"))
            .field("password", &self.password.as_ref().map(|_| "<redacted>"))
            .field("client_tls", &self.client_tls.as_ref().map(|_| "<pem>"))
            .finish()
    }
}

/// A multiplexed, self-reconnecting connection to either kind of endpoint.
/// Cheap to clone; clones share the underlying connection.
#[derive(Clone)]
pub enum StreamConnection {
    Standalone(ConnectionManager),
    Cluster(ClusterConnection),
}

impl StreamConnection {
    /// A new connection for ordinary commands.
    pub async fn connect(endpoint: &Endpoint) -> Result<Self, StreamError> {
        Self::connect_with(endpoint, RESPONSE_TIMEOUT).await
    }

    /// A new connection of its own for `XREADGROUP ... BLOCK block`: its
    /// response timeout outlasts the block, and blocking on it never delays
    /// the acks and claims that go over the ordinary connection.
    pub async fn connect_blocking(endpoint: &Endpoint, block: Duration) -> Result<Self, StreamError> {
        Self::connect_with(endpoint, block + RESPONSE_TIMEOUT).await
    }

    async fn connect_with(endpoint: &Endpoint, response_timeout: Duration) -> Result<Self, StreamError> {
        let err = |e| StreamError::new("connecting to Redis", e);
        let info = endpoint.connection_info().map_err(err)?;
        match endpoint.mode {
            Mode::Standalone => {
                let client = match endpoint.certificates() {
                    Some(certs) => redis::Client::build_with_tls(info, certs),
                    None => redis::Client::open(info),
                }
                .map_err(err)?;
                let config = ConnectionManagerConfig::new()
                    .set_connection_timeout(Some(CONNECT_TIMEOUT))
                    .set_response_timeout(Some(response_timeout))
                    .set_number_of_retries(2);
                let manager =
                    tokio::time::timeout(CONNECT_TIMEOUT * 3, ConnectionManager::new_with_config(client, config))
                        .await
                        .map_err(|_| err(timeout_error()))?
                        .map_err(err)?;
                Ok(Self::Standalone(manager))
            }
            Mode::Cluster => {
                // No retries by the client: it re-sends after a dropped
                // connection or a timeout too, when the command may have
                // run, and a read, a claim or a fence counter run twice is
                // not the same as once. [`refused_unrun`] says what is
                // sent again, and how (`cluster_command`).
                let mut builder = redis::cluster::ClusterClientBuilder::new(vec![info])
                    .connection_timeout(CONNECT_TIMEOUT)
                    .response_timeout(response_timeout)
                    .retries(0);
                if let Some(certs) = endpoint.certificates() {
                    builder = builder.certs(certs);
                }
                let client = builder.build().map_err(err)?;
                let conn = tokio::time::timeout(CONNECT_TIMEOUT * 3, client.get_async_connection())
                    .await
                    .map_err(|_| err(timeout_error()))?
                    .map_err(err)?;
                Ok(Self::Cluster(conn))
            }
        }
    }
}

fn timeout_error() -> redis::RedisError {
    redis::RedisError::from(std::io::Error::new(std::io::ErrorKind::TimedOut, "connection timed out"))
}

/// What to do with a cluster command the server (or the cluster client,
/// before sending) refused without running it.
#[derive(Debug, PartialEq, Eq)]
pub enum Refused {
    /// `MOVED`: send it to the slot's master the server named.
    MovedTo { host: String, port: u16 },
    /// `ASK`: the slot is migrating and the key is not here: send it to
    /// the node named, preceded by `ASKING`.
    AskAt { host: String, port: u16 },
    /// `TRYAGAIN`, `CLUSTERDOWN`, `MASTERDOWN`, `LOADING`, `READONLY` (a
    /// demoted master), or no connection to the slot's node: send it again
    /// after a pause, by the slot map the client rebuilds meanwhile.
    Again,
}

/// Whether and how `e`'s command is sent again: only when the cluster
/// refused it unrun. A dropped connection or a timeout is never re-sent: the
/// command may have run, and a read, a claim or a counter run twice is not
/// the same as once.
pub fn refused_unrun(e: &RedisError) -> Option<Refused> {
    let redirect = || {
        let (addr, _slot) = e.redirect_node()?;
        let (host, port) = addr.rsplit_once(':')?;
        Some((host.trim_matches(['[', ']']).to_string(), port.parse().ok()?))
    };
    match e.kind() {
        ErrorKind::Server(ServerErrorKind::Moved) => redirect().map(|(host, port)| Refused::MovedTo { host, port }),
        ErrorKind::Server(ServerErrorKind::Ask) => redirect().map(|(host, port)| Refused::AskAt { host, port }),
        ErrorKind::Server(
            ServerErrorKind::TryAgain
            | ServerErrorKind::ClusterDown
            | ServerErrorKind::MasterDown
            | ServerErrorKind::BusyLoading
            | ServerErrorKind::ReadOnly,
        )
        | ErrorKind::ClusterConnectionNotFound => Some(Refused::Again),
        _ => None,
    }
}

fn to_node(host: String, port: u16) -> SingleNodeRoutingInfo {
    SingleNodeRoutingInfo::ByAddress { host, port }
}

/// `ASKING` on the connection to the node an `ASK` named, as the cluster
/// client does it: the next command there (ours, or `MULTI` and the
/// transaction it opens) may then use the importing slot. Its own refusal
/// (an ACL without `+asking`) is the caller's error.
async fn asking(c: &mut ClusterConnection, host: &str, port: u16) -> redis::RedisResult<()> {
    let node = RoutingInfo::SingleNode(to_node(host.to_string(), port));
    c.route_command(redis::cmd("ASKING"), node).await?.extract_error().map(drop)
}

/// One command on the cluster, sent again while the cluster refuses it
/// unrun ([`refused_unrun`]), at most [`CLUSTER_RESENDS`] times.
async fn cluster_command(c: &mut ClusterConnection, cmd: &Cmd) -> redis::RedisResult<Value> {
    if let Some(replies) = fanned_out(cmd) {
        return on_every_master(c, cmd, replies).await;
    }
    let mut sent = c.req_packed_command(cmd).await;
    let mut pause = CLUSTER_RESEND_PAUSE;
    for _ in 0..CLUSTER_RESENDS {
        let Some(refused) = sent.as_ref().err().and_then(refused_unrun) else { break };
        sent = match refused {
            Refused::MovedTo { host, port } => {
                c.route_command(cmd.clone(), RoutingInfo::SingleNode(to_node(host, port))).await
            }
            Refused::AskAt { host, port } => {
                asking(c, &host, port).await?;
                c.route_command(cmd.clone(), RoutingInfo::SingleNode(to_node(host, port))).await
            }
            Refused::Again => {
                tokio::time::sleep(pause).await;
                pause *= 2;
                c.req_packed_command(cmd).await
            }
        };
    }
    sent
}

/// A command the cluster client would send to every node (`SCRIPT LOAD`
/// on a script's first use on a node, `INFO`), sent to each master in turn
/// instead. redis-rs 1.8 queues such a fan-out's parts without waking its
/// connection task: they could wait, unsent, for another command or the
/// response timeout (a first ack script stalled 10 s; the same lost wake-up
/// as valkey-glide#7052). Each master is named by a slot it serves, so the
/// client's own slot map and connections route it. Replicas are left out:
/// no script runs there (a promoted one answers `NOSCRIPT`, and the script
/// is loaded then), and the settings `INFO` is read for are the masters'.
/// Replies as the client would: one reply where all must succeed, else
/// each master's.
async fn on_every_master(c: &mut ClusterConnection, cmd: &Cmd, replies_as: Replies) -> redis::RedisResult<Value> {
    use redis::cluster_routing::{Route, SlotAddr};
    let slots = c
        .route_command(
            redis::cmd("CLUSTER").arg("SLOTS").clone(),
            RoutingInfo::SingleNode(SingleNodeRoutingInfo::Random),
        )
        .await?
        .extract_error()?;
    let masters = masters_of(&slots);
    if masters.is_empty() {
        return Err(RedisError::from((ErrorKind::ClusterConnectionNotFound, "CLUSTER SLOTS names no master")));
    }
    let mut replies = Vec::with_capacity(masters.len());
    for (slot, name) in masters {
        let node = RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(Route::new(slot, SlotAddr::Master)));
        let reply = c.route_command(cmd.clone(), node).await?.extract_error()?;
        replies.push((Value::SimpleString(name), reply));
    }
    match replies_as {
        Replies::One => Ok(replies.pop().map_or(Value::Nil, |(_, reply)| reply)),
        Replies::EachByAddress => Ok(Value::Map(replies)),
    }
}

/// Each master of a `CLUSTER SLOTS` reply once (told apart by its node ID),
/// as the first slot of a range it serves and a name (`host:port`, or its
/// ID where the host is not given).
fn masters_of(slots: &Value) -> Vec<(u16, String)> {
    let text = |v: Option<&Value>| match v {
        Some(Value::BulkString(b)) => Some(String::from_utf8_lossy(b).into_owned()),
        Some(Value::SimpleString(s)) => Some(s.clone()),
        _ => None,
    };
    let mut masters: Vec<(u16, String)> = Vec::new();
    let mut seen: Vec<String> = Vec::new();
    let Value::Array(ranges) = slots else {
        return masters;
    };
    for range in ranges {
        let Value::Array(range) = range else { continue };
        let (Some(Value::Int(start)), Some(Value::Array(master))) = (range.first(), range.get(2)) else { continue };
        let Ok(start) = u16::try_from(*start) else { continue };
        let host = text(master.first()).unwrap_or_default();
        let port = match master.get(1) {
            Some(Value::Int(port)) => *port,
            _ => continue,
        };
        let id = text(master.get(2)).unwrap_or_else(|| format!("{host}:{port}"));
        if seen.contains(&id) {
            continue;
        }
        let name = if host.is_empty() { id.clone() } else { format!("{host}:{port}") };
        seen.push(id);
        masters.push((start, name));
    }
    masters
}

/// How the reply of a command sent to every master is made.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Replies {
    /// One of them: all succeeded, all alike (`SCRIPT LOAD`'s hash).
    One,
    /// Each node's, by its address (`INFO`).
    EachByAddress,
}

/// Whether the cluster client would fan `cmd` out to every node, for the
/// commands this code sends: `SCRIPT LOAD` and `INFO`.
fn fanned_out(cmd: &Cmd) -> Option<Replies> {
    let mut args = cmd.args_iter().filter_map(|a| match a {
        redis::Arg::Simple(bytes) => Some(bytes),
        _ => None,
    });
    let name = args.next()?;
    if name.eq_ignore_ascii_case(b"INFO") {
        return Some(Replies::EachByAddress);
    }
    let sub = args.next()?;
    (name.eq_ignore_ascii_case(b"SCRIPT") && sub.eq_ignore_ascii_case(b"LOAD")).then_some(Replies::One)
}

/// [`cluster_command`] for a pipeline (`offset`, `count`: the replies
/// wanted, as `req_packed_commands` takes them). Pipelines carry reads and
/// writes idempotent by construction (`DEL`, the dead-letter script), so one
/// refused part way is sent whole again. After `ASK`, `ASKING` goes first
/// (it covers a transaction's commands too, `MULTI` keeping it).
async fn cluster_pipeline(
    c: &mut ClusterConnection,
    pipeline: &Pipeline,
    offset: usize,
    count: usize,
) -> redis::RedisResult<Vec<Value>> {
    let mut sent = c.req_packed_commands(pipeline, offset, count).await;
    let mut pause = CLUSTER_RESEND_PAUSE;
    for _ in 0..CLUSTER_RESENDS {
        let Some(refused) = sent.as_ref().err().and_then(refused_unrun) else { break };
        sent = match refused {
            Refused::MovedTo { host, port } => {
                c.route_pipeline(pipeline.clone(), offset, count, to_node(host, port)).await
            }
            Refused::AskAt { host, port } => {
                asking(c, &host, port).await?;
                c.route_pipeline(pipeline.clone(), offset, count, to_node(host, port)).await
            }
            Refused::Again => {
                tokio::time::sleep(pause).await;
                pause *= 2;
                c.req_packed_commands(pipeline, offset, count).await
            }
        };
    }
    sent
}

impl ConnectionLike for StreamConnection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Self::Standalone(c) => c.req_packed_command(cmd),
            Self::Cluster(c) => Box::pin(cluster_command(c, cmd)),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        cmd: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Self::Standalone(c) => c.req_packed_commands(cmd, offset, count),
            Self::Cluster(c) => Box::pin(cluster_pipeline(c, cmd, offset, count)),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Self::Standalone(c) => c.get_db(),
            Self::Cluster(c) => c.get_db(),
        }
    }
}

/// One connection per endpoint, shared by every caller that names it, with
/// what was last read of the server's eviction and persistence settings.
#[derive(Clone, Default)]
pub struct Connections {
    by_endpoint: Arc<Mutex<HashMap<Endpoint, Shared>>>,
    /// Connects under way or failed, per endpoint not yet connected.
    attempts: Arc<std::sync::Mutex<HashMap<Endpoint, Arc<Attempt>>>>,
}

#[derive(Clone)]
struct Shared {
    conn: StreamConnection,
    safety: crate::version::Safety,
    /// When `safety` was read.
    checked: std::time::Instant,
}

/// How often the eviction and persistence settings are read again (one
/// `INFO memory persistence` per endpoint): a setting changed with
/// `CONFIG SET` shows within this.
pub const SAFETY_CHECK_EVERY: Duration = Duration::from_secs(60);

/// How long a connect that failed as unreachable is the answer for its
/// endpoint before one caller tries again: half the default poll. Every resource that names a
/// dead endpoint would otherwise hold one of the operator's bounded
/// reconciles for a whole connect timeout, every poll, and starve the
/// resources whose Redis answers.
pub const CONNECT_FAILURE_REMEMBERED: Duration = Duration::from_secs(5);

/// The connects to one endpoint: one at a time, and the last failure.
#[derive(Default)]
struct Attempt {
    /// Held by the caller connecting.
    connecting: Mutex<()>,
    failed: std::sync::Mutex<Option<Failure>>,
}

struct Failure {
    at: std::time::Instant,
    class: crate::error::ErrorClass,
    action: &'static str,
    message: String,
}

impl Attempt {
    /// The last failure, if younger than `within`.
    fn failure(&self, within: Duration) -> Option<StreamError> {
        let failed = self.failed.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let f = failed.as_ref().filter(|f| f.at.elapsed() < within)?;
        Some(StreamError::remembered(f.class, f.action, &f.message))
    }

    /// Remembers a failure as unreachable, or forgets the last one: a
    /// server that answers (wrong credentials, too old) is quick to ask
    /// again, and what it said must not be hidden by an older outage.
    fn record(&self, e: &StreamError) {
        let failure = (e.class == crate::error::ErrorClass::Unreachable).then(|| Failure {
            at: std::time::Instant::now(),
            class: e.class,
            action: e.action,
            message: e.source.to_string(),
        });
        *self.failed.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = failure;
    }
}

impl Connections {
    /// The shared connection for `endpoint`, connecting on first use.
    pub async fn get(&self, endpoint: &Endpoint) -> Result<StreamConnection, StreamError> {
        Ok(self.get_checked(endpoint).await?.0)
    }

    /// The shared connection for `endpoint` and the server's eviction and
    /// persistence settings, read at most every [`SAFETY_CHECK_EVERY`]
    /// (unknown when they could not be read: never an error for the caller).
    /// One caller at a time connects to an endpoint; a connect that failed
    /// as unreachable is every caller's answer for
    /// [`CONNECT_FAILURE_REMEMBERED`], and while one caller tries again
    /// after it, the others get it at once.
    pub async fn get_checked(
        &self,
        endpoint: &Endpoint,
    ) -> Result<(StreamConnection, crate::version::Safety), StreamError> {
        loop {
            let cached = {
                let mut map = self.by_endpoint.lock().await;
                match map.get_mut(endpoint) {
                    Some(shared) if shared.checked.elapsed() < SAFETY_CHECK_EVERY => {
                        return Ok((shared.conn.clone(), shared.safety.clone()));
                    }
                    // Due: this caller reads it again; the others meanwhile use
                    // what is known (one INFO per endpoint, not one per caller).
                    Some(shared) => {
                        shared.checked = std::time::Instant::now();
                        Some(shared.clone())
                    }
                    None => None,
                }
            };
            let Some(mut shared) = cached else {
                // Connected here or by another caller meanwhile: taken from the map.
                self.connect_once(endpoint).await?;
                continue;
            };
            // A failed read keeps what was known: a setting, not a figure, and
            // it does not change because one read failed.
            if let Ok(read) = crate::version::server_safety(&mut shared.conn).await {
                shared.safety = read;
            }
            let mut map = self.by_endpoint.lock().await;
            if let Some(entry) = map.get_mut(endpoint) {
                entry.safety = shared.safety.clone();
            }
            return Ok((shared.conn, shared.safety));
        }
    }

    /// Connects to `endpoint` and puts the connection in the map, unless
    /// another caller is connecting: then this one waits for it the first
    /// time, and after a failure gets that failure at once.
    async fn connect_once(&self, endpoint: &Endpoint) -> Result<(), StreamError> {
        let attempt = {
            let mut attempts = self.attempts.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            Arc::clone(attempts.entry(endpoint.clone()).or_default())
        };
        if let Some(recent) = attempt.failure(CONNECT_FAILURE_REMEMBERED) {
            return Err(recent);
        }
        let _connecting = match attempt.connecting.try_lock() {
            // Connected by another caller since this one looked.
            Ok(_) if self.by_endpoint.lock().await.contains_key(endpoint) => return Ok(()),
            Ok(connecting) => connecting,
            Err(_) => {
                // Being tried again after a failure: that failure is the answer.
                if let Some(last) = attempt.failure(Duration::MAX) {
                    return Err(last);
                }
                let connecting = attempt.connecting.lock().await;
                if let Some(recent) = attempt.failure(CONNECT_FAILURE_REMEMBERED) {
                    return Err(recent);
                }
                if self.by_endpoint.lock().await.contains_key(endpoint) {
                    return Ok(());
                }
                connecting
            }
        };
        match connect_and_check(endpoint).await {
            Ok(shared) => {
                self.by_endpoint.lock().await.entry(endpoint.clone()).or_insert(shared);
                self.attempts.lock().unwrap_or_else(std::sync::PoisonError::into_inner).remove(endpoint);
                Ok(())
            }
            Err(e) => {
                attempt.record(&e);
                Err(e)
            }
        }
    }

    /// How many endpoints have a shared connection.
    pub async fn endpoints(&self) -> usize {
        self.by_endpoint.lock().await.len()
    }
}

/// A new connection, refused when the server is too old (never kept, so
/// every poll says so again until it is upgraded), with the server's
/// eviction and persistence settings.
async fn connect_and_check(endpoint: &Endpoint) -> Result<Shared, StreamError> {
    let mut conn = StreamConnection::connect(endpoint).await?;
    if let Some(version) = crate::version::server_version(&mut conn).await?.filter(|v| !v.is_supported()) {
        return Err(StreamError::unsupported(version));
    }
    let safety = crate::version::server_safety(&mut conn).await.unwrap_or(crate::version::Safety::UNKNOWN);
    Ok(Shared { conn, safety, checked: std::time::Instant::now() })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_server_whoever_authenticates_and_however_spelt() {
        let e = |url: &str| Endpoint::new(url, Mode::Standalone);
        let apart = Endpoint { username: Some("u".into()), password: Some("p".into()), ..e("redis://h:6379") };
        assert!(e("redis://u:p@h:6379/0").same_server(&apart));
        assert!(e("redis://h").same_server(&e("redis://other:x@h:6379/")), "the default port");
        assert!(!e("redis://h:6379/1").same_server(&e("redis://h:6379/0")), "another database");
        assert!(!e("redis://h:6380").same_server(&e("redis://h:6379")));
        assert!(!Endpoint::new("redis://h:6379", Mode::Cluster).same_server(&e("redis://h:6379")));
    }

    #[test]
    fn the_masters_of_a_slot_map_each_once() {
        let node = |host: &str, port: i64, id: &str| {
            Value::Array(vec![Value::BulkString(host.into()), Value::Int(port), Value::BulkString(id.into())])
        };
        let range = |start: i64, end: i64, nodes: Vec<Value>| {
            let mut range = vec![Value::Int(start), Value::Int(end)];
            range.extend(nodes);
            Value::Array(range)
        };
        let slots = Value::Array(vec![
            range(0, 5460, vec![node("10.0.0.1", 6379, "a"), node("10.0.0.4", 6379, "d")]),
            range(5461, 10922, vec![node("10.0.0.2", 6379, "b")]),
            range(10923, 12000, vec![node("10.0.0.3", 6380, "c")]),
            range(12001, 16383, vec![node("10.0.0.3", 6380, "c")]),
        ]);
        assert_eq!(
            masters_of(&slots),
            [(0, "10.0.0.1:6379".into()), (5461, "10.0.0.2:6379".into()), (10923, "10.0.0.3:6380".into())],
            "replicas and a master's second range left out"
        );
        // A one-node cluster names no host for itself: still a master.
        let alone = Value::Array(vec![range(0, 16383, vec![node("", 7000, "e")])]);
        assert_eq!(masters_of(&alone), [(0, "e".into())]);
        assert!(masters_of(&Value::Nil).is_empty());
    }

    #[test]
    fn script_loads_and_info_go_to_every_master_and_nothing_else() {
        assert_eq!(fanned_out(redis::cmd("SCRIPT").arg("LOAD").arg("return 1")), Some(Replies::One));
        assert_eq!(fanned_out(redis::cmd("script").arg("load").arg("return 1")), Some(Replies::One));
        assert_eq!(fanned_out(redis::cmd("INFO").arg("memory").arg("persistence")), Some(Replies::EachByAddress));
        for single in [
            redis::cmd("EVALSHA").arg("abc").arg(1).arg("k").clone(),
            redis::cmd("SCRIPT").clone(),
            redis::cmd("XACK").arg("s").clone(),
        ] {
            assert_eq!(fanned_out(&single), None, "{single:?}");
        }
    }

    #[test]
    fn debug_shows_no_credential() {
        let endpoint = Endpoint {
            username: Some("orders-user".into()),
            password: Some("hunter2".into()),
            ..Endpoint::new("redis://url-user:url-secret@h:6379", Mode::Standalone)
        };
        let shown = format!("{endpoint:?}");
        for secret in ["orders-user", "hunter2", "url-user", "url-secret"] {
            assert!(!shown.contains(secret), "{secret} in {shown}");
        }
        assert!(shown.contains("h:6379"), "{shown}");
    }

    fn error(reply: &str) -> RedisError {
        redis::parse_redis_value(reply.as_bytes()).and_then(Value::extract_error).expect_err("an error reply")
    }

    #[test]
    fn only_what_the_cluster_refused_unrun_is_sent_again() {
        assert_eq!(
            refused_unrun(&error("-MOVED 3999 127.0.0.1:6381\r\n")),
            Some(Refused::MovedTo { host: "127.0.0.1".into(), port: 6381 })
        );
        assert_eq!(
            refused_unrun(&error("-ASK 3999 10.0.0.2:7000\r\n")),
            Some(Refused::AskAt { host: "10.0.0.2".into(), port: 7000 })
        );
        for again in [
            "-TRYAGAIN Multiple keys request during rehashing of slot\r\n",
            "-CLUSTERDOWN The cluster is down\r\n",
            "-MASTERDOWN Link with MASTER is down\r\n",
            "-LOADING Redis is loading the dataset in memory\r\n",
            "-READONLY You can't write against a read only replica.\r\n",
        ] {
            assert_eq!(refused_unrun(&error(again)), Some(Refused::Again), "{again}");
        }
        // The command may have run: the caller is told, nothing is re-sent.
        let dropped = RedisError::from(std::io::Error::new(std::io::ErrorKind::ConnectionReset, "reset by peer"));
        for maybe_ran in [dropped, timeout_error(), error("-ERR unknown command\r\n"), error("-NOSCRIPT no script\r\n")]
        {
            assert_eq!(refused_unrun(&maybe_ran), None, "{maybe_ran}");
        }
    }
}
