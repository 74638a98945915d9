//! A worker's hold on the entries it has in hand, and how it lets go. Every
//! step is one script per stream, so it checks ownership and acts atomically:
//!
//! * `extend`: while a batch is in hand, its unsettled entries' idle time is
//!   reset (`XCLAIM … JUSTID`: no extra delivery) and their guard marks'
//!   TTLs renewed (put back if one expired while the server was down), so
//!   no other consumer may claim an entry this one still holds, however long
//!   its handler or its queue; after a restart or failover claims wait for
//!   this renewal (`claim::claim_rules_lua`);
//! * `commit`: a settled entry's event completion record (its lock
//!   released), then its ack (and its last error cleared), but the ack
//!   only while this consumer still owns the entry in the PEL (another holder
//!   that claimed it acks it itself);
//! * `hand_back`: an entry not started (shutdown, a failed batch) is made
//!   claimable at once, its mark dropped; its next claim does not count the
//!   delivery (`started`).

use streamfleet_streams::retention::StreamId;
use streamfleet_streams::started::HeldSince;
use streamfleet_streams::{ConsumerRef, StreamConnection, StreamError};

/// KEYS: stream, the group's alive registry, the stream's server epoch,
/// then the marks of the entries that have one (in order). ARGV: group,
/// consumer, mark TTL ms, then per entry: ID, mark ('' for none). Records
/// that this consumer renewed a hold now (`keys::alive_key`: an entry whose
/// payload is gone cannot have its idle time reset, and claims must not
/// call it lost while its holder lives), after noting a silence of the
/// whole group it ends (`consumers::silence_lua`). Returns per entry 1 when
/// still ours. An entry whose payload is gone is not touched (an `XCLAIM`
/// would drop it from the PEL without a record).
static EXTEND: std::sync::LazyLock<redis::Script> = std::sync::LazyLock::new(|| {
    redis::Script::new(&format!(
        r"{}
        local t = redis.call('TIME')
        local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
        silence_ended(KEYS[3], KEYS[2], now)
        redis.call('ZADD', KEYS[2], string.format('%.0f', now), ARGV[2])
        redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', string.format('(%.0f', now - 86400000))
        local out, m = {{}}, 4
        for j = 4, #ARGV, 2 do
            local id, mark = ARGV[j], ARGV[j + 1]
            local p = redis.call('XPENDING', KEYS[1], ARGV[1], id, id, 1)
            local ours = p[1] ~= nil and p[1][2] == ARGV[2]
            if ours and #redis.call('XRANGE', KEYS[1], id, id) > 0 then
                redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, id, 'JUSTID')
            end
            if mark ~= '' then
                if ours then
                    -- A mark that expired while no hold could be renewed (the
                    -- server was down) is put back: the entry is still ours.
                    local v = redis.call('GET', KEYS[m])
                    if v == mark then
                        redis.call('PEXPIRE', KEYS[m], ARGV[3])
                    elseif not v then
                        redis.call('SET', KEYS[m], mark, 'PX', ARGV[3])
                    end
                end
                m = m + 1
            end
            out[#out + 1] = ours and 1 or 0
        end
        return out",
        streamfleet_streams::consumers::silence_lua()
    ))
});

/// KEYS: stream, the group's last-error hash, then per entry to complete
/// its completion record and its lock. ARGV: group, consumer, completed TTL
/// ms, the lowest and highest ID of the entries, the proof of the hold
/// (`started::HeldSince::args`), then per entry: ID, 1 to
/// complete it, the lock's mark ('' for none). Completing writes the event's
/// completion record and releases the lock if it still holds this
/// delivery's mark; it happens whether or not the entry is still ours (its
/// effect happened); the ack (and the entry's last error cleared) only when
/// it is. Which are ours comes from the proof, else from this consumer's
/// own PEL over the entries' ID span (`started::HELD_BY_LUA`). Returns the IDs another
/// consumer holds now (not acked here); run twice, the second run acks
/// nothing and reports those IDs again
/// (`protocol::a_commit_sent_twice_acks_once_and_never_acks_what_another_holds`).
static COMMIT: std::sync::LazyLock<redis::Script> = std::sync::LazyLock::new(|| {
    redis::Script::new(
        &(streamfleet_streams::started::record_fields_lua()
            + streamfleet_streams::started::SERVER_MS_LUA
            + streamfleet_streams::started::HELD_BY_LUA
            + r"
        local wanted, n = {}, 0
        for j = 8, #ARGV, 3 do
            wanted[ARGV[j]] = true
            n = n + 1
        end
        if n == 0 then return {} end
        local ours = held_by(KEYS[1], ARGV[1], ARGV[2], ARGV[4], ARGV[5], wanted, n, ARGV[6], ARGV[7])
        local acked, lost, m = {}, {}, 3
        local function ack()
            redis.call('XACK', KEYS[1], ARGV[1], unpack(acked))
            -- The entries' records (`started::RECORD_SUFFIXES`).
            local fields = {}
            for _, id in ipairs(acked) do record_fields(id, fields) end
            redis.call('HDEL', KEYS[2], unpack(fields))
            acked = {}
        end
        for j = 8, #ARGV, 3 do
            local id = ARGV[j]
            if ARGV[j + 1] == '1' then
                redis.call('SET', KEYS[m], 'completed', 'PX', ARGV[3])
                if ARGV[j + 2] ~= '' and redis.call('GET', KEYS[m + 1]) == ARGV[j + 2] then
                    redis.call('DEL', KEYS[m + 1])
                end
                m = m + 2
            end
            if ours[id] then
                acked[#acked + 1] = id
                if #acked == 500 then ack() end
            elseif #redis.call('XPENDING', KEYS[1], ARGV[1], id, id, 1) > 0 then
                -- Another consumer's now. (Not pending at all: acked, by
                -- this script run before or by its claimer: nothing lost.)
                lost[#lost + 1] = id
            end
        end
        if #acked > 0 then ack() end
        return lost"),
    )
});

/// KEYS: stream, mark (may be absent), the group's entry records. ARGV:
/// group, consumer, ID, idle ms to set, mark ('' for none), how the
/// delivery ended (`started::handed_back` or `started::ended`). The
/// delivery count is left: whether this delivery counts is for the next
/// claim to say (`started`: not when it was handed back unstarted).
static HAND_BACK: std::sync::LazyLock<redis::Script> = std::sync::LazyLock::new(|| {
    redis::Script::new(
        r"
        if ARGV[5] ~= '' and redis.call('GET', KEYS[2]) == ARGV[5] then redis.call('DEL', KEYS[2]) end
        local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1)
        if p[1] == nil or p[1][2] ~= ARGV[2] or #redis.call('XRANGE', KEYS[1], ARGV[3], ARGV[3]) == 0 then
            return 0
        end
        redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[3], 'IDLE', ARGV[4], 'JUSTID')
        redis.call('HSET', KEYS[3], ARGV[3] .. ':run', ARGV[6])
        return 1",
    )
});

/// What committing an entry completes with the Redis guard: its event's
/// completion record, and the lock (key and this delivery's mark) to release.
pub struct Completion {
    pub record: String,
    pub lock: Option<(String, String)>,
}

/// One entry in hand: its ID and, with the Redis guard, its mark's key and value.
pub struct Held<'a> {
    pub id: &'a str,
    pub mark: Option<(String, String)>,
}

/// This consumer's hold on one stream's entries.
pub struct Lease<'a> {
    pub holder: ConsumerRef<'a>,
}

impl Lease<'_> {
    /// Extends the hold on `held`. Returns, per entry, whether it is still ours.
    pub async fn extend(
        &self,
        conn: &mut StreamConnection,
        mark_ttl_ms: u64,
        held: &[Held<'_>],
    ) -> Result<Vec<bool>, StreamError> {
        if held.is_empty() {
            return Ok(Vec::new());
        }
        let mut script = EXTEND.prepare_invoke();
        script
            .key(self.holder.stream)
            .key(streamfleet_streams::keys::alive_key(self.holder.stream, self.holder.group))
            .key(streamfleet_streams::keys::server_epoch_key(self.holder.stream))
            .arg(self.holder.group)
            .arg(self.holder.consumer)
            .arg(mark_ttl_ms);
        for h in held {
            script.arg(h.id);
            match &h.mark {
                Some((key, value)) => {
                    script.key(key).arg(value);
                }
                None => {
                    script.arg("");
                }
            }
        }
        let owned: Vec<u8> =
            script.invoke_async(conn).await.map_err(|e| StreamError::new("extending the hold on entries", e))?;
        Ok(owned.into_iter().map(|o| o == 1).collect())
    }

    /// Commits settled entries: `(ID, what to complete)`; `held` proves
    /// they are still this consumer's without a look at the PEL. Returns
    /// the IDs not acked because another consumer owns them now.
    pub async fn commit(
        &self,
        conn: &mut StreamConnection,
        completed_ttl_ms: u64,
        held: Option<HeldSince>,
        settled: &[(&str, Option<Completion>)],
    ) -> Result<Vec<String>, StreamError> {
        let (low, high) = StreamId::span(settled.iter().map(|(id, _)| *id));
        let [at, window] = HeldSince::args(held);
        let mut script = COMMIT.prepare_invoke();
        script
            .key(self.holder.stream)
            .key(streamfleet_streams::keys::last_error_key(self.holder.stream, self.holder.group))
            .arg(self.holder.group)
            .arg(self.holder.consumer)
            .arg(completed_ttl_ms)
            .arg(low)
            .arg(high)
            .arg(at)
            .arg(window);
        for (id, completion) in settled {
            script.arg(*id);
            match completion {
                Some(c) => {
                    script.arg("1").arg(c.lock.as_ref().map_or("", |(_, mark)| mark.as_str()));
                    script.key(&c.record);
                    match &c.lock {
                        Some((key, _)) => script.key(key),
                        // A key no one holds: in the stream's slot, never read.
                        None => script.key(&c.record),
                    };
                }
                None => {
                    script.arg("0").arg("");
                }
            }
        }
        script.invoke_async(conn).await.map_err(|e| StreamError::new("acking entries", e))
    }

    /// Hands an entry back: claimable at once (idle `idle_ms`), its mark
    /// gone, and how its delivery `deliveries` ended recorded: unstarted (its
    /// next claim does not count it) or, `started`, abandoned while its
    /// handler ran (the drain deadline: counted, not a crash). Returns
    /// whether it was still ours.
    pub async fn hand_back(
        &self,
        conn: &mut StreamConnection,
        held: &Held<'_>,
        idle_ms: u64,
        deliveries: u64,
        started: bool,
    ) -> Result<bool, StreamError> {
        let mut script = HAND_BACK.prepare_invoke();
        let (key, value) = held.mark.clone().unwrap_or_else(|| (self.holder.stream.to_string(), String::new()));
        let ended = if started {
            streamfleet_streams::started::ended(deliveries)
        } else {
            streamfleet_streams::started::handed_back(deliveries)
        };
        script
            .key(self.holder.stream)
            .key(key)
            .key(streamfleet_streams::keys::last_error_key(self.holder.stream, self.holder.group))
            .arg(self.holder.group)
            .arg(self.holder.consumer)
            .arg(held.id)
            .arg(idle_ms)
            .arg(value)
            .arg(ended);
        let done: u8 = script.invoke_async(conn).await.map_err(|e| StreamError::new("handing an entry back", e))?;
        Ok(done == 1)
    }
}
