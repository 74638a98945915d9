"""A streamfleet worker in Python (redis-py), following the env contract
(docs/env-contract.md) without the Rust library: the at-least-once
protocol with an idempotent handler, ack after commit and only while the
entry is still ours, bounded deliveries, dead letters that say why, lost
payloads recorded, claims of idle entries, and a drain on SIGTERM.

The handler charges an order once into a ledger hash (`HSETNX`), so a
redelivery after a crash between the charge and the ack is absorbed;
`poison=1` is refused (a permanent failure, dead-lettered at once).

    STREAMFLEET_REDIS_URL=redis://127.0.0.1:6379 STREAMFLEET_STREAMS=orders \
    STREAMFLEET_GROUP=billing STREAMFLEET_CONSUMER=w1 python3 streamfleet_worker.py

Optional: EXAMPLE_LEDGER (the ledger hash, default `ledger`),
EXAMPLE_HANDLER_MS (time each charge takes).
"""

import os
import signal
import sys
import time

import redis

# One script per step, so each check and its action are atomic (the
# protocol's rules 3, 4 and 6). KEYS/ARGV as documented beside each.

# KEYS: dead-letter stream, stream, last-error hash. ARGV: group, ID, then
# the letter's fields and values. XADD first: if it fails nothing is acked.
DEAD_LETTER = """
local id = redis.call('XADD', KEYS[1], '*', unpack(ARGV, 3))
redis.call('XACK', KEYS[2], ARGV[1], ARGV[2])
redis.call('HDEL', KEYS[3], ARGV[2])
return id
"""

# KEYS: stream. ARGV: group, consumer, ID. Acks only while this consumer
# still owns the entry in the PEL (another that claimed it acks it itself).
ACK_IF_OURS = """
local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1)
if p[1] == nil or p[1][2] ~= ARGV[2] then return 0 end
return redis.call('XACK', KEYS[1], ARGV[1], ARGV[3])
"""

# KEYS: stream, dead-letter stream, payload-lost count, payload-lost IDs,
# server epoch, alive registry. ARGV: group, consumer, min idle ms, start
# ('-' or '(ID'), count, now ms. Claims entries idle past min-idle-time; one
# of those whose payload is gone becomes a payload-missing dead letter
# (naming its last holder) and a loss record in the same script, unless its
# owner renewed a hold within min-idle-time (it has the entry in hand). Not XAUTOCLAIM: it drops
# deleted IDs whatever their idle time (a live worker's trimmed entry). A
# new server epoch (a restart, a failover) starts a wait of min-idle-time
# with no claims: live holders renew their holds first.
CLAIM = """
local run = string.match(redis.call('INFO', 'server'), 'run_id:(%w+)') or ''
local repl = string.match(redis.call('INFO', 'replication'), 'master_replid:(%w+)') or ''
local epoch = run .. ':' .. repl
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local seen = redis.call('HMGET', KEYS[5], 'epoch', 'since')
if seen[1] ~= epoch then
  redis.call('HSET', KEYS[5], 'epoch', epoch, 'since', now)
  return {'0-0', {}}
end
if now - tonumber(seen[2]) < tonumber(ARGV[3]) then return {'0-0', {}} end
local page = redis.call('XPENDING', KEYS[1], ARGV[1], 'IDLE', ARGV[3], ARGV[4], '+', ARGV[5])
local existing = {}
for _, p in ipairs(page) do
  local alive_at = tonumber(redis.call('ZSCORE', KEYS[6], p[2]) or '')
  if string.match(p[2], '^streamfleet:retry:%d+$') then
    -- Parked by a Rust worker for a retry on the schedule (env contract
    -- rule 10): this minimal worker leaves it to them, taken when due.
  elseif #redis.call('XRANGE', KEYS[1], p[1], p[1]) > 0 then
    existing[#existing + 1] = p[1]
  elseif not (alive_at and now - alive_at < tonumber(ARGV[3])) then
    redis.call('XADD', KEYS[2], '*',
      'streamfleet.source-stream', KEYS[1], 'streamfleet.source-id', p[1],
      'streamfleet.group', ARGV[1], 'streamfleet.consumer', p[2], 'streamfleet.deliveries', 0,
      'streamfleet.reason', 'payload-missing', 'streamfleet.error', 'payload trimmed or deleted while pending',
      'streamfleet.dead-lettered-at', ARGV[6])
    redis.call('XACK', KEYS[1], ARGV[1], p[1])
    redis.call('HINCRBY', KEYS[3], 'count', 1)
    redis.call('LPUSH', KEYS[4], p[1])
    redis.call('LTRIM', KEYS[4], 0, 19)
  end
end
local claimed = {}
if #existing > 0 then
  claimed = redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], ARGV[3], unpack(existing))
end
local next = '0-0'
if #page >= tonumber(ARGV[5]) then next = '(' .. page[#page][1] end
return {next, claimed}
"""

# KEYS: stream. ARGV: group, consumer, ID, idle ms, retry count. Hands an
# entry never started back, claimable at once, its delivery uncounted.
HAND_BACK = """
local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1)
if p[1] == nil or p[1][2] ~= ARGV[2] then return 0 end
redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[3], 'IDLE', ARGV[4], 'RETRYCOUNT', ARGV[5], 'JUSTID')
return 1
"""


def companion(stream, suffix):
    """A key in the stream's Redis Cluster slot (docs/env-contract.md)."""
    open_ = stream.find("{")
    tagged = open_ >= 0 and stream.find("}", open_ + 2) > open_
    return f"{stream}:{suffix}" if tagged else "{" + stream + "}:" + suffix


class Permanent(Exception):
    """A business rule refuses the entry: dead-letter it now."""


class Worker:
    def __init__(self, env):
        self.streams = env["STREAMFLEET_STREAMS"].split(",")
        self.group = env["STREAMFLEET_GROUP"]
        self.consumer = env["STREAMFLEET_CONSUMER"]
        self.min_idle_ms = int(env.get("STREAMFLEET_MIN_IDLE_MS", "60000"))
        self.max_deliveries = int(env.get("STREAMFLEET_MAX_DELIVERIES", "5"))
        self.batch = int(env.get("STREAMFLEET_BATCH_SIZE", "10"))
        self.drain_ms = int(env.get("STREAMFLEET_DRAIN_TIMEOUT_MS", "10000"))
        dead = env.get("STREAMFLEET_DEAD_LETTER_STREAM")
        if dead in self.streams:
            sys.exit(f"STREAMFLEET_DEAD_LETTER_STREAM {dead!r} is one of STREAMFLEET_STREAMS: refusing to start")
        self.dead_letter_stream = {s: (dead if (dead and s == self.streams[0]) else companion(s, "dead"))
                                   for s in self.streams}
        self.ledger = env.get("EXAMPLE_LEDGER", "ledger")
        self.handler_s = int(env.get("EXAMPLE_HANDLER_MS", "0")) / 1000
        url = env["STREAMFLEET_REDIS_URL"]
        self.redis = redis.Redis.from_url(url)
        # Rule 1: the blocking read on a connection of its own.
        self.reader = redis.Redis.from_url(url)
        self.dead_letter = self.redis.register_script(DEAD_LETTER)
        self.ack_if_ours = self.redis.register_script(ACK_IF_OURS)
        self.claim = self.redis.register_script(CLAIM)
        self.hand_back = self.redis.register_script(HAND_BACK)
        self.stopping = False
        signal.signal(signal.SIGTERM, self.stop)

    def stop(self, *_):
        self.stopping = True

    def handle(self, fields):
        """The business effect, idempotent: one charge per order, ever."""
        order = fields.get(b"order_id")
        if order is None:
            raise Permanent("no order_id field")
        if fields.get(b"poison") == b"1":
            raise Permanent(f"order {order.decode()}: card declined")
        if self.handler_s:
            time.sleep(self.handler_s)
        # HSETNX: a repeat after a crash between charge and ack is a no-op.
        self.redis.hsetnx(self.ledger, order, self.consumer)

    def letter(self, stream, entry_id, fields, deliveries, reason, error):
        meta = {
            "streamfleet.source-stream": stream, "streamfleet.source-id": entry_id,
            "streamfleet.group": self.group, "streamfleet.consumer": self.consumer,
            "streamfleet.deliveries": deliveries, "streamfleet.reason": reason,
            "streamfleet.error": error, "streamfleet.dead-lettered-at": int(time.time() * 1000),
        }
        order = fields.get(b"order_id")
        if order is not None:
            meta["streamfleet.business-key"] = order
        args = [self.group, entry_id]
        for k, v in list(fields.items()) + list(meta.items()):
            args += [k, v]
        keys = [self.dead_letter_stream[stream], stream, companion(stream, f"last-error:{self.group}")]
        self.dead_letter(keys=keys, args=args)

    def settle(self, stream, entry_id, fields, deliveries):
        # Rule 8: a replay addressed to another group is acked unrun.
        replay_for = fields.get(b"streamfleet.replay-for")
        if replay_for is not None and replay_for.decode() != self.group:
            self.ack_if_ours(keys=[stream], args=[self.group, self.consumer, entry_id])
            return
        if deliveries > self.max_deliveries:
            error = self.redis.hget(companion(stream, f"last-error:{self.group}"), entry_id) or b"delivered too often"
            self.letter(stream, entry_id, fields, deliveries, "max-deliveries", error)
            return
        try:
            self.handle(fields)
        except Permanent as refused:
            self.letter(stream, entry_id, fields, deliveries, "permanent", str(refused))
            return
        except redis.RedisError as e:
            # Transient: record why, leave it pending for redelivery.
            self.redis.hset(companion(stream, f"last-error:{self.group}"), entry_id, f"transient: {e}")
            return
        # Rules 2 and 6: the effect is committed; ack only while it is ours.
        self.ack_if_ours(keys=[stream], args=[self.group, self.consumer, entry_id])

    def process(self, stream, entries, deliveries_of):
        for i, (entry_id, fields) in enumerate(entries):
            entry_id = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
            if self.stopping:
                # Rule 7: hand back what never started, its delivery uncounted.
                for later_id, _ in entries[i:]:
                    later_id = later_id.decode() if isinstance(later_id, bytes) else later_id
                    back = max(deliveries_of(later_id) - 1, 0)
                    self.hand_back(keys=[stream], args=[self.group, self.consumer, later_id,
                                                        self.min_idle_ms + 1, back])
                return
            if fields is None:
                continue
            self.settle(stream, entry_id, fields, deliveries_of(entry_id))

    def claim_idle(self, stream):
        """Rule 4: entries of crashed consumers, page after page until 0-0."""
        cursor = "-"
        while not self.stopping:
            keys = [stream, self.dead_letter_stream[stream], companion(stream, f"payload-lost:{self.group}"),
                    companion(stream, f"payload-lost-ids:{self.group}"), companion(stream, "server-epoch"),
                    companion(stream, f"alive:{self.group}")]
            args = [self.group, self.consumer, self.min_idle_ms, cursor, self.batch, int(time.time() * 1000)]
            cursor, claimed = self.claim(keys=keys, args=args)[:2]
            cursor = cursor.decode() if isinstance(cursor, bytes) else cursor
            # From a script the entries come as [id, [field, value, ...]].
            claimed = [(e[0], dict(zip(e[1][::2], e[1][1::2]))) for e in claimed]
            if claimed:
                counts = self.delivery_counts(stream, claimed)
                self.process(stream, claimed, lambda i: counts.get(i, 1))
            if cursor == "0-0":
                return

    def delivery_counts(self, stream, entries):
        ids = [e[0].decode() if isinstance(e[0], bytes) else e[0] for e in entries]
        pending = self.redis.xpending_range(stream, self.group, min=ids[0], max=ids[-1], count=len(ids) * 2,
                                            consumername=self.consumer)
        return {(p["message_id"].decode() if isinstance(p["message_id"], bytes) else p["message_id"]):
                p["times_delivered"] for p in pending}

    def run(self):
        print(f"python worker {self.consumer} consuming {self.streams} as {self.group}", flush=True)
        next_claim = 0.0
        while not self.stopping:
            if time.monotonic() >= next_claim:
                next_claim = time.monotonic() + min(self.min_idle_ms / 2000, 1.0)
                for stream in self.streams:
                    self.claim_idle(stream)
            # Rule 5: a short block keeps this consumer touching Redis. Its
            # batches are small and its handler quick, so no entry in hand
            # nears min-idle-time; a slower handler must renew its hold.
            reply = self.reader.xreadgroup(self.group, self.consumer, {s: ">" for s in self.streams},
                                           count=self.batch, block=1000)
            for stream, entries in reply or []:
                stream = stream.decode() if isinstance(stream, bytes) else stream
                self.process(stream, entries, lambda _id: 1)
        print(f"python worker {self.consumer} drained; stopping", flush=True)


if __name__ == "__main__":
    Worker(os.environ).run()
