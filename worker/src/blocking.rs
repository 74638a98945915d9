//! A handler whose work blocks its thread (a synchronous client, a long
//! computation), run on tokio's blocking pool so it never holds up the
//! runtime's threads: the reads, the flushes of other entries. (The hold on
//! the batch has a thread of its own either way.)

use crate::consumer::{DELIVERY, Handler, Outcome};
use std::sync::Arc;
use streamfleet_streams::Entry;

type KeyFn = dyn Fn(&Entry) -> Option<String> + Send + Sync;

/// A [`Handler`] from a blocking function: `Blocking::new(|entry| …)`.
/// Each call runs on `tokio::task::spawn_blocking`, with
/// [`crate::current_delivery`] available inside. A call past its deadline
/// (min-idle-time) counts as a transient failure, but cannot be cancelled:
/// it runs on to its end, so keep the work idempotent as always.
pub struct Blocking<F> {
    handle: Arc<F>,
    key: Option<Box<KeyFn>>,
}

impl<F> Blocking<F>
where
    F: Fn(&Entry) -> Outcome + Send + Sync + 'static,
{
    pub fn new(handle: F) -> Self {
        Self { handle: Arc::new(handle), key: None }
    }

    /// The business key of an entry (see [`Handler::business_key`]).
    pub fn with_business_key(mut self, key: impl Fn(&Entry) -> Option<String> + Send + Sync + 'static) -> Self {
        self.key = Some(Box::new(key));
        self
    }
}

impl<F> Handler for Blocking<F>
where
    F: Fn(&Entry) -> Outcome + Send + Sync + 'static,
{
    fn business_key(&self, entry: &Entry) -> Option<String> {
        self.key.as_ref().and_then(|key| key(entry))
    }

    async fn handle(&self, entry: &Entry) -> Outcome {
        let (handle, entry) = (self.handle.clone(), entry.clone());
        let delivery = crate::current_delivery();
        let run = move || match delivery {
            Some(delivery) => DELIVERY.sync_scope(delivery, || handle(&entry)),
            None => handle(&entry),
        };
        match tokio::task::spawn_blocking(run).await {
            Ok(outcome) => outcome,
            // It panicked: a failure of this entry only, as in any handler.
            Err(e) => Outcome::Transient(format!("handler panicked: {e}")),
        }
    }
}
