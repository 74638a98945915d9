//! Committing done entries (completion records and acks) as they come,
//! retried while Redis is away.

use super::*;

/// How long a batch keeps retrying the commit of done entries (Redis down,
/// a failover): at least this, and at least twice min-idle-time, so a
/// restarted server's claim wait (`claim::claim_rules_lua`) is covered.
pub(super) const COMMIT_RETRY_FOR: Duration = Duration::from_secs(10);

impl<H: Handler> Worker<H> {
    /// Sends the settled entries' completion marks and acks as they come, in
    /// as few round trips as they arrive in. A flush that fails is retried
    /// with backoff (its entries stay `Done`, held, never handed back) for
    /// up to [`COMMIT_RETRY_FOR`] or twice min-idle-time after the last
    /// success; then the batch fails (no handler starts any more) and what
    /// is still uncommitted is left pending as it is.
    pub(super) async fn flush_settled(
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
                        Some(first) => {
                            ready.push(first);
                            // Its wave-mates are settling now: let them
                            // queue, so they share this flush.
                            tokio::task::yield_now().await;
                        }
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
            ready.retain(|(i, _)| batch.phase[*i].get() != Phase::Settled);
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

    pub(super) async fn flush(
        &self,
        conn: &mut StreamConnection,
        ready: &[(usize, Settled)],
        batch: &Batch,
    ) -> Result<(), WorkerError> {
        if self.at_most_once {
            for (i, _) in ready {
                batch.advance(*i, Event::Committed);
            }
            return Ok(());
        }
        fail::fail_point!("worker::before-commit", |_| {
            batch.crash.notify_one();
            Err(WorkerError::Failpoint("worker::before-commit"))
        });
        // A commit Redis refuses (out of memory, a reset): the entries stay
        // held and are sent again, never handed back (tests).
        fail::fail_point!("worker::commit-refused", |_| Err(WorkerError::Redis(StreamError::new(
            "committing done entries",
            redis::RedisError::from(std::io::Error::other("refused at failpoint worker::commit-refused")),
        ))));
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
            let held = batch.held_since(stream);
            let not_ours = self.lease(stream).commit(conn, completed_ttl, held, &settled).await?;
            // Committed (acked here, or by the consumer that claimed it).
            for (i, _) in ready.iter().filter(|(i, _)| batch.entries[*i].stream == stream) {
                batch.advance(*i, Event::Committed);
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
}
