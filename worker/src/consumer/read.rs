//! Reading new entries: one blocking reader per stream set (per hash slot
//! on a cluster).

use super::*;

/// How long each read blocks when a worker reads several slots of a cluster.
pub(super) const MULTI_SLOT_BLOCK: Duration = Duration::from_millis(200);

/// Entries one read delivered, and per stream the proof that they are
/// still this consumer's while young (`started::HeldSince`).
#[derive(Default)]
pub(super) struct Delivered {
    pub(super) entries: Vec<Entry>,
    pub(super) held: BTreeMap<String, HeldSince>,
}

/// A blocking read connection and the streams it reads together.
pub(super) struct Reader {
    pub(super) streams: Vec<String>,
    pub(super) conn: StreamConnection,
    pub(super) block: Duration,
}

impl<H: Handler> Worker<H> {
    /// The blocking readers: one for every stream on a standalone server; on
    /// a cluster one per hash slot (a multi-key `XREADGROUP` across slots is
    /// refused with CROSSSLOT), each blocking a shorter time so an entry on
    /// one slot never waits long for another slot's read to time out.
    pub(super) async fn readers(&self) -> Result<Vec<Reader>, WorkerError> {
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
    pub(super) async fn read(&self, readers: &mut [Reader]) -> Result<Delivered, StreamError> {
        if readers.len() > 1 {
            let delivered = self.read_all(readers, false).await?;
            if !delivered.entries.is_empty() {
                return Ok(delivered);
            }
        }
        self.read_all(readers, true).await
    }

    pub(super) async fn read_all(&self, readers: &mut [Reader], block: bool) -> Result<Delivered, StreamError> {
        let readers_count = readers.len();
        let results = futures::future::join_all(readers.iter_mut().map(|r| self.read_from(r, block))).await;
        let (mut entries, mut failure, mut failed) = (Delivered::default(), None, 0);
        for result in results {
            match result {
                Ok(mut read) => {
                    entries.entries.append(&mut read.entries);
                    entries.held.append(&mut read.held);
                }
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
            Some(e) if entries.entries.is_empty() && failed == readers_count => Err(e),
            _ => Ok(entries),
        }
    }

    /// Entries one read or one claim of others' entries takes into this
    /// worker's hands: `spec.worker.prefetch`, else the batch size (per
    /// stream: a read over several shards takes this many from each).
    pub(super) fn take_at_once(&self) -> usize {
        self.config.options.prefetch.map_or(self.config.batch_size, |n| usize::try_from(n).unwrap_or(1))
    }

    /// New entries only: idle ones are taken by the claim cycle, never by
    /// `XREADGROUP … CLAIM` (8.4), which would bypass what the claim script
    /// checks (a young server epoch, a live holder's trimmed entry). The
    /// server's time, read in the same round trip just before, is the proof
    /// of the hold on what the read delivers.
    pub(super) async fn read_from(&self, reader: &mut Reader, block: bool) -> Result<Delivered, StreamError> {
        let mut opts =
            StreamReadOptions::default().group(&self.config.group, &self.config.consumer).count(self.take_at_once());
        if block {
            opts = opts.block(usize::try_from(streamfleet_streams::millis(reader.block)).unwrap_or(2000));
        }
        if self.at_most_once {
            opts = opts.noack();
        }
        let ids: Vec<&str> = reader.streams.iter().map(|_| ">").collect();
        let mut read = redis::cmd("XREADGROUP");
        read.arg(&opts).arg("STREAMS").arg(&reader.streams).arg(&ids);
        let failed = |e| StreamError::new("reading new entries", e);
        // (At-most-once: nothing is held.)
        let (read_at, reply): (Option<u64>, redis::Value) = match reader.streams.first() {
            Some(first) if !self.at_most_once => {
                let mut pipe = redis::pipe();
                pipe.add_command(streamfleet_streams::started::server_ms_command(first)).add_command(read);
                let (at, reply): (u64, redis::Value) = pipe.query_async(&mut reader.conn).await.map_err(failed)?;
                (Some(at), reply)
            }
            _ => (None, read.query_async(&mut reader.conn).await.map_err(failed)?),
        };
        let streams = read_reply_from_value(reply).map_err(|e| failed(e.into()))?;
        let held = match read_at {
            Some(at) => {
                let proof = HeldSince::new(at, self.config.min_idle);
                streams.iter().map(|(stream, _)| (stream.clone(), proof)).collect()
            }
            None => BTreeMap::new(),
        };
        let entries = streams
            .into_iter()
            .flat_map(|(stream, entries)| {
                entries.into_iter().map(move |(id, fields)| Entry {
                    stream: stream.clone(),
                    deliveries: 1,
                    crashes: 0,
                    id,
                    fields,
                })
            })
            .collect();
        Ok(Delivered { entries, held })
    }
}
