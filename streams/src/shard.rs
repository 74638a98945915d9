//! Sharding a pipeline across stream keys: which shard a business key
//! belongs to, and each shard's key. The assignment is part of the
//! cross-language contract (`docs/sharding.md`, test vectors in
//! `docs/shard-vectors.json`): FNV-1a 64 over the key's UTF-8 bytes, then
//! jump consistent hash (Lamping & Veach, 2014) into the shard count. Growing
//! the count from N to M moves only the keys that land on the new shards
//! (about (M − N)/M of them), never one between old shards.

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

/// FNV-1a, 64 bits.
pub fn fnv1a64(data: &[u8]) -> u64 {
    data.iter().fold(FNV_OFFSET, |h, b| (h ^ u64::from(*b)).wrapping_mul(FNV_PRIME))
}

/// Jump consistent hash of `key` into `buckets` (at least 1) buckets, with
/// the reference's IEEE-754 double arithmetic (so every language agrees).
pub fn jump_consistent_hash(mut key: u64, buckets: u32) -> u32 {
    let (mut b, mut j): (i64, i64) = (-1, 0);
    while j < i64::from(buckets.max(1)) {
        b = j;
        key = key.wrapping_mul(2_862_933_555_777_941_757).wrapping_add(1);
        #[allow(clippy::cast_precision_loss, clippy::cast_possible_truncation)]
        {
            j = ((b + 1) as f64 * ((1_u64 << 31) as f64 / ((key >> 33) + 1) as f64)) as i64;
        }
    }
    u32::try_from(b).unwrap_or(0)
}

/// The shard (0-based) of `business_key` among `shards`.
pub fn shard_of(business_key: &str, shards: u32) -> u32 {
    jump_consistent_hash(fnv1a64(business_key.as_bytes()), shards)
}

/// The stream key of shard `shard`: shard 0 is the stream itself (so one
/// shard is today's pipeline, key for key); shard i is `<stream>:<i>`, a key
/// Redis Cluster hashes whole, so shards land in different slots.
pub fn shard_key(stream: &str, shard: u32) -> String {
    if shard == 0 { stream.to_string() } else { format!("{stream}:{shard}") }
}

/// Every shard key of a pipeline of `shards` shards.
pub fn shard_keys(stream: &str, shards: u32) -> Vec<String> {
    (0..shards.max(1)).map(|i| shard_key(stream, i)).collect()
}

/// Sends an entry to its business key's shard (`XADD`); returns its ID.
pub async fn send<C: redis::aio::ConnectionLike + Send>(
    conn: &mut C,
    stream: &str,
    shards: u32,
    business_key: &str,
    fields: &[(&str, &[u8])],
) -> Result<String, crate::StreamError> {
    send_to_shard(conn, stream, shards, business_key, None, fields).await
}

/// [`send`] for an event the producer may add twice (it sends again after
/// an error, when the first `XADD` may have landed): the entry carries
/// `event_id` as `streamfleet.event-id`, so the workers' guard runs the
/// event once whichever copy comes first, and acks the other unrun.
pub async fn send_event<C: redis::aio::ConnectionLike + Send>(
    conn: &mut C,
    stream: &str,
    shards: u32,
    business_key: &str,
    event_id: &str,
    fields: &[(&str, &[u8])],
) -> Result<String, crate::StreamError> {
    send_to_shard(conn, stream, shards, business_key, Some(event_id), fields).await
}

async fn send_to_shard<C: redis::aio::ConnectionLike + Send>(
    conn: &mut C,
    stream: &str,
    shards: u32,
    business_key: &str,
    event_id: Option<&str>,
    fields: &[(&str, &[u8])],
) -> Result<String, crate::StreamError> {
    let mut cmd = redis::cmd("XADD");
    cmd.arg(shard_key(stream, shard_of(business_key, shards))).arg("*");
    if let Some(event) = event_id {
        cmd.arg(crate::entry::F_EVENT_ID).arg(event);
    }
    for (k, v) in fields {
        cmd.arg(*k).arg(*v);
    }
    cmd.query_async(conn).await.map_err(|e| crate::StreamError::new("sending an entry to its shard", e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(serde::Deserialize)]
    struct Vectors {
        vectors: Vec<Vector>,
    }

    #[derive(serde::Deserialize)]
    struct Vector {
        key: String,
        shards: u32,
        shard: u32,
    }

    #[test]
    fn the_published_vectors_hold() {
        let file: Vectors = serde_json::from_str(include_str!("../../docs/shard-vectors.json")).unwrap();
        assert!(file.vectors.len() > 50);
        for v in file.vectors {
            assert_eq!(shard_of(&v.key, v.shards), v.shard, "{:?} into {}", v.key, v.shards);
        }
    }

    #[test]
    fn fnv_matches_its_reference_values() {
        assert_eq!(fnv1a64(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a64(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a64(b"foobar"), 0x8594_4171_f739_67e8);
    }

    #[test]
    fn growing_moves_keys_only_to_the_new_shards() {
        for i in 0..2000 {
            let key = format!("order-{i}");
            let (before, after) = (shard_of(&key, 3), shard_of(&key, 5));
            assert!(after == before || after >= 3, "{key}: {before} -> {after}");
        }
        let on_new = (0..2000).filter(|i| shard_of(&format!("order-{i}"), 5) >= 3).count();
        assert!((700..900).contains(&on_new), "about 2/5 move: {on_new}");
    }

    #[test]
    fn one_shard_is_the_stream_itself() {
        assert_eq!(shard_keys("orders", 1), vec!["orders"]);
        assert_eq!(shard_keys("orders", 3), vec!["orders", "orders:1", "orders:2"]);
        assert_eq!(shard_of("anything", 1), 0);
    }
}
