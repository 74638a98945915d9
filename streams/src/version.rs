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

pub async fn server_version<C: ConnectionLike + Send>(conn: &mut C) -> Result<Option<Version>, StreamError> {
    let info: String = redis::cmd("INFO")
        .arg("server")
        .query_async(conn)
        .await
        .map_err(|e| StreamError::new("reading the server version", e))?;
    Ok(parse_info(&info))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_gates_features() {
        let v = parse_info("# Server\r\nredis_version:7.0.15\r\nredis_git_sha1:0\r\n").unwrap();
        assert_eq!(v, Version { major: 7, minor: 0, patch: 15 });
        assert!(!v.has_readgroup_claim() && !v.has_acked_trim() && !v.has_consumer_inactive());
        let v = parse_info("redis_version:8.4.0").unwrap();
        assert!(v.has_readgroup_claim() && v.has_acked_trim() && v.has_consumer_inactive());
        assert!(parse_info("redis_version:8.2").unwrap().has_acked_trim());
        assert!(!parse_info("redis_version:8.2").unwrap().has_readgroup_claim());
        assert_eq!(parse_info("no version here"), None);
    }
}
