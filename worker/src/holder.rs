//! The hold on the batches in hand, on a thread of its own: a current-thread
//! runtime with its own Redis connection. Handlers that block their threads
//! (a `std::thread::sleep`, a blocking client, a long computation) can then
//! never starve it; a starved hold lets an entry in hand pass min-idle-time
//! and another consumer claim it: a second holder.

use crate::lease::{Held, Lease};
use crate::phase::{Phase, PhaseCell};
use std::sync::Arc;
use std::time::Duration;
use streamfleet_streams::{Endpoint, StreamConnection};
use tokio::sync::{Notify, mpsc, oneshot};

/// One entry a hold renews: its stream, ID and guard mark (key, value).
pub(crate) struct HeldEntry {
    pub stream: String,
    pub id: String,
    pub mark: Option<(String, String)>,
}

/// What the hold thread needs to know of the worker.
#[derive(Clone)]
pub(crate) struct HoldSettings {
    pub endpoint: Endpoint,
    pub group: String,
    pub consumer: String,
    /// How long a renewed mark lives (min-idle-time).
    pub mark_ttl_ms: u64,
    /// How often the entries are renewed.
    pub every: Duration,
}

/// A batch to hold until its [`HoldHandle`] lets go.
struct HoldJob {
    entries: Arc<Vec<HeldEntry>>,
    phases: Arc<[PhaseCell]>,
    /// Receives the sender to acknowledge the release with.
    release: oneshot::Receiver<oneshot::Sender<()>>,
}

/// The hold thread; dropping it ends the thread.
pub(crate) struct Holder {
    jobs: mpsc::UnboundedSender<HoldJob>,
    wake: Arc<Notify>,
    patience: Duration,
}

/// Holds a batch while it lives; [`HoldHandle::release`] stops the hold and
/// waits until no renewal is in flight (a renewal after a hand-back would
/// make the entry unclaimable again, or put its mark back).
pub(crate) struct HoldHandle {
    release: Option<oneshot::Sender<oneshot::Sender<()>>>,
    wake: Arc<Notify>,
    /// How long a release waits for a renewal in flight.
    patience: Duration,
}

impl HoldHandle {
    pub async fn release(mut self) {
        let (ack, acked) = oneshot::channel();
        if let Some(release) = self.release.take()
            && release.send(ack).is_ok()
        {
            self.wake.notify_one();
            // An error: the thread is gone, and with it any renewal. A
            // renewal stuck on a server that does not answer must not stall
            // the consume loop: past the patience, the worst a late renewal
            // does is delay a handed-back entry's next claim by min-idle-time.
            if tokio::time::timeout(self.patience, acked).await.is_err() {
                tracing::warn!("the hold did not let go in time (a renewal in flight); going on");
            }
        }
    }
}

impl Drop for HoldHandle {
    fn drop(&mut self) {
        // Dropped without a release (a failpoint's crash, a cancelled
        // batch): the hold stops at the thread's next look.
        if let Some(release) = self.release.take() {
            let (ack, _) = oneshot::channel();
            let _ = release.send(ack);
            self.wake.notify_one();
        }
    }
}

impl Holder {
    /// Starts the hold thread. Fails only if the OS refuses a thread.
    pub fn start(settings: HoldSettings) -> std::io::Result<Self> {
        let (jobs, receiver) = mpsc::unbounded_channel();
        let wake = Arc::new(Notify::new());
        let woken = wake.clone();
        let patience = (settings.every * 2).max(Duration::from_secs(1));
        std::thread::Builder::new().name("streamfleet-hold".into()).spawn(move || {
            match tokio::runtime::Builder::new_current_thread().enable_all().build() {
                Ok(runtime) => runtime.block_on(run(settings, receiver, woken)),
                Err(e) => tracing::error!(error = %e, "the hold thread could not start its runtime"),
            }
        })?;
        Ok(Self { jobs, wake, patience })
    }

    /// Holds `entries` (their phases in `phases`) until the handle is released.
    pub fn hold(&self, entries: Arc<Vec<HeldEntry>>, phases: Arc<[PhaseCell]>) -> HoldHandle {
        let (release, receiver) = oneshot::channel();
        let _ = self.jobs.send(HoldJob { entries, phases, release: receiver });
        self.wake.notify_one();
        HoldHandle { release: Some(release), wake: self.wake.clone(), patience: self.patience }
    }
}

async fn run(settings: HoldSettings, mut jobs: mpsc::UnboundedReceiver<HoldJob>, wake: Arc<Notify>) {
    let mut conn: Option<StreamConnection> = None;
    let mut active: Vec<HoldJob> = Vec::new();
    let mut tick = tokio::time::interval(settings.every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let renew = tokio::select! {
            job = jobs.recv() => match job {
                Some(job) => { active.push(job); false }
                // The worker is gone.
                None => return,
            },
            () = wake.notified() => false,
            _ = tick.tick() => true,
        };
        active.retain_mut(|job| match job.release.try_recv() {
            Ok(ack) => {
                let _ = ack.send(());
                false
            }
            Err(oneshot::error::TryRecvError::Closed) => false,
            Err(oneshot::error::TryRecvError::Empty) => true,
        });
        if !renew || active.is_empty() {
            continue;
        }
        if conn.is_none() {
            match StreamConnection::connect(&settings.endpoint).await {
                Ok(c) => conn = Some(c),
                Err(e) => {
                    tracing::warn!(error = %e, "the hold could not connect; retrying");
                    continue;
                }
            }
        }
        if let Some(conn) = conn.as_mut() {
            for job in &active {
                renew_job(conn, &settings, job).await;
            }
        }
    }
}

/// Renews one batch's entries in hand, per stream.
async fn renew_job(conn: &mut StreamConnection, settings: &HoldSettings, job: &HoldJob) {
    let mut by_stream: std::collections::BTreeMap<&str, Vec<usize>> = std::collections::BTreeMap::new();
    for (i, entry) in job.entries.iter().enumerate() {
        if job.phases[i].get().is_held() {
            by_stream.entry(entry.stream.as_str()).or_default().push(i);
        }
    }
    for (stream, open) in by_stream {
        let held: Vec<Held> =
            open.iter().map(|&i| Held { id: &job.entries[i].id, mark: job.entries[i].mark.clone() }).collect();
        let lease = Lease { stream, group: &settings.group, consumer: &settings.consumer };
        match lease.extend(conn, settings.mark_ttl_ms, &held).await {
            Ok(owned) => {
                for (i, ours) in open.into_iter().zip(owned) {
                    if !ours && job.phases[i].get() != Phase::Settled {
                        tracing::warn!(stream, id = %job.entries[i].id, "an entry in hand was claimed by another consumer");
                    }
                }
            }
            Err(e) => tracing::warn!(error = %e, "extending the hold on the batch"),
        }
    }
}
