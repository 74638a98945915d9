//! The recovery sweep (`Sweep` mode): scan the whole PEL, page by page, and
//! * dead-letter entries idle past min-idle-time and delivered at least
//!   `max_deliveries` times (judged on the server by the script that scans
//!   the page and writes the letter and the ack, so a live worker that just
//!   took one keeps it);
//! * record pending entries whose payload was trimmed or deleted as
//!   `payload-missing` dead letters — counted, never success;
//! * leave everything else to the workers' own claim loops, entries parked
//!   for a retry (`retry`) included, whatever their delivery count.
//!
//! Handlers are never run here, and nothing is claimed: an entry is
//! settled where it is pending, in one script per page.

use crate::deadletter::{F_AT, F_BUSINESS_KEY, F_CONSUMER, F_DELIVERIES, F_ERROR, F_GROUP, F_REASON};
use crate::deadletter::{F_SOURCE_ID, F_SOURCE_STREAM, Reason};
use crate::error::StreamError;
use crate::keys;
use crate::recovery::{RecoveryReport, now_ms};
use crate::retention::StreamId;
use redis::aio::ConnectionLike;
use std::time::Duration;

pub struct SweepSettings<'a> {
    pub stream: &'a str,
    pub group: &'a str,
    /// The sweep's consumer name (its pod name): a consumer of that name
    /// left by an earlier version, which claimed, is deleted when empty.
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

    /// Entries per page: `batch`, at most [`PAGE_MAX`].
    fn page(&self) -> usize {
        self.batch.clamp(1, PAGE_MAX)
    }
}

/// The most entries one page's script takes: it holds the server while it
/// runs (`bench-sweep` times pages of this size).
pub const PAGE_MAX: usize = 1000;

/// One full pass over the PEL, a page at a time, each page scanned,
/// checked and settled by one script ([`SWEEP_PAGE`]): the client only
/// carries the cursor. A page whose script fails as a whole is scanned
/// again on its own to name it and go past it; what cannot be settled is
/// left pending and named in `left_pending`; only a scan that fails ends the
/// pass early.
pub async fn sweep<C: ConnectionLike + Send>(
    conn: &mut C,
    s: &SweepSettings<'_>,
) -> Result<RecoveryReport, StreamError> {
    let min_idle_ms = crate::millis(s.min_idle);
    let mut report = RecoveryReport::default();
    let mut start = "-".to_string();
    loop {
        let (rows, last) = match sweep_page(conn, s, min_idle_ms, &start).await {
            Ok(page) => {
                page.count_into(&mut report);
                (page.rows, page.last)
            }
            // The script failed as a whole (or its reply was lost): the
            // page is scanned again to name it and go past it. Part of it
            // may have been settled before the failure, uncounted.
            Err(e) => {
                let rows = scan_page(conn, s, min_idle_ms, &start).await?;
                let (Some((first, ..)), Some((last, ..))) = (rows.first(), rows.last()) else {
                    report.left_pending.push(format!("the pending entries {}: {e}", after(&start)));
                    break;
                };
                report.left_pending.push(format!("a page of pending entries from {first} to {last}: {e}"));
                (rows.len(), last.clone())
            }
        };
        report.scanned = report.scanned.saturating_add(u64::try_from(rows).unwrap_or(u64::MAX));
        if rows < s.page() || last.is_empty() {
            break;
        }
        // The cursor only moves forward (a reply that says otherwise would
        // loop for ever).
        let from = start.strip_prefix('(').and_then(StreamId::parse);
        let moved = StreamId::parse(&last).is_some_and(|to| from.is_none_or(|from| from < to));
        if !moved {
            report.left_pending.push(format!("the pending entries {}: the PEL's page ended at {last}", after(&start)));
            break;
        }
        start = format!("({last}");
    }
    crate::consumers::delete_if_empty(conn, s.sweeper()).await?;
    report.finished_at_ms = now_ms();
    Ok(report)
}

/// One row of `XPENDING`: entry ID, owner, idle milliseconds, deliveries.
type PendingRow = (String, String, u64, u64);

/// The next page of entries nobody has touched for min-idle-time
/// (`XPENDING … IDLE`), after `start`: to name a page whose script failed.
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
        .arg(s.page())
        .query_async(conn)
        .await
        .map_err(|e| StreamError::new("scanning the PEL", e))
}

/// One page of the PEL swept, in one script and so judged by the PEL as it
/// is (a claim, a renewal, a stall or a restart just before counts):
/// * scan: the next page of entries idle past min-idle-time (`XPENDING …
///   IDLE`) after the cursor, and their payloads (one `XRANGE` over the
///   page's span; IDs past where a span full of acked entries stopped it
///   are looked up one by one);
/// * an entry whose payload is gone, claimable from its owner
///   (`claim::claim_rules_lua`) and whose owner has not renewed a hold
///   within min-idle-time (in its hands, a gone payload is not lost), gets
///   its `payload-missing` letter and loss record (`claim::lost_lua`, as a
///   claim step writes them);
/// * an entry delivered `max_deliveries` times (a last delivery handed back
///   unstarted not counted, `started`), not parked for a retry (inside its
///   horizon, its next delivery decides) and claimable gets its
///   `max-deliveries` letter: its payload, last error and business key
///   (`started::key_field`);
/// * the rest are the workers'.
///
/// Nothing is claimed: each letter goes with its ack and the drop of the
/// entry's record. A letter Redis refuses (out of memory) stops the page
/// there and is returned, with what was settled before it. (Redis refuses a
/// script's write only before its first one, which may be the claim rules'
/// record of a new server epoch or of a group's silence: then the script
/// fails as a whole.)
/// Returns the page's last ID (empty for none), how many entries it held,
/// the poison IDs lettered, the lost IDs recorded, and the refusal (empty
/// if none). Run twice (a resend after a lost reply), the second run finds
/// the settled entries gone from the PEL.
/// KEYS: stream, dead-letter stream, loss count, loss IDs, server epoch,
/// dead-consumer registry, alive registry, entry records. ARGV: group, min
/// idle ms, why a payload is lost, max deliveries, cursor, page size, span
/// bound.
static SWEEP_PAGE: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
    format!(
        r"{redelivery}{lost}{rules}{parked}
        -- A huge entry is written packed (`entry::pack`): Lua's unpack
        -- takes a few thousand values at most.
        local function pack(fields)
            local out = {{}}
            for i = 1, #fields do out[i] = #fields[i] .. ':' .. fields[i] end
            return table.concat(out)
        end
        local function message(e)
            if type(e) == 'table' then return tostring(e.err) end
            return tostring(e)
        end
        local group, min_idle, max = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[4])
        local rows = redis.call('XPENDING', KEYS[1], group, 'IDLE', ARGV[2], ARGV[5], '+', ARGV[6])
        if #rows == 0 then return {{'', 0, {{}}, {{}}, ''}} end
        local span = redis.call('XRANGE', KEYS[1], rows[1][1], rows[#rows][1], 'COUNT', ARGV[7])
        local payloads = {{}}
        for _, e in ipairs(span) do payloads[e[1]] = e[2] end
        local cut = #span >= tonumber(ARGV[7])
        local claimable, alive = claim_rules(KEYS[5], KEYS[6], KEYS[7], min_idle)
        local t = redis.call('TIME')
        local at = t[1] .. string.format('%03d', math.floor(tonumber(t[2]) / 1000))
        local poison, gone, failure = {{}}, {{}}, ''
        for _, row in ipairs(rows) do
            local id, owner, idle, count = row[1], row[2], row[3], row[4]
            local fields = payloads[id]
            if fields == nil and cut then
                local read = redis.call('XRANGE', KEYS[1], id, id)
                if #read > 0 then fields = read[1][2] end
            end
            local n = string.format('%d', count)
            if fields == nil then
                if claimable(idle, owner) and not alive(owner) then
                    local refused = lost(id, owner, KEYS[8], n)
                    if refused then failure = message(refused) break end
                    gone[#gone + 1] = id
                end
            elseif count >= max and not parked_count(owner) and claimable(idle, owner) then
                local r = redis.call('HMGET', KEYS[8], id, id .. ':run', id .. ':key')
                local counted = count
                if r[2] == n .. ':back' then counted = counted - 1 end
                if counted >= max then
                    local letter = {{'XADD', KEYS[2], '*', '{F_SOURCE_STREAM}', KEYS[1], '{F_SOURCE_ID}', id,
                        '{F_GROUP}', group, '{F_CONSUMER}', owner, '{F_DELIVERIES}', n,
                        '{F_REASON}', '{max_deliveries}',
                        '{F_ERROR}', r[1] or ('delivered ' .. n .. ' times without an ack'), '{F_AT}', at}}
                    if r[3] then
                        letter[#letter + 1] = '{F_BUSINESS_KEY}'
                        letter[#letter + 1] = r[3]
                    end
                    if #fields > {pack_over} then
                        letter[#letter + 1] = '{packed}'
                        letter[#letter + 1] = pack(fields)
                    else
                        for _, f in ipairs(fields) do letter[#letter + 1] = f end
                    end
                    local added = redis.pcall(unpack(letter))
                    if type(added) == 'table' and added.err then failure = message(added) break end
                    redis.call('XACK', KEYS[1], group, id)
                    forget(KEYS[8], id)
                    poison[#poison + 1] = id
                end
            end
        end
        return {{rows[#rows][1], #rows, poison, gone, failure}}",
        redelivery = crate::started::redelivery_lua(),
        lost = crate::claim::lost_lua(),
        rules = crate::claim::claim_rules_lua(),
        parked = crate::retry::consumers_lua(),
        max_deliveries = Reason::MaxDeliveries.as_str(),
        pack_over = 2 * crate::entry::PACK_OVER_FIELDS,
        packed = crate::entry::F_PACKED_FIELDS,
    )
});

/// Why a payload is recorded lost, in its letter.
const LOST_WHY: &str = "payload trimmed or deleted while pending";

/// The command that sweeps the page after `start` (`-` for the first;
/// [`SWEEP_PAGE`], whose reply it gets).
pub fn page_command(s: &SweepSettings<'_>, min_idle_ms: u64, start: &str) -> redis::Cmd {
    let mut cmd = redis::cmd("EVAL");
    cmd.arg(SWEEP_PAGE.as_str())
        .arg(8)
        .arg(s.stream)
        .arg(s.dead_letter_stream)
        .arg(crate::payload_loss::count_key(s.stream, s.group))
        .arg(crate::payload_loss::ids_key(s.stream, s.group))
        .arg(keys::server_epoch_key(s.stream))
        .arg(keys::dead_consumers_key(s.stream, s.group))
        .arg(keys::alive_key(s.stream, s.group))
        .arg(keys::last_error_key(s.stream, s.group))
        .arg(s.group)
        .arg(min_idle_ms)
        .arg(LOST_WHY)
        .arg(s.max_deliveries)
        .arg(start)
        .arg(s.page())
        .arg(s.page() * 2);
    cmd
}

/// The reply of [`SWEEP_PAGE`] ([`page_command`]).
pub type PageReply = (String, usize, Vec<String>, Vec<String>, String);

/// What one page's script did.
struct SweptPage {
    /// Its last ID (empty: the PEL had nothing after the cursor).
    last: String,
    rows: usize,
    dead_lettered: usize,
    lost: usize,
    /// Why it stopped, naming it, when a letter was refused.
    refused: Option<String>,
}

impl SweptPage {
    /// Counted from the script's reply: what it wrote, not what was sent.
    fn count_into(&self, report: &mut RecoveryReport) {
        let n = |k: usize| u64::try_from(k).unwrap_or(u64::MAX);
        report.claimed += n(self.dead_lettered);
        report.dead_lettered += n(self.dead_lettered);
        report.payload_lost += n(self.lost);
        if let Some(refused) = &self.refused {
            report.left_pending.push(refused.clone());
        }
    }
}

async fn sweep_page<C: ConnectionLike + Send>(
    conn: &mut C,
    s: &SweepSettings<'_>,
    min_idle_ms: u64,
    start: &str,
) -> Result<SweptPage, StreamError> {
    let (last, rows, lettered, lost, refused): PageReply = page_command(s, min_idle_ms, start)
        .query_async(conn)
        .await
        .map_err(|e| StreamError::new("sweeping a page of the PEL", e))?;
    let refused = (!refused.is_empty()).then(|| {
        let settled = lettered.len() + lost.len();
        let after = after(start);
        format!("a page of pending entries {after}, to {last}: a dead letter was refused ({settled} settled before it): {refused}")
    });
    Ok(SweptPage { last, rows, dead_lettered: lettered.len(), lost: lost.len(), refused })
}

/// Where a page starts, for a message: `start` is `-` or `(<ID>`.
fn after(start: &str) -> String {
    match start.strip_prefix('(') {
        Some(id) => format!("after {id}"),
        None => "from the start of the PEL".to_string(),
    }
}
