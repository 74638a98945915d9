//! Taking entries back: this consumer's own after a restart, idle ones of
//! crashed consumers in the claim cycle, and recovery mode's passes.

use super::*;

/// Pages of due retries one claim cycle takes per stream.
const DUE_PAGES_PER_CYCLE: usize = 4;

impl<H: Handler> Worker<H> {
    /// Recovery mode: claim every idle entry, re-run handlers, until a full
    /// pass over the PEL claims nothing.
    pub(super) async fn recover(&self, conn: &mut StreamConnection, stop: &AtomicBool) -> Result<(), WorkerError> {
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
            left_pending: Vec::new(),
        };
        for stream in &self.config.streams {
            write_report(conn, self.me(stream).group(), &report).await?;
        }
        tracing::info!(?report, "recovery finished");
        Ok(())
    }

    /// Handles this consumer's own pending entries, oldest first.
    pub(super) async fn take_back_own(
        &self,
        conn: &mut StreamConnection,
        stop: &AtomicBool,
    ) -> Result<(), WorkerError> {
        for stream in &self.config.streams {
            let dead_letter_stream = self.config.dead_letter_stream_of(stream);
            let mut after = "-".to_string();
            while !stopping(stop) {
                let own = claim_own(
                    conn,
                    self.me(stream),
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
    pub(super) async fn settle_claimed(
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
        if suspects.is_empty() {
            return self.process(conn, rest, BTreeMap::new()).await;
        }
        // Their batch-mates would wait unheld while the suspects run one by
        // one: handed back first, unstarted (not counted), claimable at once.
        self.hand_back_unstarted(conn, &rest).await;
        for suspect in suspects {
            tracing::warn!(stream, id = %suspect.id, crashes = suspect.crashes, "running alone an entry whose handler was running when a worker died");
            self.process(conn, vec![suspect], BTreeMap::new()).await?;
        }
        Ok(())
    }

    /// Where claims on `dead_letter_stream`'s stream record pending entries
    /// found without a payload.
    pub(super) fn loss_record<'a>(&'a self, dead_letter_stream: &'a str) -> LossRecord<'a> {
        LossRecord {
            dead_letter_stream,
            consumer: &self.config.consumer,
            why: "payload trimmed or deleted while pending",
        }
    }

    /// Claims `stream`'s parked entries whose retry is due (`retry`), page
    /// by page, at most [`DUE_PAGES_PER_CYCLE`] (the rest next cycle: new
    /// entries are read meanwhile), and handles them. Returns how many were
    /// claimed.
    async fn claim_due_retries(
        &self,
        conn: &mut StreamConnection,
        stream: &str,
        dead_letter_stream: &str,
        stop: &AtomicBool,
    ) -> Result<usize, WorkerError> {
        let mut total = 0;
        for _ in 0..DUE_PAGES_PER_CYCLE {
            if stopping(stop) {
                break;
            }
            let due = match claim_due(
                conn,
                self.me(stream),
                &self.loss_record(dead_letter_stream),
                &self.config.retry,
                self.config.max_deliveries,
                self.take_at_once(),
            )
            .await
            {
                Ok(due) => due,
                // As for idle claims: one shard failing must not stop the others.
                Err(e) if self.config.mode == RunMode::Consume => {
                    tracing::warn!(stream, error = %e, "claiming entries due for a retry");
                    break;
                }
                Err(e) => return Err(e.into()),
            };
            let taken = due.entries.len() + due.deleted.len();
            if due.waiting > 0 && self.config.mode == RunMode::Recovery {
                tracing::info!(
                    stream,
                    waiting = due.waiting,
                    "entries parked for a retry that is not due yet: left to the consumers"
                );
            }
            total += due.entries.len();
            self.stats.add(&self.stats.claimed, due.entries.len());
            self.settle_claimed(conn, stream, due.deleted, due.entries).await?;
            if taken < self.take_at_once() {
                break;
            }
        }
        Ok(total)
    }

    /// One pass of idle claims over each stream's PEL, from `0-0` until the
    /// cursor returns to `0-0` (`claim::autoclaim`). Returns how many
    /// entries were claimed, and whether idle entries were deferred (after
    /// a restart, a failover or a stall their holders renew first: a consumer tries
    /// again next cycle, a recovery run waits).
    pub(super) async fn claim_cycle(
        &self,
        conn: &mut StreamConnection,
        stop: &AtomicBool,
    ) -> Result<(usize, bool), WorkerError> {
        let (mut total, mut deferred) = (0, false);
        for stream in &self.config.streams {
            let dead_letter_stream = self.config.dead_letter_stream_of(stream);
            total += self.claim_due_retries(conn, stream, &dead_letter_stream, stop).await?;
            let mut cursor = "0-0".to_string();
            loop {
                let claimed = match autoclaim(
                    conn,
                    self.me(stream),
                    &self.loss_record(&dead_letter_stream),
                    self.config.min_idle,
                    &cursor,
                    self.take_at_once(),
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
                // Idle entries deferred (the server restarted, failed over or
                // stalled less than min-idle-time ago: their holders renew first):
                // a consumer takes them in a later cycle; a recovery run
                // passes again (it stops only on a pass that claims nothing).
                deferred |= claimed.deferred;
                total += claimed.entries.len();
                self.stats.add(&self.stats.claimed, claimed.entries.len());
                self.settle_claimed(conn, stream, claimed.deleted, claimed.entries).await?;
                // (A cursor that does not move would spin: the rest next cycle.)
                if claimed.next == cursor || claimed.next == "0-0" || stopping(stop) {
                    break;
                }
                cursor = claimed.next;
            }
        }
        Ok((total, deferred))
    }
}
