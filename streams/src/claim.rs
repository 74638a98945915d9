//! Claiming idle pending entries and learning their delivery counts.

use crate::entry::{Entry, entries_from_value};
use crate::error::StreamError;
use crate::group_ref::ConsumerRef;
use crate::group_ref::GroupRef;
use redis::aio::ConnectionLike;
use std::time::Duration;

/// One claim step.
pub struct Claimed {
    /// Entries now owned by the claiming consumer, delivery counts included.
    pub entries: Vec<Entry>,
    /// Pending IDs whose payload is gone (trimmed or XDEL'd), already
    /// recorded as lost (dead letter and loss record) and dropped from the PEL
    /// by the same script that found them.
    pub deleted: Vec<String>,
    /// Cursor for the next step; `0-0` once the whole PEL was scanned.
    pub next: String,
    /// Some idle entries were left because the server restarted, failed
    /// over or stalled less than min-idle-time ago and their holders may still renew
    /// (`claim_rules_lua`). Try again later.
    pub deferred: bool,
}

/// Where a claim records the pending IDs it finds without a payload: the
/// dead-letter stream and the group's payload-loss record, written by the
/// same script that drops the ID from the PEL (never after it: a crash in
/// between would lose it without a word). The dead letter names the
/// consumer that last held the entry.
pub struct LossRecord<'a> {
    pub dead_letter_stream: &'a str,
    /// Named in the dead letter as the consumer that met the loss when the
    /// script does not know the last holder.
    pub consumer: &'a str,
    pub why: &'a str,
}

/// Lua shared by the claim scripts and the sweep: `lost(id, holder,
/// record_key, deliveries)` writes the payload-missing dead letter (naming
/// `holder`, the consumer that last held the entry, and the entry's
/// business key when a handler started it, `started::key_field`), acks the
/// ID and drops its entry record (`started::redelivery_lua`'s `forget`,
/// which must come first), then counts the loss. The letter's delivery
/// count is `deliveries` when given, else `0`. A letter Redis refuses (out
/// of memory) writes nothing and is returned, to stop the caller there;
/// `nil` once written. Any later failure raises: the letter is acked by then,
/// so it is never written twice.
/// KEYS: stream, dead-letter stream, loss count, loss IDs. ARGV[1] group,
/// ARGV[3] why.
pub(crate) fn lost_lua() -> String {
    use crate::deadletter::*;
    format!(
        r"
        local function lost(id, holder, record_key, deliveries)
            local t = redis.call('TIME')
            local at = t[1] .. string.format('%03d', math.floor(tonumber(t[2]) / 1000))
            local letter = {{'XADD', KEYS[2], '*', '{F_SOURCE_STREAM}', KEYS[1], '{F_SOURCE_ID}', id,
                '{F_GROUP}', ARGV[1], '{F_CONSUMER}', holder, '{F_DELIVERIES}', deliveries or '0',
                '{F_REASON}', 'payload-missing', '{F_ERROR}', ARGV[3], '{F_AT}', at}}
            local key = redis.call('HGET', record_key, id .. ':key')
            if key then
                letter[#letter + 1] = '{F_BUSINESS_KEY}'
                letter[#letter + 1] = key
            end
            local added = redis.pcall(unpack(letter))
            if type(added) == 'table' and added.err then return added end
            redis.call('XACK', KEYS[1], ARGV[1], id)
            forget(record_key, id)
            redis.call('HINCRBY', KEYS[3], 'count', 1)
            redis.call('LPUSH', KEYS[4], id)
            redis.call('LTRIM', KEYS[4], 0, {latest})
        end
        ",
        latest = crate::payload_loss::LATEST - 1
    )
}

/// Lua shared by the claim scripts: `xclaim(claimer, min_idle, ids,
/// options)` sends `XCLAIM KEYS[1] ARGV[1] claimer min_idle ids… options…`
/// (ARGV[1] is the group) in slices of 500 IDs (Lua's `unpack` has a
/// limit) and returns every reply element in order.
fn xclaim_lua() -> &'static str {
    r"
        local function xclaim(claimer, min_idle, ids, options)
            local out = {}
            for from = 1, #ids, 500 do
                local args = {'XCLAIM', KEYS[1], ARGV[1], claimer, min_idle}
                for i = from, math.min(from + 499, #ids) do args[#args + 1] = ids[i] end
                for _, o in ipairs(options) do args[#args + 1] = o end
                for _, c in ipairs(redis.call(unpack(args))) do out[#out + 1] = c end
            end
            return out
        end
        "
}

/// Lua shared by every script that takes entries other consumers held:
/// `claim_rules(epoch_key, dead_key, alive_key, min_idle_ms)` returns
/// `claimable(idle, owner)` and `alive(owner)` (the owner renewed a hold
/// within min-idle-time: an entry of its whose payload is gone is in its
/// hands, not lost). A restart or a failover stops every hold: the
/// idle times kept in the PEL (in the AOF, or replicated to the promoted
/// replica) went on counting while no holder could reach the server, so an
/// entry a live worker holds can look abandoned the moment the server is
/// back. So an entry idle past min-idle-time is claimable only when
///
/// * its idle time was measured wholly by this server as master (its last
///   delivery or renewal came after the server started, and for a promoted
///   replica after claims first saw it promoted), or
/// * the server's epoch (its `run_id` and replication ID, recorded beside
///   the stream with when claims first saw it) is min-idle-time old: every
///   live holder, renewing every third of min-idle-time, has re-asserted
///   its hold by then, or
/// * its owner was declared dead (the operator saw its pod gone).
///
/// A server seen for the first time that was never promoted dates its
/// epoch from its start (`uptime_in_seconds`), so a long-running server
/// claims at once; an epoch that changed since claims last looked (a
/// restart, a failover) dates from that first look, never earlier.
///
/// A server that stalls without restarting (a slow `fsync` under
/// `appendfsync always`, a long script, a paused VM) stops every hold too,
/// and when it resumes a claim can run before the holders' renewals queued
/// behind it. So a silence of the whole group (no consumer beat for
/// `consumers::GROUP_SILENCE`, [`crate::consumers::silence_lua`]) counts as
/// a new epoch from when it ended, for the group's claims.
pub fn claim_rules_lua() -> String {
    crate::consumers::silence_lua()
        + r"
        local function claim_rules(epoch_key, dead_key, alive_key, min_idle)
            local server = redis.call('INFO', 'server')
            local run = string.match(server, 'run_id:(%w+)') or ''
            local uptime = tonumber(string.match(server, 'uptime_in_seconds:(%d+)') or '0') or 0
            local repl = redis.call('INFO', 'replication')
            local replid = string.match(repl, 'master_replid:(%w+)') or ''
            local replid2 = string.match(repl, 'master_replid2:(%w+)') or ''
            local promoted = replid2 ~= '' and string.match(replid2, '^0+$') == nil
            local epoch = run .. ':' .. replid
            local t = redis.call('TIME')
            local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
            local started = now - uptime * 1000
            local seen = redis.call('HMGET', epoch_key, 'epoch', 'since')
            local since = tonumber(seen[2])
            if seen[1] ~= epoch or since == nil then
                since = now
                -- Never seen, never promoted: from its start (the uptime is
                -- whole seconds: a second earlier, so a fresh server's
                -- first entries count as tracked).
                if not seen[1] and not promoted then since = started - 1000 end
                redis.call('HSET', epoch_key, 'epoch', epoch, 'since', string.format('%.0f', since))
            end
            local tracked = promoted and since or math.min(started, since)
            local open = now - since >= min_idle
            -- A silence of the whole group (a stalled server) stopped every
            -- hold as a restart does: an entry that became claimable during
            -- it (last renewed before it ended, and not yet claimable when
            -- it began) waits min-idle-time after it.
            local resumed, quiet_from = silence_ended(epoch_key, alive_key, now)
            local heard = now - resumed >= min_idle
            local dead, seen_alive = {}, {}
            local function claimable(idle, owner)
                idle = tonumber(idle) or 0
                if idle < min_idle then return false end
                local last = now - idle
                local epoch_ok = open or last >= tracked
                local silence_ok = heard or last >= resumed or last + min_idle <= quiet_from
                if epoch_ok and silence_ok then return true end
                if dead[owner] == nil then dead[owner] = redis.call('ZSCORE', dead_key, owner) ~= false end
                return dead[owner]
            end
            local function alive(owner)
                if seen_alive[owner] == nil then
                    local at = tonumber(redis.call('ZSCORE', alive_key, owner) or '')
                    seen_alive[owner] = at ~= nil and now - at < min_idle
                end
                return seen_alive[owner]
            end
            return claimable, alive
        end
        "
}

/// Lua shared by the scripts that claim with a delivery (not `JUSTID`):
/// `take(claimer, min_idle, ids, counts, record_key, options)` claims `ids`
/// (their delivery counts now in `counts[id]`; `options` more `XCLAIM`
/// options), each counted up or, when its last delivery never started,
/// with its count unchanged
/// (`started::redelivery_lua`). Returns the claimed entries (ID and
/// fields, in `ids` order), their delivery counts and crash counts.
fn take_lua() -> &'static str {
    r"
        local function take(claimer, min_idle, ids, counts, record_key, options)
            local counted, kept, delivered, crashed = {}, {}, {}, {}
            for _, id in ipairs(ids) do
                local count, crashes, keep = redelivery(record_key, id, counts[id])
                delivered[id], crashed[id] = count, crashes
                if keep then
                    kept[count] = kept[count] or {}
                    table.insert(kept[count], id)
                else
                    counted[#counted + 1] = id
                end
            end
            local got = {}
            for _, c in ipairs(xclaim(claimer, min_idle, counted, options)) do
                if c then got[c[1]] = c end
            end
            for count, same in pairs(kept) do
                local o = { 'RETRYCOUNT', string.format('%d', count) }
                for _, x in ipairs(options) do o[#o + 1] = x end
                for _, c in ipairs(xclaim(claimer, min_idle, same, o)) do
                    if c then got[c[1]] = c end
                end
            end
            local claimed, counts_out, crashes_out = {}, {}, {}
            for _, id in ipairs(ids) do
                if got[id] then
                    claimed[#claimed + 1] = got[id]
                    counts_out[#counts_out + 1] = delivered[id]
                    crashes_out[#crashes_out + 1] = crashed[id]
                end
            end
            return claimed, counts_out, crashes_out
        end
        "
}

/// One claim step over the PEL, with what it meets recorded in the same
/// script. KEYS: stream, dead-letter stream, loss count, loss IDs, server
/// epoch, dead-consumer registry, alive registry, entry records. ARGV[4]
/// claimer, ARGV[5] min idle, ARGV[6] cursor (`0-0` to start), ARGV[7]
/// count.
///
/// Not `XAUTOCLAIM`: it drops a deleted ID from the PEL whatever its idle
/// time, so an entry a producer's `MAXLEN` trimmed while a live worker
/// handles it would be recorded lost, and that worker's finished work
/// redone by whoever reads the runbook. Here only entries idle past
/// min-idle-time are looked at (`XPENDING … IDLE`); of those, the ones
/// without a payload are recorded lost naming their last holder, the rest
/// claimed (`XCLAIM` with the same min idle: atomic here anyway), counted
/// or not as their started record says (`take_lua`). Entries not claimable
/// yet after a restart, a failover or a stall ([`claim_rules_lua`]) are neither
/// claimed nor checked for their payload.
/// Returns: next cursor (`0-0` when done), the claimed entries, the lost
/// IDs, each claimed entry's delivery count (this claim included) and crash
/// count, and how many idle entries were deferred.
static CLAIM_IDLE: std::sync::LazyLock<redis::Script> = std::sync::LazyLock::new(|| {
    redis::Script::new(&format!(
        r"{}{}{}{}{}{}
        local claimable, alive = claim_rules(KEYS[5], KEYS[6], KEYS[7], tonumber(ARGV[5]))
        local n = tonumber(ARGV[7])
        -- Consumer by consumer (their own PELs), parking consumers left
        -- out: entries waiting for a retry are never scanned here, however
        -- many. The cursor is `<consumer>\n<last ID>`.
        local from_consumer, from_id = nil, '-'
        if ARGV[6] ~= '0-0' then
            local consumer, id = string.match(ARGV[6], '^(.*)\n([^\n]*)$')
            from_consumer, from_id = consumer or '', '(' .. (id or '0-0')
        end
        -- Consumers come in byte order (Redis's rax); Lua's `>` on strings
        -- follows the server's locale, so bytes are compared here.
        local function after(a, b)
            for i = 1, math.min(#a, #b) do
                local x, y = string.byte(a, i), string.byte(b, i)
                if x ~= y then return x > y end
            end
            return #a > #b
        end
        local page, next, started = {{}}, '0-0', from_consumer == nil
        for _, c in ipairs(consumers(KEYS[1], ARGV[1])) do
            local start = '-'
            if from_consumer ~= nil and c.name == from_consumer then
                started, start = true, from_id
            elseif not started and after(c.name, from_consumer) then
                started = true
            end
            if started and c.pending > 0 and not parked_count(c.name) and #page < n then
                local left = n - #page
                local rows = redis.call('XPENDING', KEYS[1], ARGV[1], 'IDLE', ARGV[5], start, '+', left, c.name)
                for _, p in ipairs(rows) do page[#page + 1] = p end
                if #rows > 0 and #rows >= left then
                    next = c.name .. '\n' .. rows[#rows][1]
                    break
                end
            end
        end
        local existing, counts, gone, deferred = {{}}, {{}}, {{}}, 0
        for _, p in ipairs(page) do
            if not claimable(p[3], p[2]) then
                deferred = deferred + 1
            elseif #redis.call('XRANGE', KEYS[1], p[1], p[1]) > 0 then
                existing[#existing + 1] = p[1]
                counts[p[1]] = p[4]
            elseif not alive(p[2]) then
                -- (An owner that renewed a hold within min-idle-time has it
                -- in hand, its payload trimmed under it: its hold cannot
                -- reset the idle time of an entry without a payload. The
                -- owner finishes and acks it: not a loss.)
                local refused = lost(p[1], p[2], KEYS[8])
                if refused then return refused end
                gone[#gone + 1] = p[1]
            end
        end
        local claimed, delivered, crashes = take(ARGV[4], ARGV[5], existing, counts, KEYS[8], {{}})
        return {{next, claimed, gone, delivered, crashes, deferred}}",
        crate::started::redelivery_lua(),
        lost_lua(),
        claim_rules_lua(),
        xclaim_lua(),
        take_lua(),
        crate::retry::consumers_lua(),
    ))
});

/// XCLAIM of given IDs the claimer still owns (its own take-back, or the
/// release of a dead consumer's entries to itself), those without a payload
/// recorded as lost first (an XCLAIM would drop them silently). KEYS:
/// stream, dead-letter stream, loss count, loss IDs, entry records. ARGV[4]
/// claimer and expected owner, ARGV[5] min idle, ARGV[6] IDLE to set (''
/// to leave), ARGV[7] '1' for JUSTID (delivery counts unchanged), then the
/// IDs. Without JUSTID each entry is counted up or not as its started
/// record says (`take_lua`). Returns the XCLAIM reply, the IDs found lost,
/// and (without JUSTID) each claimed entry's delivery and crash counts.
static CLAIM_IDS: std::sync::LazyLock<redis::Script> = std::sync::LazyLock::new(|| {
    redis::Script::new(&format!(
        r"{}{}{}{}
        local existing, counts, gone = {{}}, {{}}, {{}}
        for i = 8, #ARGV do
            local id = ARGV[i]
            local p = redis.call('XPENDING', KEYS[1], ARGV[1], id, id, 1)[1]
            -- Only entries the claimer still owns: one another consumer took
            -- since the caller looked is theirs now.
            if p ~= nil and p[2] == ARGV[4] then
                if #redis.call('XRANGE', KEYS[1], id, id) > 0 then
                    existing[#existing + 1] = id
                    counts[id] = p[4]
                else
                    local refused = lost(id, p[2], KEYS[5])
                    if refused then return refused end
                    gone[#gone + 1] = id
                end
            end
        end
        local options = {{}}
        if ARGV[6] ~= '' then
            options[#options + 1] = 'IDLE'
            options[#options + 1] = ARGV[6]
        end
        if ARGV[7] == '1' then
            options[#options + 1] = 'JUSTID'
            return {{xclaim(ARGV[4], ARGV[5], existing, options), gone, {{}}, {{}}}}
        end
        local claimed, delivered, crashes = take(ARGV[4], ARGV[5], existing, counts, KEYS[5], options)
        return {{claimed, gone, delivered, crashes}}",
        crate::started::redelivery_lua(),
        lost_lua(),
        xclaim_lua(),
        take_lua()
    ))
});

pub(crate) fn prepare<'a>(
    script: &'a redis::Script,
    stream: &str,
    group: &str,
    loss: &LossRecord<'_>,
) -> redis::ScriptInvocation<'a> {
    let mut invocation = script.prepare_invoke();
    invocation
        .key(stream)
        .key(loss.dead_letter_stream)
        .key(crate::payload_loss::count_key(stream, group))
        .key(crate::payload_loss::ids_key(stream, group))
        .arg(group)
        .arg(loss.consumer)
        .arg(loss.why);
    invocation
}

/// Claims up to `count` entries idle for at least `min_idle`, scanning from
/// `start` (`0-0` or a returned cursor). IDs idle that long whose payload is
/// gone are recorded in `loss` by the same script (naming their last
/// holder) and returned as `deleted`; an entry a live holder still renews
/// is never looked at, payload or not; nor is one whose holder may still
/// renew after a restart, a failover or a stall ([`claim_rules_lua`]).
#[allow(clippy::too_many_arguments)]
pub async fn autoclaim<C: ConnectionLike + Send>(
    conn: &mut C,
    who: ConsumerRef<'_>,
    loss: &LossRecord<'_>,
    min_idle: Duration,
    start: &str,
    count: usize,
) -> Result<Claimed, StreamError> {
    let ConsumerRef { stream, group, consumer } = who;
    let min_idle_ms = crate::millis(min_idle);
    let mut script = prepare(&CLAIM_IDLE, stream, group, loss);
    script
        .key(crate::keys::server_epoch_key(stream))
        .key(crate::keys::dead_consumers_key(stream, group))
        .key(crate::keys::alive_key(stream, group))
        .key(crate::keys::last_error_key(stream, group))
        .arg(consumer)
        .arg(min_idle_ms)
        .arg(start)
        .arg(count);
    type Reply = (String, redis::Value, Vec<String>, Vec<u64>, Vec<u32>, u64);
    let (next, claimed, deleted, delivered, crashes, deferred): Reply =
        script.invoke_async(conn).await.map_err(|e| StreamError::new("claiming idle entries", e))?;
    let entries = claimed_entries(stream, claimed, delivered, crashes)
        .map_err(|e| StreamError::new("claiming idle entries", e))?;
    Ok(Claimed { entries, deleted, next, deferred: deferred > 0 })
}

/// Takes parked entries whose retry is due (`retry`), then `XCLAIM`s them
/// (counted: their delivery ended, so the next counts). From the ranges of
/// the due-time index (`retry::INDEX_SPAN_MS`, one per delivery count) that
/// hold at least as many IDs as their parking consumers hold entries: the
/// IDs whose idle time reached the threshold, most overdue first across
/// ranges, each checked against the PEL (not parked any more: dropped;
/// parked at another count or since another time: re-scored to what the
/// PEL says), at most ten IDs looked at per entry wanted. A range holding
/// fewer (entries parked without the index: an older worker, the index
/// lost) is served by `XPENDING … IDLE <threshold(n)> …
/// streamfleet:retry:<n>` (a scan of that consumer's entries), and 1,000 of
/// its entries are indexed per call from a cursor per delivery count (the
/// cursor hash). Nothing parked: the index and cursors hold only stale
/// IDs and are dropped. Payloads gone meanwhile are recorded lost. KEYS:
/// stream, dead-letter stream, loss count, loss IDs, entry records,
/// due-time index, its cursors. ARGV[4] claimer, ARGV[5] count, then the
/// thresholds (ms) for deliveries 1, 2, … (the last one serves every
/// higher count). Returns the claimed entries, the lost IDs, the delivery
/// and crash counts, how many entries stay parked, and 1 when the index
/// served every range (0: some were scanned).
static CLAIM_DUE: std::sync::LazyLock<redis::Script> = std::sync::LazyLock::new(|| {
    redis::Script::new(&format!(
        r"{}{}{}{}{}{}
        local want = tonumber(ARGV[5])
        local t = redis.call('TIME')
        local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
        local existing, counts, gone, parked = {{}}, {{}}, {{}}, 0
        local ranges, order = {{}}, {{}}
        for _, c in ipairs(consumers(KEYS[1], ARGV[1])) do
            local n = parked_count(c.name)
            if n and c.pending > 0 then
                parked = parked + c.pending
                local b = bucket(n)
                if not ranges[b] then
                    ranges[b] = {{ pending = 0, parking = {{}} }}
                    order[#order + 1] = b
                end
                ranges[b].pending = ranges[b].pending + c.pending
                table.insert(ranges[b].parking, {{ name = c.name, n = n }})
            end
        end
        local function threshold(n)
            return tonumber(ARGV[5 + math.max(1, math.min(n, #ARGV - 5))])
        end
        local function left()
            return want - #existing - #gone
        end
        local function found(p)
            redis.call('ZREM', KEYS[6], p[1])
            if #redis.call('XRANGE', KEYS[1], p[1], p[1]) > 0 then
                existing[#existing + 1] = p[1]
                counts[p[1]] = p[4]
            else
                local refused = lost(p[1], p[2], KEYS[5])
                if refused then return refused end
                gone[#gone + 1] = p[1]
            end
        end
        local function reindex(c)
            local field = tostring(c.n)
            local from = redis.call('HGET', KEYS[7], field)
            local page = redis.call('XPENDING', KEYS[1], ARGV[1], from and ('(' .. from) or '-', '+', 1000, c.name)
            for _, p in ipairs(page) do
                redis.call('ZADD', KEYS[6], index_score(c.n, now - p[3]), p[1])
            end
            if #page < 1000 then
                redis.call('HDEL', KEYS[7], field)
            else
                redis.call('HSET', KEYS[7], field, page[#page][1])
            end
        end
        if parked == 0 then
            redis.call('DEL', KEYS[6], KEYS[7])
        end
        local indexed, looked, covered = 1, 0, {{}}
        for _, b in ipairs(order) do
            local low = b * INDEX_SPAN
            if redis.call('ZCOUNT', KEYS[6], low, low + INDEX_SPAN - 1) >= ranges[b].pending then
                covered[#covered + 1] = b
            else
                indexed = 0
                for _, c in ipairs(ranges[b].parking) do
                    -- (Indexed first: what is taken next leaves the index.)
                    reindex(c)
                    if left() > 0 then
                        local page = redis.call('XPENDING', KEYS[1], ARGV[1], 'IDLE', threshold(c.n), '-', '+', left(), c.name)
                        for _, p in ipairs(page) do
                            local refused = found(p)
                            if refused then return refused end
                        end
                    end
                end
            end
        end
        -- The due IDs of every covered range, most overdue first: each ID
        -- looked at leaves its range (taken, dropped or re-scored later),
        -- so a second round sees only new ones.
        while left() > 0 and looked < 10 * want and #covered > 0 do
            local due = {{}}
            for _, b in ipairs(covered) do
                local low = b * INDEX_SPAN
                local high = low + now - threshold(b)
                local page = redis.call('ZRANGEBYSCORE', KEYS[6], low, string.format('%.0f', high), 'WITHSCORES', 'LIMIT', 0, left())
                for i = 1, #page, 2 do
                    due[#due + 1] = {{ id = page[i], b = b, late = high - tonumber(page[i + 1]) }}
                end
            end
            if #due == 0 then break end
            table.sort(due, function(x, y) return x.late > y.late end)
            for _, d in ipairs(due) do
                if left() <= 0 or looked >= 10 * want then break end
                looked = looked + 1
                local p = redis.call('XPENDING', KEYS[1], ARGV[1], d.id, d.id, 1)[1]
                local n = p and parked_count(p[2])
                if not n then
                    redis.call('ZREM', KEYS[6], d.id)
                elseif bucket(n) == d.b and p[3] >= threshold(n) then
                    local refused = found(p)
                    if refused then return refused end
                else
                    redis.call('ZADD', KEYS[6], index_score(n, now - p[3]), d.id)
                end
            end
        end
        local claimed, delivered, crashes = take(ARGV[4], 0, existing, counts, KEYS[5], {{}})
        return {{claimed, gone, delivered, crashes, parked - #claimed - #gone, indexed}}",
        crate::started::redelivery_lua(),
        lost_lua(),
        xclaim_lua(),
        take_lua(),
        crate::retry::consumers_lua(),
        crate::retry::due_index_lua(),
    ))
});

/// What [`claim_due`] took.
pub struct Due {
    /// Entries whose retry was due, now the claimer's, delivery counted.
    pub entries: Vec<Entry>,
    /// Parked IDs whose payload was gone: recorded lost.
    pub deleted: Vec<String>,
    /// Entries still parked, waiting for their retry.
    pub waiting: u64,
    /// Whether the due-time index found them (`false`: some entries were
    /// parked without it, so the parking consumers were scanned).
    pub indexed: bool,
}

/// Claims up to `count` parked entries whose retry is due under `schedule`
/// (`retry`), in one script whatever the number of entries waiting.
#[allow(clippy::too_many_arguments)]
pub async fn claim_due<C: ConnectionLike + Send>(
    conn: &mut C,
    who: ConsumerRef<'_>,
    loss: &LossRecord<'_>,
    schedule: &crate::retry::Schedule,
    max_deliveries: u64,
    count: usize,
) -> Result<Due, StreamError> {
    let ConsumerRef { stream, group, consumer } = who;
    let mut script = prepare(&CLAIM_DUE, stream, group, loss);
    script
        .key(crate::keys::last_error_key(stream, group))
        .key(crate::keys::retry_due_key(stream, group))
        .key(crate::keys::retry_index_cursor_key(stream, group))
        .arg(consumer)
        .arg(count);
    for n in 1..=max_deliveries.clamp(1, 1_000) {
        script.arg(crate::millis(schedule.threshold(n)));
    }
    type Reply = (redis::Value, Vec<String>, Vec<u64>, Vec<u32>, i64, i64);
    let (claimed, deleted, delivered, crashes, waiting, indexed): Reply =
        script.invoke_async(conn).await.map_err(|e| StreamError::new("claiming entries due for a retry", e))?;
    let entries = claimed_entries(stream, claimed, delivered, crashes)
        .map_err(|e| StreamError::new("claiming entries due for a retry", e))?;
    Ok(Due { entries, deleted, waiting: u64::try_from(waiting).unwrap_or(0), indexed: indexed == 1 })
}

/// The entries of an `XCLAIM` reply, with the delivery and crash counts the
/// claim script gave them (in the reply's order).
fn claimed_entries(
    stream: &str,
    reply: redis::Value,
    deliveries: Vec<u64>,
    crashes: Vec<u32>,
) -> Result<Vec<Entry>, redis::RedisError> {
    let entries = entries_from_value(reply)?;
    Ok(entries
        .into_iter()
        .zip(deliveries.into_iter().zip(crashes))
        .map(|((id, fields), (deliveries, crashes))| Entry {
            deliveries,
            crashes,
            stream: stream.to_string(),
            id,
            fields,
        })
        .collect())
}

/// How [`claim_ids`] claims.
pub struct ClaimIds<'a> {
    pub consumer: &'a str,
    /// Only entries idle at least this long (ms) are taken.
    pub min_idle_ms: u64,
    /// Sets the claimed entries' idle time (`XCLAIM … IDLE`).
    pub set_idle_ms: Option<u64>,
    /// `JUSTID`: no payloads returned, delivery counts unchanged. Without
    /// it each entry's count goes up, unless its last delivery never
    /// started (`started`).
    pub just_id: bool,
}

/// What [`claim_ids`] did.
pub struct ClaimedIds {
    /// The `XCLAIM` reply: IDs with `JUSTID`, else entries.
    pub reply: redis::Value,
    /// IDs whose payload was gone, recorded lost.
    pub lost: Vec<String>,
    /// Without `JUSTID`: each claimed entry's delivery count and crash
    /// count, in the reply's order.
    pub deliveries: Vec<u64>,
    pub crashes: Vec<u32>,
}

/// `XCLAIM` of `ids`, the ones without a payload recorded in `loss` (and
/// acked) by the same script.
pub async fn claim_ids<C: ConnectionLike + Send>(
    conn: &mut C,
    of: GroupRef<'_>,
    loss: &LossRecord<'_>,
    how: &ClaimIds<'_>,
    ids: &[&str],
) -> Result<ClaimedIds, StreamError> {
    let GroupRef { stream, group } = of;
    let mut script = prepare(&CLAIM_IDS, stream, group, loss);
    script
        .key(crate::keys::last_error_key(stream, group))
        .arg(how.consumer)
        .arg(how.min_idle_ms)
        .arg(how.set_idle_ms.map(|ms| ms.to_string()).unwrap_or_default())
        .arg(if how.just_id { "1" } else { "0" })
        .arg(ids);
    let (reply, lost, deliveries, crashes) =
        script.invoke_async(conn).await.map_err(|e| StreamError::new("claiming entries", e))?;
    Ok(ClaimedIds { reply, lost, deliveries, crashes })
}

/// Takes back up to `count` of `consumer`'s own pending entries after
/// `after` (exclusive; `-` for the start): what a restarted process under the
/// same consumer name read before and never settled. Those whose payload is
/// gone are recorded in `loss` and returned as `deleted`. `next` is the last
/// ID looked at, or `0-0` when the PEL holds no more of them.
#[allow(clippy::too_many_arguments)]
pub async fn claim_own<C: ConnectionLike + Send>(
    conn: &mut C,
    who: ConsumerRef<'_>,
    loss: &LossRecord<'_>,
    after: &str,
    count: usize,
) -> Result<Claimed, StreamError> {
    let ConsumerRef { stream, group, consumer } = who;
    let start = if after == "-" { after.to_string() } else { format!("({after}") };
    let pending = crate::consumers::pending_of(conn, who, &start, count).await?;
    let Some((last, ..)) = pending.last() else {
        return Ok(Claimed { entries: Vec::new(), deleted: Vec::new(), next: "0-0".into(), deferred: false });
    };
    let next = if pending.len() < count { "0-0".to_string() } else { last.clone() };
    let ids: Vec<&str> = pending.iter().map(|(id, ..)| id.as_str()).collect();
    // A compare-and-set on idleness: an entry someone else claimed since the
    // XPENDING above has a fresh idle time and is left to them.
    let least_idle = pending.iter().map(|(_, _, idle, _)| *idle).min().unwrap_or(0);
    let how = ClaimIds { consumer, min_idle_ms: least_idle, set_idle_ms: None, just_id: false };
    let claimed = claim_ids(conn, crate::GroupRef::new(stream, group), loss, &how, &ids).await?;
    let entries = claimed_entries(stream, claimed.reply, claimed.deliveries, claimed.crashes)
        .map_err(|e| StreamError::new("taking back own pending entries", e))?;
    Ok(Claimed { entries, deleted: claimed.lost, next, deferred: false })
}
