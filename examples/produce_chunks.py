#!/usr/bin/env python3
"""Publishes document chunks to an embed-dlq source stream with redis-py.

Each chunk is one stream entry with the fields `doc_id`, `chunk_index`, `text` and,
optionally, `metadata` (a JSON object, as text) -- the format in docs/sources.md. With
`--shards N`, a chunk goes to `STREAM:<shard>`, the shard chosen by a stable hash of its
doc_id, so every version of a chunk lands on one shard, in order (what
`embed-dlq ingest --from-stream STREAM --source-shards N` reads).

    pip install redis
    python3 examples/produce_chunks.py --redis-url redis://127.0.0.1:6379 --stream chunks --count 1000
    embed-dlq ingest --from-stream chunks --idle-exit-ms 2000

A Redis Cluster: pass every seed URL, comma-separated (`--redis-url redis://h:7001,redis://h:7002`).
Prints one line of JSON: the number of entries published per stream.
"""

import argparse
import hashlib
import json
import sys

try:
    import redis
except ImportError:  # the suite runs this file: say what is missing, never skip
    sys.exit("produce_chunks.py needs redis-py: pip install redis")


def shard_of(doc_id: str, shards: int) -> int:
    """The shard of a document: the first 8 bytes of its SHA-1, big-endian, modulo shards."""
    digest = hashlib.sha1(doc_id.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % shards


def connect(url: str):
    urls = [u.strip() for u in url.split(",") if u.strip()]
    if len(urls) > 1:
        from redis.cluster import ClusterNode, RedisCluster

        nodes = []
        for u in urls:
            parsed = redis.connection.parse_url(u)
            nodes.append(ClusterNode(parsed.get("host", "127.0.0.1"), parsed.get("port", 6379)))
        return RedisCluster(startup_nodes=nodes)
    return redis.Redis.from_url(urls[0])


def chunks(count: int, prefix: str, per_doc: int):
    for i in range(count):
        yield {
            "doc_id": f"{prefix}-{i // per_doc}",
            "chunk_index": i % per_doc,
            "text": f"Chunk {i} of the {prefix} corpus, published from Python.",
            "metadata": {"producer": "python", "n": i},
        }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379")
    ap.add_argument("--stream", required=True)
    ap.add_argument("--shards", type=int, default=1)
    ap.add_argument("--count", type=int, default=100)
    ap.add_argument("--per-doc", type=int, default=4)
    ap.add_argument("--doc-prefix", default="py")
    args = ap.parse_args()
    r = connect(args.redis_url)
    published = {}
    pipe = r.pipeline(transaction=False)
    pending = 0
    for c in chunks(args.count, args.doc_prefix, args.per_doc):
        stream = args.stream if args.shards <= 1 else f"{args.stream}:{shard_of(c['doc_id'], args.shards)}"
        fields = {
            "doc_id": c["doc_id"],
            "chunk_index": str(c["chunk_index"]),
            "text": c["text"],
            "metadata": json.dumps(c["metadata"]),
        }
        pipe.xadd(stream, fields)
        published[stream] = published.get(stream, 0) + 1
        pending += 1
        if pending == 500:
            pipe.execute()
            pending = 0
    if pending:
        pipe.execute()
    print(json.dumps({"published": published}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
