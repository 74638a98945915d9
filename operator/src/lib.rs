//! The streamfleet operator: controller, owned-object builders, leader
//! election and probes. `main.rs` wires them into the `streamfleet` binary.

pub mod cli;
pub mod conditions;
pub mod console;
pub mod controller;
pub mod digest_key;
pub mod error;
pub mod events;
pub mod leader;
pub mod metrics;
pub mod objects;
pub mod probes;
pub mod redis_endpoint;
pub mod sweep_command;
