//! The consumption loop: read a batch, run the handler on each entry, ack
//! what succeeded (after the handler's commit, never before), dead-letter
//! what must leave, leave the rest pending for redelivery; claim entries that
//! crashed consumers left idle; drain on shutdown.

use crate::guard::{Guard, GuardState, IdempotencyStore};
use crate::stats::Stats;
use futures::{FutureExt as _, StreamExt as _};
use rand::Rng as _;
use redis::streams::{StreamReadOptions, StreamReadReply};
use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};
use streamfleet_streams::claim::{autoclaim, claim_own};
use streamfleet_streams::config::{RunMode, WorkerConfig};
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
    /// The business key (an order ID, say): the idempotency token and the
    /// dead letter's `business-key`. `None` uses the entry ID.
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
        Self {
            config,
            handler: Arc::new(handler),
            guard: None,
            stats: Arc::new(Stats::default()),
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

    async fn consume(&self, conn: &mut StreamConnection, stop: &AtomicBool) -> Result<(), WorkerError> {
        let mut reader = StreamConnection::connect_blocking(&self.config.endpoint, self.config.block).await?;
        // Often enough that entries released from a dead consumer move within
        // a second or two; XAUTOCLAIM over an empty or fresh PEL is cheap.
        let claim_every = (self.config.min_idle / 2).min(Duration::from_secs(1));
        let mut next_claim = Instant::now();
        // Redis 8.4 can hand idle entries out with the read itself
        // (XREADGROUP ... CLAIM); older servers get the XAUTOCLAIM cycle. The
        // cycle runs in both cases: it also reports payloads lost while pending.
        let version = streamfleet_streams::version::server_version(conn).await?;
        let claim_in_read = !self.at_most_once && version.is_some_and(|v| v.has_readgroup_claim());
        tracing::info!(?version, claim_in_read, at_most_once = self.at_most_once, "consuming");
        if !self.at_most_once {
            // A restart under the same name (same pod): what this consumer read
            // before and never settled is handled first, at once.
            self.take_back_own(conn, stop).await?;
        }
        // Never cancel a read in flight: entries it delivered would sit in our
        // PEL unseen until claimed. The short BLOCK bounds the drain instead.
        while !stopping(stop) {
            if !self.at_most_once && Instant::now() >= next_claim {
                self.claim_cycle(conn, stop).await?;
                next_claim = Instant::now() + claim_every;
            }
            let entries = match self.read(&mut reader, claim_in_read).await {
                Ok(entries) => entries,
                Err(e) => {
                    tracing::warn!(error = %e, "read failed; retrying");
                    tokio::time::sleep(Duration::from_millis(500)).await;
                    continue;
                }
            };
            self.process(conn, entries).await?;
        }
        tracing::info!(consumer = %self.config.consumer, "drained; stopping");
        Ok(())
    }

    /// Recovery mode: claim every idle entry, re-run handlers, until a full
    /// pass over the PEL claims nothing.
    async fn recover(&self, conn: &mut StreamConnection, stop: &AtomicBool) -> Result<(), WorkerError> {
        let mut claimed = 0;
        while !stopping(stop) {
            let n = self.claim_cycle(conn, stop).await?;
            claimed += n;
            if n == 0 {
                break;
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
            let mut after = "-".to_string();
            while !stopping(stop) {
                let own =
                    claim_own(conn, stream, &self.config.group, &self.config.consumer, &after, self.config.batch_size)
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

    /// Claimed entries are handled; IDs whose payload is gone are recorded lost.
    async fn settle_claimed(
        &self,
        conn: &mut StreamConnection,
        stream: &str,
        deleted: Vec<String>,
        entries: Vec<Entry>,
    ) -> Result<(), WorkerError> {
        for id in &deleted {
            self.payload_missing(conn, stream, id).await?;
        }
        self.process(conn, entries).await
    }

    /// One pass of XAUTOCLAIM over each stream's PEL, from `0-0` until the
    /// cursor returns to `0-0`. Returns how many entries were claimed.
    async fn claim_cycle(&self, conn: &mut StreamConnection, stop: &AtomicBool) -> Result<usize, WorkerError> {
        let mut total = 0;
        for stream in &self.config.streams {
            let mut cursor = "0-0".to_string();
            loop {
                let claimed = autoclaim(
                    conn,
                    stream,
                    &self.config.group,
                    &self.config.consumer,
                    self.config.min_idle,
                    &cursor,
                    self.config.batch_size,
                )
                .await?;
                total += claimed.entries.len();
                self.stats.add(&self.stats.claimed, claimed.entries.len());
                self.settle_claimed(conn, stream, claimed.deleted, claimed.entries).await?;
                cursor = claimed.next;
                if cursor == "0-0" || stopping(stop) {
                    break;
                }
            }
        }
        Ok(total)
    }

    async fn read(&self, reader: &mut StreamConnection, claim_idle: bool) -> Result<Vec<Entry>, StreamError> {
        let block_ms = usize::try_from(self.config.block.as_millis()).unwrap_or(2000);
        let mut opts = StreamReadOptions::default()
            .group(&self.config.group, &self.config.consumer)
            .count(self.config.batch_size)
            .block(block_ms);
        if self.at_most_once {
            opts = opts.noack();
        }
        let ids: Vec<&str> = self.config.streams.iter().map(|_| ">").collect();
        let mut cmd = redis::cmd("XREADGROUP");
        cmd.arg(&opts);
        if claim_idle {
            cmd.arg("CLAIM").arg(u64::try_from(self.config.min_idle.as_millis()).unwrap_or(u64::MAX));
        }
        let reply: Option<StreamReadReply> = cmd
            .arg("STREAMS")
            .arg(&self.config.streams)
            .arg(&ids)
            .query_async(reader)
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
                            // A claimed entry (8.4 CLAIM) carries its count.
                            deliveries: e.delivered_count.and_then(|n| u64::try_from(n).ok()).unwrap_or(1),
                            id: e.id,
                            fields: fields_from_map(e.map),
                        })
                    })
                    .collect()
            })
            .unwrap_or_default())
    }

    /// Handles a batch: one round trip to learn every entry's guard state,
    /// then up to `concurrency` handlers at once (entries sharing a business
    /// key one after another, in stream order). Each entry is settled as soon
    /// as its handler is done: its completion mark and ack go out in the next
    /// small flush (mark first, so a crash between them leaves a completed key
    /// whose redelivery is suppressed, never an unmarked ack), never deferred
    /// to the end of the batch.
    async fn process(&self, conn: &mut StreamConnection, entries: Vec<Entry>) -> Result<(), WorkerError> {
        if entries.is_empty() {
            return Ok(());
        }
        let keys: Vec<KeyOf> = entries.iter().map(|e| self.key_of(e)).collect();
        let tokens: Vec<String> = entries
            .iter()
            .zip(&keys)
            .map(|(e, k)| match k {
                KeyOf::Key(key) => key.clone(),
                _ => e.id.clone(),
            })
            .collect();
        let items: Vec<(&str, &str)> =
            entries.iter().zip(&tokens).map(|(e, t)| (e.stream.as_str(), t.as_str())).collect();
        let states = match &self.guard {
            Some(Idempotency::Redis(guard)) => guard.begin_all(conn, &items).await?,
            Some(Idempotency::Store(store)) => store.begin(&items).await.map_err(store_error)?,
            None => vec![GuardState::Acquired; entries.len()],
        };
        let (settled_tx, settled_rx) = tokio::sync::mpsc::unbounded_channel::<(usize, Settled)>();
        let failure: std::sync::Mutex<Option<WorkerError>> = std::sync::Mutex::new(None);
        let handlers = async {
            futures::stream::iter(key_groups(&items))
                .for_each_concurrent(self.config.concurrency.max(1), |group| {
                    let (tx, mut conn, failure) = (settled_tx.clone(), conn.clone(), &failure);
                    let (entries, keys, tokens, states) = (&entries, &keys, &tokens, &states);
                    async move {
                        for i in group {
                            let failed = failure.lock().map_or(true, |f| f.is_some());
                            // At-most-once entries are in no PEL: leaving one unstarted loses it.
                            if failed || (stopping(&self.stop) && !self.at_most_once) {
                                // Shutting down, or the batch failed: start nothing
                                // new; let the next holder take it at once.
                                if states[i] == GuardState::Acquired
                                    && let Err(e) = self.release(&mut conn, &entries[i].stream, &tokens[i]).await
                                {
                                    tracing::warn!(error = %e, "releasing a mark on shutdown");
                                }
                                continue;
                            }
                            match self.settle(&mut conn, &entries[i], &keys[i], &tokens[i], states[i]).await {
                                Ok(Settled::Leave) => {}
                                Ok(settled) => {
                                    let _ = tx.send((i, settled));
                                }
                                Err(e) => {
                                    tracing::warn!(error = %e, stream = %entries[i].stream, id = %entries[i].id, "settling an entry");
                                    if let Ok(mut slot) = failure.lock() {
                                        slot.get_or_insert(e);
                                    }
                                }
                            }
                        }
                    }
                })
                .await;
            drop(settled_tx);
        };
        let flushes = self.flush_settled(conn.clone(), settled_rx, &entries, &tokens);
        let ((), flushed) = tokio::join!(handlers, flushes);
        if let Some(e) = failure.into_inner().ok().flatten() {
            return Err(e);
        }
        flushed
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
    /// as few round trips as they arrive in.
    async fn flush_settled(
        &self,
        mut conn: StreamConnection,
        mut settled: tokio::sync::mpsc::UnboundedReceiver<(usize, Settled)>,
        entries: &[Entry],
        tokens: &[String],
    ) -> Result<(), WorkerError> {
        let mut failure = None;
        while let Some(first) = settled.recv().await {
            let mut batch = vec![first];
            while let Ok(more) = settled.try_recv() {
                batch.push(more);
            }
            if let Err(e) = self.flush(&mut conn, &batch, entries, tokens).await {
                failure.get_or_insert(e);
            }
        }
        failure.map_or(Ok(()), Err)
    }

    async fn flush(
        &self,
        conn: &mut StreamConnection,
        batch: &[(usize, Settled)],
        entries: &[Entry],
        tokens: &[String],
    ) -> Result<(), WorkerError> {
        if self.at_most_once {
            return Ok(());
        }
        let started = Instant::now();
        let completed: Vec<(&str, &str)> = batch
            .iter()
            .filter(|(_, s)| *s == Settled::AckCompleted)
            .map(|(i, _)| (entries[*i].stream.as_str(), tokens[*i].as_str()))
            .collect();
        let mut acks: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
        for (i, _) in batch {
            acks.entry(entries[*i].stream.as_str()).or_default().push(entries[*i].id.as_str());
        }
        let mut pipe = redis::pipe();
        match &self.guard {
            Some(Idempotency::Redis(guard)) => {
                for (stream, token) in &completed {
                    guard.complete_into(&mut pipe, stream, token);
                }
            }
            Some(Idempotency::Store(store)) if !completed.is_empty() => {
                store.complete(&completed).await.map_err(store_error)?;
            }
            _ => {}
        }
        for (stream, ids) in &acks {
            pipe.cmd("XACK").arg(stream).arg(&self.config.group).arg(ids).ignore();
        }
        let () = pipe.query_async(conn).await.map_err(|e| StreamError::new("acking entries", e))?;
        self.stats.ack_latency.observe(started.elapsed());
        Ok(())
    }

    /// Decides one entry.
    async fn settle(
        &self,
        conn: &mut StreamConnection,
        entry: &Entry,
        key_of: &KeyOf,
        token: &str,
        state: GuardState,
    ) -> Result<Settled, WorkerError> {
        let key = match key_of {
            KeyOf::Key(key) => Some(key.as_str()),
            KeyOf::None => None,
            KeyOf::Panicked(why) => {
                let error = format!("the business key extractor panicked: {why}");
                return self.reject(conn, entry, Reason::Malformed, &error, None, token).await;
            }
        };
        if entry.deliveries > self.config.max_deliveries {
            let error = deadletter::last_error(conn, &entry.stream, &self.config.group, &entry.id).await?;
            let error = error.unwrap_or_else(|| "delivered too often".into());
            // Its mark goes too, or later entries of the key wait it out.
            if state == GuardState::Acquired {
                self.release(conn, &entry.stream, token).await?;
            }
            self.dead_letter(conn, entry, Reason::MaxDeliveries, &error, key).await?;
            return Ok(Settled::Leave);
        }
        match (state, &self.guard) {
            (GuardState::Completed, Some(guard)) => {
                self.stats.add(&self.stats.suppressed, 1);
                if let Idempotency::Redis(guard) = guard {
                    guard.count_suppressed(conn, &entry.stream).await?;
                }
                return Ok(Settled::Ack);
            }
            // Someone is on it (or crashed mid-way): leave it pending; it is
            // claimed again once idle past min-idle-time.
            (GuardState::Busy, _) => return Ok(Settled::Leave),
            _ => {}
        }
        let started = Instant::now();
        let outcome = self.handle_with_retries(entry).await;
        self.stats.handler_latency.observe(started.elapsed());
        match outcome {
            Outcome::Done => {
                self.stats.add(&self.stats.processed, 1);
                Ok(Settled::AckCompleted)
            }
            Outcome::Transient(error) => {
                self.stats.add(&self.stats.failed, 1);
                self.release(conn, &entry.stream, token).await?;
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
            Outcome::Permanent(error) => self.reject(conn, entry, Reason::Permanent, &error, key, token).await,
            Outcome::Malformed(error) => self.reject(conn, entry, Reason::Malformed, &error, key, token).await,
        }
    }

    async fn release(&self, conn: &mut StreamConnection, stream: &str, token: &str) -> Result<(), WorkerError> {
        match &self.guard {
            Some(Idempotency::Redis(guard)) => guard.release(conn, stream, token).await?,
            Some(Idempotency::Store(store)) => store.release(stream, token).await.map_err(store_error)?,
            None => {}
        }
        Ok(())
    }

    /// Permanent and malformed entries leave at once, acked by their dead letter.
    async fn reject(
        &self,
        conn: &mut StreamConnection,
        entry: &Entry,
        reason: Reason,
        error: &str,
        key: Option<&str>,
        token: &str,
    ) -> Result<Settled, WorkerError> {
        self.stats.add(&self.stats.failed, 1);
        self.release(conn, &entry.stream, token).await?;
        self.dead_letter(conn, entry, reason, error, key).await?;
        Ok(Settled::Leave)
    }

    /// Runs the handler, retrying transient failures with exponential backoff
    /// and jitter while the entry is far from min-idle-time (half of it), so
    /// no other consumer claims an entry this one still holds. The same half
    /// is every attempt's deadline: a handler still running then is dropped
    /// and counts as a transient failure.
    async fn handle_with_retries(&self, entry: &Entry) -> Outcome {
        let budget = self.config.min_idle / 2;
        let started = Instant::now();
        let mut delay = Duration::from_millis(50);
        loop {
            // A panicking handler fails this entry only (retried, and
            // dead-lettered past maxDeliveries like any failure).
            // Inside an async block, so a panic while building the future is caught too.
            let attempt = async { self.handler.handle(entry).await };
            let left = budget.saturating_sub(started.elapsed()).max(Duration::from_millis(1));
            let outcome = match tokio::time::timeout(left, std::panic::AssertUnwindSafe(attempt).catch_unwind()).await {
                // Past its deadline (half of min-idle-time): given up, so no one
                // claims the entry while its first holder still runs it.
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
        let id = deadletter::dead_letter(conn, &self.config.dead_letter_stream, entry, &letter).await?;
        self.stats.add(&self.stats.dead_lettered, 1);
        tracing::warn!(stream = %entry.stream, id = %entry.id, dead_letter = %id, reason = reason.as_str(), error, "dead-lettered");
        Ok(())
    }

    /// A pending entry whose payload is gone: never success. Recorded in the
    /// dead-letter stream (XAUTOCLAIM has already dropped it from the PEL).
    async fn payload_missing(&self, conn: &mut StreamConnection, stream: &str, id: &str) -> Result<(), WorkerError> {
        let entry = Entry { stream: stream.to_string(), id: id.to_string(), fields: Vec::new(), deliveries: 0 };
        self.stats.add(&self.stats.payload_missing, 1);
        self.dead_letter(conn, &entry, Reason::PayloadMissing, "payload trimmed or deleted while pending", None).await
    }
}
