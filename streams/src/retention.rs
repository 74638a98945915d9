//! Safe retention. Acking never trims; trimming is `XTRIM MINID` to a floor
//! that keeps, for **every** group on the stream (managed or not), its oldest
//! pending entry and its first undelivered one. A target that would cut deeper
//! is held at the floor and reported as blocked.

use crate::error::StreamError;
use redis::aio::ConnectionLike;
use redis::streams::StreamInfoGroupsReply;

/// Entries to look at, at most, per poll when turning a `maxLength` into an
/// ID; trimming a long excess proceeds over several polls.
pub const LENGTH_SCAN_BOUND: usize = 10_000;

/// A stream entry ID, ordered as Redis orders them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct StreamId {
    pub ms: u64,
    pub seq: u64,
}

impl StreamId {
    pub fn parse(id: &str) -> Option<Self> {
        let (ms, seq) = id.split_once('-').unwrap_or((id, "0"));
        Some(Self { ms: ms.parse().ok()?, seq: seq.parse().ok()? })
    }

    /// The lowest and highest of `ids`, as range bounds. An ID that does not
    /// parse widens the span to the whole stream (`-`, `+`): never a
    /// narrower, wrong answer.
    pub fn span<'a>(ids: impl IntoIterator<Item = &'a str>) -> (String, String) {
        let parsed: Option<Vec<StreamId>> = ids.into_iter().map(StreamId::parse).collect();
        let span = parsed.and_then(|ids| Some((ids.iter().min()?.to_string(), ids.iter().max()?.to_string())));
        span.unwrap_or_else(|| ("-".into(), "+".into()))
    }

    /// The largest ID before this one (`0-0` stays `0-0`).
    pub fn prev(self) -> Self {
        match self.seq.checked_sub(1) {
            Some(seq) => Self { ms: self.ms, seq },
            None if self.ms > 0 => Self { ms: self.ms - 1, seq: u64::MAX },
            None => self,
        }
    }

    /// The smallest ID after this one (the largest ID stays itself).
    pub fn next(self) -> Self {
        match (self.seq.checked_add(1), self.ms.checked_add(1)) {
            (Some(seq), _) => Self { ms: self.ms, seq },
            (None, Some(ms)) => Self { ms, seq: 0 },
            (None, None) => self,
        }
    }
}

impl std::fmt::Display for StreamId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}-{}", self.ms, self.seq)
    }
}

/// What one retention pass decided and did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Retention {
    /// The lowest ID any group still needs (`None`: no group constrains it).
    pub floor: Option<StreamId>,
    /// What the policy asked for.
    pub target: Option<StreamId>,
    /// The target would have cut below the floor: held there.
    pub blocked: bool,
    /// Entries removed.
    pub trimmed: u64,
}

/// The pure decision: trim to the target, but never past the floor.
pub fn trim_point(target: Option<StreamId>, floor: Option<StreamId>) -> (Option<StreamId>, bool) {
    match (target, floor) {
        (None, _) => (None, false),
        (Some(t), None) => (Some(t), false),
        (Some(t), Some(f)) if t <= f => (Some(t), false),
        (Some(_), Some(f)) => (Some(f), true),
    }
}

/// The safe floor over every group of `stream`.
pub async fn safe_floor<C: ConnectionLike + Send>(conn: &mut C, stream: &str) -> Result<Option<StreamId>, StreamError> {
    let err = |e| StreamError::new("computing the retention floor", e);
    let groups: StreamInfoGroupsReply =
        redis::cmd("XINFO").arg("GROUPS").arg(stream).query_async(conn).await.map_err(err)?;
    let mut floor: Option<StreamId> = None;
    let mut lower = |id: StreamId| floor = Some(floor.map_or(id, |f| f.min(id)));
    let mut pipe = redis::pipe();
    let mut with_pending = 0;
    for g in &groups.groups {
        if let Some(last) = StreamId::parse(&g.last_delivered_id) {
            lower(last.next());
        }
        if g.pending > 0 {
            pipe.cmd("XPENDING").arg(stream).arg(&g.name);
            with_pending += 1;
        }
    }
    if with_pending > 0 {
        // Summary form: (count, smallest pending ID, largest, per-consumer).
        let summaries: Vec<(u64, Option<String>, Option<String>, redis::Value)> =
            pipe.query_async(conn).await.map_err(err)?;
        for (_, smallest, _, _) in summaries {
            if let Some(id) = smallest.as_deref().and_then(StreamId::parse) {
                lower(id);
            }
        }
    }
    Ok(floor)
}

/// The ID a `maxLength` / `maxAgeSeconds` policy would trim to (the larger,
/// i.e. the stricter of the two).
pub async fn target<C: ConnectionLike + Send>(
    conn: &mut C,
    stream: &str,
    max_length: Option<u64>,
    max_age_ms: Option<u64>,
    now_ms: u64,
) -> Result<Option<StreamId>, StreamError> {
    let mut target = max_age_ms.map(|age| StreamId { ms: now_ms.saturating_sub(age), seq: 0 });
    if let Some(keep) = max_length {
        let len: u64 = redis::cmd("XLEN")
            .arg(stream)
            .query_async(conn)
            .await
            .map_err(|e| StreamError::new("reading the stream length", e))?;
        let excess = len.saturating_sub(keep);
        if excess > 0 {
            // The first entry to keep is the excess-th + 1; scan at most the bound.
            let scan = usize::try_from(excess).unwrap_or(usize::MAX).min(LENGTH_SCAN_BOUND) + 1;
            let ids: Vec<(String, redis::Value)> = redis::cmd("XRANGE")
                .arg(stream)
                .arg("-")
                .arg("+")
                .arg("COUNT")
                .arg(scan)
                .query_async(conn)
                .await
                .map_err(|e| StreamError::new("locating the length limit", e))?;
            if let Some(id) = ids.last().and_then(|(id, _)| StreamId::parse(id)) {
                target = Some(target.map_or(id, |t| t.max(id)));
            }
        }
    }
    Ok(target)
}

/// Recomputes the floor and trims in one script, so a group created (or an
/// entry delivered) between the caller's look at the floor and the trim is
/// still protected: `XTRIM MINID` to the lower of the asked point and every
/// group's oldest pending entry and first undelivered ID (IDs compared and
/// stepped as decimal text: Lua numbers are floats).
/// KEYS: stream. ARGV: the point. Returns how many entries were removed.
static TRIM_WITHIN_FLOOR: std::sync::LazyLock<redis::Script> = std::sync::LazyLock::new(|| {
    redis::Script::new(
        r"
        local function parts(id)
            local ms, seq = string.match(id, '^(%d+)-(%d+)$')
            return ms or id, seq or '0'
        end
        local function num_less(a, b)
            if #a ~= #b then return #a < #b end
            return a < b
        end
        local function less(a, b)
            local am, as = parts(a)
            local bm, bs = parts(b)
            if am ~= bm then return num_less(am, bm) end
            return num_less(as, bs)
        end
        local function plus_one(digits)
            local out, carry = '', 1
            for i = #digits, 1, -1 do
                local d = tonumber(string.sub(digits, i, i)) + carry
                carry = d == 10 and 1 or 0
                out = (d % 10) .. out
            end
            if carry == 1 then out = '1' .. out end
            return out
        end
        -- A sequence number at its largest steps into the next millisecond
        -- (its successor is no ID: XTRIM would refuse it, wedging every
        -- trim); the largest ID of all is its own successor.
        local largest = '18446744073709551615'
        local function after(id)
            local ms, seq = parts(id)
            if seq ~= largest then return ms .. '-' .. plus_one(seq) end
            if ms == largest then return id end
            return plus_one(ms) .. '-0'
        end
        local point = ARGV[1]
        for _, g in ipairs(redis.call('XINFO', 'GROUPS', KEYS[1])) do
            local info = {}
            for i = 1, #g, 2 do info[g[i]] = g[i + 1] end
            local first_undelivered = after(info['last-delivered-id'] or '0-0')
            if less(first_undelivered, point) then point = first_undelivered end
            if tonumber(info['pending']) > 0 then
                local oldest = redis.call('XPENDING', KEYS[1], info['name'])[2]
                if oldest and less(oldest, point) then point = oldest end
            end
        end
        return redis.call('XTRIM', KEYS[1], 'MINID', point)",
    )
});

/// Trims below `id`, but never past the floor as it stands at that instant
/// (see `TRIM_WITHIN_FLOOR`); returns how many entries were removed.
pub async fn trim_to<C: ConnectionLike + Send>(conn: &mut C, stream: &str, id: StreamId) -> Result<u64, StreamError> {
    fail::fail_point!("streams::retention::before-trim");
    TRIM_WITHIN_FLOOR
        .key(stream)
        .arg(id.to_string())
        .invoke_async(conn)
        .await
        .map_err(|e| StreamError::new("trimming the stream", e))
}

/// One retention pass: decide and `XTRIM MINID` (never past the floor).
pub async fn enforce<C: ConnectionLike + Send>(
    conn: &mut C,
    stream: &str,
    max_length: Option<u64>,
    max_age_ms: Option<u64>,
    now_ms: u64,
) -> Result<Retention, StreamError> {
    let target = target(conn, stream, max_length, max_age_ms, now_ms).await?;
    let floor = safe_floor(conn, stream).await?;
    let (point, blocked) = trim_point(target, floor);
    let trimmed = match point {
        Some(id) => trim_to(conn, stream, id).await?,
        None => 0,
    };
    Ok(Retention { floor, target, blocked, trimmed })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(ms: u64, seq: u64) -> StreamId {
        StreamId { ms, seq }
    }

    #[test]
    fn ids_parse_order_and_step() {
        assert_eq!(StreamId::parse("17-3"), Some(id(17, 3)));
        assert_eq!(StreamId::parse("17"), Some(id(17, 0)));
        assert_eq!(StreamId::parse("x-1"), None);
        assert!(id(2, 0) > id(1, 99));
        assert_eq!(id(5, 1).next(), id(5, 2));
        assert_eq!(id(5, u64::MAX).next(), id(6, 0));
        assert_eq!(id(u64::MAX, u64::MAX).next(), id(u64::MAX, u64::MAX));
        assert_eq!(id(6, 0).prev(), id(5, u64::MAX));
        assert_eq!(id(6, 3).prev(), id(6, 2));
        assert_eq!(id(0, 0).prev(), id(0, 0));
    }

    #[test]
    fn the_floor_holds_the_target() {
        assert_eq!(trim_point(None, Some(id(5, 0))), (None, false));
        assert_eq!(trim_point(Some(id(3, 0)), Some(id(5, 0))), (Some(id(3, 0)), false));
        assert_eq!(trim_point(Some(id(9, 0)), Some(id(5, 0))), (Some(id(5, 0)), true));
        assert_eq!(trim_point(Some(id(9, 0)), None), (Some(id(9, 0)), false));
    }
}
