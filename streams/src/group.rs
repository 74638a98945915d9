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

/// Creates `group` again on `stream` at `start_id`, for a group that
/// vanished with its PEL (its stream deleted, or Redis restarted without
/// persistence), dropping in the same script what was kept about the
/// entries pending in it: an entry delivered again is not judged by its old
/// delivery's records (a start, a crash count, or a business key that, with
/// producer-set IDs reused, was another entry's). A group that exists by
/// then (another operator made it) is left alone, records and all.
pub async fn recreate_group<C: ConnectionLike + Send>(
    conn: &mut C,
    stream: &str,
    group: &str,
    start_id: &str,
) -> Result<GroupCreation, StreamError> {
    const RECREATE: &str = r"
        local ok, groups = pcall(redis.call, 'XINFO', 'GROUPS', KEYS[1])
        if ok then
            for _, g in ipairs(groups) do
                if g[2] == ARGV[1] then return 0 end
            end
        end
        redis.call('DEL', KEYS[2], KEYS[3], KEYS[4])
        redis.call('XGROUP', 'CREATE', KEYS[1], ARGV[1], ARGV[2], 'MKSTREAM')
        return 1";
    let [records, due, cursor] = pending_records(stream, group);
    let created: i64 = redis::cmd("EVAL")
        .arg(RECREATE)
        .arg(4)
        .arg(stream)
        .arg(records)
        .arg(due)
        .arg(cursor)
        .arg(group)
        .arg(start_id)
        .query_async(conn)
        .await
        .map_err(|e| StreamError::new("creating the consumer group again", e))?;
    Ok(if created == 1 { GroupCreation::Created } else { GroupCreation::AlreadyExisted })
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
