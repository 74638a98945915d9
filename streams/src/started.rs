//! The per-entry "started" record: which delivery of a pending entry ran its
//! handler, whether that run ended, and how many times the worker process
//! died while it ran. Kept in the group's entry-record hash
//! (`keys::last_error_key`, beside the entry's last error), so it is in the
//! stream's slot and goes with the entry's ack or dead letter.
//!
//! What it is for: a handler that kills its process (out of memory on a big
//! payload, `abort`, a segfault) is not a failure the worker sees. Without a
//! record every restart re-claims the whole batch with one more delivery, and
//! after `maxDeliveries` restarts entries that never ran are dead letters
//! "delivered too often". With it a claim tells apart, per entry:
//!
//! * **handed back unstarted** (`<n>:back`, written by the worker that let
//!   it go: shutdown, a failed batch, its key busy elsewhere): claimed with
//!   its delivery count unchanged (`XCLAIM … RETRYCOUNT`), since that
//!   delivery never ran;
//! * **started and never ended** (`<n>`): the process died while it ran:
//!   counted, and its crash count goes up. The worker runs such an entry
//!   alone, so the next crash is charged to it only, and dead-letters it as
//!   `crashed-worker` once its count reaches the crash limit;
//! * anything else (`<n>:end`, an older delivery's record, none at all): a
//!   delivery like any other, counted. Not starting is what must be written
//!   down, never assumed: a process that dies before it could record
//!   anything (out of memory decoding a huge entry) still counts, and such
//!   an entry reaches `maxDeliveries` like any other.
//!
//! Beside it, the entry's business key (`<id>:key`, [`key_field`]), written
//! with the start record: whoever later dead-letters the entry without its
//! payload (a claim or the sweep finding it trimmed, the sweep finding it
//! poison) can still say which order it was.

use crate::entry::Entry;
use crate::error::StreamError;
use crate::group_ref::ConsumerRef;
use crate::keys;
use redis::aio::ConnectionLike;

/// The field holding the delivery whose handler started last: `<n>` while
/// it runs, `<n>:end` once it returned.
pub fn run_field(id: &str) -> String {
    format!("{id}:run")
}

/// The field counting the times the process died while the entry's handler ran.
pub fn crashes_field(id: &str) -> String {
    format!("{id}:crashes")
}

/// The field holding the entry's business key, written with its start record.
pub fn key_field(id: &str) -> String {
    format!("{id}:key")
}

/// The suffixes of an entry's fields in the entry-record hash: its last
/// error (the ID alone), its run record, crash count, first failure
/// (`retry`) and business key. An entry that leaves the PEL drops them all.
pub const RECORD_SUFFIXES: [&str; 5] = ["", ":run", ":crashes", ":since", ":key"];

/// Lua: `record_fields(id, out)` appends entry `id`'s fields in the
/// entry-record hash ([`RECORD_SUFFIXES`]) to `out` and returns it.
pub fn record_fields_lua() -> String {
    let suffixes: Vec<String> = RECORD_SUFFIXES.iter().map(|s| format!("'{s}'")).collect();
    format!(
        r"
        local RECORD_SUFFIXES = {{ {} }}
        local function record_fields(id, out)
            for _, s in ipairs(RECORD_SUFFIXES) do out[#out + 1] = id .. s end
            return out
        end
        ",
        suffixes.join(", ")
    )
}

/// Proof, on Redis's own clock, that a consumer still holds the entries one
/// read delivered to it: the server's time (ms) no later than their
/// delivery, read on the server that delivered them. While the server's
/// clock is less than [`HeldSince::window_ms`] past `at_ms`, and the lowest
/// of the entries acted on is still in the consumer's PEL, no other
/// consumer can hold any of them, and the scripts that act on them skip the
/// ownership check over their span (the `XPENDING` page of [`HELD_BY_LUA`]):
///
/// * every claim and the sweep wait for an entry to be idle min-idle-time,
///   and no consumer claims after less than the least min-idle-time a
///   worker accepts (`contract::LEAST_MIN_IDLE_MS`, whatever values the
///   group's consumers run with, during a change say); the window is at
///   most half of that ([`HOLD_PROOF_LIMIT`]);
/// * the operator's release of a dead consumer's entries leaves those idle
///   for less than [`HOLD_PROOF_LIMIT`] (`consumers::release_pending`): a
///   process still reading behind a deleted pod keeps what it just read;
/// * a read lost in a failover or a restart (the PEL rolled back), or a
///   group deleted and created again, takes all of the read's entries out
///   of the consumer's PEL at once (a read is replicated and written to the
///   AOF as one transaction, and the consumer reads nothing else while its
///   batch is in hand): the one entry looked up tells.
///
/// Not covered: a group rewound by hand (`XGROUP SETID` to an earlier ID,
/// to replay) hands entries still pending to whichever consumer reads them
/// next, without any wait; within the window the old holder may still start
/// and ack them. A rewind asks for them to run again anyway (at least once;
/// the guard keeps the two runs of a key apart), and it was a race before:
/// a look at the PEL before the start did not stop a rewind right after.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeldSince {
    pub at_ms: u64,
    pub window_ms: u64,
}

/// The longest a read's proof of the hold lasts ([`HeldSince`]): half the
/// least min-idle-time a worker accepts. A batch of light handlers is done
/// within it; slower ones look at the PEL.
pub const HOLD_PROOF_LIMIT: std::time::Duration =
    std::time::Duration::from_millis(streamfleet_contract::LEAST_MIN_IDLE_MS / 2);

/// How long a read's proof of the hold lasts in a group whose claims wait
/// `min_idle`: half of it, at most [`HOLD_PROOF_LIMIT`].
pub fn hold_proof_window(min_idle: std::time::Duration) -> std::time::Duration {
    (min_idle / 2).min(HOLD_PROOF_LIMIT)
}

impl HeldSince {
    /// The proof for entries delivered after `at_ms` (server time) to a
    /// group whose claims wait `min_idle` ([`hold_proof_window`]).
    pub fn new(at_ms: u64, min_idle: std::time::Duration) -> Self {
        Self { at_ms, window_ms: crate::millis(hold_proof_window(min_idle)) }
    }

    /// The script arguments: `at_ms`, `window_ms` (`0 0`: no proof).
    pub fn args(proof: Option<Self>) -> [u64; 2] {
        proof.map_or([0, 0], |p| [p.at_ms, p.window_ms])
    }
}

/// Lua: the server's time now, in ms.
pub const SERVER_MS_LUA: &str = r"
        local function server_ms()
            local t = redis.call('TIME')
            return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
        end
        ";

/// A script returning the server's time in ms, keyed by a stream so it runs
/// on the server that holds it (a cluster's node of its slot).
pub fn server_ms_command(stream: &str) -> redis::Cmd {
    let mut cmd = redis::cmd("EVAL");
    cmd.arg(format!("{SERVER_MS_LUA} return server_ms()")).arg(1).arg(stream);
    cmd
}

/// Lua: `held_by(stream, group, consumer, low, high, wanted, n, at, window)`: which of
/// the `n` IDs of the set `wanted`, all between `low` and `high`, `consumer`
/// holds in the PEL. Read from its own PEL over that span, in pages of `n`
/// (`XPENDING … <consumer>`): one call for entries read together, not one
/// point lookup each, and no further page once all `n` are found. All of
/// them, with one point lookup of `low`, while `at` and `window` prove the
/// hold ([`HeldSince`]; `0 0`: no proof). Needs [`SERVER_MS_LUA`].
pub const HELD_BY_LUA: &str = r"
        local function held_by(stream, group, consumer, low, high, wanted, n, at, window)
            at, window = tonumber(at) or 0, tonumber(window) or 0
            if at > 0 and server_ms() - at < window
                and #redis.call('XPENDING', stream, group, low, low, 1, consumer) > 0 then
                return wanted
            end
            local held, from, found = {}, low, 0
            while n > 0 do
                local page = redis.call('XPENDING', stream, group, from, high, n, consumer)
                for _, p in ipairs(page) do
                    if wanted[p[1]] then
                        held[p[1]] = true
                        found = found + 1
                    end
                end
                if #page < n or found == n then break end
                from = '(' .. page[#page][1]
            end
            return held
        end
        ";

/// The value [`run_field`] holds once delivery `deliveries`'s handler returned.
pub fn ended(deliveries: u64) -> String {
    format!("{deliveries}:end")
}

/// The value [`run_field`] holds when delivery `deliveries` was handed back
/// (or left) without its handler starting: its next claim does not count it.
pub fn handed_back(deliveries: u64) -> String {
    format!("{deliveries}:back")
}

/// Records that `entry`'s current delivery ends without its handler having
/// started (its business key busy elsewhere): its next claim does not count
/// it. Written only while `consumer` holds the entry, with its business key.
pub async fn record_not_started<C: ConnectionLike + Send>(
    conn: &mut C,
    entry: &Entry,
    business_key: Option<&str>,
    group: &str,
    consumer: &str,
) -> Result<bool, StreamError> {
    let runs = [(entry.id.as_str(), handed_back(entry.deliveries), business_key)];
    let action = "recording an entry left unstarted";
    let written = record_runs(conn, &entry.stream, group, consumer, None, &runs, action).await?;
    Ok(written.first() == Some(&true))
}

/// Records that the handlers of `starting` (entries of `stream`: ID,
/// delivery count and business key) start now, in one script: a worker whose handlers start
/// together writes their records together (group commit). Written (and
/// waited for) before the handlers run: a process that dies in one leaves
/// the record behind for the next claim to read. Per entry, false (and
/// nothing written for it) when `consumer` no longer holds it (its hold
/// lapsed and another claimed, acked or dead-lettered it): its handler
/// must not start. With `held` (a proof the hold is young), they are not
/// looked up.
pub async fn record_starts<C: ConnectionLike + Send>(
    conn: &mut C,
    who: ConsumerRef<'_>,
    held: Option<HeldSince>,
    starting: &[(&str, u64, Option<&str>)],
) -> Result<Vec<bool>, StreamError> {
    let ConsumerRef { stream, group, consumer } = who;
    let runs: Vec<(&str, String, Option<&str>)> =
        starting.iter().map(|(id, deliveries, key)| (*id, deliveries.to_string(), *key)).collect();
    record_runs(conn, stream, group, consumer, held, &runs, "recording handlers' start").await
}

/// Sets each entry's run record ([`run_field`]) and business key
/// ([`key_field`]) while `ARGV[2]` holds it in the PEL, in one script: a
/// holder whose hold lapsed never leaves a record for an entry that has
/// left the PEL (where nothing would ever delete it) or that another
/// consumer now runs. KEYS: the stream, the entry-record hash. ARGV: group,
/// consumer, the lowest and highest of the IDs, the proof of the hold
/// ([`HeldSince::args`]), then per entry its ID, value and business key
/// ('' for none). Returns per entry 1 written, 0 not held. Which are held
/// comes from the proof, else one `XPENDING` over the IDs' span
/// ([`HELD_BY_LUA`]), and one `HSET` writes them all.
static RECORD_RUNS: std::sync::LazyLock<redis::Script> =
    std::sync::LazyLock::new(|| redis::Script::new(&format!("{SERVER_MS_LUA}{HELD_BY_LUA}{RECORD_RUNS_LUA}")));

const RECORD_RUNS_LUA: &str = r"
        local out, fields, wanted, n = {}, {}, {}, 0
        for j = 7, #ARGV, 3 do
            wanted[ARGV[j]] = true
            n = n + 1
        end
        local held = held_by(KEYS[1], ARGV[1], ARGV[2], ARGV[3], ARGV[4], wanted, n, ARGV[5], ARGV[6])
        for j = 7, #ARGV, 3 do
            local id = ARGV[j]
            if held[id] then
                fields[#fields + 1] = id .. ':run'
                fields[#fields + 1] = ARGV[j + 1]
                if ARGV[j + 2] ~= '' then
                    fields[#fields + 1] = id .. ':key'
                    fields[#fields + 1] = ARGV[j + 2]
                end
                out[#out + 1] = 1
            else
                out[#out + 1] = 0
            end
        end
        if #fields > 0 then
            redis.call('HSET', KEYS[2], unpack(fields))
        end
        return out";

async fn record_runs<C: ConnectionLike + Send>(
    conn: &mut C,
    stream: &str,
    group: &str,
    consumer: &str,
    held: Option<HeldSince>,
    runs: &[(&str, String, Option<&str>)],
    action: &'static str,
) -> Result<Vec<bool>, StreamError> {
    if runs.is_empty() {
        return Ok(Vec::new());
    }
    let mut script = RECORD_RUNS.prepare_invoke();
    let (low, high) = crate::retention::StreamId::span(runs.iter().map(|(id, _, _)| *id));
    script.key(stream).key(keys::last_error_key(stream, group)).arg(group).arg(consumer).arg(low).arg(high);
    let [at, window] = HeldSince::args(held);
    script.arg(at).arg(window);
    for (id, value, key) in runs {
        script.arg(*id).arg(value).arg(key.unwrap_or_default());
    }
    let written: Vec<u8> = script.invoke_async(conn).await.map_err(|e| StreamError::new(action, e))?;
    Ok(written.into_iter().map(|w| w == 1).collect())
}

/// Lua shared by the claim scripts: `redelivery(record_key, id, count)`
/// reads entry `id`'s record (its delivery count now is `count`) and returns
/// the delivery count the claim gives it, its crash count, and whether that
/// count must be set (`XCLAIM … RETRYCOUNT`: its last delivery was handed
/// back unstarted) rather than counted up. Also `forget(record_key, id)`:
/// drops the entry's whole record ([`RECORD_SUFFIXES`]), for an entry that
/// leaves the PEL.
pub fn redelivery_lua() -> String {
    record_fields_lua()
        + r"
        local function redelivery(record_key, id, count)
            local r = redis.call('HMGET', record_key, id .. ':run', id .. ':crashes')
            local n = string.format('%d', count)
            local crashes = tonumber(r[2] or '0') or 0
            if r[1] == n then
                -- Started and never ended: the process died while it ran.
                crashes = redis.call('HINCRBY', record_key, id .. ':crashes', 1)
                return count + 1, crashes, false
            elseif r[1] == n .. ':back' then
                -- Used up: if this claimer dies before recording anything,
                -- its delivery counts.
                redis.call('HDEL', record_key, id .. ':run')
                return count, crashes, true
            end
            return count + 1, crashes, false
        end
        local function forget(record_key, id)
            redis.call('HDEL', record_key, unpack(record_fields(id, {})))
        end
        "
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_proof_lasts_half_min_idle_time_and_never_past_half_the_least_a_worker_accepts() {
        use std::time::Duration;
        assert_eq!(hold_proof_window(Duration::from_millis(100)), Duration::from_millis(50));
        assert_eq!(hold_proof_window(Duration::from_secs(60)), Duration::from_millis(50));
        assert_eq!(HOLD_PROOF_LIMIT.as_millis() * 2, u128::from(streamfleet_contract::LEAST_MIN_IDLE_MS));
        assert_eq!(HeldSince::new(7, Duration::from_secs(60)), HeldSince { at_ms: 7, window_ms: 50 });
        assert_eq!(HeldSince::args(None), [0, 0], "no proof");
    }

    #[test]
    fn fields_are_the_entrys_own() {
        assert_eq!(run_field("5-0"), "5-0:run");
        assert_eq!(crashes_field("5-0"), "5-0:crashes");
        assert_eq!(ended(3), "3:end");
        assert_eq!(handed_back(3), "3:back");
        assert_eq!(key_field("5-0"), "5-0:key");
        // The Lua reads the same names the Rust writes, and drops them all.
        assert!(redelivery_lua().contains("id .. ':run'") && redelivery_lua().contains("':back'"));
        let fields = [run_field("x"), crashes_field("x"), key_field("x"), crate::retry::failing_since_field("x")];
        for f in fields.iter().chain([&"x".to_string()]) {
            let suffix = f.strip_prefix('x').unwrap_or_default();
            assert!(RECORD_SUFFIXES.contains(&suffix), "{f} is not dropped with its entry");
        }
        // The scripts that write and read the key use the same field.
        let key = format!("id .. '{}'", key_field(""));
        assert!(RECORD_RUNS_LUA.contains(&key) && crate::claim::lost_lua().contains(&key));
    }
}
