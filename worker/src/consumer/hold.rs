//! Holding a batch's entries while it is in hand, and handing back what it
//! leaves open.

use super::*;

/// The thread that holds batches in hand and beats (tells Redis this
/// consumer is alive): a runtime and a connection of its own, so a handler
/// that blocks the worker's threads (`std::thread::sleep`, a synchronous
/// client called from async code) cannot starve the hold and let another
/// consumer claim, and run again, what this one is still running, nor
/// silence the heartbeat and have the operator take a live consumer for
/// dead. Started when the worker runs; ends when the worker is dropped.
pub(super) struct Holder {
    jobs: tokio::sync::mpsc::UnboundedSender<HoldJob>,
}

/// One batch to hold until `done`: its entries' IDs, streams and guard
/// marks (fixed once acquired) and phases (read as they move). Says on
/// `stopped` when it no longer extends anything.
struct HoldJob {
    batch: Arc<Batch>,
    marks: Vec<Option<(String, String)>>,
    done: Arc<tokio::sync::Notify>,
    stopped: tokio::sync::oneshot::Sender<()>,
}

impl Holder {
    fn start(config: &WorkerConfig) -> std::io::Result<Self> {
        let (jobs, mut queue) = tokio::sync::mpsc::unbounded_channel::<HoldJob>();
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        let site = Arc::new(HoldSite {
            conn: tokio::sync::OnceCell::new(),
            endpoint: config.endpoint.clone(),
            group: config.group.clone(),
            consumer: config.consumer.clone(),
            streams: config.streams.clone(),
            every: (config.min_idle / 3).clamp(Duration::from_millis(30), Duration::from_secs(2)),
            ttl: crate::guard::millis(config.min_idle),
            hung_after: hung_after(config),
        });
        std::thread::Builder::new().name("streamfleet-hold".into()).spawn(move || {
            runtime.block_on(async move {
                tokio::spawn(site.clone().beat());
                while let Some(job) = queue.recv().await {
                    let site = site.clone();
                    tokio::spawn(async move {
                        let HoldJob { batch, marks, done, mut stopped } = job;
                        tokio::select! {
                            () = site.hold(&batch, &marks, &done) => {
                                let _ = stopped.send(());
                            }
                            // The batch is gone (a failpoint's crash, a cancelled future): so is its hold.
                            () = stopped.closed() => {}
                        }
                    });
                }
            });
        })?;
        Ok(Self { jobs })
    }
}

/// How long a handler may run before its batch is let go: its longest
/// legitimate run (`longest_run`: the last attempt's start inside the retry
/// budget, then its deadline) and min-idle-time more. An attempt is dropped
/// at its deadline, so only a handler that blocks its thread past it (it
/// cannot be cancelled) runs this long; its batch is then claimed once
/// idle, as a crashed worker's would be, rather than held for as long as
/// the process lives.
fn hung_after(config: &WorkerConfig) -> Duration {
    super::settle::longest_run(config).saturating_add(config.min_idle)
}

/// Where the holder thread holds batches: its connection (made on first
/// use), the consumer, and how often and how long each hold lasts.
struct HoldSite {
    conn: tokio::sync::OnceCell<StreamConnection>,
    endpoint: streamfleet_streams::Endpoint,
    group: String,
    consumer: String,
    streams: Vec<String>,
    every: Duration,
    ttl: u64,
    /// A handler running longer than this is hung (`hung_after`).
    hung_after: Duration,
}

impl HoldSite {
    async fn connection(&self) -> Result<StreamConnection, StreamError> {
        self.conn.get_or_try_init(|| StreamConnection::connect(&self.endpoint)).await.cloned()
    }

    /// Tells each stream's group this consumer is alive every
    /// `HEARTBEAT_EVERY` (`consumers::heartbeat`), which also takes it out
    /// of the dead registry if the operator declared it dead while it
    /// lived. `XINFO CONSUMERS` idle time is no proof of life (Redis 7.0
    /// does not refresh it on an empty read).
    async fn beat(self: Arc<Self>) {
        let mut failing = false;
        let site = &*self;
        loop {
            let next = tokio::time::Instant::now() + HEARTBEAT_EVERY;
            let beaten = match site.connection().await {
                // Every stream at once, each bounded by the beat interval:
                // one slow shard delays no other shard's beat.
                Ok(conn) => futures::future::join_all(site.streams.iter().map(|stream| {
                    let mut conn = conn.clone();
                    async move {
                        let beat = consumers::heartbeat(&mut conn, ConsumerRef::new(stream, &site.group, &site.consumer));
                        match tokio::time::timeout(HEARTBEAT_EVERY, beat).await {
                            Ok(Ok(true)) => {
                                tracing::warn!(stream = %stream, consumer = %site.consumer, "this consumer had been declared dead while alive; no longer");
                                Ok(())
                            }
                            Ok(Ok(false)) => Ok(()),
                            Ok(Err(e)) => Err(e.to_string()),
                            Err(_) => Err(format!("no reply within {HEARTBEAT_EVERY:?}")),
                        }
                    }
                }))
                .await
                .into_iter()
                .collect::<Result<Vec<()>, String>>()
                .map(drop),
                Err(e) => Err(e.to_string()),
            };
            match beaten {
                // Once per outage, not every half second.
                Err(e) if !failing => {
                    tracing::warn!(error = %e, "recording this consumer alive failed; retrying");
                    failing = true;
                }
                Err(_) => {}
                Ok(()) => failing = false,
            }
            tokio::time::sleep_until(next).await;
        }
    }

    /// Extends the hold on the batch's unsettled entries every `every`
    /// until the batch is done, or until a handler of it is hung: a handler
    /// that blocks its thread freezes the batch's whole task (its other
    /// handlers, its commits), so the batch is let go as a crashed worker's
    /// would be, and claimed once idle. Should the hung handler return, the
    /// batch goes on unheld: an entry claimed away meanwhile is neither
    /// started (`started`) nor acked (`lease::commit`) here.
    async fn hold(&self, batch: &Batch, marks: &[Option<(String, String)>], done: &tokio::sync::Notify) {
        let (group, consumer, ttl) = (self.group.as_str(), self.consumer.as_str(), self.ttl);
        loop {
            tokio::select! {
                () = done.notified() => return,
                () = tokio::time::sleep(self.every) => {}
            }
            let mut conn = match self.connection().await {
                Ok(conn) => conn,
                // (The heartbeat logs the outage.)
                Err(_) => continue,
            };
            if let Some(i) = (0..batch.entries.len()).find(|&i| batch.hung(i, self.hung_after)) {
                let entry = &batch.entries[i];
                tracing::warn!(stream = %entry.stream, id = %entry.id, after = ?self.hung_after, "a handler is hung (it blocks its thread past its deadline, freezing its batch): the batch is no longer held, other consumers claim its entries once idle");
                return;
            }
            // No entry leaves between the snapshot and its extension: a
            // guard mark released meanwhile would be put back (`release`).
            let _turn = batch.extending.lock().await;
            for (stream, open) in batch.open_by_stream() {
                let held: Vec<Held> =
                    open.iter().map(|&i| Held { id: &batch.entries[i].id, mark: marks[i].clone() }).collect();
                let lease = Lease { holder: ConsumerRef::new(stream, group, consumer) };
                match lease.extend(&mut conn, ttl, &held).await {
                    Ok(owned) => {
                        for (i, ours) in open.into_iter().zip(owned) {
                            if !ours && batch.phase[i].get() != Phase::Settled {
                                tracing::warn!(stream, id = %batch.entries[i].id, "an entry in hand was claimed by another consumer");
                            }
                        }
                    }
                    Err(e) => tracing::warn!(error = %e, "extending the hold on the batch"),
                }
            }
        }
    }
}

impl<H: Handler> Worker<H> {
    /// The [`Holder`], started on first use. `None` (logged) if its thread
    /// could not be started: batches are then not held (their entries can
    /// be claimed once idle) and the consumer does not beat.
    pub(super) fn holder(&self) -> Option<&Holder> {
        if self.holder.get().is_none() {
            match Holder::start(&self.config) {
                Ok(holder) => {
                    let _ = self.holder.set(holder);
                }
                Err(e) => {
                    tracing::error!(error = %e, "starting the hold thread failed: batches are not held and this consumer does not beat");
                    return None;
                }
            }
        }
        self.holder.get()
    }

    /// Holds the batch's unsettled entries (on the [`Holder`]'s thread) until
    /// `done`; resolves once the hold no longer extends anything.
    pub(super) async fn hold(&self, batch: &Arc<Batch>, done: &Arc<tokio::sync::Notify>) {
        if self.at_most_once {
            return;
        }
        let Some(holder) = self.holder() else {
            return;
        };
        let (stopped, finished) = tokio::sync::oneshot::channel();
        let marks = (0..batch.entries.len()).map(|i| self.mark_of(batch, i)).collect();
        let job = HoldJob { batch: batch.clone(), marks, done: done.clone(), stopped };
        if holder.jobs.send(job).is_err() {
            tracing::error!("the hold thread is gone: this batch is not held (its entries can be claimed once idle)");
            return;
        }
        let _ = finished.await;
    }

    /// Hands back entries read or claimed but never started (no guard mark
    /// taken): claimable at once, their delivery not counted. Best effort:
    /// one that fails is claimed once idle past min-idle-time, and counted.
    pub(super) async fn hand_back_unstarted(&self, conn: &mut StreamConnection, entries: &[Entry]) {
        if self.at_most_once {
            return;
        }
        let idle = crate::guard::millis(self.config.min_idle).saturating_add(1);
        for entry in entries {
            let held = Held { id: &entry.id, mark: None };
            if let Err(e) = self.lease(&entry.stream).hand_back(conn, &held, idle, entry.deliveries, false).await {
                tracing::warn!(stream = %entry.stream, id = %entry.id, error = %e, "handing an entry back");
            }
        }
    }

    /// Hands back every entry of the batch not settled: not started, or
    /// abandoned at the drain deadline.
    pub(super) async fn hand_back_open(&self, conn: &mut StreamConnection, batch: &Batch) -> Result<(), WorkerError> {
        if self.at_most_once {
            return Ok(());
        }
        let idle = crate::guard::millis(self.config.min_idle).saturating_add(1);
        let mut failure = None;
        for (stream, open) in batch.open_by_stream() {
            let lease = self.lease(stream);
            for i in open {
                let entry = &batch.entries[i];
                let started = match batch.phase[i].get().hand_back() {
                    // Its effect happened: never claimable early. It stays
                    // ours, mark and all, until min-idle-time passes.
                    HandBack::Keep | HandBack::Nothing => continue,
                    // Not counted by its next claim (`started`): it never ran.
                    HandBack::NotStarted => false,
                    // Counted by its next claim (not as a crash): it ran.
                    HandBack::Abandoned => {
                        tracing::warn!(stream, id = %entry.id, "handing back an entry whose handler was still running (the drain deadline, or a failed batch)");
                        true
                    }
                };
                // Each on its own: one failing leaves the rest handed back
                // (a failed one is claimable once idle past min-idle-time).
                let held = self.held(batch, i);
                if let Err(e) = lease.hand_back(conn, &held, idle, entry.deliveries, started).await {
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
}
