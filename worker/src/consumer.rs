//! The consumption loop: read a batch, run the handler on each entry, ack
//! what succeeded (after the handler's commit, never before), dead-letter
//! what must leave, leave the rest pending for redelivery; claim entries that
//! crashed consumers left idle; drain on shutdown.

use crate::guard::{Acquisition, Guard, GuardState, IdempotencyStore};
use crate::lease::{Completion, Held, Lease};
use crate::stats::Stats;
use futures::{FutureExt as _, StreamExt as _};
use rand::Rng as _;
use redis::streams::{StreamReadOptions, StreamReadReply};
use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};
use streamfleet_streams::claim::{LossRecord, autoclaim, claim_own};
use streamfleet_streams::config::{RunMode, WorkerConfig};
use streamfleet_streams::consumers::{self, HEARTBEAT_EVERY};
use streamfleet_streams::deadletter::{self, Letter, Reason};
use streamfleet_streams::entry::fields_from_map;
use streamfleet_streams::recovery::{RecoveryReport, now_ms, write_report};
use streamfleet_streams::{Entry, StreamConnection, StreamError};

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

/// How long each read blocks when a worker reads several slots of a cluster.
const MULTI_SLOT_BLOCK: Duration = Duration::from_millis(200);

/// A blocking read connection and the streams it reads together.
struct Reader {
    streams: Vec<String>,
    conn: StreamConnection,
    block: Duration,
}

/// What the consume loop has learned so far.
struct ConsumeState {
    /// Whether the server's version was checked (7.0 or later).
    server_checked: bool,
    /// Whether this consumer's own pending entries were taken back.
    taken_back: bool,
    next_claim: Instant,
    next_heartbeat: Instant,
}

/// Where an entry of a batch stands.
const WAITING: u8 = 0;
const RUNNING: u8 = 1;
/// Its effect is done and its commit (completion mark and ack) not yet
/// written: held and retried, never handed back (that would re-run it).
const DONE: u8 = 3;
/// Left for redelivery (a failure) or to its dead letter: its lock is being
/// released, so it is no longer held (a hold must not put the lock back)
/// nor handed back.
const LEAVING: u8 = 4;
const SETTLED: u8 = 2;

/// How long a batch keeps retrying the commit of done entries (Redis down,
/// a failover): at least this, and at least twice min-idle-time, so a
/// restarted server's claim wait (`claim::claim_rules_lua`) is covered.
const COMMIT_RETRY_FOR: Duration = Duration::from_secs(10);

/// How many times a worker process may die while one entry's handler runs
/// (it ran alone after the first) before the entry is dead-lettered as
/// `crashed-worker`, as Sidekiq's super_fetch quarantines a job that kills
/// its process.
const CRASH_LIMIT: u32 = 3;

/// A batch in hand.
struct Batch {
    entries: Vec<Entry>,
    keys: Vec<KeyOf>,
    /// Each entry's guard token: its business key, or its ID.
    tokens: Vec<String>,
    acquisitions: Vec<Acquisition>,
    /// `WAITING`, `RUNNING`, `DONE` or `SETTLED` (committed, or left for redelivery).
    phase: Vec<std::sync::atomic::AtomicU8>,
    /// Notified when a failpoint stops the batch where it stands (tests).
    crash: tokio::sync::Notify,
}

impl Batch {
    /// The entries not settled yet, per stream.
    fn open_by_stream(&self) -> BTreeMap<&str, Vec<usize>> {
        let mut open: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
        for (i, entry) in self.entries.iter().enumerate() {
            if !matches!(self.phase[i].load(Ordering::SeqCst), SETTLED | LEAVING) {
                open.entry(entry.stream.as_str()).or_default().push(i);
            }
        }
        open
    }
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
    static DELIVERY: Delivery;
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
    /// A failpoint (tests only) stopped the worker where it stood, as a crash would.
    #[error("stopped at failpoint {0}")]
    Failpoint(&'static str),
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
}

impl<H: Handler> Worker<H> {
    pub fn new(config: WorkerConfig, handler: H) -> Self {
        let stats = Arc::new(Stats::for_group(&config.group));
        Self {
            config,
            handler: Arc::new(handler),
            guard: None,
            stats,
            at_most_once: false,
            stop: Arc::new(AtomicBool::new(false)),
        }
    }

    /// At-most-once delivery (`XREADGROUP ... NOACK`), for lossy telemetry
    /// only: entries never enter the PEL, so a crash or a transient failure
    /// loses them. Never the default; it must be asked for. Turns the guard
    /// and claiming off (there is nothing pending to guard or claim).
    pub fn at_most_once(mut self) -> Self {
        self.at_most_once = true;
        self.guard = None;
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
        let mut conn = StreamConnection::connect(&self.config.endpoint).await?;
        let result = match self.config.mode {
            RunMode::Recovery => self.recover(&mut conn, &stop).await,
            RunMode::Consume => self.consume(&mut conn, &stop).await,
        };
        watcher.abort();
        result
    }

    /// The consume loop. A failing step (Redis unreachable, the group gone
    /// while the operator recreates it) is retried with backoff, never fatal:
    /// a worker that exits would only crash-loop until Redis is back.
    async fn consume(&self, conn: &mut StreamConnection, stop: &AtomicBool) -> Result<(), WorkerError> {
        let mut readers = self.readers().await?;
        let now = Instant::now();
        let mut state =
            ConsumeState { server_checked: false, taken_back: self.at_most_once, next_claim: now, next_heartbeat: now };
        let mut delay = RETRY_FIRST;
        while !stopping(stop) {
            match self.consume_step(conn, &mut readers, stop, &mut state).await {
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
        if !state.server_checked {
            let version = streamfleet_streams::version::server_version(conn).await?;
            if let Some(v) = version.filter(|v| !v.is_supported()) {
                return Err(WorkerError::Unsupported(format!(
                    "Redis {}.{}.{} is older than 7.0, which streamfleet needs",
                    v.major, v.minor, v.patch
                )));
            }
            tracing::info!(?version, at_most_once = self.at_most_once, "consuming");
            state.server_checked = true;
        }
        if Instant::now() >= state.next_heartbeat {
            // Idle or not: `XINFO CONSUMERS` idle time is no proof of life
            // (Redis 7.0 does not refresh it on an empty read).
            state.next_heartbeat = Instant::now() + HEARTBEAT_EVERY / 2;
            self.heartbeat(conn).await?;
        }
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
        let entries = self.read(readers).await?;
        self.process(conn, entries).await
    }

    /// Tells each stream's group this consumer is alive
    /// (`consumers::heartbeat`), which also takes it out of the dead
    /// registry if the operator declared it dead while it lived.
    async fn heartbeat(&self, conn: &mut StreamConnection) -> Result<(), WorkerError> {
        for stream in &self.config.streams {
            let revived = consumers::heartbeat(conn, stream, &self.config.group, &self.config.consumer).await?;
            if revived {
                tracing::warn!(stream = %stream, consumer = %self.config.consumer, "this consumer had been declared dead while alive; no longer");
            }
        }
        Ok(())
    }

    /// Recovery mode: claim every idle entry, re-run handlers, until a full
    /// pass over the PEL claims nothing.
    async fn recover(&self, conn: &mut StreamConnection, stop: &AtomicBool) -> Result<(), WorkerError> {
        let mut claimed = 0;
        while !stopping(stop) {
            let (n, deferred) = self.claim_cycle(conn, stop).await?;
            claimed += n;
            if n == 0 && !deferred {
                break;
            }
            if n == 0 {
                tokio::time::sleep((self.config.min_idle / 4).clamp(Duration::from_millis(10), RETRY_MAX)).await;
            }
        }
        // The same report a sweep writes: the operator shows it as lastRecovery.
        let report = RecoveryReport {
            finished_at_ms: now_ms(),
            scanned: u64::try_from(claimed).unwrap_or(u64::MAX),
            claimed: u64::try_from(claimed).unwrap_or(u64::MAX),
            dead_lettered: Stats::get(&self.stats.dead_lettered),
            payload_lost: Stats::get(&self.stats.payload_missing),
        };
        for stream in &self.config.streams {
            write_report(conn, stream, &self.config.group, &report).await?;
        }
        tracing::info!(?report, "recovery finished");
        Ok(())
    }

    /// Handles this consumer's own pending entries, oldest first.
    async fn take_back_own(&self, conn: &mut StreamConnection, stop: &AtomicBool) -> Result<(), WorkerError> {
        for stream in &self.config.streams {
            let dead_letter_stream = self.config.dead_letter_stream_of(stream);
            let mut after = "-".to_string();
            while !stopping(stop) {
                let own = claim_own(
                    conn,
                    stream,
                    &self.config.group,
                    &self.config.consumer,
                    &self.loss_record(&dead_letter_stream),
                    &after,
                    self.config.batch_size,
                )
                .await?;
                if !own.entries.is_empty() || !own.deleted.is_empty() {
                    tracing::info!(stream = %stream, entries = own.entries.len(), "taking back own pending entries");
                }
                self.settle_claimed(conn, stream, own.deleted, own.entries).await?;
                if own.next == "0-0" {
                    break;
                }
                after = own.next;
            }
        }
        Ok(())
    }

    /// Claimed entries are handled; IDs whose payload is gone were recorded
    /// lost by the claim itself.
    async fn settle_claimed(
        &self,
        conn: &mut StreamConnection,
        stream: &str,
        deleted: Vec<String>,
        entries: Vec<Entry>,
    ) -> Result<(), WorkerError> {
        if !deleted.is_empty() || !entries.is_empty() {
            fail::fail_point!("worker::after-claim", |_| Err(WorkerError::Failpoint("worker::after-claim")));
        }
        if !deleted.is_empty() {
            self.stats.add(&self.stats.payload_missing, deleted.len());
            tracing::warn!(stream, ids = ?deleted, "pending entries whose payload was trimmed or deleted: recorded as lost");
        }
        // An entry whose handler was running when a process died runs alone,
        // first: if it kills this process too, no batch-mate was running to
        // share the blame (`started`), and it alone reaches the crash limit.
        let (suspects, rest): (Vec<Entry>, Vec<Entry>) = entries.into_iter().partition(|e| e.crashes > 0);
        for suspect in suspects {
            tracing::warn!(stream, id = %suspect.id, crashes = suspect.crashes, "running alone an entry whose handler was running when a worker died");
            self.process(conn, vec![suspect]).await?;
        }
        self.process(conn, rest).await
    }

    /// Where claims on `dead_letter_stream`'s stream record pending entries
    /// found without a payload.
    fn loss_record<'a>(&'a self, dead_letter_stream: &'a str) -> LossRecord<'a> {
        LossRecord {
            dead_letter_stream,
            consumer: &self.config.consumer,
            why: "payload trimmed or deleted while pending",
        }
    }

    /// One pass of idle claims over each stream's PEL, from `0-0` until the
    /// cursor returns to `0-0` (`claim::autoclaim`). Returns how many
    /// entries were claimed, and whether idle entries were deferred (after
    /// a restart or failover their holders renew first: a consumer tries
    /// again next cycle, a recovery run waits).
    async fn claim_cycle(&self, conn: &mut StreamConnection, stop: &AtomicBool) -> Result<(usize, bool), WorkerError> {
        let (mut total, mut deferred) = (0, false);
        for stream in &self.config.streams {
            let dead_letter_stream = self.config.dead_letter_stream_of(stream);
            let mut cursor = "0-0".to_string();
            loop {
                let claimed = match autoclaim(
                    conn,
                    stream,
                    &self.config.group,
                    &self.config.consumer,
                    &self.loss_record(&dead_letter_stream),
                    self.config.min_idle,
                    &cursor,
                    self.config.batch_size,
                )
                .await
                {
                    Ok(claimed) => claimed,
                    // While consuming, one shard failing (its group being
                    // recreated, its master failing over) must not stop the
                    // others' claims; a recovery run must not report success.
                    Err(e) if self.config.mode == RunMode::Consume => {
                        tracing::warn!(stream, error = %e, "claiming idle entries");
                        break;
                    }
                    Err(e) => return Err(e.into()),
                };
                // Idle entries deferred (the server restarted or failed over
                // less than min-idle-time ago: their holders renew first):
                // a consumer takes them in a later cycle; a recovery run
                // passes again (it stops only on a pass that claims nothing).
                deferred |= claimed.deferred;
                total += claimed.entries.len();
                self.stats.add(&self.stats.claimed, claimed.entries.len());
                self.settle_claimed(conn, stream, claimed.deleted, claimed.entries).await?;
                cursor = claimed.next;
                if cursor == "0-0" || stopping(stop) {
                    break;
                }
            }
        }
        Ok((total, deferred))
    }

    /// The blocking readers: one for every stream on a standalone server; on
    /// a cluster one per hash slot (a multi-key `XREADGROUP` across slots is
    /// refused with CROSSSLOT), each blocking a shorter time so an entry on
    /// one slot never waits long for another slot's read to time out.
    async fn readers(&self) -> Result<Vec<Reader>, WorkerError> {
        let groups: Vec<Vec<String>> = match self.config.endpoint.mode {
            streamfleet_streams::Mode::Standalone => vec![self.config.streams.clone()],
            streamfleet_streams::Mode::Cluster => {
                let mut by_slot: BTreeMap<&str, Vec<String>> = BTreeMap::new();
                for stream in &self.config.streams {
                    by_slot.entry(streamfleet_streams::keys::slot_text(stream)).or_default().push(stream.clone());
                }
                by_slot.into_values().collect()
            }
        };
        let block = if groups.len() > 1 { self.config.block.min(MULTI_SLOT_BLOCK) } else { self.config.block };
        let mut readers = Vec::with_capacity(groups.len());
        for streams in groups {
            let conn = StreamConnection::connect_blocking(&self.config.endpoint, block).await?;
            readers.push(Reader { streams, conn, block });
        }
        Ok(readers)
    }

    /// New entries. One reader: one blocking read. Several (a cluster's
    /// slots): first an immediate read on each, and only when all came back
    /// empty a blocking read on each, so a slot with entries never waits on
    /// an idle slot's block. Entries any reader delivered are returned even
    /// when another failed (they are in our PEL now); the error only when
    /// none delivered anything.
    async fn read(&self, readers: &mut [Reader]) -> Result<Vec<Entry>, StreamError> {
        if readers.len() > 1 {
            let entries = self.read_all(readers, false).await?;
            if !entries.is_empty() {
                return Ok(entries);
            }
        }
        self.read_all(readers, true).await
    }

    async fn read_all(&self, readers: &mut [Reader], block: bool) -> Result<Vec<Entry>, StreamError> {
        let readers_count = readers.len();
        let results = futures::future::join_all(readers.iter_mut().map(|r| self.read_from(r, block))).await;
        let (mut entries, mut failure, mut failed) = (Vec::new(), None, 0);
        for result in results {
            match result {
                Ok(mut read) => entries.append(&mut read),
                Err(e) => {
                    tracing::warn!(error = %e, "a read failed");
                    failed += 1;
                    failure.get_or_insert(e);
                }
            }
        }
        match failure {
            // Every reader failed: the caller backs off. One slot down must
            // not hold up the others.
            Some(e) if entries.is_empty() && failed == readers_count => Err(e),
            _ => Ok(entries),
        }
    }

    /// New entries only: idle ones are taken by the claim cycle, never by
    /// `XREADGROUP … CLAIM` (8.4), which would bypass what the claim script
    /// checks (a young server epoch, a live holder's trimmed entry).
    async fn read_from(&self, reader: &mut Reader, block: bool) -> Result<Vec<Entry>, StreamError> {
        let mut opts =
            StreamReadOptions::default().group(&self.config.group, &self.config.consumer).count(self.config.batch_size);
        if block {
            opts = opts.block(usize::try_from(reader.block.as_millis()).unwrap_or(2000));
        }
        if self.at_most_once {
            opts = opts.noack();
        }
        let ids: Vec<&str> = reader.streams.iter().map(|_| ">").collect();
        let mut cmd = redis::cmd("XREADGROUP");
        cmd.arg(&opts);
        let reply: Option<StreamReadReply> = cmd
            .arg("STREAMS")
            .arg(&reader.streams)
            .arg(&ids)
            .query_async(&mut reader.conn)
            .await
            .map_err(|e| StreamError::new("reading new entries", e))?;
        Ok(reply
            .map(|r| {
                r.keys
                    .into_iter()
                    .flat_map(|k| {
                        let stream = k.key;
                        k.ids.into_iter().map(move |e| Entry {
                            stream: stream.clone(),
                            deliveries: 1,
                            crashes: 0,
                            id: e.id,
                            fields: fields_from_map(e.map),
                        })
                    })
                    .collect()
            })
            .unwrap_or_default())
    }

    /// Handles a batch: one round trip to learn (and take) every entry's
    /// guard state, then up to `concurrency` handlers at once (entries sharing
    /// a business key one after another, in stream order). Each entry is
    /// committed as soon as its handler is done: its completion mark and ack
    /// go out in the next small flush (mark first, so a crash between them
    /// leaves a completed key whose redelivery is suppressed, never an
    /// unmarked ack), never deferred to the end of the batch. While the batch
    /// is in hand its unsettled entries are held (`lease::Lease::extend`), so
    /// neither a slow handler nor a long queue lets another consumer claim
    /// them. What was not started (shutdown, a failed batch) or still runs at
    /// the drain deadline is handed back, claimable at once.
    async fn process(&self, conn: &mut StreamConnection, entries: Vec<Entry>) -> Result<(), WorkerError> {
        let (foreign, entries): (Vec<Entry>, Vec<Entry>) = entries.into_iter().partition(|e| {
            e.field_str(streamfleet_streams::replay::F_REPLAY_FOR).is_some_and(|group| group != self.config.group)
        });
        self.skip_foreign_replays(conn, &foreign).await?;
        if entries.is_empty() {
            return Ok(());
        }
        let keys: Vec<KeyOf> = entries.iter().map(|e| self.key_of(e)).collect();
        let tokens: Vec<String> = entries
            .iter()
            .zip(&keys)
            .map(|(e, k)| match k {
                KeyOf::Key(key) => key.clone(),
                _ => e.event_id().to_string(),
            })
            .collect();
        let items: Vec<(&str, &str)> =
            entries.iter().zip(&tokens).map(|(e, t)| (e.stream.as_str(), t.as_str())).collect();
        let acquired = |state| Acquisition { state, fence: None };
        let acquisitions = match &self.guard {
            Some(Idempotency::Redis(guard)) => {
                let with_events: Vec<(&str, &str, &str)> =
                    items.iter().zip(&entries).map(|((s, t), e)| (*s, *t, e.event_id())).collect();
                guard.begin_all(conn, &with_events).await?
            }
            Some(Idempotency::Store(store)) => {
                let events: Vec<(&str, &str)> = entries.iter().map(|e| (e.stream.as_str(), e.event_id())).collect();
                store.begin(&events).await.map_err(store_error)?.into_iter().map(acquired).collect()
            }
            None => vec![acquired(GuardState::Acquired); entries.len()],
        };
        let groups = key_groups(&items);
        drop(items);
        let batch = Batch {
            phase: entries.iter().map(|_| std::sync::atomic::AtomicU8::new(WAITING)).collect(),
            entries,
            keys,
            tokens,
            acquisitions,
            crash: tokio::sync::Notify::new(),
        };
        let (settled_tx, settled_rx) = tokio::sync::mpsc::unbounded_channel::<(usize, Settled)>();
        let failure: std::sync::Mutex<Option<WorkerError>> = std::sync::Mutex::new(None);
        let done = tokio::sync::Notify::new();
        let handlers = async {
            let run = futures::stream::iter(groups).for_each_concurrent(self.config.concurrency.max(1), |group| {
                let (tx, conn, failure, batch) = (settled_tx.clone(), conn.clone(), &failure, &batch);
                self.run_group(conn, batch, group, tx, failure)
            });
            tokio::select! {
                () = run => {}
                () = self.drain_deadline() => {
                    tracing::warn!(consumer = %self.config.consumer, "drain deadline passed: handing back the entries still running");
                }
            }
            drop(settled_tx);
        };
        let flushes = self.flush_settled(conn.clone(), settled_rx, &batch, &failure);
        // The hold lasts until every done entry is committed too.
        let work = async {
            let ((), flushed) = tokio::join!(handlers, flushes);
            done.notify_one();
            flushed
        };
        let holds = self.hold(conn.clone(), &batch, &done);
        tokio::select! {
            (flushed, ()) = async { tokio::join!(work, holds) } => {
                self.after_batch(conn, &batch, failure, flushed).await
            }
            // A failpoint: stop as a crash would, writing nothing more.
            () = batch.crash.notified() => Err(WorkerError::Failpoint("crash")),
        }
    }

    /// Hands back what the batch left open, then reports its first failure.
    async fn after_batch(
        &self,
        conn: &mut StreamConnection,
        batch: &Batch,
        failure: std::sync::Mutex<Option<WorkerError>>,
        flushed: Result<(), WorkerError>,
    ) -> Result<(), WorkerError> {
        let handed_back = self.hand_back_open(conn, batch).await;
        if let Some(e) = failure.into_inner().ok().flatten() {
            return Err(e);
        }
        flushed?;
        handed_back
    }

    /// Acks, unrun, replays addressed to another group of the same stream.
    async fn skip_foreign_replays(&self, conn: &mut StreamConnection, foreign: &[Entry]) -> Result<(), WorkerError> {
        if foreign.is_empty() || self.at_most_once {
            return Ok(());
        }
        let mut by_stream: BTreeMap<&str, Vec<(&str, Option<Completion>)>> = BTreeMap::new();
        for entry in foreign {
            by_stream.entry(entry.stream.as_str()).or_default().push((entry.id.as_str(), None));
        }
        for (stream, ids) in by_stream {
            self.lease(stream).commit(conn, 0, &ids).await?;
        }
        self.stats.add(&self.stats.foreign_replays, foreign.len());
        Ok(())
    }

    /// Runs one business key's entries in stream order.
    async fn run_group(
        &self,
        mut conn: StreamConnection,
        batch: &Batch,
        group: Vec<usize>,
        settled: tokio::sync::mpsc::UnboundedSender<(usize, Settled)>,
        failure: &std::sync::Mutex<Option<WorkerError>>,
    ) {
        for i in group {
            let failed = failure.lock().map_or(true, |f| f.is_some());
            // At-most-once entries are in no PEL: leaving one unstarted loses it.
            if failed || (stopping(&self.stop) && !self.at_most_once) {
                // Shutting down, or the batch failed: start nothing new.
                continue;
            }
            batch.phase[i].store(RUNNING, Ordering::SeqCst);
            match self.settle(&mut conn, batch, i).await {
                Ok(Settled::Leave) => batch.phase[i].store(SETTLED, Ordering::SeqCst),
                Ok(outcome) => {
                    batch.phase[i].store(DONE, Ordering::SeqCst);
                    let _ = settled.send((i, outcome));
                }
                Err(e) => {
                    if let WorkerError::Failpoint(_) = e {
                        batch.crash.notify_one();
                    }
                    let entry = &batch.entries[i];
                    tracing::warn!(error = %e, stream = %entry.stream, id = %entry.id, "settling an entry");
                    if let Ok(mut slot) = failure.lock() {
                        slot.get_or_insert(e);
                    }
                }
            }
        }
    }

    /// Resolves `drain_timeout` after shutdown began (never, until it does).
    async fn drain_deadline(&self) {
        while !stopping(&self.stop) {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        tokio::time::sleep(self.config.drain_timeout).await;
    }

    /// Extends the hold on the batch's unsettled entries every third of
    /// min-idle-time (2 s at most) until the handlers are done.
    async fn hold(&self, mut conn: StreamConnection, batch: &Batch, done: &tokio::sync::Notify) {
        if self.at_most_once {
            return;
        }
        // At least every 2 s: the hold is also what shows the operator this
        // consumer is alive while it reads nothing (`reaper::SILENT_FOR_MS`).
        let every = (self.config.min_idle / 3).clamp(Duration::from_millis(30), Duration::from_secs(2));
        loop {
            tokio::select! {
                () = done.notified() => return,
                () = tokio::time::sleep(every) => {}
            }
            for (stream, open) in batch.open_by_stream() {
                let held: Vec<Held> = open.iter().map(|&i| self.held(batch, i)).collect();
                let lease = self.lease(stream);
                let ttl = crate::guard::millis(self.config.min_idle);
                match lease.extend(&mut conn, ttl, &held).await {
                    Ok(owned) => {
                        for (i, ours) in open.into_iter().zip(owned) {
                            if !ours && batch.phase[i].load(Ordering::SeqCst) != SETTLED {
                                tracing::warn!(stream, id = %batch.entries[i].id, "an entry in hand was claimed by another consumer");
                            }
                        }
                    }
                    Err(e) => tracing::warn!(error = %e, "extending the hold on the batch"),
                }
            }
        }
    }

    /// Hands back every entry of the batch not settled: not started, or
    /// abandoned at the drain deadline.
    async fn hand_back_open(&self, conn: &mut StreamConnection, batch: &Batch) -> Result<(), WorkerError> {
        if self.at_most_once {
            return Ok(());
        }
        let idle = crate::guard::millis(self.config.min_idle).saturating_add(1);
        let mut failure = None;
        for (stream, open) in batch.open_by_stream() {
            let lease = self.lease(stream);
            for i in open {
                let entry = &batch.entries[i];
                let phase = batch.phase[i].load(Ordering::SeqCst);
                if phase == DONE {
                    // Its effect happened: never claimable early. It stays
                    // ours, mark and all, until min-idle-time passes.
                    continue;
                }
                // Each on its own: one failing leaves the rest handed back
                // (a failed one is claimable once idle past min-idle-time).
                // One never started is not counted by its next claim
                // (`started`); one abandoned running is, as a crash.
                if let Err(e) = lease.hand_back(conn, &self.held(batch, i), idle).await {
                    tracing::warn!(stream, id = %entry.id, error = %e, "handing an entry back");
                    failure.get_or_insert(WorkerError::from(e));
                }
                if let (Some(Idempotency::Store(store)), GuardState::Acquired) =
                    (&self.guard, batch.acquisitions[i].state)
                    && let Err(e) = store.release(&entry.stream, entry.event_id()).await
                {
                    failure.get_or_insert(store_error(e));
                }
            }
        }
        failure.map_or(Ok(()), Err)
    }

    fn lease<'a>(&'a self, stream: &'a str) -> Lease<'a> {
        Lease { stream, group: &self.config.group, consumer: &self.config.consumer }
    }

    /// An entry in hand, with its guard mark when the Redis guard gave it one.
    fn held<'a>(&self, batch: &'a Batch, i: usize) -> Held<'a> {
        Held { id: &batch.entries[i].id, mark: self.mark_of(batch, i) }
    }

    /// The Redis guard's mark of entry `i`: key and the value it acquired.
    fn mark_of(&self, batch: &Batch, i: usize) -> Option<(String, String)> {
        match (&self.guard, batch.acquisitions[i].fence) {
            (Some(Idempotency::Redis(guard)), Some(fence)) => {
                Some((guard.key(&batch.entries[i].stream, &batch.tokens[i]), guard.mark(fence)))
            }
            _ => None,
        }
    }

    /// The business key, or why there is none. A key extractor that panics
    /// marks the entry malformed instead of wedging it.
    fn key_of(&self, entry: &Entry) -> KeyOf {
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.handler.business_key(entry))) {
            Ok(Some(key)) => KeyOf::Key(key),
            Ok(None) => KeyOf::None,
            Err(panic) => KeyOf::Panicked(panic_message(panic.as_ref())),
        }
    }

    /// Sends the settled entries' completion marks and acks as they come, in
    /// as few round trips as they arrive in. A flush that fails is retried
    /// with backoff (its entries stay `DONE`, held, never handed back) for
    /// up to [`COMMIT_RETRY_FOR`] or twice min-idle-time after the last
    /// success; then the batch fails (no handler starts any more) and what
    /// is still uncommitted is left pending as it is.
    async fn flush_settled(
        &self,
        mut conn: StreamConnection,
        mut settled: tokio::sync::mpsc::UnboundedReceiver<(usize, Settled)>,
        batch: &Batch,
        batch_failure: &std::sync::Mutex<Option<WorkerError>>,
    ) -> Result<(), WorkerError> {
        let give_up_after = COMMIT_RETRY_FOR.max(self.config.min_idle * 2);
        let mut failing: Vec<(usize, Settled)> = Vec::new();
        let mut failure: Option<(WorkerError, Instant)> = None;
        let mut delay = RETRY_FIRST;
        let mut open = true;
        while open || !failing.is_empty() {
            let mut ready = std::mem::take(&mut failing);
            if open {
                if ready.is_empty() {
                    match settled.recv().await {
                        Some(first) => ready.push(first),
                        None => open = false,
                    }
                } else {
                    // Retrying: wait out the backoff unless more arrive.
                    match tokio::time::timeout(delay, settled.recv()).await {
                        Ok(Some(more)) => ready.push(more),
                        Ok(None) => open = false,
                        Err(_) => {}
                    }
                }
                while let Ok(more) = settled.try_recv() {
                    ready.push(more);
                }
            } else {
                tokio::time::sleep(delay).await;
            }
            // What an earlier, partly failed flush committed is not sent again.
            ready.retain(|(i, _)| batch.phase[*i].load(Ordering::SeqCst) != SETTLED);
            if ready.is_empty() {
                continue;
            }
            match self.flush(&mut conn, &ready, batch).await {
                Ok(()) => {
                    failure = None;
                    delay = RETRY_FIRST;
                }
                Err(e @ WorkerError::Failpoint(_)) => return Err(e),
                Err(e) => {
                    let since = failure.as_ref().map_or_else(Instant::now, |(_, at)| *at);
                    if since.elapsed() >= give_up_after {
                        tracing::error!(error = %e, entries = ready.len(), "committing done entries kept failing; left pending (their marks expire, then they are claimed and re-run)");
                        // No handler starts any more: its effect could not be committed either.
                        if let Ok(mut slot) = batch_failure.lock() {
                            slot.get_or_insert(e);
                        }
                        return Ok(());
                    }
                    tracing::warn!(error = %e, entries = ready.len(), retry_in = ?delay, "committing done entries failed; retrying");
                    failure = Some((e, since));
                    failing = ready;
                    delay = (delay * 2).min(RETRY_MAX);
                }
            }
        }
        Ok(())
    }

    async fn flush(
        &self,
        conn: &mut StreamConnection,
        ready: &[(usize, Settled)],
        batch: &Batch,
    ) -> Result<(), WorkerError> {
        if self.at_most_once {
            for (i, _) in ready {
                batch.phase[*i].store(SETTLED, Ordering::SeqCst);
            }
            return Ok(());
        }
        fail::fail_point!("worker::before-commit", |_| {
            batch.crash.notify_one();
            Err(WorkerError::Failpoint("worker::before-commit"))
        });
        let started = Instant::now();
        if let Some(Idempotency::Store(store)) = &self.guard {
            let completed: Vec<(&str, &str)> = ready
                .iter()
                .filter(|(_, s)| *s == Settled::AckCompleted)
                .map(|(i, _)| (batch.entries[*i].stream.as_str(), batch.entries[*i].event_id()))
                .collect();
            if !completed.is_empty() {
                store.complete(&completed).await.map_err(store_error)?;
            }
        }
        let mut by_stream: BTreeMap<&str, Vec<(&str, Option<Completion>)>> = BTreeMap::new();
        for &(i, settled) in ready {
            let entry = &batch.entries[i];
            let completion = match &self.guard {
                Some(Idempotency::Redis(guard)) if settled == Settled::AckCompleted => Some(Completion {
                    record: guard.completion_key(&entry.stream, entry.event_id()),
                    lock: self.mark_of(batch, i),
                }),
                _ => None,
            };
            by_stream.entry(entry.stream.as_str()).or_default().push((entry.id.as_str(), completion));
        }
        let completed_ttl = match &self.guard {
            Some(Idempotency::Redis(guard)) => crate::guard::millis(guard.completed_ttl()),
            _ => 0,
        };
        for (stream, settled) in by_stream {
            let not_ours = self.lease(stream).commit(conn, completed_ttl, &settled).await?;
            // Committed (acked here, or by the consumer that claimed it).
            for (i, _) in ready.iter().filter(|(i, _)| batch.entries[*i].stream == stream) {
                batch.phase[*i].store(SETTLED, Ordering::SeqCst);
            }
            if !not_ours.is_empty() {
                // Its effect happened; the consumer that claimed it acks it.
                self.stats.add(&self.stats.ownership_lost, not_ours.len());
                tracing::warn!(stream, ids = ?not_ours, "done, but claimed by another consumer meanwhile: not acked here");
            }
        }
        self.stats.ack_latency.observe(started.elapsed());
        Ok(())
    }

    /// Decides one entry.
    async fn settle(&self, conn: &mut StreamConnection, batch: &Batch, i: usize) -> Result<Settled, WorkerError> {
        let (entry, acquisition) = (&batch.entries[i], batch.acquisitions[i]);
        let key = match &batch.keys[i] {
            KeyOf::Key(key) => Some(key.as_str()),
            KeyOf::None => None,
            KeyOf::Panicked(why) => {
                let error = format!("the business key extractor panicked: {why}");
                return self.reject(conn, batch, i, Reason::Malformed, &error, None).await;
            }
        };
        match (acquisition.state, &self.guard) {
            // Completed by another delivery: acked as a duplicate, never
            // dead-lettered (a replay of that letter would be a second effect).
            (GuardState::Completed, Some(guard)) => {
                self.stats.add(&self.stats.suppressed, 1);
                if let Idempotency::Redis(guard) = guard {
                    guard.count_suppressed(conn, &entry.stream).await?;
                }
                return Ok(Settled::Ack);
            }
            _ if entry.crashes >= self.crash_limit() => {
                let error = format!(
                    "the worker process died {} times while this entry's handler ran (out of memory, an abort, a segfault?)",
                    entry.crashes
                );
                self.release(conn, batch, i).await?;
                self.dead_letter(conn, entry, Reason::CrashedWorker, &error, key).await?;
                return Ok(Settled::Leave);
            }
            _ if entry.deliveries > self.config.max_deliveries => {
                let error = deadletter::last_error(conn, &entry.stream, &self.config.group, &entry.id).await?;
                let error = error.unwrap_or_else(|| "delivered too often".into());
                // Its mark goes too, or later entries of the key wait it out.
                self.release(conn, batch, i).await?;
                self.dead_letter(conn, entry, Reason::MaxDeliveries, &error, key).await?;
                return Ok(Settled::Leave);
            }
            // Someone is on it (or crashed mid-way): leave it pending; it is
            // claimed again once idle past min-idle-time.
            (GuardState::Busy, _) => return Ok(Settled::Leave),
            _ => {}
        }
        if !self.at_most_once {
            self.record_start(conn, entry).await?;
        }
        let started = Instant::now();
        self.stats.delivered(entry.deliveries);
        let delivery = Delivery {
            consumer: self.config.consumer.clone(),
            stream: entry.stream.clone(),
            id: entry.id.clone(),
            deliveries: entry.deliveries,
            fence: acquisition.fence,
        };
        let outcome = DELIVERY.scope(delivery, self.handle_with_retries(entry)).await;
        self.stats.handler_latency.observe(started.elapsed());
        match outcome {
            Outcome::Done => {
                self.stats.add(&self.stats.processed, 1);
                fail::fail_point!("worker::after-effect", |_| Err(WorkerError::Failpoint("worker::after-effect")));
                Ok(Settled::AckCompleted)
            }
            Outcome::Transient(error) => {
                self.stats.add(&self.stats.failed, 1);
                self.release(conn, batch, i).await?;
                let error = format!("transient: {error}");
                if self.at_most_once {
                    tracing::warn!(stream = %entry.stream, id = %entry.id, error, "dropped (at-most-once delivery)");
                    return Ok(Settled::Leave);
                }
                if entry.deliveries >= self.config.max_deliveries {
                    self.dead_letter(conn, entry, Reason::MaxDeliveries, &error, key).await?;
                } else {
                    deadletter::record_last_error(conn, entry, &self.config.group, &error).await?;
                }
                Ok(Settled::Leave)
            }
            Outcome::Permanent(error) => self.reject(conn, batch, i, Reason::Permanent, &error, key).await,
            Outcome::Malformed(error) => self.reject(conn, batch, i, Reason::Malformed, &error, key).await,
        }
    }

    /// Records that `entry`'s handler starts (`started`), before it runs: if
    /// it takes the process down, the next claim knows it was running. While
    /// Redis is unreachable (a restart, a failover) it retries with backoff
    /// (the batch stays held meanwhile) rather than fail the batch, whose
    /// entries would then sit unheld; it gives up only on shutdown.
    async fn record_start(&self, conn: &mut StreamConnection, entry: &Entry) -> Result<(), WorkerError> {
        let mut delay = RETRY_FIRST;
        loop {
            match streamfleet_streams::started::record_start(conn, entry, &self.config.group).await {
                Ok(()) => return Ok(()),
                Err(e) if stopping(&self.stop) => return Err(e.into()),
                Err(e) => {
                    tracing::warn!(stream = %entry.stream, id = %entry.id, error = %e, retry_in = ?delay, "recording a handler's start failed; retrying");
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(RETRY_MAX);
                }
            }
        }
    }

    /// How many times a process may die while an entry's handler runs before
    /// the entry is dead-lettered as `crashed-worker`: [`CRASH_LIMIT`], or
    /// `maxDeliveries` when lower.
    fn crash_limit(&self) -> u32 {
        u32::try_from(self.config.max_deliveries).unwrap_or(u32::MAX).clamp(1, CRASH_LIMIT)
    }

    /// Drops the guard's hold on a key entry `i` acquired; from now on the
    /// entry is leaving the batch (`LEAVING`: no longer held).
    async fn release(&self, conn: &mut StreamConnection, batch: &Batch, i: usize) -> Result<(), WorkerError> {
        batch.phase[i].store(LEAVING, Ordering::SeqCst);
        let (entry, acquisition) = (&batch.entries[i], batch.acquisitions[i]);
        if acquisition.state != GuardState::Acquired {
            return Ok(());
        }
        match (&self.guard, acquisition.fence) {
            (Some(Idempotency::Redis(guard)), Some(fence)) => {
                guard.release(conn, &entry.stream, &batch.tokens[i], fence).await?
            }
            (Some(Idempotency::Store(store)), _) => {
                store.release(&entry.stream, entry.event_id()).await.map_err(store_error)?
            }
            _ => {}
        }
        Ok(())
    }

    /// Permanent and malformed entries leave at once, acked by their dead letter.
    async fn reject(
        &self,
        conn: &mut StreamConnection,
        batch: &Batch,
        i: usize,
        reason: Reason,
        error: &str,
        key: Option<&str>,
    ) -> Result<Settled, WorkerError> {
        self.stats.add(&self.stats.failed, 1);
        self.release(conn, batch, i).await?;
        self.dead_letter(conn, &batch.entries[i], reason, error, key).await?;
        Ok(Settled::Leave)
    }

    /// Runs the handler, retrying transient failures with exponential backoff
    /// and jitter for up to min-idle-time; the same budget is every attempt's
    /// deadline: a handler still running then is dropped and counts as a
    /// transient failure. The hold keeps the entry this one's meanwhile (no
    /// other consumer claims it), so the deadline only bounds a hung handler:
    /// an attempt dropped after its effect is run again by the next
    /// delivery, possibly elsewhere, which the handler's idempotency absorbs.
    async fn handle_with_retries(&self, entry: &Entry) -> Outcome {
        let budget = self.config.min_idle;
        let started = Instant::now();
        let mut delay = Duration::from_millis(50);
        loop {
            // A panicking handler fails this entry only (retried, and
            // dead-lettered past maxDeliveries like any failure).
            // Inside an async block, so a panic while building the future is caught too.
            let attempt = async { self.handler.handle(entry).await };
            let left = budget.saturating_sub(started.elapsed()).max(Duration::from_millis(1));
            let outcome = match tokio::time::timeout(left, std::panic::AssertUnwindSafe(attempt).catch_unwind()).await {
                // Past its deadline (min-idle-time): given up; the entry is
                // left for its next delivery.
                Err(_) => Outcome::Transient(format!("handler timed out after {left:?}")),
                Ok(Ok(outcome)) => outcome,
                Ok(Err(panic)) => Outcome::Transient(format!("handler panicked: {}", panic_message(panic.as_ref()))),
            };
            let Outcome::Transient(_) = &outcome else {
                return outcome;
            };
            let jittered = delay.mul_f64(rand::rng().random_range(0.5..1.5));
            if started.elapsed() + jittered >= budget {
                return outcome;
            }
            self.stats.add(&self.stats.retried, 1);
            tokio::time::sleep(jittered).await;
            delay = (delay * 2).min(budget / 4);
        }
    }

    async fn dead_letter(
        &self,
        conn: &mut StreamConnection,
        entry: &Entry,
        reason: Reason,
        error: &str,
        business_key: Option<&str>,
    ) -> Result<(), WorkerError> {
        let letter = Letter { group: &self.config.group, consumer: &self.config.consumer, reason, error, business_key };
        let dead_letter_stream = self.config.dead_letter_stream_of(&entry.stream);
        match deadletter::dead_letter(conn, &dead_letter_stream, entry, &letter).await {
            Ok(id) => {
                self.stats.dead_lettered_as(reason.as_str());
                tracing::warn!(stream = %entry.stream, id = %entry.id, dead_letter = %id, reason = reason.as_str(), error, "dead-lettered");
            }
            // Nothing was acked (the script acks only after its XADD): the
            // entry stays pending and fails alone; the rest of the batch goes on.
            Err(e) => {
                self.stats.add(&self.stats.dead_letter_failed, 1);
                tracing::error!(stream = %entry.stream, id = %entry.id, dead_letter_stream, error = %e, "dead-lettering failed; the entry stays pending");
            }
        }
        Ok(())
    }
}
