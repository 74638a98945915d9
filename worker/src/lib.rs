//! streamfleet's worker library: the at-least-once protocol on a Redis
//! Streams consumer group, configured by the operator's env contract.
//!
//! ```no_run
//! use streamfleet_worker::{Entry, Handler, Outcome, Worker, WorkerConfig};
//! struct Charge;
//! impl Handler for Charge {
//!     fn business_key(&self, e: &Entry) -> Option<String> { e.field_str("order_id").map(str::to_string) }
//!     async fn handle(&self, e: &Entry) -> Outcome {
//!         // Commit the effect idempotently (keyed by the order ID), then return Done.
//!         Outcome::Done
//!     }
//! }
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! Worker::new(WorkerConfig::from_env()?, Charge)
//!     .with_idempotency_guard(std::time::Duration::from_secs(24 * 3600))
//!     .run(streamfleet_worker::shutdown_signal())
//!     .await?;
//! # Ok(()) }
//! ```

pub mod blocking;
pub mod breaker;
pub mod consumer;
pub mod guard;
pub mod lease;
pub mod phase;
pub mod stats;

pub use blocking::Blocking;
pub use consumer::{Delivery, Handler, Outcome, Worker, WorkerError, current_delivery};
pub use guard::{GuardState, IdempotencyStore, StoreFuture};
pub use stats::Stats;
pub use streamfleet_process::shutdown_signal;
pub use streamfleet_streams::Entry;
pub use streamfleet_streams::config::{ConfigError, RunMode, WorkerConfig};
/// Sending by business key to its shard, and the shard function.
pub use streamfleet_streams::shard;
