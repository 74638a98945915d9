"""A streamfleet producer in Python (redis-py): sends an entry to the shard
its business key belongs to, by the same function the Rust library uses
(docs/sharding.md): FNV-1a 64 over the key's UTF-8 bytes, then jump
consistent hash (Lamping & Veach) into the shard count.

    python3 streamfleet_producer.py --check-vectors ../../docs/shard-vectors.json
    python3 streamfleet_producer.py --url redis://127.0.0.1:6379 --stream orders \
        --shards 3 --key order-17 order_id=order-17 amount_cents=100
"""

import argparse
import json
import sys

FNV_OFFSET = 0xCBF29CE484222325
FNV_PRIME = 0x100000001B3
MASK64 = 0xFFFFFFFFFFFFFFFF


def fnv1a64(data: bytes) -> int:
    h = FNV_OFFSET
    for byte in data:
        h ^= byte
        h = (h * FNV_PRIME) & MASK64
    return h


def jump_consistent_hash(key: int, buckets: int) -> int:
    b, j = -1, 0
    while j < buckets:
        b = j
        key = (key * 2862933555777941757 + 1) & MASK64
        j = int((b + 1) * (float(1 << 31) / float((key >> 33) + 1)))
    return b


def shard_of(business_key: str, shards: int) -> int:
    """The shard (0-based) of a business key among `shards` shards."""
    if shards < 1:
        raise ValueError("shards must be at least 1")
    return jump_consistent_hash(fnv1a64(business_key.encode("utf-8")), shards)


def shard_key(stream: str, shard: int) -> str:
    """Shard 0 is the stream itself; shard i is `<stream>:<i>`."""
    return stream if shard == 0 else f"{stream}:{shard}"


def send(client, stream: str, shards: int, business_key: str, fields: dict) -> str:
    """XADD to the business key's shard; returns the entry ID."""
    entry_id = client.xadd(shard_key(stream, shard_of(business_key, shards)), fields)
    return entry_id.decode() if isinstance(entry_id, bytes) else entry_id


def check_vectors(path: str) -> int:
    with open(path, encoding="utf-8") as f:
        vectors = json.load(f)["vectors"]
    bad = [v for v in vectors if shard_of(v["key"], v["shards"]) != v["shard"]]
    for v in bad:
        print(f"mismatch: {v} -> {shard_of(v['key'], v['shards'])}", file=sys.stderr)
    print(f"{len(vectors) - len(bad)}/{len(vectors)} vectors match")
    return 1 if bad else 0


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--check-vectors")
    p.add_argument("--url")
    p.add_argument("--stream")
    p.add_argument("--shards", type=int, default=1)
    p.add_argument("--key")
    p.add_argument("fields", nargs="*", help="field=value")
    a = p.parse_args()
    if a.check_vectors:
        return check_vectors(a.check_vectors)
    import redis  # only needed to send

    client = redis.Redis.from_url(a.url)
    fields = dict(kv.split("=", 1) for kv in a.fields)
    print(send(client, a.stream, a.shards, a.key, fields))
    return 0


if __name__ == "__main__":
    sys.exit(main())
