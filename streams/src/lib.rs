//! Everything streamfleet says to Redis Streams. No Kubernetes types live
//! here: the operator and the worker library both build on this crate.

pub mod claim;
pub mod config;
pub mod connection;
pub mod consumers;
pub mod deadletter;
pub mod dlq;
mod duration;
pub mod entry;
pub mod error;
pub mod group;
pub mod group_ref;
pub mod health;
pub mod keys;
pub mod payload_loss;
pub mod pending;
pub mod recovery;
pub mod replay;
pub mod retention;
pub mod retry;
pub mod shard;
pub mod started;
pub mod sweep;
pub mod version;

pub use config::{ConfigError, RunMode, WorkerConfig};
pub use connection::{ClientTls, Connections, Endpoint, Mode, StreamConnection};
pub use duration::millis;
pub use entry::Entry;
pub use error::{ErrorClass, StreamError};
pub use group::{GroupCreation, destroy_group, ensure_group, recreate_group};
pub use group_ref::{ConsumerRef, GroupRef};
