//! Holding a batch's entries while it is in hand, and handing back what it
//! leaves open.

use super::*;

impl<H: Handler> Worker<H> {
    /// Extends the hold on the batch's unsettled entries every third of
    /// min-idle-time (2 s at most) until the handlers are done.
    pub(super) async fn hold(&self, mut conn: StreamConnection, batch: &Batch, done: &tokio::sync::Notify) {
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
