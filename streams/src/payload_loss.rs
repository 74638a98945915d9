//! The durable record of lost payloads, per group: whoever meets a pending
//! entry whose payload was trimmed or deleted (a worker's claim loop, the
//! sweep, a worker in another language) records it here, in the same
//! script as its `payload-missing` dead letter, and the operator reads it
//! every poll. Two keys in the stream's hash slot:
//!
//! * `<tag>:payload-lost:<group>`: a hash; field `count` is the total ever lost;
//! * `<tag>:payload-lost-ids:<group>`: a list of the latest lost entry IDs
//!   (newest first, at most [`LATEST`]).

use crate::error::StreamError;
use crate::group_ref::GroupRef;
use crate::keys;
use redis::aio::ConnectionLike;

/// How many of the latest lost IDs are kept.
pub const LATEST: usize = 20;

pub fn count_key(stream: &str, group: &str) -> String {
    keys::companion_key(stream, &format!("payload-lost:{group}"))
}

pub fn ids_key(stream: &str, group: &str) -> String {
    keys::companion_key(stream, &format!("payload-lost-ids:{group}"))
}

/// What has been lost in a group, as recorded.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PayloadLoss {
    /// Entries whose payload was found gone, ever.
    pub total: u64,
    /// The latest of their IDs, newest first.
    pub latest: Vec<String>,
}

/// Reads the record (one round trip).
pub async fn read<C: ConnectionLike + Send>(conn: &mut C, of: GroupRef<'_>) -> Result<PayloadLoss, StreamError> {
    let GroupRef { stream, group } = of;
    let mut pipe = redis::pipe();
    pipe.cmd("HGET").arg(count_key(stream, group)).arg("count");
    pipe.cmd("LRANGE").arg(ids_key(stream, group)).arg(0).arg(LATEST - 1);
    let (total, latest): (Option<u64>, Vec<String>) =
        pipe.query_async(conn).await.map_err(|e| StreamError::new("reading the payload-loss record", e))?;
    Ok(PayloadLoss { total: total.unwrap_or(0), latest })
}
