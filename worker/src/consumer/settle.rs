//! Deciding one entry: the guard's verdict, the crash and delivery limits,
//! the handler with its in-process retries, and where the entry goes.

use super::*;

/// How many times a worker process may die while one entry's handler runs
/// (it ran alone after the first) before the entry is dead-lettered as
/// `crashed-worker`, as Sidekiq's super_fetch quarantines a job that kills
/// its process.
pub(super) const CRASH_LIMIT: u32 = 3;

/// How long a transient failure is retried in process before the entry
/// waits for its next delivery on the schedule (at most a quarter of
/// min-idle-time).
pub(super) const IN_PROCESS_RETRIES_FOR: Duration = Duration::from_secs(1);

/// How long one attempt of a handler may run before it is dropped and
/// counts as a transient failure: the pipeline's handler timeout, else
/// min-idle-time.
pub(super) fn handler_deadline(config: &WorkerConfig) -> Duration {
    config.options.handler_timeout_ms.map_or(config.min_idle, Duration::from_millis)
}

/// How long in-process retries of one delivery may go on: a blip's worth.
fn retry_budget(deadline: Duration) -> Duration {
    IN_PROCESS_RETRIES_FOR.min(deadline / 4)
}

/// The longest one delivery's handler runs without being hung: a last
/// attempt may start just inside the retry budget and run to its deadline.
pub(super) fn longest_run(config: &WorkerConfig) -> Duration {
    let deadline = handler_deadline(config);
    deadline.saturating_add(retry_budget(deadline))
}

impl<H: Handler> Worker<H> {
    /// Decides one entry.
    pub(super) async fn settle(
        &self,
        conn: &mut StreamConnection,
        batch: &Batch,
        i: usize,
        starts: &start::Starts,
    ) -> Result<Settled, WorkerError> {
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
                let error = deadletter::last_error(conn, self.me(&entry.stream).group(), &entry.id).await?;
                let error = error.unwrap_or_else(|| "delivered too often".into());
                // Its mark goes too, or later entries of the key wait it out.
                self.release(conn, batch, i).await?;
                self.dead_letter(conn, entry, Reason::MaxDeliveries, &error, key).await?;
                return Ok(Settled::Leave);
            }
            // Someone is on it (or crashed mid-way): leave it pending; it is
            // claimed again once idle past min-idle-time.
            (GuardState::Busy, _) => {
                // Not run: its next claim does not count this delivery.
                if !self.at_most_once {
                    let (group, consumer) = (&self.config.group, &self.config.consumer);
                    streamfleet_streams::started::record_not_started(conn, entry, key, group, consumer).await?;
                }
                return Ok(Settled::Leave);
            }
            _ => {}
        }
        let probe = match self.gate() {
            Gate::Run => false,
            Gate::Probe => true,
            // Its last attempt is made, open or not: an entry is never
            // dead-lettered without a call at its horizon.
            Gate::Wait { .. } if entry.deliveries >= self.config.max_deliveries => false,
            // The downstream is failing: not called. The delivery fails as
            // the call would have, and the entry goes on along its schedule
            // (so its horizon is the same with the breaker as without).
            Gate::Wait { error, .. } => {
                self.stats.add(&self.stats.circuit_waited, 1);
                self.release(conn, batch, i).await?;
                let error = format!("not called, the circuit is open after repeated failures: {error}");
                self.retry_later(conn, entry, &error, key).await?;
                return Ok(Settled::Leave);
            }
        };
        fail::fail_point!("worker::before-start");
        if !self.at_most_once && !self.start(starts, i).await? {
            // Claimed away since it was read (this consumer's hold lapsed):
            // its new holder runs it, not this one.
            tracing::info!(stream = %entry.stream, id = %entry.id, "not started: another consumer holds the entry now");
            self.release(conn, batch, i).await?;
            return Ok(Settled::Leave);
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
        batch.handler_running(i, true);
        let outcome = DELIVERY.scope(delivery, self.handle_with_retries(entry, probe)).await;
        batch.handler_running(i, false);
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
                self.retry_later(conn, entry, &error, key).await?;
                Ok(Settled::Leave)
            }
            Outcome::Permanent(error) => self.reject(conn, batch, i, Reason::Permanent, &error, key).await,
            Outcome::Malformed(error) => self.reject(conn, batch, i, Reason::Malformed, &error, key).await,
        }
    }

    /// A transient failure: the entry is parked until its next attempt is
    /// due on the retry schedule (`retry`), or dead-lettered
    /// `retries-exhausted` when this was its last delivery or its
    /// `retryFor` horizon has passed.
    pub(super) async fn retry_later(
        &self,
        conn: &mut StreamConnection,
        entry: &Entry,
        error: &str,
        key: Option<&str>,
    ) -> Result<(), WorkerError> {
        let schedule = &self.config.retry;
        let exhausted = |why: String| format!("{error} (gave up: {why})");
        if entry.deliveries >= self.config.max_deliveries {
            let why = exhausted(format!("{} attempts, the most maxDeliveries allows", entry.deliveries));
            return self.dead_letter(conn, entry, Reason::RetriesExhausted, &why, key).await;
        }
        let dead_letter_stream = self.config.dead_letter_stream_of(&entry.stream);
        let loss = self.loss_record(&dead_letter_stream);
        let jitter = rand::rng().random_range(0.0..1.0);
        let parked = streamfleet_streams::retry::park(
            conn,
            entry,
            &self.config.group,
            &self.config.consumer,
            &loss,
            schedule,
            error,
            jitter,
        )
        .await?;
        match parked {
            Parked::Until(delay) => {
                self.stats.add(&self.stats.parked, 1);
                tracing::info!(stream = %entry.stream, id = %entry.id, deliveries = entry.deliveries, retry_in = ?delay, error, "failed; retrying on the schedule");
            }
            Parked::HorizonPassed => {
                let limit = schedule.retry_for.unwrap_or_default();
                let why = exhausted(format!("{} attempts, retryFor {limit:?} passed", entry.deliveries));
                self.dead_letter(conn, entry, Reason::RetriesExhausted, &why, key).await?;
            }
            Parked::NotOurs => {
                tracing::info!(stream = %entry.stream, id = %entry.id, "failed, and no longer this consumer's: left to its holder");
            }
            Parked::Lost => {
                self.stats.add(&self.stats.payload_missing, 1);
                tracing::warn!(stream = %entry.stream, id = %entry.id, "failed, and its payload was trimmed or deleted meanwhile: recorded as lost");
            }
        }
        Ok(())
    }

    /// Whether a handler may call the downstream now (`breaker`).
    fn gate(&self) -> Gate {
        match &self.breaker {
            Some(breaker) => breaker.lock().unwrap_or_else(std::sync::PoisonError::into_inner).gate(Instant::now()),
            None => Gate::Run,
        }
    }

    /// Whether the breaker is open now.
    fn circuit_open(&self) -> bool {
        self.breaker.as_ref().is_some_and(|b| b.lock().unwrap_or_else(std::sync::PoisonError::into_inner).is_open())
    }

    /// Tells the breaker how a delivery's call went.
    fn record_delivery(&self, failure: Result<(), &str>, probe: bool) {
        let Some(breaker) = &self.breaker else {
            return;
        };
        let mut breaker = breaker.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        match breaker.record(Instant::now(), failure, probe) {
            Some(Transition::Opened { failures, attempts, error, wait }) => {
                self.stats.circuit_open.set(1);
                tracing::warn!(
                    failures,
                    attempts,
                    error,
                    ?wait,
                    "most attempts fail with the same error: calls paused (circuit open); entries go on along their retry schedule uncalled until a probe succeeds"
                );
            }
            Some(Transition::Closed) => {
                self.stats.circuit_open.set(0);
                tracing::info!("a probe succeeded: calls resume (circuit closed)");
            }
            None => {}
        }
    }

    /// How many times a process may die while an entry's handler runs before
    /// the entry is dead-lettered as `crashed-worker`: [`CRASH_LIMIT`], or
    /// `maxDeliveries` when lower.
    pub(super) fn crash_limit(&self) -> u32 {
        u32::try_from(self.config.max_deliveries).unwrap_or(u32::MAX).clamp(1, CRASH_LIMIT)
    }

    /// Drops the guard's hold on a key entry `i` acquired; from now on the
    /// entry is leaving the batch (`Phase::Leaving`: no longer held).
    pub(super) async fn release(
        &self,
        conn: &mut StreamConnection,
        batch: &Batch,
        i: usize,
    ) -> Result<(), WorkerError> {
        // Not while the hold extends (it read the entry as held, and would
        // put the mark back): once marked leaving, no extension touches it.
        let turn = batch.extending.lock().await;
        batch.advance(i, Event::Leave);
        drop(turn);
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
    pub(super) async fn reject(
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

    /// Runs the handler, retrying a transient failure in process for a short
    /// while only ([`IN_PROCESS_RETRIES_FOR`], a blip); past that the entry
    /// waits for its next delivery on the retry schedule (`retry_later`), so
    /// the horizon is the schedule's whatever the batch size, the
    /// concurrency or the handler time. Every attempt's deadline is
    /// [`handler_deadline`]: a handler still running then is dropped and counts as
    /// a transient failure. The hold keeps the entry this one's meanwhile
    /// (no other consumer claims it), so the deadline only bounds a hung
    /// handler: an attempt dropped after its effect is run again by the next
    /// delivery, possibly elsewhere, which the handler's idempotency absorbs.
    pub(super) async fn handle_with_retries(&self, entry: &Entry, probe: bool) -> Outcome {
        let deadline = handler_deadline(&self.config);
        let budget = retry_budget(deadline);
        let started = Instant::now();
        let mut delay = Duration::from_millis(50);
        loop {
            // A panicking handler fails this entry only (retried, and
            // dead-lettered past maxDeliveries like any failure).
            // Inside an async block, so a panic while building the future is caught too.
            let attempt = async { self.handler.handle(entry).await };
            let outcome = match tokio::time::timeout(deadline, std::panic::AssertUnwindSafe(attempt).catch_unwind())
                .await
            {
                // Past its deadline: given up; the entry is
                // left for its next delivery.
                Err(_) => Outcome::Transient(format!("handler timed out after {deadline:?}")),
                Ok(Ok(outcome)) => outcome,
                Ok(Err(panic)) => Outcome::Transient(format!("handler panicked: {}", panic_message(panic.as_ref()))),
            };
            let Outcome::Transient(error) = &outcome else {
                // The downstream answered (done, or refused for good).
                self.record_delivery(Ok(()), probe);
                return outcome;
            };
            let jittered = delay.mul_f64(rand::rng().random_range(0.5..1.5));
            // A probe is one attempt; an open breaker stops the calls (opened
            // by other deliveries meanwhile).
            if probe || self.circuit_open() || started.elapsed() + jittered >= budget {
                // One outcome per delivery, not per attempt: a few entries'
                // in-process retries are no outage. A panic is this
                // handler's bug, not the downstream's.
                let panicked = error.starts_with("handler panicked");
                if !panicked || probe {
                    self.record_delivery(Err(error), probe);
                }
                return outcome;
            }
            self.stats.add(&self.stats.retried, 1);
            tokio::time::sleep(jittered).await;
            delay = (delay * 2).min(budget / 2);
        }
    }

    pub(super) async fn dead_letter(
        &self,
        conn: &mut StreamConnection,
        entry: &Entry,
        reason: Reason,
        error: &str,
        business_key: Option<&str>,
    ) -> Result<(), WorkerError> {
        let letter = Letter {
            group: &self.config.group,
            consumer: &self.config.consumer,
            reason,
            error,
            business_key,
            // (At-most-once: read with NOACK, never pending.)
            while_pending: !self.at_most_once,
        };
        let dead_letter_stream = self.config.dead_letter_stream_of(&entry.stream);
        match deadletter::dead_letter(conn, &dead_letter_stream, entry, &letter).await {
            Ok(Some(id)) => {
                self.stats.dead_lettered_as(reason.as_str());
                tracing::warn!(stream = %entry.stream, id = %entry.id, dead_letter = %id, reason = reason.as_str(), error, "dead-lettered");
            }
            Ok(None) => {
                tracing::info!(stream = %entry.stream, id = %entry.id, reason = reason.as_str(), "no longer pending (already dead-lettered or acknowledged): no letter written");
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
