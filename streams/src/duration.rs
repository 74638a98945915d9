//! Durations as Redis and the env contract take them: whole milliseconds.

use std::time::Duration;

/// `d` in whole milliseconds, saturating at `u64::MAX` (about 584 million
/// years: never reached by a duration a user can configure).
pub fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn millis_truncates_and_saturates() {
        assert_eq!(millis(Duration::from_micros(1_999)), 1);
        assert_eq!(millis(Duration::from_secs(60)), 60_000);
        assert_eq!(millis(Duration::MAX), u64::MAX);
    }
}
