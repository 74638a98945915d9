//! The outcome of a recovery run, kept in Redis beside the stream
//! (`{stream}:recovery:<group>`, a hash) so the operator reports it in the
//! resource's status without the recovery Job needing any API credentials.

use crate::error::StreamError;
use crate::group_ref::GroupRef;
use crate::keys;
use redis::aio::ConnectionLike;
use std::collections::HashMap;

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RecoveryReport {
    /// Unix milliseconds when the run finished.
    pub finished_at_ms: u64,
    /// Pending entries examined.
    pub scanned: u64,
    /// Entries taken from their holders: by a sweep, to dead-letter them (in
    /// the script that writes the letter, with no claim); by a worker, to
    /// re-run them.
    pub claimed: u64,
    pub dead_lettered: u64,
    /// Pending entries whose payload was gone (recorded, never success).
    pub payload_lost: u64,
    /// What this run could not settle and left pending for the next one
    /// (one line per entry or page, naming it); not kept in Redis: the run
    /// prints it and fails, so its Job shows `RecoveryFailing`.
    pub left_pending: Vec<String>,
}

pub fn report_key(stream: &str, group: &str) -> String {
    keys::companion_key(stream, &format!("recovery:{group}"))
}

pub async fn write_report<C: ConnectionLike + Send>(
    conn: &mut C,
    of: GroupRef<'_>,
    report: &RecoveryReport,
) -> Result<(), StreamError> {
    let GroupRef { stream, group } = of;
    let () = redis::cmd("HSET")
        .arg(report_key(stream, group))
        .arg("finished-at-ms")
        .arg(report.finished_at_ms)
        .arg("scanned")
        .arg(report.scanned)
        .arg("claimed")
        .arg(report.claimed)
        .arg("dead-lettered")
        .arg(report.dead_lettered)
        .arg("payload-lost")
        .arg(report.payload_lost)
        .query_async(conn)
        .await
        .map_err(|e| StreamError::new("writing the recovery report", e))?;
    Ok(())
}

/// The last report, if a recovery ever ran.
pub async fn read_report<C: ConnectionLike + Send>(
    conn: &mut C,
    of: GroupRef<'_>,
) -> Result<Option<RecoveryReport>, StreamError> {
    let GroupRef { stream, group } = of;
    let fields: HashMap<String, u64> = redis::cmd("HGETALL")
        .arg(report_key(stream, group))
        .query_async(conn)
        .await
        .map_err(|e| StreamError::new("reading the recovery report", e))?;
    let get = |k: &str| fields.get(k).copied().unwrap_or(0);
    Ok((!fields.is_empty()).then(|| RecoveryReport {
        finished_at_ms: get("finished-at-ms"),
        scanned: get("scanned"),
        claimed: get("claimed"),
        dead_lettered: get("dead-lettered"),
        payload_lost: get("payload-lost"),
        left_pending: Vec::new(),
    }))
}

pub fn now_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(crate::millis).unwrap_or(0)
}
