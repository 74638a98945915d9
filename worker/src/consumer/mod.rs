//! The consumption loop: read a batch, run the handler on each entry, ack
//! what succeeded (after the handler's commit, never before), dead-letter
//! what must leave, leave the rest pending for redelivery; claim entries that
//! crashed consumers left idle; drain on shutdown.

mod batch;
mod commit;
mod hold;
mod read;
mod reclaim;
mod settle;
mod start;

use batch::Batch;
use read::Reader;

use crate::breaker::{Breaker, Gate, Transition};
use crate::guard::{Acquisition, Guard, GuardState, IdempotencyStore};
use crate::lease::{Completion, Held, Lease};
use crate::phase::{Event, HandBack, Phase, PhaseCell};
use crate::stats::Stats;
use futures::{FutureExt as _, StreamExt as _};
use rand::Rng as _;
use redis::streams::StreamReadOptions;
use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};
use streamfleet_streams::claim::{LossRecord, autoclaim, claim_due, claim_own};
use streamfleet_streams::config::{RunMode, WorkerConfig};
use streamfleet_streams::consumers::{self, HEARTBEAT_EVERY};
use streamfleet_streams::deadletter::{self, Letter, Reason};
use streamfleet_streams::entry::read_reply_from_value;
use streamfleet_streams::recovery::{RecoveryReport, now_ms, write_report};
use streamfleet_streams::retry::Parked;
use streamfleet_streams::started::HeldSince;
use streamfleet_streams::{ConsumerRef, Entry, StreamConnection, StreamError};

/// What becomes of one entry of a batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Settled {
    /// Ack in the next flush.
    Ack,
    /// Mark its business key completed, then ack, in the next flush.
    AckCompleted,
    /// Leave pending (for redelivery), or already acked by its dead letter.
    Leave,
}

/// Backoff of a failing consume step.
const RETRY_FIRST: Duration = Duration::from_millis(200);
const RETRY_MAX: Duration = Duration::from_secs(5);

/// What the consume loop has learned so far.
struct ConsumeState {
    /// Whether this consumer's own pending entries were taken back.
    taken_back: bool,
    next_claim: Instant,
}

/// The delivery a handler is running, as [`current_delivery`] tells it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Delivery {
    pub consumer: String,
    pub stream: String,
    pub id: String,
    /// Times delivered, this delivery included.
    pub deliveries: u64,
    /// With the Redis guard: this acquisition's fencing token. Every
    /// acquisition of a business key gets a larger one, so a business store
    /// that records the largest fence per key and refuses a smaller one never
    /// applies a stale holder's effect after a newer holder's.
    pub fence: Option<u64>,
}

tokio::task_local! {
    pub(crate) static DELIVERY: Delivery;
}

/// The delivery the calling handler is running (`None` outside a handler).
pub fn current_delivery() -> Option<Delivery> {
    DELIVERY.try_with(Delivery::clone).ok()
}

/// An entry's business key, as the handler's extractor gave it.
enum KeyOf {
    Key(String),
    None,
    Panicked(String),
}

/// Groups the batch's entries by (stream, key), in stream order: a group runs
/// one entry after another, groups run concurrently.
fn key_groups(items: &[(&str, &str)]) -> Vec<Vec<usize>> {
    let mut groups: Vec<Vec<usize>> = Vec::new();
    let mut index: std::collections::HashMap<(&str, &str), usize> = std::collections::HashMap::new();
    for (i, item) in items.iter().enumerate() {
        match index.get(item) {
            Some(&g) => groups[g].push(i),
            None => {
                index.insert(*item, groups.len());
                groups.push(vec![i]);
            }
        }
    }
    groups
}

fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(no message)".into())
}

fn stopping(stop: &AtomicBool) -> bool {
    stop.load(Ordering::SeqCst)
}

/// What a handler says about one entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The business effect is committed: ack.
    Done,
    /// A dependency failed; retrying may succeed. Retried in process with
    /// backoff, then left pending for redelivery; dead-lettered at `maxDeliveries`.
    Transient(String),
    /// A business rule refuses the entry: dead-letter now.
    Permanent(String),
    /// The entry cannot be understood: dead-letter now.
    Malformed(String),
}

/// The user's code. `handle` must be idempotent: an entry can be delivered
/// again after a crash between its effect and its ack.
pub trait Handler: Send + Sync + 'static {
    /// The business key (an order ID, say): the ordering key (with the
    /// guard, never two handlers of one key at once) and the dead letter's
    /// `business-key`. Not the idempotency token: that is the event
    /// (`Entry::event_id`: the entry ID, or its `streamfleet.event-id`
    /// field), so a second event of one key ("refunded" after "charged")
    /// runs. `None`: the event is the key.
    fn business_key(&self, _entry: &Entry) -> Option<String> {
        None
    }

    fn handle(&self, entry: &Entry) -> impl Future<Output = Outcome> + Send;
}

#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    #[error("{0}")]
    Redis(#[from] StreamError),
    #[error("idempotency store: {0}")]
    Store(String),
    /// The server cannot run the protocol (older than 7.0).
    #[error("{0}")]
    Unsupported(String),
    /// Shutting down while Redis was unreachable: what was being done did
    /// not happen (and is not retried).
    #[error("stopped: {0}")]
    Stopped(&'static str),
    /// `STREAMFLEET_METRICS_ADDR` cannot be listened on.
    #[error("serving /metrics on {0}")]
    Admin(String),
    /// A failpoint (tests only) stopped the worker where it stood, as a crash would.
    #[error("stopped at failpoint {0}")]
    Failpoint(&'static str),
}

/// The worker's metrics and probes server, stopped when dropped.
struct AdminServer(tokio::task::JoinHandle<()>);

impl AdminServer {
    /// Stops it and waits until its port is closed.
    async fn stop(mut self) {
        self.0.abort();
        let _ = (&mut self.0).await;
    }
}

impl Drop for AdminServer {
    fn drop(&mut self) {
        self.0.abort();
    }
}

fn store_error(e: Box<dyn std::error::Error + Send + Sync>) -> WorkerError {
    WorkerError::Store(e.to_string())
}

/// Where business keys' processing/completed states live.
enum Idempotency {
    /// The built-in Redis guard (completions ride along with the acks).
    Redis(Guard),
    /// The user's own store.
    Store(Box<dyn IdempotencyStore>),
}

pub struct Worker<H> {
    config: WorkerConfig,
    handler: Arc<H>,
    guard: Option<Idempotency>,
    stats: Arc<Stats>,
    at_most_once: bool,
    /// Set on shutdown: no handler starts after it.
    stop: Arc<AtomicBool>,
    /// Stops calling a failing downstream (`breaker`); `None`: turned off.
    breaker: Option<Arc<std::sync::Mutex<Breaker>>>,
    /// Holds batches in hand from a thread of its own (started with the first batch).
    holder: std::sync::OnceLock<hold::Holder>,
    /// What `/readyz` says: Redis answered the last step.
    readiness: streamfleet_process::Readiness,
}

impl<H: Handler> Worker<H> {
    pub fn new(config: WorkerConfig, handler: H) -> Self {
        let stats = Arc::new(Stats::for_group(&config.group));
        let breaker = Breaker::new(config.retry.initial, config.retry.max);
        Self {
            breaker: Some(Arc::new(std::sync::Mutex::new(breaker))),
            config,
            handler: Arc::new(handler),
            guard: None,
            stats,
            at_most_once: false,
            stop: Arc::new(AtomicBool::new(false)),
            holder: std::sync::OnceLock::new(),
            readiness: streamfleet_process::Readiness::new(false),
        }
    }

    /// No circuit breaker: every entry's attempts call the handler, even
    /// while most fail with the same error (for handlers whose failures say
    /// nothing about the next entry's chances).
    pub fn without_circuit_breaker(mut self) -> Self {
        self.breaker = None;
        self
    }

    /// At-most-once delivery (`XREADGROUP ... NOACK`), for lossy telemetry
    /// only: entries never enter the PEL, so a crash or a transient failure
    /// loses them. Never the default; it must be asked for. Turns the guard
    /// and claiming off (there is nothing pending to guard or claim).
    pub fn at_most_once(mut self) -> Self {
        self.at_most_once = true;
        self.guard = None;
        // (A failure is dropped, not retried: nothing to spare.)
        self.breaker = None;
        self
    }

    /// Turns on the Redis idempotency guard: an entry whose business key was
    /// already completed is acked without running the handler again (counted
    /// as a suppressed duplicate). `completed_ttl` must outlast the
    /// redelivery window (min-idle-time × max deliveries, at least).
    pub fn with_idempotency_guard(mut self, completed_ttl: Duration) -> Self {
        if !self.at_most_once {
            self.guard = Some(Idempotency::Redis(Guard::new(&self.config, completed_ttl)));
        }
        self
    }

    /// Uses your own idempotency store instead of the Redis guard (see
    /// [`IdempotencyStore`]).
    pub fn with_idempotency_store(mut self, store: impl IdempotencyStore) -> Self {
        if !self.at_most_once {
            self.guard = Some(Idempotency::Store(Box::new(store)));
        }
        self
    }

    pub fn stats(&self) -> Arc<Stats> {
        self.stats.clone()
    }

    /// Runs until `shutdown` resolves (consume mode) or until nothing is left
    /// to claim (recovery mode). On shutdown it stops reading and starts no
    /// new handler; handlers in flight finish and are acked; entries of the
    /// batch not started stay pending with their guard marks released.
    pub async fn run(self, shutdown: impl Future<Output = ()> + Send + 'static) -> Result<(), WorkerError> {
        let stop = self.stop.clone();
        let flag = stop.clone();
        let watcher = tokio::spawn(async move {
            shutdown.await;
            flag.store(true, Ordering::SeqCst);
        });
        // Stopped however `run` ends (dropped on an early return).
        let admin = self.serve_admin().await?;
        let mut conn = StreamConnection::connect(&self.config.endpoint).await?;
        // Before anything is written or reported ready: a server too old is
        // refused, and the worker stops saying why.
        let version = streamfleet_streams::version::server_version(&mut conn).await?;
        if let Some(v) = version.filter(|v| !v.is_supported()) {
            watcher.abort();
            return Err(WorkerError::Unsupported(format!(
                "Redis {}.{}.{} is older than 7.0, which streamfleet needs",
                v.major, v.minor, v.patch
            )));
        }
        tracing::info!(?version, mode = ?self.config.mode, at_most_once = self.at_most_once, "running");
        self.readiness.set(true);
        // Beats from now on, from a thread of its own.
        let _ = self.holder();
        let result = match self.config.mode {
            RunMode::Recovery => self.recover(&mut conn, &stop).await,
            RunMode::Consume => self.consume(&mut conn, &stop).await,
        };
        self.readiness.set(false);
        watcher.abort();
        if let Some(admin) = admin {
            admin.stop().await;
        }
        result
    }

    /// `/metrics`, `/healthz` and `/readyz` on `STREAMFLEET_METRICS_ADDR`,
    /// when the pod template sets it. A worker told to serve them that
    /// cannot does not start: its probes would fail with no reason given.
    #[cfg(feature = "admin")]
    async fn serve_admin(&self) -> Result<Option<AdminServer>, WorkerError> {
        let Some(addr) = &self.config.metrics_addr else { return Ok(None) };
        let listener =
            tokio::net::TcpListener::bind(addr).await.map_err(|e| WorkerError::Admin(format!("{addr}: {e}")))?;
        let serving = self.stats.clone().serve(listener, self.readiness.clone());
        Ok(Some(AdminServer(tokio::spawn(async move {
            if let Err(e) = serving.await {
                tracing::warn!(error = %e, "metrics server");
            }
        }))))
    }

    /// Built without the `admin` feature: no HTTP stack to serve them with.
    #[cfg(not(feature = "admin"))]
    async fn serve_admin(&self) -> Result<Option<AdminServer>, WorkerError> {
        match &self.config.metrics_addr {
            None => Ok(None),
            Some(addr) => Err(WorkerError::Admin(format!(
                "{addr}: this worker was built without the `admin` feature of streamfleet-worker"
            ))),
        }
    }

    /// The consume loop. A failing step (Redis unreachable, the group gone
    /// while the operator recreates it) is retried with backoff, never fatal:
    /// a worker that exits would only crash-loop until Redis is back.
    async fn consume(&self, conn: &mut StreamConnection, stop: &AtomicBool) -> Result<(), WorkerError> {
        let mut readers = self.readers().await?;
        let now = Instant::now();
        let mut state = ConsumeState { taken_back: self.at_most_once, next_claim: now };
        let mut delay = RETRY_FIRST;
        while !stopping(stop) {
            let step = self.consume_step(conn, &mut readers, stop, &mut state).await;
            self.readiness.set(step.is_ok());
            match step {
                Ok(()) => delay = RETRY_FIRST,
                Err(e @ WorkerError::Failpoint(_)) => return Err(e),
                Err(e) => {
                    tracing::warn!(error = %e, retry_in = ?delay, "consuming failed; retrying");
                    let until = Instant::now() + delay;
                    while Instant::now() < until && !stopping(stop) {
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                    delay = (delay * 2).min(RETRY_MAX);
                }
            }
        }
        tracing::info!(consumer = %self.config.consumer, "drained; stopping");
        Ok(())
    }

    /// One turn of the consume loop: the claim cycle when due, one read, its batch.
    async fn consume_step(
        &self,
        conn: &mut StreamConnection,
        readers: &mut [Reader],
        stop: &AtomicBool,
        state: &mut ConsumeState,
    ) -> Result<(), WorkerError> {
        if !state.taken_back {
            // A restart under the same name (same pod): what this consumer read
            // before and never settled is handled first, at once.
            self.take_back_own(conn, stop).await?;
            state.taken_back = true;
        }
        if !self.at_most_once && Instant::now() >= state.next_claim {
            // Often enough that entries released from a dead consumer move
            // within a second or two; a claim step over a fresh PEL is cheap.
            // Set first: a failing cycle must not keep the loop from reading.
            state.next_claim = Instant::now() + (self.config.min_idle / 2).min(Duration::from_secs(1));
            self.claim_cycle(conn, stop).await?;
        }
        // Never cancel a read in flight: entries it delivered would sit in our
        // PEL unseen until claimed. The short BLOCK bounds the drain instead.
        let delivered = self.read(readers).await?;
        self.process(conn, delivered.entries, delivered.held).await
    }
}
