//! The recovery sweep (`Sweep` mode): scan the whole PEL, page by page, and
//! * dead-letter entries idle past min-idle-time and delivered at least
//!   `max_deliveries` times (claimed first, so a live worker that just took
//!   one keeps it; dead letter and ack are atomic);
//! * record pending entries whose payload was trimmed or deleted as
//!   `payload-missing` dead letters — counted, never success;
//! * leave everything else to the workers' own claim loops.
//!
//! Handlers are never run here.

use crate::deadletter::{self, Letter, Reason};
use crate::entry::{Entry, fields_from_map};
use crate::error::StreamError;
use crate::recovery::{RecoveryReport, now_ms};
use redis::aio::ConnectionLike;
use std::time::Duration;

pub struct SweepSettings<'a> {
    pub stream: &'a str,
    pub group: &'a str,
    /// The sweep's own consumer name (its pod name); deleted when done.
    pub consumer: &'a str,
    pub dead_letter_stream: &'a str,
    pub min_idle: Duration,
    pub max_deliveries: u64,
    pub batch: usize,
}

/// One full pass over the PEL.
pub async fn sweep<C: ConnectionLike + Send>(
    conn: &mut C,
    s: &SweepSettings<'_>,
) -> Result<RecoveryReport, StreamError> {
    let err = |what| move |e| StreamError::new(what, e);
    let min_idle_ms = u64::try_from(s.min_idle.as_millis()).unwrap_or(u64::MAX);
    let mut report = RecoveryReport::default();
    let mut start = "-".to_string();
    loop {
        // XPENDING ... IDLE: only entries nobody has touched for min-idle-time.
        let page: Vec<(String, String, u64, u64)> = redis::cmd("XPENDING")
            .arg(s.stream)
            .arg(s.group)
            .arg("IDLE")
            .arg(min_idle_ms)
            .arg(&start)
            .arg("+")
            .arg(s.batch)
            .query_async(conn)
            .await
            .map_err(err("scanning the PEL"))?;
        let Some((last, ..)) = page.last() else { break };
        start = format!("({last}");
        report.scanned += u64::try_from(page.len()).unwrap_or(u64::MAX);

        // Which payloads still exist: one pipelined XRANGE per entry.
        let mut pipe = redis::pipe();
        for (id, ..) in &page {
            pipe.cmd("XRANGE").arg(s.stream).arg(id).arg(id);
        }
        let payloads: Vec<Vec<(String, std::collections::HashMap<String, redis::Value>)>> =
            pipe.query_async(conn).await.map_err(err("reading pending payloads"))?;

        for ((id, owner, _, deliveries), payload) in page.iter().zip(payloads) {
            if payload.is_empty() {
                let entry =
                    Entry { stream: s.stream.into(), id: id.clone(), fields: Vec::new(), deliveries: *deliveries };
                let letter = Letter {
                    group: s.group,
                    consumer: owner,
                    reason: Reason::PayloadMissing,
                    error: "payload trimmed or deleted while pending",
                    business_key: None,
                };
                deadletter::dead_letter(conn, s.dead_letter_stream, &entry, &letter).await?;
                report.payload_lost += 1;
                continue;
            }
            if *deliveries < s.max_deliveries {
                continue;
            }
            // Claim first: if a worker took it meanwhile, its idle time reset
            // and the claim (min-idle guarded) takes nothing.
            let claimed: Vec<String> = redis::cmd("XCLAIM")
                .arg(s.stream)
                .arg(s.group)
                .arg(s.consumer)
                .arg(min_idle_ms)
                .arg(id)
                .arg("JUSTID")
                .query_async(conn)
                .await
                .map_err(err("claiming a poison entry"))?;
            if claimed.is_empty() {
                continue;
            }
            report.claimed += 1;
            let fields = payload.into_iter().next().map(|(_, map)| fields_from_map(map)).unwrap_or_default();
            let entry = Entry { stream: s.stream.into(), id: id.clone(), fields, deliveries: *deliveries };
            let error = deadletter::last_error(conn, s.stream, s.group, id).await?;
            let error = error.unwrap_or_else(|| format!("delivered {deliveries} times without an ack"));
            let letter = Letter {
                group: s.group,
                consumer: owner,
                reason: Reason::MaxDeliveries,
                error: &error,
                business_key: None,
            };
            deadletter::dead_letter(conn, s.dead_letter_stream, &entry, &letter).await?;
            report.dead_lettered += 1;
        }
        if page.len() < s.batch {
            break;
        }
    }
    crate::consumers::delete_if_empty(conn, s.stream, s.group, s.consumer).await?;
    report.finished_at_ms = now_ms();
    Ok(report)
}
