//! A batch in hand: its guard acquisitions, its handlers by business key,
//! and the tasks that run beside them (flushes, the hold).

use super::*;

/// A batch in hand.
pub(super) struct Batch {
    pub(super) entries: Vec<Entry>,
    pub(super) keys: Vec<KeyOf>,
    /// Each entry's guard token: its business key, or its ID.
    pub(super) tokens: Vec<String>,
    pub(super) acquisitions: Vec<Acquisition>,
    /// Where each entry stands (`phase`).
    pub(super) phase: Vec<PhaseCell>,
    /// Notified when a failpoint stops the batch where it stands (tests).
    pub(super) crash: tokio::sync::Notify,
    /// When the batch was taken, the origin of `handler_since`.
    pub(super) born: Instant,
    /// Per entry, since when (ms after `born`, plus 1) its handler has been
    /// running; 0 while none runs.
    pub(super) handler_since: Vec<std::sync::atomic::AtomicU64>,
    /// Taken by the hold across reading which entries are held and extending
    /// them, and by an entry leaving (`release`), so a guard mark released
    /// is never put back by an extension that read the entry as held.
    pub(super) extending: tokio::sync::Mutex<()>,
    /// Per stream, the proof that its entries are still this consumer's
    /// while young (from the read that delivered them; none for claimed ones).
    pub(super) held: BTreeMap<String, HeldSince>,
}

impl Batch {
    /// Moves entry `i` on by `event`. An event its phase does not allow is
    /// a defect: logged, the phase left as it is.
    pub(super) fn advance(&self, i: usize, event: Event) {
        if let Err(phase) = self.phase[i].apply(event) {
            tracing::error!(id = %self.entries[i].id, ?phase, ?event, "an entry's phase does not allow this event (a defect)");
        }
    }

    /// The proof that this batch's entries of `stream` are still held.
    pub(super) fn held_since(&self, stream: &str) -> Option<HeldSince> {
        self.held.get(stream).copied()
    }

    /// Entry `i`'s business key, if its extractor gave one.
    pub(super) fn key(&self, i: usize) -> Option<&str> {
        match &self.keys[i] {
            KeyOf::Key(key) => Some(key.as_str()),
            KeyOf::None | KeyOf::Panicked(_) => None,
        }
    }

    fn since_born(&self) -> u64 {
        streamfleet_streams::millis(self.born.elapsed()).saturating_add(1)
    }

    /// Entry `i`'s handler starts (`true`) or has returned (`false`).
    pub(super) fn handler_running(&self, i: usize, running: bool) {
        let since = if running { self.since_born() } else { 0 };
        self.handler_since[i].store(since, Ordering::SeqCst);
    }

    /// Whether entry `i`'s handler has been running for longer than `limit`.
    pub(super) fn hung(&self, i: usize, limit: Duration) -> bool {
        let since = self.handler_since[i].load(Ordering::SeqCst);
        since != 0 && self.since_born().saturating_sub(since) > streamfleet_streams::millis(limit)
    }

    /// The entries in hand (`Phase::is_held`), per stream.
    pub(super) fn open_by_stream(&self) -> BTreeMap<&str, Vec<usize>> {
        let mut open: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
        for (i, entry) in self.entries.iter().enumerate() {
            if self.phase[i].get().is_held() {
                open.entry(entry.stream.as_str()).or_default().push(i);
            }
        }
        open
    }
}

impl<H: Handler> Worker<H> {
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
    pub(super) async fn process(
        &self,
        conn: &mut StreamConnection,
        entries: Vec<Entry>,
        held: BTreeMap<String, HeldSince>,
    ) -> Result<(), WorkerError> {
        let (foreign, entries): (Vec<Entry>, Vec<Entry>) = entries.into_iter().partition(|e| {
            e.field_str(streamfleet_streams::replay::F_REPLAY_FOR).is_some_and(|group| group != self.config.group)
        });
        if let Err(e) = self.skip_foreign_replays(conn, &foreign).await {
            // Nothing started: handed back rather than orphaned (counted).
            self.hand_back_unstarted(conn, &foreign).await;
            self.hand_back_unstarted(conn, &entries).await;
            return Err(e);
        }
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
                guard.begin_all(conn, &with_events).await.map_err(WorkerError::from)
            }
            Some(Idempotency::Store(store)) => {
                let events: Vec<(&str, &str)> = entries.iter().map(|e| (e.stream.as_str(), e.event_id())).collect();
                store.begin(&events).await.map_err(store_error).map(|s| s.into_iter().map(acquired).collect())
            }
            None => Ok(vec![acquired(GuardState::Acquired); entries.len()]),
        };
        let acquisitions = match acquisitions {
            Ok(acquisitions) => acquisitions,
            Err(e) => {
                // Read, and nothing started (a slot migrating, the store
                // down): handed back unstarted rather than orphaned, so their
                // next claim does not count the delivery. The loop backs off.
                self.hand_back_unstarted(conn, &entries).await;
                return Err(e);
            }
        };
        let groups = key_groups(&items);
        drop(items);
        let batch = Arc::new(Batch {
            phase: entries.iter().map(|_| PhaseCell::default()).collect(),
            handler_since: entries.iter().map(|_| std::sync::atomic::AtomicU64::new(0)).collect(),
            entries,
            keys,
            tokens,
            acquisitions,
            crash: tokio::sync::Notify::new(),
            born: Instant::now(),
            extending: tokio::sync::Mutex::new(()),
            held,
        });
        let (settled_tx, settled_rx) = tokio::sync::mpsc::unbounded_channel::<(usize, Settled)>();
        let failure: std::sync::Mutex<Option<WorkerError>> = std::sync::Mutex::new(None);
        let (starts_tx, starts_rx) = tokio::sync::mpsc::unbounded_channel::<start::StartRequest>();
        let done = Arc::new(tokio::sync::Notify::new());
        let handlers = async {
            let run = futures::stream::iter(groups).for_each_concurrent(self.config.concurrency.max(1), |group| {
                let (tx, starts, conn, failure, batch) =
                    (settled_tx.clone(), starts_tx.clone(), conn.clone(), &failure, &batch);
                self.run_group(conn, batch, group, tx, starts, failure)
            });
            tokio::select! {
                () = run => {}
                () = self.drain_deadline() => {
                    tracing::warn!(consumer = %self.config.consumer, "drain deadline passed: handing back the entries still running");
                }
            }
            drop(settled_tx);
            drop(starts_tx);
        };
        let flushes = self.flush_settled(conn.clone(), settled_rx, &batch, &failure);
        let starts = self.record_starts(conn.clone(), starts_rx, &batch);
        // The hold lasts until every done entry is committed too.
        let work = async {
            let ((), flushed, ()) = tokio::join!(handlers, flushes, starts);
            done.notify_one();
            flushed
        };
        let holds = self.hold(&batch, &done);
        tokio::select! {
            (flushed, ()) = async { tokio::join!(work, holds) } => {
                self.after_batch(conn, &batch, failure, flushed).await
            }
            // A failpoint: stop as a crash would, writing nothing more.
            () = batch.crash.notified() => Err(WorkerError::Failpoint("crash")),
        }
    }

    /// Hands back what the batch left open, then reports its first failure.
    pub(super) async fn after_batch(
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
    pub(super) async fn skip_foreign_replays(
        &self,
        conn: &mut StreamConnection,
        foreign: &[Entry],
    ) -> Result<(), WorkerError> {
        if foreign.is_empty() || self.at_most_once {
            return Ok(());
        }
        let mut by_stream: BTreeMap<&str, Vec<(&str, Option<Completion>)>> = BTreeMap::new();
        for entry in foreign {
            by_stream.entry(entry.stream.as_str()).or_default().push((entry.id.as_str(), None));
        }
        for (stream, ids) in by_stream {
            self.lease(stream).commit(conn, 0, None, &ids).await?;
        }
        self.stats.add(&self.stats.foreign_replays, foreign.len());
        Ok(())
    }

    /// Runs one business key's entries in stream order.
    pub(super) async fn run_group(
        &self,
        mut conn: StreamConnection,
        batch: &Batch,
        group: Vec<usize>,
        settled: tokio::sync::mpsc::UnboundedSender<(usize, Settled)>,
        starts: start::Starts,
        failure: &std::sync::Mutex<Option<WorkerError>>,
    ) {
        for i in group {
            let failed = failure.lock().map_or(true, |f| f.is_some());
            // At-most-once entries are in no PEL: leaving one unstarted loses it.
            if failed || (stopping(&self.stop) && !self.at_most_once) {
                // Shutting down, or the batch failed: start nothing new.
                continue;
            }
            batch.advance(i, Event::Start);
            match self.settle(&mut conn, batch, i, &starts).await {
                Ok(Settled::Leave) => batch.advance(i, Event::Left),
                Ok(outcome) => {
                    batch.advance(i, Event::EffectDone);
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
    pub(super) async fn drain_deadline(&self) {
        while !stopping(&self.stop) {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        tokio::time::sleep(self.config.drain_timeout).await;
    }

    pub(super) fn lease<'a>(&'a self, stream: &'a str) -> Lease<'a> {
        Lease { holder: self.me(stream) }
    }

    /// This worker's consumer of the group on `stream`.
    pub(super) fn me<'a>(&'a self, stream: &'a str) -> ConsumerRef<'a> {
        ConsumerRef::new(stream, &self.config.group, &self.config.consumer)
    }

    /// An entry in hand, with its guard mark when the Redis guard gave it one.
    pub(super) fn held<'a>(&self, batch: &'a Batch, i: usize) -> Held<'a> {
        Held { id: &batch.entries[i].id, mark: self.mark_of(batch, i) }
    }

    /// The Redis guard's mark of entry `i`: key and the value it acquired.
    pub(super) fn mark_of(&self, batch: &Batch, i: usize) -> Option<(String, String)> {
        match (&self.guard, batch.acquisitions[i].fence) {
            (Some(Idempotency::Redis(guard)), Some(fence)) => {
                Some((guard.key(&batch.entries[i].stream, &batch.tokens[i]), guard.mark(fence)))
            }
            _ => None,
        }
    }

    /// The business key, or why there is none. A key extractor that panics
    /// marks the entry malformed instead of wedging it.
    pub(super) fn key_of(&self, entry: &Entry) -> KeyOf {
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.handler.business_key(entry))) {
            Ok(Some(key)) => KeyOf::Key(key),
            Ok(None) => KeyOf::None,
            Err(panic) => KeyOf::Panicked(panic_message(panic.as_ref())),
        }
    }
}
