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
EXAMPLE_HANDLER_MS (time each charge takes). While the key `<ledger>:down`
exists the payment provider is down: every charge fails transiently, and
the entry waits parked for its retry on the schedule (rule 10).
"""

import os
import random
import signal
import sys
import tempfile
import time
import urllib.parse

import redis

# One script per step, so each check and its action are atomic (the
# protocol's rules 3, 4 and 6). KEYS/ARGV as documented beside each.

# KEYS: dead-letter stream, stream, entry records. ARGV: group, ID, then
# the letter's fields and values. XADD first: if it fails nothing is acked.
DEAD_LETTER = """
local id = redis.call('XADD', KEYS[1], '*', unpack(ARGV, 3))
redis.call('XACK', KEYS[2], ARGV[1], ARGV[2])
redis.call('HDEL', KEYS[3], ARGV[2], ARGV[2] .. ':run', ARGV[2] .. ':crashes', ARGV[2] .. ':since', ARGV[2] .. ':key')
return id
"""

# KEYS: stream, entry records. ARGV: group, consumer, ID. Acks only while
# this consumer still owns the entry in the PEL (another that claimed it
# acks it itself), and drops the entry's records with the ack.
ACK_IF_OURS = """
local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1)
if p[1] == nil or p[1][2] ~= ARGV[2] then return 0 end
redis.call('HDEL', KEYS[2], ARGV[3], ARGV[3] .. ':run', ARGV[3] .. ':crashes', ARGV[3] .. ':since', ARGV[3] .. ':key')
return redis.call('XACK', KEYS[1], ARGV[1], ARGV[3])
"""

# Rule 10. KEYS: stream, entry records, due-time index. ARGV: group,
# consumer, ID, delivery count n, error, T(n) ms, this entry's delay ms,
# retryFor ms (0: none). Parks an entry whose delivery n failed transiently
# with the parking consumer for n, its idle time set so it is due when its
# delay is over, and indexes it: score n * 2^42 + the ms its idle time
# counts from (min(n, 2047)), the PEL's own figure.
# Returns the delay, -1 past the retryFor horizon (dead-letter it), -2 not
# ours, -3 payload gone (left: a claim records it lost).
PARK = """
local id = ARGV[3]
local p = redis.call('XPENDING', KEYS[1], ARGV[1], id, id, 1)[1]
if p == nil or p[2] ~= ARGV[2] then return -2 end
if #redis.call('XRANGE', KEYS[1], id, id) == 0 then return -3 end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('HSET', KEYS[2], id, ARGV[5], id .. ':run', ARGV[4] .. ':end')
redis.call('HSETNX', KEYS[2], id .. ':since', string.format('%.0f', now))
local delay, limit = tonumber(ARGV[7]), tonumber(ARGV[8])
if limit > 0 then
  local left = tonumber(redis.call('HGET', KEYS[2], id .. ':since')) + limit - now
  if left <= 0 then return -1 end
  delay = math.min(delay, left)
end
local idle = math.max(0, tonumber(ARGV[6]) - delay)
redis.call('XCLAIM', KEYS[1], ARGV[1], 'streamfleet:retry:' .. ARGV[4], 0, id, 'IDLE', string.format('%.0f', idle), 'JUSTID')
redis.call('ZADD', KEYS[3], string.format('%.0f', math.min(tonumber(ARGV[4]), 2047) * 4398046511104 + now - idle), id)
return delay
"""

# Rule 10. KEYS: stream, due-time index, its cursors. ARGV: group, consumer,
# count, then T(1), T(2), ... ms (the last serves every higher count).
# Claims parked entries that are due. From each delivery count n whose
# range of the index (scores n * 2^42 ...) holds as many IDs as its parking
# consumer holds entries: the IDs scored up to n * 2^42 + now - T(n), most
# overdue first across ranges, each checked against the PEL (not parked:
# dropped; else re-scored to what the PEL says unless due). Otherwise a scan
# (XPENDING IDLE T(n)), and 1,000 of that consumer's entries indexed from a
# cursor. One whose payload is gone is left to a Rust claimer or the sweep,
# which record it lost.
CLAIM_DUE = """
local SPAN = 4398046511104
local function bucket(n) return math.min(n, 2047) end
local function score(n, since) return string.format('%.0f', bucket(n) * SPAN + since) end
local function parked_count(name) return tonumber(string.match(name, '^streamfleet:retry:(%d+)$') or '') end
local function threshold(n) return tonumber(ARGV[3 + math.max(1, math.min(n, #ARGV - 3))]) end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local due, want, parked, ranges, order = {}, tonumber(ARGV[3]), 0, {}, {}
for _, c in ipairs(redis.call('XINFO', 'CONSUMERS', KEYS[1], ARGV[1])) do
  local info = {}
  for k = 1, #c, 2 do info[c[k]] = c[k + 1] end
  local n = parked_count(info['name'])
  if n and info['pending'] > 0 then
    parked = parked + info['pending']
    local b = bucket(n)
    if not ranges[b] then ranges[b] = {pending = 0, parking = {}}; order[#order + 1] = b end
    ranges[b].pending = ranges[b].pending + info['pending']
    table.insert(ranges[b].parking, {info['name'], n})
  end
end
if parked == 0 then redis.call('DEL', KEYS[2], KEYS[3]) end
local function take(p, later)
  if #redis.call('XRANGE', KEYS[1], p[1], p[1]) > 0 then
    redis.call('ZREM', KEYS[2], p[1])
    due[#due + 1] = p[1]
  elseif later then
    -- Payload gone: behind the others, still indexed for a Rust claimer.
    redis.call('ZADD', KEYS[2], later, p[1])
  end
end
local covered, looked = {}, 0
for _, b in ipairs(order) do
  local low = b * SPAN
  if redis.call('ZCOUNT', KEYS[2], low, low + SPAN - 1) >= ranges[b].pending then
    covered[#covered + 1] = b
  else
    for _, c in ipairs(ranges[b].parking) do
      local field = tostring(c[2])
      local cursor = redis.call('HGET', KEYS[3], field)
      local page = redis.call('XPENDING', KEYS[1], ARGV[1], cursor and ('(' .. cursor) or '-', '+', 1000, c[1])
      for _, p in ipairs(page) do redis.call('ZADD', KEYS[2], score(c[2], now - p[3]), p[1]) end
      if #page < 1000 then redis.call('HDEL', KEYS[3], field) else redis.call('HSET', KEYS[3], field, page[#page][1]) end
      if #due < want then
        for _, p in ipairs(redis.call('XPENDING', KEYS[1], ARGV[1], 'IDLE', threshold(c[2]), '-', '+', want - #due, c[1])) do
          take(p)
        end
      end
    end
  end
end
while #due < want and looked < 10 * want and #covered > 0 do
  local cands = {}
  for _, b in ipairs(covered) do
    local low = b * SPAN
    local high = low + now - threshold(b)
    local page = redis.call('ZRANGEBYSCORE', KEYS[2], low, string.format('%.0f', high), 'WITHSCORES', 'LIMIT', 0, want - #due)
    for i = 1, #page, 2 do cands[#cands + 1] = {page[i], b, high - tonumber(page[i + 1])} end
  end
  if #cands == 0 then break end
  table.sort(cands, function(x, y) return x[3] > y[3] end)
  for _, d in ipairs(cands) do
    if #due >= want or looked >= 10 * want then break end
    looked = looked + 1
    local p = redis.call('XPENDING', KEYS[1], ARGV[1], d[1], d[1], 1)[1]
    local n = p and parked_count(p[2])
    if not n then
      redis.call('ZREM', KEYS[2], d[1])
    elseif bucket(n) == d[2] and p[3] >= threshold(n) then
      take(p, score(n, now))
    else
      redis.call('ZADD', KEYS[2], score(n, now - p[3]), d[1])
    end
  end
end
if #due == 0 then return {} end
return redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, unpack(due))
"""

# KEYS: stream, dead-letter stream, payload-lost count, payload-lost IDs,
# server epoch, alive registry. ARGV: group, consumer, min idle ms, start
# ('-' or '(ID'), count, now ms. Claims entries idle past min-idle-time; one
# of those whose payload is gone becomes a payload-missing dead letter
# (naming its last holder) and a loss record in the same script, unless its
# owner renewed a hold within min-idle-time (it has the entry in hand). Not XAUTOCLAIM: it drops
# deleted IDs whatever their idle time (a live worker's trimmed entry). A
# new server epoch (a restart, a failover) or a silence of the whole group
# (a stalled server) starts a wait of min-idle-time with no claims: live
# holders renew their holds first.
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
-- A silence of the whole group (a stalled server: no hold could be renewed
-- through it) is a new epoch too: no claims for min-idle-time after it.
local field = 'resumed:' .. KEYS[6]
local resumed = tonumber(redis.call('HGET', KEYS[5], field) or '0') or 0
if #redis.call('ZRANGEBYSCORE', KEYS[6], string.format('(%.0f', now - 1000), '+inf', 'LIMIT', 0, 1) == 0
    and #redis.call('ZRANGEBYSCORE', KEYS[6], string.format('(%.0f', resumed), '+inf', 'LIMIT', 0, 1) > 0 then
  redis.call('HSET', KEYS[5], field, string.format('%.0f', now))
  return {'0-0', {}}
end
if now - resumed < tonumber(ARGV[3]) then return {'0-0', {}} end
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


_CLIENT_CERT_FILES = None


def connect(env):
    """A connection as the contract describes it: the URL, and the username,
    password, CA and client certificate beside it when set, with the Rust
    library's rules: the password is used as it is (never percent-encoded
    into the URL), an empty one is none, a password both in the URL and
    apart is refused, and a username given apart wins over the URL's."""
    global _CLIENT_CERT_FILES
    url = env["STREAMFLEET_REDIS_URL"].strip()
    options = {}
    password = env.get("STREAMFLEET_REDIS_PASSWORD") or None
    # Whitespace around the name (a Secret's trailing newline) is not part of it.
    username = (env.get("STREAMFLEET_REDIS_USERNAME") or "").strip() or None
    if username and not password:
        sys.exit("STREAMFLEET_REDIS_USERNAME is set without STREAMFLEET_REDIS_PASSWORD")
    if password:
        parts = urllib.parse.urlsplit(url)
        if parts.password:
            sys.exit("the URL carries a password and STREAMFLEET_REDIS_PASSWORD is set: keep one")
        # redis-py lets the URL's credentials win over keyword arguments:
        # the URL goes without them.
        options["password"] = password
        if username or parts.username:
            options["username"] = username or urllib.parse.unquote(parts.username)
        url = urllib.parse.urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[-1]))
    if env.get("STREAMFLEET_REDIS_CA_PEM"):
        options["ssl_ca_data"] = env["STREAMFLEET_REDIS_CA_PEM"]
    if env.get("STREAMFLEET_REDIS_CLIENT_CERT_PEM"):
        # redis-py reads client certificates from files: private ones, once
        # per process, under TMPDIR (an emptyDir with a read-only root).
        if _CLIENT_CERT_FILES is None:
            folder = tempfile.mkdtemp(prefix="streamfleet-tls-")
            files = []
            for name, var in (("tls.crt", "STREAMFLEET_REDIS_CLIENT_CERT_PEM"), ("tls.key", "STREAMFLEET_REDIS_CLIENT_KEY_PEM")):
                path = os.path.join(folder, name)
                with open(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
                    f.write(env[var])
                files.append(path)
            _CLIENT_CERT_FILES = tuple(files)
        options["ssl_certfile"], options["ssl_keyfile"] = _CLIENT_CERT_FILES
    return redis.Redis.from_url(url, **options)


def companion(stream, suffix):
    """A key in the stream's Redis Cluster slot (docs/env-contract.md)."""
    open_ = stream.find("{")
    tagged = open_ >= 0 and stream.find("}", open_ + 2) > open_
    return f"{stream}:{suffix}" if tagged else "{" + stream + "}:" + suffix


class Permanent(Exception):
    """A business rule refuses the entry: dead-letter it now."""


class Transient(Exception):
    """A downstream failed: try again on the retry schedule."""


class Schedule:
    """The retry schedule of the env contract (STREAMFLEET_RETRY_*, rule 10)."""

    def __init__(self, env, min_idle_ms):
        self.exponential = env.get("STREAMFLEET_RETRY_BACKOFF", "Exponential") != "Fixed"
        self.initial = int(env.get("STREAMFLEET_RETRY_INITIAL_DELAY_MS", min_idle_ms))
        self.max = max(int(env.get("STREAMFLEET_RETRY_MAX_DELAY_MS", "900000")), self.initial)
        self.jitter = min(int(env.get("STREAMFLEET_RETRY_JITTER_PERCENT", "20")), 100)
        self.retry_for = int(env.get("STREAMFLEET_RETRY_FOR_MS", "0"))

    def base(self, n):
        if not self.exponential:
            return self.initial
        return min(self.initial * 2 ** min(max(n, 1) - 1, 40), self.max)

    def threshold(self, n):
        """The longest delay after delivery n: its parking consumer's threshold."""
        return self.base(n) * (100 + self.jitter) // 100

    def delay(self, n):
        return self.base(n) + int((self.threshold(n) - self.base(n)) * random.random())


class Worker:
    def __init__(self, env):
        self.streams = env["STREAMFLEET_STREAMS"].split(",")
        self.group = env["STREAMFLEET_GROUP"]
        self.consumer = env["STREAMFLEET_CONSUMER"]
        self.min_idle_ms = int(env.get("STREAMFLEET_MIN_IDLE_MS", "60000"))
        self.max_deliveries = int(env.get("STREAMFLEET_MAX_DELIVERIES", "10"))
        self.schedule = Schedule(env, self.min_idle_ms)
        self.batch = int(env.get("STREAMFLEET_BATCH_SIZE", "10"))
        # Entries one read or claim takes (absent: the batch size).
        self.prefetch = max(1, int(env.get("STREAMFLEET_PREFETCH") or self.batch))
        self.drain_ms = int(env.get("STREAMFLEET_DRAIN_TIMEOUT_MS", "10000"))
        dead = env.get("STREAMFLEET_DEAD_LETTER_STREAM")
        if dead in self.streams:
            sys.exit(f"STREAMFLEET_DEAD_LETTER_STREAM {dead!r} is one of STREAMFLEET_STREAMS: refusing to start")
        self.dead_letter_stream = {s: (dead if (dead and s == self.streams[0]) else companion(s, f"dead:{self.group}"))
                                   for s in self.streams}
        self.ledger = env.get("EXAMPLE_LEDGER", "ledger")
        self.handler_s = int(env.get("EXAMPLE_HANDLER_MS", "0")) / 1000
        self.redis = connect(env)
        # Rule 1: the blocking read on a connection of its own.
        self.reader = connect(env)
        self.dead_letter = self.redis.register_script(DEAD_LETTER)
        self.ack_if_ours = self.redis.register_script(ACK_IF_OURS)
        self.claim = self.redis.register_script(CLAIM)
        self.hand_back = self.redis.register_script(HAND_BACK)
        self.park = self.redis.register_script(PARK)
        self.claim_due = self.redis.register_script(CLAIM_DUE)
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
        if self.redis.exists(f"{self.ledger}:down"):
            raise Transient("payment provider: 503 service unavailable")
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
        keys = [self.dead_letter_stream[stream], stream, self.records(stream)]
        self.dead_letter(keys=keys, args=args)

    def records(self, stream):
        return companion(stream, f"last-error:{self.group}")

    def retry_due(self, stream):
        return companion(stream, f"retry-due:{self.group}")

    def retry_cursors(self, stream):
        return companion(stream, f"retry-index:{self.group}")

    def settle(self, stream, entry_id, fields, deliveries):
        # Rule 8: a replay addressed to another group is acked unrun.
        replay_for = fields.get(b"streamfleet.replay-for")
        if replay_for is not None and replay_for.decode() != self.group:
            self.ack_if_ours(keys=[stream, self.records(stream)], args=[self.group, self.consumer, entry_id])
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
        except (Transient, redis.RedisError) as e:
            self.retry_later(stream, entry_id, fields, deliveries, f"transient: {e}")
            return
        # Rules 2 and 6: the effect is committed; ack only while it is ours.
        self.ack_if_ours(keys=[stream, self.records(stream)], args=[self.group, self.consumer, entry_id])

    def retry_later(self, stream, entry_id, fields, deliveries, error):
        """Rules 3 and 10: park it for its next attempt, or dead-letter it at the horizon."""
        if deliveries >= self.max_deliveries:
            self.letter(stream, entry_id, fields, deliveries, "retries-exhausted",
                        f"{error} (gave up: {deliveries} attempts, the most maxDeliveries allows)")
            return
        s = self.schedule
        args = [self.group, self.consumer, entry_id, deliveries, error, s.threshold(deliveries),
                s.delay(deliveries), s.retry_for]
        if self.park(keys=[stream, self.records(stream), self.retry_due(stream)], args=args) == -1:
            self.letter(stream, entry_id, fields, deliveries, "retries-exhausted",
                        f"{error} (gave up: {deliveries} attempts, retryFor passed)")

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

    def take_due(self, stream):
        """Rule 10: parked entries whose retry is due."""
        thresholds = [self.schedule.threshold(n) for n in range(1, max(self.max_deliveries, 1) + 1)]
        while not self.stopping:
            claimed = self.claim_due(keys=[stream, self.retry_due(stream), self.retry_cursors(stream)], args=[self.group, self.consumer, self.prefetch] + thresholds)
            claimed = [(e[0], dict(zip(e[1][::2], e[1][1::2]))) for e in claimed]
            if claimed:
                counts = self.delivery_counts(stream, claimed)
                self.process(stream, claimed, lambda i: counts.get(i, 1))
            if len(claimed) < self.prefetch:
                return

    def claim_idle(self, stream):
        """Rule 4: entries of crashed consumers, page after page until 0-0."""
        cursor = "-"
        while not self.stopping:
            keys = [stream, self.dead_letter_stream[stream], companion(stream, f"payload-lost:{self.group}"),
                    companion(stream, f"payload-lost-ids:{self.group}"), companion(stream, "server-epoch"),
                    companion(stream, f"alive:{self.group}")]
            args = [self.group, self.consumer, self.min_idle_ms, cursor, self.prefetch, int(time.time() * 1000)]
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
        ids.sort(key=lambda i: tuple(int(part) for part in i.split("-")))
        pending = self.redis.xpending_range(stream, self.group, min=ids[0], max=ids[-1], count=10000,
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
                    self.take_due(stream)
                    self.claim_idle(stream)
            # Rule 5: a short block keeps this consumer touching Redis. Its
            # batches are small and its handler quick, so no entry in hand
            # nears min-idle-time; a slower handler must renew its hold.
            reply = self.reader.xreadgroup(self.group, self.consumer, {s: ">" for s in self.streams},
                                           count=self.prefetch, block=1000)
            for stream, entries in reply or []:
                stream = stream.decode() if isinstance(stream, bytes) else stream
                self.process(stream, entries, lambda _id: 1)
        print(f"python worker {self.consumer} drained; stopping", flush=True)


if __name__ == "__main__":
    Worker(os.environ).run()
