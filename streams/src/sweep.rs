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
use crate::entry::Entry;
use crate::error::StreamError;
use crate::keys;
use crate::recovery::{RecoveryReport, now_ms};
use crate::retention::StreamId;
use crate::started;
use redis::aio::ConnectionLike;
use std::collections::{HashMap, HashSet};
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

impl<'a> SweepSettings<'a> {
    /// The sweep's consumer of the group.
    pub fn sweeper(&self) -> crate::ConsumerRef<'a> {
        crate::ConsumerRef::new(self.stream, self.group, self.consumer)
    }
}

/// `1` for each ARGV entry ID present in KEYS[1], `0` for each one gone.
const PRESENT: &str = r"
    local out = {}
    for i = 1, #ARGV do
        out[i] = (#redis.call('XRANGE', KEYS[1], ARGV[i], ARGV[i], 'COUNT', 1) > 0) and '1' or '0'
    end
    return table.concat(out)";

/// One row of `XPENDING`: entry ID, owner, idle milliseconds, deliveries.
type PendingRow = (String, String, u64, u64);

/// One full pass over the PEL, a page at a time: scan, judge who may be
/// claimed, check which payloads exist, classify, settle. The next page is
/// scanned, judged and checked (on a clone of `conn`) while this one
/// settles, so the client's work and the server's overlap: pages are
/// disjoint ID ranges, and a page's settling changes nothing the next
/// page's checks read. What cannot be settled is left pending and named in
/// `left_pending`; only a scan that fails ends the pass early.
pub async fn sweep<C: ConnectionLike + Send + Clone>(
    conn: &mut C,
    s: &SweepSettings<'_>,
) -> Result<RecoveryReport, StreamError> {
    let min_idle_ms = crate::millis(s.min_idle);
    let mut report = RecoveryReport::default();
    let mut ahead = conn.clone();
    let mut next = scan_and_check(&mut ahead, s, min_idle_ms, "-").await?;
    while let Some(page) = next.take() {
        report.scanned += u64::try_from(page.rows).unwrap_or(u64::MAX);
        let following = async {
            match &page.after {
                Some(start) => scan_and_check(&mut ahead, s, min_idle_ms, start).await,
                None => Ok(None),
            }
        };
        let settling = async {
            let checked = page.checked?;
            settle(conn, s, min_idle_ms, checked, &mut report).await
        };
        let (settled, following) = tokio::join!(settling, following);
        // A page that cannot be settled is left pending for the next run
        // and named; the pages after it are still swept.
        if let Err(e) = settled {
            report.left_pending.push(format!("a page of pending entries from {}: {e}", page.span));
        }
        next = following?;
    }
    crate::consumers::delete_if_empty(conn, s.sweeper()).await?;
    report.finished_at_ms = now_ms();
    Ok(report)
}

/// A scanned page, and what its checks found.
struct ScannedPage {
    /// Its first to last ID, to name it if it cannot be settled.
    span: String,
    /// How many pending entries the scan returned.
    rows: usize,
    /// Where the next page starts (`None`: this page was the last).
    after: Option<String>,
    /// Its entries to settle, or why they could not be checked.
    checked: Result<CheckedPage, StreamError>,
}

/// A page's entries that may be claimed, with the lost and the poison among
/// them, and the payloads the check read.
#[derive(Default)]
struct CheckedPage {
    page: Vec<PendingRow>,
    lost: Vec<usize>,
    poison: Vec<usize>,
    payloads: Payloads,
}

/// Scans the page after `start` and checks it (judge, payloads, classify).
/// `None` when nothing is left to scan; an error only when the scan fails.
async fn scan_and_check<C: ConnectionLike + Send>(
    conn: &mut C,
    s: &SweepSettings<'_>,
    min_idle_ms: u64,
    start: &str,
) -> Result<Option<ScannedPage>, StreamError> {
    let page = scan_page(conn, s, min_idle_ms, start).await?;
    let (Some((first, ..)), Some((last, ..))) = (page.first(), page.last()) else { return Ok(None) };
    let span = format!("{first} to {last}");
    let after = (page.len() >= s.batch).then(|| format!("({last}"));
    let rows = page.len();
    let checked = check_page(conn, s, min_idle_ms, page).await;
    Ok(Some(ScannedPage { span, rows, after, checked }))
}

/// Judge, check and classify one scanned page.
async fn check_page<C: ConnectionLike + Send>(
    conn: &mut C,
    s: &SweepSettings<'_>,
    min_idle_ms: u64,
    page: Vec<PendingRow>,
) -> Result<CheckedPage, StreamError> {
    let (page, owner_alive) = judge(conn, s, min_idle_ms, page).await?;
    if page.is_empty() {
        return Ok(CheckedPage::default());
    }
    let payloads = payloads_present(conn, s, &page).await?;
    let (lost, poison) = classify(s, &page, &payloads, &owner_alive);
    Ok(CheckedPage { page, lost, poison, payloads })
}

/// Scan: the next page of entries nobody has touched for min-idle-time
/// (`XPENDING … IDLE`), after `start`.
async fn scan_page<C: ConnectionLike + Send>(
    conn: &mut C,
    s: &SweepSettings<'_>,
    min_idle_ms: u64,
    start: &str,
) -> Result<Vec<PendingRow>, StreamError> {
    redis::cmd("XPENDING")
        .arg(s.stream)
        .arg(s.group)
        .arg("IDLE")
        .arg(min_idle_ms)
        .arg(start)
        .arg("+")
        .arg(s.batch)
        .query_async(conn)
        .await
        .map_err(|e| StreamError::new("scanning the PEL", e))
}

/// Judge: the page without the entries to leave alone — after a restart,
/// a failover or a stall, an entry whose holder may still renew, payload or
/// not (`claim::claim_rules_lua`) — and the IDs whose owner renewed a hold
/// within min-idle-time (it has them in hand: a gone payload is not lost).
async fn judge<C: ConnectionLike + Send>(
    conn: &mut C,
    s: &SweepSettings<'_>,
    min_idle_ms: u64,
    page: Vec<PendingRow>,
) -> Result<(Vec<PendingRow>, HashSet<String>), StreamError> {
    use crate::claim::Claimability;
    let rows: Vec<(u64, &str)> = page.iter().map(|(_, owner, idle, _)| (*idle, owner.as_str())).collect();
    let claimable = crate::claim::claimable(conn, crate::GroupRef::new(s.stream, s.group), min_idle_ms, &rows).await?;
    let mut owner_alive = HashSet::new();
    let mut kept = Vec::new();
    for (row, c) in page.into_iter().zip(claimable) {
        if c == Claimability::OwnerAlive {
            owner_alive.insert(row.0.clone());
        }
        if c != Claimability::Deferred {
            kept.push(row);
        }
    }
    Ok((kept, owner_alive))
}

/// The payloads of a page's entries that still exist, by ID: the fields
/// as Redis sent them, or `Nil` for one known to exist but not read.
type Payloads = HashMap<String, redis::Value>;

/// Which of the page's payloads still exist. Pending entries mostly sit
/// together, so one bounded XRANGE over the page's span answers for the IDs
/// it covers (and its payloads are kept for the poison's dead letters); IDs
/// past where it stopped (a span full of acked entries) are checked one by
/// one on the server by a script.
async fn payloads_present<C: ConnectionLike + Send>(
    conn: &mut C,
    s: &SweepSettings<'_>,
    page: &[PendingRow],
) -> Result<Payloads, StreamError> {
    let (Some((first, ..)), Some((last, ..))) = (page.first(), page.last()) else {
        return Ok(Payloads::new());
    };
    let bound = s.batch.saturating_mul(2).max(1);
    let span: Vec<(String, redis::Value)> = redis::cmd("XRANGE")
        .arg(s.stream)
        .arg(first)
        .arg(last)
        .arg("COUNT")
        .arg(bound)
        .query_async(conn)
        .await
        .map_err(|e| StreamError::new("reading pending payloads", e))?;
    let covered_to = match span.last() {
        Some((id, _)) if span.len() >= bound => StreamId::parse(id),
        _ => StreamId::parse(last),
    };
    let mut present: Payloads = span.into_iter().collect();
    let beyond: Vec<&str> = page
        .iter()
        .map(|(id, ..)| id.as_str())
        .filter(|id| StreamId::parse(id).zip(covered_to).is_none_or(|(id, to)| id > to))
        .collect();
    if !beyond.is_empty() {
        let mut presence = redis::cmd("EVAL");
        presence.arg(PRESENT).arg(1).arg(s.stream).arg(&beyond);
        let flags: String =
            presence.query_async(conn).await.map_err(|e| StreamError::new("checking pending payloads", e))?;
        let found = beyond.iter().zip(flags.bytes()).filter(|(_, p)| *p == b'1');
        present.extend(found.map(|(id, _)| (id.to_string(), redis::Value::Nil)));
    }
    Ok(present)
}

/// Classify (pure): entries whose payload is gone and whose owner is not
/// holding them are lost; entries delivered `max_deliveries` times and not
/// parked for a retry (inside its horizon, their next delivery decides)
/// are poison; the rest are the workers'. Indices into `page`.
fn classify(
    s: &SweepSettings<'_>,
    page: &[PendingRow],
    present: &Payloads,
    owner_alive: &HashSet<String>,
) -> (Vec<usize>, Vec<usize>) {
    let (mut lost, mut poison) = (Vec::new(), Vec::new());
    for (i, (id, owner, _, deliveries)) in page.iter().enumerate() {
        if !present.contains_key(id) {
            if !owner_alive.contains(id) {
                lost.push(i);
            }
        } else if *deliveries >= s.max_deliveries && crate::retry::parked_deliveries(owner).is_none() {
            poison.push(i);
        }
    }
    (lost, poison)
}

/// Settle: two round trips per page, whatever it holds (three with lost
/// payloads: their business keys are read first). Lost payloads are
/// dead-lettered together with claiming the poison (one XCLAIM, min-idle
/// guarded: an entry a worker took meanwhile has a fresh idle time and is
/// not taken), reading its last errors and payloads; then the poison's dead
/// letters. Each letter carries the entry's business key when a handler
/// started it (`started::key_field`). Each dead letter is its own atomic
/// script. Returns how many
/// poison entries were claimed and dead-lettered.
async fn settle<C: ConnectionLike + Send>(
    conn: &mut C,
    s: &SweepSettings<'_>,
    min_idle_ms: u64,
    checked: CheckedPage,
    report: &mut RecoveryReport,
) -> Result<(), StreamError> {
    let CheckedPage { page, lost, poison, mut payloads } = checked;
    let (page, lost, poison) = (page.as_slice(), lost.as_slice(), poison.as_slice());
    let err = |what| move |e| StreamError::new(what, e);
    let entry = |i: usize| {
        let (id, _, _, deliveries) = &page[i];
        Entry { stream: s.stream.into(), id: id.clone(), fields: Vec::new(), deliveries: *deliveries, crashes: 0 }
    };
    let letter = |owner, reason, error, business_key| Letter {
        group: s.group,
        consumer: owner,
        reason,
        error,
        business_key,
        while_pending: true,
    };
    let records = keys::last_error_key(s.stream, s.group);
    let mut pipe = redis::pipe();
    // Read before the letters that drop them (a key is written once, at the
    // handler's start, so reading it first misses nothing).
    let lost_keys: Vec<Option<String>> = if lost.is_empty() {
        Vec::new()
    } else {
        let mut hmget = redis::cmd("HMGET");
        hmget.arg(&records);
        for &i in lost {
            hmget.arg(started::key_field(&page[i].0));
        }
        hmget.query_async(conn).await.map_err(err("reading lost entries' business keys"))?
    };
    if !lost.is_empty() {
        let entries: Vec<Entry> = lost.iter().map(|&i| entry(i)).collect();
        let letters: Vec<Letter> = lost
            .iter()
            .zip(&lost_keys)
            .map(|(&i, key)| {
                let why = "payload trimmed or deleted while pending";
                letter(page[i].1.as_str(), Reason::PayloadMissing, why, key.as_deref())
            })
            .collect();
        let batch: Vec<_> = entries.iter().zip(&letters).collect();
        pipe.add_command(deadletter::command(s.dead_letter_stream, &batch)).ignore();
    }
    let lost_count = u64::try_from(lost.len()).unwrap_or(u64::MAX);
    if poison.is_empty() {
        if !lost.is_empty() {
            let () = pipe.query_async(conn).await.map_err(err("dead-lettering lost payloads"))?;
            report.payload_lost += lost_count;
        }
        return Ok(());
    }
    let rows: Vec<(&str, u64, &str, u64)> =
        poison.iter().map(|&i| (page[i].0.as_str(), page[i].2, page[i].1.as_str(), page[i].3)).collect();
    // (An entry whose last delivery was handed back unstarted is one
    // delivery short: the script leaves it to the workers.)
    pipe.add_command(crate::claim::claim_justid_command(
        s.stream,
        s.group,
        s.consumer,
        min_idle_ms,
        s.max_deliveries,
        &rows,
    ));
    // Their last errors, then their business keys.
    let errors = pipe.cmd("HMGET").arg(&records);
    for &i in poison {
        errors.arg(&page[i].0);
    }
    for &i in poison {
        errors.arg(started::key_field(&page[i].0));
    }
    // The payloads the check did not read.
    let unread_payload = |i: &usize| !matches!(payloads.get(&page[*i].0), Some(v) if *v != redis::Value::Nil);
    for &i in poison.iter().filter(|i| unread_payload(i)) {
        pipe.cmd("XRANGE").arg(s.stream).arg(&page[i].0).arg(&page[i].0);
    }
    // The claim, the last errors and keys, then those payloads.
    let replies: Vec<redis::Value> = pipe.query_async(conn).await.map_err(err("claiming poison entries"))?;
    report.payload_lost += lost_count;
    let mut replies = replies.into_iter();
    let mut next = || replies.next().unwrap_or(redis::Value::Nil);
    let parsed = |what| move |e: redis::ParsingError| StreamError::new(what, e.into());
    let claimed: HashSet<String> = redis::from_redis_value::<Vec<String>>(next())
        .map_err(parsed("claiming poison entries"))?
        .into_iter()
        .collect();
    let mut errors: Vec<Option<String>> = redis::from_redis_value(next()).map_err(parsed("reading last errors"))?;
    let business_keys = errors.split_off(poison.len().min(errors.len()));
    // One by one: an entry that cannot be read stays pending, named, and
    // its page-mates go on.
    let payloads: Vec<_> = poison
        .iter()
        .map(|i| match payloads.remove(&page[*i].0) {
            Some(fields) if fields != redis::Value::Nil => crate::entry::fields_from_value(fields),
            _ => crate::entry::entries_from_value(next())
                .map(|read| read.into_iter().next().map(|(_, fields)| fields).unwrap_or_default()),
        })
        .collect();
    let (mut taken, mut unread) = (Vec::new(), Vec::new());
    for (((&i, error), payload), key) in poison.iter().zip(errors).zip(payloads).zip(business_keys) {
        let mut e = entry(i);
        if !claimed.contains(&e.id) {
            continue;
        }
        let payload = match payload {
            Ok(payload) => payload,
            Err(why) => {
                report.left_pending.push(format!("entry {}: its payload could not be read ({why})", e.id));
                unread.push(&page[i]);
                continue;
            }
        };
        // (Deleted between the check and the claim: still a dead letter,
        // with the payload read by the check, or else without fields.)
        e.fields = payload;
        let error = error.unwrap_or_else(|| format!("delivered {} times without an ack", e.deliveries));
        taken.push((e, page[i].1.as_str(), error, key));
    }
    if !taken.is_empty() {
        let letters: Vec<Letter> = taken
            .iter()
            .map(|(_, owner, error, key)| letter(owner, Reason::MaxDeliveries, error.as_str(), key.as_deref()))
            .collect();
        let batch: Vec<_> = taken.iter().map(|(e, ..)| e).zip(&letters).collect();
        let written: Result<redis::Value, _> =
            deadletter::command(s.dead_letter_stream, &batch).query_async(conn).await;
        if let Err(e) = written {
            let rows: Vec<&PendingRow> =
                taken.iter().filter_map(|(e, ..)| page.iter().find(|row| row.0 == e.id)).chain(unread).collect();
            restore_idle(conn, s, &rows, &mut report.left_pending).await;
            return Err(StreamError::new("dead-lettering poison entries", e));
        }
    }
    restore_idle(conn, s, &unread, &mut report.left_pending).await;
    let settled = u64::try_from(taken.len()).unwrap_or(u64::MAX);
    report.claimed += settled;
    report.dead_lettered += settled;
    Ok(())
}

/// Gives entries this sweep claimed but could not settle their idle time
/// back, while they are still its own: the claim reset it, which would hide
/// them from the next sweep's scan and the workers' claims for another
/// min-idle-time. The sweep's consumer keeps them (it is never alive, so
/// they are claimable).
const RESTORE_IDLE: &str = r"
    for i = 1, #ARGV - 2, 2 do
        local p = redis.call('XPENDING', KEYS[1], ARGV[#ARGV - 1], ARGV[i], ARGV[i], 1)[1]
        if p and p[2] == ARGV[#ARGV] then
            redis.call('XCLAIM', KEYS[1], ARGV[#ARGV - 1], ARGV[#ARGV], 0, ARGV[i], 'IDLE', ARGV[i + 1], 'JUSTID')
        end
    end
    return 0";

async fn restore_idle<C: ConnectionLike + Send>(
    conn: &mut C,
    s: &SweepSettings<'_>,
    rows: &[&PendingRow],
    left_pending: &mut Vec<String>,
) {
    if rows.is_empty() {
        return;
    }
    let mut cmd = redis::cmd("EVAL");
    cmd.arg(RESTORE_IDLE).arg(1).arg(s.stream);
    for (id, _, idle, _) in rows {
        cmd.arg(id).arg(idle);
    }
    cmd.arg(s.group).arg(s.consumer);
    if let Err(e) = cmd.query_async::<i64>(conn).await {
        left_pending.push(format!("{} claimed entries keep a reset idle time: {e}", rows.len()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn classify_tells_lost_from_poison_and_leaves_the_rest_to_the_workers() {
        let s = SweepSettings {
            stream: "orders",
            group: "g",
            consumer: "sweep",
            dead_letter_stream: "dead",
            min_idle: Duration::from_secs(1),
            max_deliveries: 3,
            batch: 10,
        };
        let parked = crate::retry::parked_consumer(5_000);
        let row = |id: &str, owner: &str, deliveries| (id.to_string(), owner.to_string(), 2_000, deliveries);
        let page = vec![
            row("1-0", "w1", 1),            // gone, owner silent: lost
            row("2-0", "w2", 1),            // gone, owner holding it: not lost
            row("3-0", "w1", 3),            // delivered enough: poison
            row("4-0", parked.as_str(), 9), // parked for a retry: its next delivery decides
            row("5-0", "w1", 2),            // the workers'
        ];
        let present: Payloads = ["3-0", "4-0", "5-0"].map(|id| (id.to_string(), redis::Value::Nil)).into();
        let owner_alive: HashSet<String> = ["2-0"].map(String::from).into();
        assert_eq!(classify(&s, &page, &present, &owner_alive), (vec![0], vec![2]));
    }
}
