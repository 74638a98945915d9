//! Recording handlers' starts as a group commit: the handlers of a batch
//! that are about to start together (up to `concurrency`) have their start
//! records (`started`) written by one script per stream, not one each.
//! Each still waits for its own record before it runs.

use super::*;

/// One handler waiting to start: its entry's index in the batch, and where
/// to say whether it may (`None`: the record could not be written, and the
/// worker is stopping).
pub(super) type StartRequest = (usize, tokio::sync::oneshot::Sender<Option<bool>>);

/// Where a batch's handlers ask for their start records.
pub(super) type Starts = tokio::sync::mpsc::UnboundedSender<StartRequest>;

impl<H: Handler> Worker<H> {
    /// Writes the start records asked for, as they come: all that queued
    /// while the last write was in flight go in the next, one script per
    /// stream. While Redis is unreachable (a restart, a failover) it retries
    /// with backoff (the batch stays held meanwhile) rather than fail the
    /// batch, whose entries would then sit unheld; it gives up only on
    /// shutdown. Ends when every handler's sender is gone.
    pub(super) async fn record_starts(
        &self,
        conn: StreamConnection,
        mut requests: tokio::sync::mpsc::UnboundedReceiver<StartRequest>,
        batch: &Batch,
    ) {
        let mut delay = RETRY_FIRST;
        let mut waiting: Vec<StartRequest> = Vec::new();
        loop {
            if waiting.is_empty() {
                match requests.recv().await {
                    Some(first) => waiting.push(first),
                    None => return,
                }
                // The handlers that start beside this one are being polled
                // now (one reply woke them all): let them queue, so they
                // share this write rather than wait for the next.
                tokio::task::yield_now().await;
            }
            while let Ok(more) = requests.try_recv() {
                waiting.push(more);
            }
            let mut by_stream: BTreeMap<&str, Vec<StartRequest>> = BTreeMap::new();
            for request in waiting.drain(..) {
                by_stream.entry(batch.entries[request.0].stream.as_str()).or_default().push(request);
            }
            // One script per stream, all at once, each stream's handlers told
            // as soon as its script returns: a shard failing over holds up no
            // other shard's handlers.
            let mut scripts: futures::stream::FuturesUnordered<_> = by_stream
                .iter()
                .map(|(&stream, requests)| {
                    // With each its business key: a loss or poison letter
                    // written without the payload can still name it.
                    let starting: Vec<(&str, u64, Option<&str>)> = requests
                        .iter()
                        .map(|(i, _)| {
                            let entry = &batch.entries[*i];
                            (entry.id.as_str(), entry.deliveries, batch.key(*i))
                        })
                        .collect();
                    let mut conn = conn.clone();
                    async move {
                        let held = streamfleet_streams::started::record_starts(
                            &mut conn,
                            self.me(stream),
                            batch.held_since(stream),
                            &starting,
                        )
                        .await;
                        (stream, held)
                    }
                })
                .collect();
            let mut failed = None;
            while let Some((stream, held)) = scripts.next().await {
                match held {
                    Ok(held) => {
                        for ((_, reply), held) in by_stream.remove(stream).unwrap_or_default().into_iter().zip(held) {
                            let _ = reply.send(Some(held));
                        }
                    }
                    Err(e) => failed = Some(e),
                }
            }
            // The rest wait for the next write.
            waiting.extend(by_stream.into_values().flatten());
            match failed {
                None => delay = RETRY_FIRST,
                Some(e) if stopping(&self.stop) => {
                    tracing::warn!(error = %e, "recording handlers' start failed while stopping: they do not start");
                    for (_, reply) in waiting.drain(..) {
                        let _ = reply.send(None);
                    }
                }
                Some(e) => {
                    tracing::warn!(error = %e, entries = waiting.len(), retry_in = ?delay, "recording handlers' start failed; retrying");
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(RETRY_MAX);
                }
            }
        }
    }

    /// Waits for entry `i`'s start record (`record_starts`). False when this
    /// consumer no longer holds the entry: its handler must not start.
    pub(super) async fn start(&self, starts: &Starts, i: usize) -> Result<bool, WorkerError> {
        let (reply, answer) = tokio::sync::oneshot::channel();
        if starts.send((i, reply)).is_ok()
            && let Ok(Some(held)) = answer.await
        {
            return Ok(held);
        }
        Err(WorkerError::Stopped("recording a handler's start: Redis unreachable while stopping"))
    }
}
