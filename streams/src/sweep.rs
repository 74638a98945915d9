//! The recovery sweep (`Sweep` mode): scan the whole PEL, page by page, and
//! * dead-letter entries idle past min-idle-time and delivered at least
//!   `max_deliveries` times (claimed first, so a live worker that just took
//!   one keeps it; dead letter and ack are atomic);
//! * record pending entries whose payload was trimmed or deleted as
//!   `payload-missing` dead letters — counted, never success;
//! * leave everything else to the workers' own claim loops, entries parked
//!   for a retry (`retry`) included, whatever their delivery count.
//!
//! Handlers are never run here.

use crate::deadletter::{self, Letter, Reason};
use crate::entry::{Entry, fields_from_map};
use crate::error::StreamError;
use crate::keys;
use crate::recovery::{RecoveryReport, now_ms};
use crate::retention::StreamId;
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

/// `1` for each ARGV entry ID present in KEYS[1], `0` for each one gone.
const PRESENT: &str = r"
    local out = {}
    for i = 1, #ARGV do
        out[i] = (#redis.call('XRANGE', KEYS[1], ARGV[i], ARGV[i], 'COUNT', 1) > 0) and '1' or '0'
    end
    return table.concat(out)";

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
        let full_page = page.len() >= s.batch;
        // After a restart or a failover an entry whose holder may still renew
        // is left alone, payload or not (`claim::claim_rules_lua`).
        let rows: Vec<(u64, &str)> = page.iter().map(|(_, owner, idle, _)| (*idle, owner.as_str())).collect();
        let claimable = crate::claim::claimable(conn, s.stream, s.group, min_idle_ms, &rows).await?;
        // An owner that renewed a hold within min-idle-time has its entries
        // in hand: one whose payload is gone is not lost (it finishes it).
        let owner_alive: std::collections::HashSet<String> = page
            .iter()
            .zip(&claimable)
            .filter(|(_, c)| **c == crate::claim::Claimability::OwnerAlive)
            .map(|((id, ..), _)| id.clone())
            .collect();
        let page: Vec<(String, String, u64, u64)> = page
            .iter()
            .zip(claimable)
            .filter(|(_, c)| *c != crate::claim::Claimability::Deferred)
            .map(|(row, _)| row.clone())
            .collect();
        let (Some((first, ..)), Some((last, ..))) = (page.first(), page.last()) else {
            if full_page {
                continue;
            }
            break;
        };

        // Which payloads still exist. Pending entries mostly sit together, so
        // one bounded XRANGE over the page's span answers for the IDs it
        // covers; IDs past where it stopped (a span full of acked entries)
        // are checked one by one on the server by a script.
        let bound = s.batch.saturating_mul(2).max(1);
        let span: Vec<(String, redis::Value)> = redis::cmd("XRANGE")
            .arg(s.stream)
            .arg(first)
            .arg(last)
            .arg("COUNT")
            .arg(bound)
            .query_async(conn)
            .await
            .map_err(err("reading pending payloads"))?;
        let covered_to = match span.last() {
            Some((id, _)) if span.len() >= bound => StreamId::parse(id),
            _ => StreamId::parse(last),
        };
        let existing: std::collections::HashSet<&str> = span.iter().map(|(id, _)| id.as_str()).collect();
        let beyond: Vec<&str> = page
            .iter()
            .map(|(id, ..)| id.as_str())
            .filter(|id| StreamId::parse(id).zip(covered_to).is_none_or(|(id, to)| id > to))
            .collect();
        let beyond_present: std::collections::HashSet<String> = if beyond.is_empty() {
            std::collections::HashSet::new()
        } else {
            let mut presence = redis::cmd("EVAL");
            presence.arg(PRESENT).arg(1).arg(s.stream).arg(&beyond);
            let present: String = presence.query_async(conn).await.map_err(err("checking pending payloads"))?;
            beyond.iter().zip(present.bytes()).filter(|(_, p)| *p == b'1').map(|(id, _)| id.to_string()).collect()
        };
        let mut lost = Vec::new();
        let mut poison = Vec::new();
        let idle_of: std::collections::HashMap<&str, u64> =
            page.iter().map(|(id, _, idle, _)| (id.as_str(), *idle)).collect();
        for (id, owner, _, deliveries) in &page {
            let entry = Entry {
                stream: s.stream.into(),
                id: id.clone(),
                fields: Vec::new(),
                deliveries: *deliveries,
                crashes: 0,
            };
            if !existing.contains(id.as_str()) && !beyond_present.contains(id) {
                if !owner_alive.contains(id) {
                    lost.push((entry, owner.as_str()));
                }
            } else if *deliveries >= s.max_deliveries && crate::retry::parked_deliveries(owner).is_none() {
                // (A parked entry waits for its retry, inside its horizon:
                // its next delivery decides.)
                poison.push((entry, owner.as_str()));
            }
        }

        // Two more round trips per page, whatever it holds: lost payloads
        // dead-lettered together with claiming the poison (one XCLAIM, min-idle
        // guarded: an entry a worker took meanwhile has a fresh idle time and
        // is not taken), reading its last errors and payloads; then the
        // poison's dead letters. Each dead letter is its own atomic script.
        let mut pipe = redis::pipe();
        let lost_letters: Vec<Letter> = lost
            .iter()
            .map(|(_, owner)| Letter {
                group: s.group,
                consumer: owner,
                reason: Reason::PayloadMissing,
                error: "payload trimmed or deleted while pending",
                business_key: None,
                while_pending: true,
            })
            .collect();
        if !lost.is_empty() {
            let letters: Vec<_> = lost.iter().map(|(e, _)| e).zip(&lost_letters).collect();
            pipe.add_command(deadletter::command(s.dead_letter_stream, &letters)).ignore();
        }
        if !poison.is_empty() {
            let rows: Vec<(&str, u64, &str, u64)> = poison
                .iter()
                .map(|(entry, owner)| {
                    let idle = idle_of.get(entry.id.as_str()).copied().unwrap_or(0);
                    (entry.id.as_str(), idle, *owner, entry.deliveries)
                })
                .collect();
            // (An entry whose last delivery was handed back unstarted is
            // one delivery short: the script leaves it to the workers.)
            let claim =
                crate::claim::claim_justid_command(s.stream, s.group, s.consumer, min_idle_ms, s.max_deliveries, &rows);
            pipe.add_command(claim);
            let errors = pipe.cmd("HMGET").arg(keys::last_error_key(s.stream, s.group));
            for (entry, _) in &poison {
                errors.arg(&entry.id);
            }
            for (entry, _) in &poison {
                pipe.cmd("XRANGE").arg(s.stream).arg(&entry.id).arg(&entry.id);
            }
        }
        type Payload = Vec<(String, std::collections::HashMap<String, redis::Value>)>;
        let (claimed, errors, payloads) = if poison.is_empty() {
            if !lost.is_empty() {
                let () = pipe.query_async(conn).await.map_err(err("dead-lettering lost payloads"))?;
            }
            (Vec::new(), Vec::new(), Vec::new())
        } else {
            // The claim, the last errors, then one payload per poison entry.
            let replies: Vec<redis::Value> = pipe.query_async(conn).await.map_err(err("claiming poison entries"))?;
            let mut replies = replies.into_iter();
            let mut next = || replies.next().unwrap_or(redis::Value::Nil);
            let parsed = |what| move |e: redis::ParsingError| StreamError::new(what, e.into());
            let claimed: Vec<String> = redis::from_redis_value(next()).map_err(parsed("claiming poison entries"))?;
            let errors: Vec<Option<String>> = redis::from_redis_value(next()).map_err(parsed("reading last errors"))?;
            let payloads = (0..poison.len())
                .map(|_| redis::from_redis_value::<Payload>(next()))
                .collect::<Result<Vec<_>, _>>()
                .map_err(parsed("reading poison payloads"))?;
            (claimed, errors, payloads)
        };
        report.payload_lost += u64::try_from(lost.len()).unwrap_or(u64::MAX);
        let claimed: std::collections::HashSet<String> = claimed.into_iter().collect();
        let mut taken = Vec::new();
        for (((mut entry, owner), error), payload) in poison.into_iter().zip(errors).zip(payloads) {
            if !claimed.contains(&entry.id) {
                continue;
            }
            // Deleted between the check and the claim: still a dead letter, without fields.
            entry.fields = payload.into_iter().next().map(|(_, map)| fields_from_map(map)).unwrap_or_default();
            let error = error.unwrap_or_else(|| format!("delivered {} times without an ack", entry.deliveries));
            taken.push((entry, owner, error));
        }
        let letters: Vec<Letter> = taken
            .iter()
            .map(|(_, owner, error)| Letter {
                group: s.group,
                consumer: owner,
                reason: Reason::MaxDeliveries,
                error,
                business_key: None,
                while_pending: true,
            })
            .collect();
        if !taken.is_empty() {
            let batch: Vec<_> = taken.iter().map(|(e, ..)| e).zip(&letters).collect();
            let _: redis::Value = deadletter::command(s.dead_letter_stream, &batch)
                .query_async(conn)
                .await
                .map_err(err("dead-lettering poison entries"))?;
        }
        let moved = u64::try_from(taken.len()).unwrap_or(u64::MAX);
        report.claimed += moved;
        report.dead_lettered += moved;
        if !full_page {
            break;
        }
    }
    crate::consumers::delete_if_empty(conn, s.stream, s.group, s.consumer).await?;
    report.finished_at_ms = now_ms();
    Ok(report)
}
