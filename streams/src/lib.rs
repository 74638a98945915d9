//! Everything streamfleet says to Redis Streams. No Kubernetes types live
//! here: the operator and the worker library both build on this crate.

pub mod connection;
pub mod error;
pub mod group;

pub use connection::{Connections, Endpoint, Mode, StreamConnection};
pub use error::{ErrorClass, StreamError};
pub use group::{GroupCreation, destroy_group, ensure_group};
