//! Consumer-group lifecycle.

use crate::error::StreamError;
use redis::aio::ConnectionLike;

/// What `ensure_group` found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GroupCreation {
    /// The group was created at the requested start ID.
    Created,
    /// The group already existed; its position was left alone.
    AlreadyExisted,
}

/// Creates `group` on `stream` (creating the stream too) starting at
/// `start_id`. An existing group is success and keeps its position: the start
/// ID applies only at creation.
pub async fn ensure_group<C: ConnectionLike + Send>(
    conn: &mut C,
    stream: &str,
    group: &str,
    start_id: &str,
) -> Result<GroupCreation, StreamError> {
    let created: redis::RedisResult<()> =
        redis::cmd("XGROUP").arg("CREATE").arg(stream).arg(group).arg(start_id).arg("MKSTREAM").query_async(conn).await;
    match created {
        Ok(()) => Ok(GroupCreation::Created),
        Err(e) if e.code() == Some("BUSYGROUP") => Ok(GroupCreation::AlreadyExisted),
        Err(e) => Err(StreamError::new("creating the consumer group", e)),
    }
}

/// The keys that describe the entries pending in `group` (their records,
/// the retry index and its cursors): meaningless once that PEL is gone.
fn pending_records(stream: &str, group: &str) -> [String; 3] {
    [
        crate::keys::last_error_key(stream, group),
        crate::keys::retry_due_key(stream, group),
        crate::keys::retry_index_cursor_key(stream, group),
    ]
}

/// Drops what was kept about the entries pending in `group`, for a group
/// that vanished with its PEL (its stream deleted, or Redis restarted
/// without persistence) and is about to be created again: an entry
/// delivered again is not judged by its old delivery's records (a start, a
/// crash count, or a business key that, with producer-set IDs reused, was
/// another entry's). Only the operator creates groups, so nothing can have
/// written a new record before the group exists again.
pub async fn forget_pending_records<C: ConnectionLike + Send>(
    conn: &mut C,
    stream: &str,
    group: &str,
) -> Result<(), StreamError> {
    let mut pipe = redis::pipe();
    for key in &pending_records(stream, group) {
        pipe.cmd("DEL").arg(key).ignore();
    }
    pipe.query_async(conn).await.map_err(|e| StreamError::new("forgetting a vanished group's entry records", e))
}

/// Destroys `group`; returns whether it existed. Its pending entries are dropped.
pub async fn destroy_group<C: ConnectionLike + Send>(
    conn: &mut C,
    stream: &str,
    group: &str,
) -> Result<bool, StreamError> {
    let destroyed: redis::RedisResult<i64> =
        redis::cmd("XGROUP").arg("DESTROY").arg(stream).arg(group).query_async(conn).await;
    // The group's bookkeeping goes with it: a group created again under the
    // same name starts clean. (One DEL per key: they share a slot, but a
    // multi-key DEL is one command per node on a cluster either way.)
    let side_keys = [
        crate::payload_loss::count_key(stream, group),
        crate::payload_loss::ids_key(stream, group),
        crate::recovery::report_key(stream, group),
        crate::keys::dead_consumers_key(stream, group),
        crate::keys::alive_key(stream, group),
        crate::keys::suppressed_key(stream, group),
    ];
    let mut pipe = redis::pipe();
    for key in side_keys.iter().chain(&pending_records(stream, group)) {
        pipe.cmd("DEL").arg(key).ignore();
    }
    let () = pipe.query_async(conn).await.map_err(|e| StreamError::new("removing the group's bookkeeping", e))?;
    match destroyed {
        Ok(n) => Ok(n > 0),
        // The stream itself is gone: so is the group.
        Err(e) if e.to_string().contains("requires the key to exist") => Ok(false),
        Err(e) => Err(StreamError::new("destroying the consumer group", e)),
    }
}
