//! Key naming. Keys that must change atomically with a stream (its
//! dead-letter stream, its bookkeeping) share its Redis Cluster hash slot by
//! sharing its hash tag.

/// The hash tag of `key` as Redis Cluster computes it: the text between the
/// first `{` and the next `}`, when that text is not empty.
pub fn hash_tag(key: &str) -> Option<&str> {
    let open = key.find('{')?;
    let close = key[open + 1..].find('}')? + open + 1;
    (close > open + 1).then(|| &key[open + 1..close])
}

/// A key in the same hash slot as `stream`: `<stream>:<suffix>` when the
/// stream already has a hash tag, else `{<stream>}:<suffix>`.
pub fn companion_key(stream: &str, suffix: &str) -> String {
    match hash_tag(stream) {
        Some(_) => format!("{stream}:{suffix}"),
        None => format!("{{{stream}}}:{suffix}"),
    }
}

/// The default dead-letter stream of `group` on `stream`: one per group, so
/// a cap, a purge, a count or a Warning belongs to one resource even when
/// two groups read one stream; in the stream's slot, so an entry is
/// dead-lettered with its ack in one `MULTI`.
pub fn dead_letter_stream(stream: &str, group: &str) -> String {
    companion_key(stream, &format!("dead:{group}"))
}

/// The hash holding the last handler error per pending entry of `group`, so
/// whoever dead-letters the entry later can say why it failed.
pub fn last_error_key(stream: &str, group: &str) -> String {
    companion_key(stream, &format!("last-error:{group}"))
}

/// The due-time index of `group`'s entries parked for a retry (`retry`): a
/// sorted set, member the entry's ID, score when its next attempt is due
/// (the server's ms). An index only: the PEL says what is parked and since
/// when, so a claim checks each indexed ID against it, and entries parked
/// without the index (by an older worker, or the index lost) are still
/// found by a scan (`claim::claim_due`).
pub fn retry_due_key(stream: &str, group: &str) -> String {
    companion_key(stream, &format!("retry-due:{group}"))
}

/// Where re-indexing parked entries missing from the due-time index got to,
/// per delivery count (a hash: field the count, value the last ID indexed).
pub fn retry_index_cursor_key(stream: &str, group: &str) -> String {
    companion_key(stream, &format!("retry-index:{group}"))
}

/// The sorted set of consumers of `group` declared dead (member: consumer
/// name, score: when, in ms). Their idempotency-guard marks are void, so a
/// live worker may take over an entry they held without waiting them out.
pub fn dead_consumers_key(stream: &str, group: &str) -> String {
    companion_key(stream, &format!("dead-consumers:{group}"))
}

/// The durable count of duplicates the idempotency guard suppressed for `group`.
pub fn suppressed_key(stream: &str, group: &str) -> String {
    companion_key(stream, &format!("suppressed:{group}"))
}

/// The idempotency guard's lock on one business key (or, for an entry
/// without one, its event) in `group`: `processing:<consumer>:<fence>`
/// while a delivery holds it, so two handlers never run one key at once.
pub fn guard_key(stream: &str, group: &str, token: &str) -> String {
    companion_key(stream, &format!("idem:{group}:{token}"))
}

/// The idempotency guard's record that one event (`Entry::event_id`) of
/// `group` completed: a redelivery of that event is acked unrun, another
/// event of the same business key still runs.
pub fn completion_key(stream: &str, group: &str, event: &str) -> String {
    companion_key(stream, &format!("done:{group}:{event}"))
}

/// The server epoch the claims on `stream` last saw (a hash: `epoch` is
/// the server's `run_id` and replication ID, `since` when it began as far
/// as claims know, in the server's ms). A new epoch is a restart or a
/// failover: no hold could be renewed while it happened, so entries last
/// renewed before it wait min-idle-time of the new epoch before anyone
/// claims them (`claim::claim_rules_lua`).
pub fn server_epoch_key(stream: &str) -> String {
    companion_key(stream, "server-epoch")
}

/// When each consumer of `group` last renewed a hold (a sorted set: member
/// consumer, score the server's ms), so a claim can tell an entry a live
/// holder still has in hand (its payload trimmed, so its idle time can no
/// longer be reset) from one left behind.
pub fn alive_key(stream: &str, group: &str) -> String {
    companion_key(stream, &format!("alive:{group}"))
}

/// The text Redis Cluster hashes to place `key`: its hash tag, or the whole key.
pub fn slot_text(key: &str) -> &str {
    hash_tag(key).unwrap_or(key)
}

/// Whether two keys are guaranteed to share a slot.
pub fn same_slot(a: &str, b: &str) -> bool {
    slot_text(a) == slot_text(b)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hash_tags_follow_redis_rules() {
        assert_eq!(hash_tag("{user1000}.following"), Some("user1000"));
        assert_eq!(hash_tag("foo{}{bar}"), None, "an empty first tag means the whole key");
        assert_eq!(hash_tag("foo{{bar}}zap"), Some("{bar"));
        assert_eq!(hash_tag("orders"), None);
        assert_eq!(hash_tag("a{b"), None);
    }

    #[test]
    fn companions_share_the_stream_slot() {
        assert_eq!(dead_letter_stream("orders", "billing"), "{orders}:dead:billing");
        assert_eq!(dead_letter_stream("{shop}orders", "billing"), "{shop}orders:dead:billing");
        assert!(same_slot("orders", &dead_letter_stream("orders", "billing")));
        assert!(same_slot("{a}x", &last_error_key("{a}x", "g")));
        assert!(!same_slot("orders", "orders:dead"));
    }
}
