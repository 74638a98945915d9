//! The server's version, and the stream features newer servers add. Paths
//! that use them fall back cleanly on older servers (Debian's 7.0 here, where
//! the fallbacks are what the tests exercise).

use crate::error::StreamError;
use redis::aio::ConnectionLike;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Version {
    pub major: u32,
    pub minor: u32,
    pub patch: u32,
}

impl Version {
    /// The oldest server streamfleet runs on.
    pub const OLDEST_SUPPORTED: Version = Version { major: 7, minor: 0, patch: 0 };

    /// 7.0 and later: the guard's `SET … NX GET`, `XPENDING … IDLE` and the
    /// claims' reports of deleted entries need it; older servers are refused.
    pub fn is_supported(self) -> bool {
        self >= Self::OLDEST_SUPPORTED
    }

    /// `XREADGROUP ... CLAIM min-idle-time` (8.4): new and idle entries in one read.
    pub fn has_readgroup_claim(self) -> bool {
        self >= Version { major: 8, minor: 4, patch: 0 }
    }

    /// `XTRIM ... ACKED` (8.2): trim only entries every group has acknowledged.
    pub fn has_acked_trim(self) -> bool {
        self >= Version { major: 8, minor: 2, patch: 0 }
    }

    /// Consumer `inactive` time in `XINFO CONSUMERS` (7.2).
    pub fn has_consumer_inactive(self) -> bool {
        self >= Version { major: 7, minor: 2, patch: 0 }
    }
}

/// Parses `redis_version:` out of `INFO server`.
pub fn parse_info(info: &str) -> Option<Version> {
    let text = info.lines().find_map(|l| l.trim().strip_prefix("redis_version:"))?;
    let mut parts = text.trim().split('.').map(|p| p.parse::<u32>().ok());
    Some(Version {
        major: parts.next()??,
        minor: parts.next().flatten().unwrap_or(0),
        patch: parts.next().flatten().unwrap_or(0),
    })
}

/// The server's version; on a Redis Cluster, where `INFO` answers once per
/// node, the lowest of them (a feature is usable only if every node has it).
pub async fn server_version<C: ConnectionLike + Send>(conn: &mut C) -> Result<Option<Version>, StreamError> {
    let texts = info(conn, &["server"], "reading the server version").await?;
    Ok(texts.iter().filter_map(|t| parse_info(t)).min())
}

/// `INFO <section>…`: one text for a server, one per node on a cluster.
async fn info<C: ConnectionLike + Send>(
    conn: &mut C,
    sections: &[&str],
    action: &'static str,
) -> Result<Vec<String>, StreamError> {
    let reply: redis::Value =
        redis::cmd("INFO").arg(sections).query_async(conn).await.map_err(|e| StreamError::new(action, e))?;
    let mut texts = Vec::new();
    collect_texts(reply, &mut texts);
    Ok(texts)
}

/// Whether the server may evict keys when its memory is full
/// (`maxmemory-policy` other than `noeviction`, with a `maxmemory` set).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Eviction {
    /// `noeviction`, or no memory limit: a write fails instead.
    Never,
    /// Keys can be evicted: under `allkeys-*` a stream with its groups and
    /// every pending entry; under `volatile-*` the keys that expire (the
    /// idempotency guard's marks and completion records) before their time.
    Possible { policy: String, maxmemory: u64 },
    /// `INFO memory` did not say.
    Unknown,
}

/// The eviction setting out of `INFO memory`; `None` when it is not there.
pub fn parse_eviction(info: &str) -> Option<Eviction> {
    let field = |name: &str| info.lines().find_map(|l| l.trim().strip_prefix(name)).map(str::trim);
    let policy = field("maxmemory_policy:")?;
    let maxmemory: u64 = field("maxmemory:")?.parse().ok()?;
    Some(if policy == "noeviction" || maxmemory == 0 {
        Eviction::Never
    } else {
        Eviction::Possible { policy: policy.to_string(), maxmemory }
    })
}

/// Whether what the server confirmed (an entry added, an ack) survives its
/// restart.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Persistence {
    /// An append-only file (`aof_enabled:1`): writes survive a restart, up
    /// to its `appendfsync` policy (`always`: all; `everysec`: all but about
    /// the last second).
    AppendOnly,
    /// No append-only file: whatever was written since the last RDB
    /// snapshot (if snapshots are taken at all) is gone after a restart.
    NoAppendOnly,
    /// `INFO persistence` did not say.
    Unknown,
}

/// The persistence setting out of `INFO persistence`; `None` when it is
/// not there.
pub fn parse_persistence(info: &str) -> Option<Persistence> {
    match info.lines().find_map(|l| l.trim().strip_prefix("aof_enabled:"))?.trim() {
        "1" => Some(Persistence::AppendOnly),
        "0" => Some(Persistence::NoAppendOnly),
        _ => None,
    }
}

/// The server settings that can lose work without any command failing:
/// eviction and persistence. Read in one `INFO memory persistence`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Safety {
    pub eviction: Eviction,
    pub persistence: Persistence,
}

impl Safety {
    /// Nothing known (the settings could not be read).
    pub const UNKNOWN: Safety = Safety { eviction: Eviction::Unknown, persistence: Persistence::Unknown };
}

/// The server's eviction and persistence settings; on a Redis Cluster the
/// first node at risk (any node losing a shard's stream loses its work).
pub async fn server_safety<C: ConnectionLike + Send>(conn: &mut C) -> Result<Safety, StreamError> {
    let texts = info(conn, &["memory", "persistence"], "reading the eviction and persistence settings").await?;
    let evictions: Vec<Option<Eviction>> = texts.iter().map(|t| parse_eviction(t)).collect();
    let eviction = if let Some(possible) = evictions.iter().flatten().find(|e| matches!(e, Eviction::Possible { .. })) {
        possible.clone()
    } else if !evictions.is_empty() && evictions.iter().all(|e| *e == Some(Eviction::Never)) {
        Eviction::Never
    } else {
        Eviction::Unknown
    };
    let persistences: Vec<Option<Persistence>> = texts.iter().map(|t| parse_persistence(t)).collect();
    let persistence = if persistences.contains(&Some(Persistence::NoAppendOnly)) {
        Persistence::NoAppendOnly
    } else if !persistences.is_empty() && persistences.iter().all(|p| *p == Some(Persistence::AppendOnly)) {
        Persistence::AppendOnly
    } else {
        Persistence::Unknown
    };
    Ok(Safety { eviction, persistence })
}

/// Every text in a reply: one for a server, one per node (a map keyed by the
/// node's address) for a cluster.
fn collect_texts(value: redis::Value, out: &mut Vec<String>) {
    match value {
        redis::Value::BulkString(bytes) => out.push(String::from_utf8_lossy(&bytes).into_owned()),
        redis::Value::SimpleString(text) | redis::Value::VerbatimString { text, .. } => out.push(text),
        redis::Value::Array(items) | redis::Value::Set(items) => {
            items.into_iter().for_each(|v| collect_texts(v, out));
        }
        redis::Value::Map(pairs) => pairs.into_iter().for_each(|(_, v)| collect_texts(v, out)),
        _ => {}
    }
}

#[cfg(test)]
mod eviction_tests {
    use super::*;

    #[test]
    fn eviction_needs_a_policy_that_evicts_and_a_memory_limit() {
        let info = |policy: &str, max: &str| format!("# Memory\r\nmaxmemory:{max}\r\nmaxmemory_policy:{policy}\r\n");
        assert_eq!(parse_eviction(&info("noeviction", "1073741824")), Some(Eviction::Never));
        assert_eq!(parse_eviction(&info("allkeys-lru", "0")), Some(Eviction::Never));
        assert_eq!(
            parse_eviction(&info("allkeys-lru", "1073741824")),
            Some(Eviction::Possible { policy: "allkeys-lru".into(), maxmemory: 1_073_741_824 })
        );
        assert_eq!(parse_eviction("# Memory\r\nused_memory:1\r\n"), None);
        assert_eq!(parse_eviction(&info("volatile-ttl", "x")), None);
    }

    #[test]
    fn persistence_is_the_append_only_file() {
        let info =
            |aof: &str| format!("# Persistence\r\nloading:0\r\naof_enabled:{aof}\r\naof_rewrite_in_progress:0\r\n");
        assert_eq!(parse_persistence(&info("1")), Some(Persistence::AppendOnly));
        assert_eq!(parse_persistence(&info("0")), Some(Persistence::NoAppendOnly));
        assert_eq!(parse_persistence(&info("maybe")), None);
        assert_eq!(parse_persistence("# Memory\r\nused_memory:1\r\n"), None);
    }
}

#[cfg(test)]
mod reply_tests {
    use super::*;

    #[test]
    fn a_cluster_reply_yields_the_lowest_node_version() {
        let node = |v: &str| redis::Value::BulkString(format!("# Server\r\nredis_version:{v}\r\n").into_bytes());
        let reply = redis::Value::Map(vec![
            (redis::Value::SimpleString("127.0.0.1:7000".into()), node("8.4.0")),
            (redis::Value::SimpleString("127.0.0.1:7001".into()), node("7.0.15")),
        ]);
        let mut texts = Vec::new();
        collect_texts(reply, &mut texts);
        let lowest = texts.iter().filter_map(|t| parse_info(t)).min();
        assert_eq!(lowest, Some(Version { major: 7, minor: 0, patch: 15 }));
    }
}
