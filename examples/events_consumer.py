#!/usr/bin/env python3
"""A Python consumer of the embed-dlq events streams (the contract: docs/events.md and
docs/events.schema.json), with a consumer group of its own.

It prints one line per event and acknowledges (XACK) an entry only after it has handled it, so
a consumer that dies between the two gets the entry again: delivery is at least once, and the
event's ``event_id`` (a UUID that never repeats) is what to deduplicate by.

On start it resumes: first the entries this consumer (same ``--consumer`` name) read and never
acknowledged before it stopped (``XREADGROUP ... 0``), then those other consumers of the group
left unacknowledged for ``--min-idle-ms`` (``XAUTOCLAIM``: they crashed), then new ones
(``XREADGROUP ... >``). A new group starts at ``--start`` (``$``: only events published from now
on, the default; ``0``: everything the streams still hold).

The streams: one per shard, ``{prefix}:events`` with one shard, else ``{prefix:sII-k}:events``
(docs/SCALING.md). The shard count is read from ``{prefix}:meta`` (field ``stream_shards``,
recorded by the first ``serve``/``tail``/``reconcile``); ``--stream-shards`` is only a fallback
before anything recorded it, and a different recorded count is refused. A group covers one
stream, so the consumer reads the shards in turn.

    pip install 'redis>=5'
    REDIS_URL=redis://127.0.0.1:6379/ python3 examples/events_consumer.py --group alerts
    # Redis Cluster: several seed URLs, comma-separated (or --cluster with one)
    REDIS_URL=redis://10.0.0.1:7000/,redis://10.0.0.2:7000/ python3 examples/events_consumer.py

Errors: connection loss, a server loading or failing over, a cluster redirection storm are
retried with capped exponential backoff and full jitter (0.1 s doubling to 5 s); a group or
stream that vanished (Redis lost its data) is recreated from the oldest entry; anything else
(wrong type, no permission) stops with exit code 1. SIGINT/SIGTERM stop after the current
batch (exit 0). Exit code 2: bad arguments, a shard count mismatch, redis-py missing.
"""

import argparse
import json
import os
import random
import signal
import socket
import sys
import time

try:
    import redis
    from redis.cluster import ClusterNode, RedisCluster
    from redis.crc import key_slot
except ImportError as e:  # a directory called `redis` on sys.path is a namespace package
    sys.stderr.write(f"events_consumer: redis-py is not installed ({e}): pip install 'redis>=5'\n")
    sys.exit(2)

DEFAULT_PREFIX = "embed-dlq"
# Bounds of the knobs (a value outside is clamped, with a warning).
COUNT_BOUNDS = (1, 1000)
BLOCK_MS_BOUNDS = (10, 60_000)
MIN_IDLE_MS_BOUNDS = (1_000, 24 * 3600 * 1000)
MAX_SHARDS = 256  # embed_dlq::streams::MAX_SHARDS
CLUSTER_SLOTS = 16384
# What one printed line shows of a field that comes from the input (a doc id, a table name).
FIELD_CHARS = 200
BACKOFF_BASE_S, BACKOFF_CAP_S = 0.1, 5.0

# Errors worth waiting out: the server or the network comes back, the cluster settles.
TRANSIENT = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    redis.exceptions.BusyLoadingError,
    redis.exceptions.TryAgainError,
    redis.exceptions.ClusterDownError,
    redis.exceptions.MasterDownError,
    redis.exceptions.ReadOnlyError,
)
for _name in ("ClusterError", "MovedError", "AskError"):
    if hasattr(redis.exceptions, _name):
        TRANSIENT += (getattr(redis.exceptions, _name),)


def log(msg):
    sys.stderr.write(f"events_consumer: {msg}\n")
    sys.stderr.flush()


def clamp(name, value, bounds):
    lo, hi = bounds
    if value < lo or value > hi:
        clamped = min(max(value, lo), hi)
        log(f"--{name} {value} is outside {lo}..={hi}; using {clamped}")
        return clamped
    return value


def shard_tag(prefix, i, n):
    """The hash tag of shard i of n (embed_dlq::streams::shard_tag): `prefix:sII-k` with the
    smallest k whose slot lies in the middle half of the i-th of n equal slot ranges."""
    width = CLUSTER_SLOTS // n
    lo = i * width + width // 4
    hi = lo + max(width // 2, 1)
    k = 0
    while True:
        tag = f"{prefix}:s{i:02}-{k}"
        if lo <= key_slot(tag.encode()) < hi:
            return tag
        k += 1


def events_streams(prefix, shards):
    if shards == 1:
        return [f"{{{prefix}}}:events"]
    return [f"{{{shard_tag(prefix, i, shards)}}}:events" for i in range(shards)]


def connect(url, cluster):
    urls = [u.strip() for u in url.split(",") if u.strip()]
    if not urls:
        raise SystemExit("events_consumer: empty Redis URL")
    # Replies may wait up to a BLOCK; a socket timeout longer than the longest BLOCK.
    common = dict(decode_responses=True, socket_timeout=BLOCK_MS_BOUNDS[1] / 1000 + 10, socket_connect_timeout=5)
    if cluster or len(urls) > 1:
        nodes = []
        for u in urls:
            parsed = redis.connection.parse_url(u)
            nodes.append(ClusterNode(parsed.get("host", "127.0.0.1"), int(parsed.get("port", 6379))))
        first = redis.connection.parse_url(urls[0])
        auth = {k: first[k] for k in ("username", "password") if first.get(k)}
        return RedisCluster(startup_nodes=nodes, **auth, **common)
    return redis.Redis.from_url(urls[0], **common)


def recorded_shards(r, prefix):
    value = r.hget(f"{{{prefix}}}:meta", "stream_shards")
    return int(value) if value is not None else None


def one_line(text):
    """A value from the input, on one line and bounded (control characters escaped)."""
    text = str(text)
    out = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text[:FIELD_CHARS])
    return out + ("…" if len(text) > FIELD_CHARS else "")


class Consumer:
    def __init__(self, r, streams, group, consumer, count, block_ms, min_idle_ms, as_json, die_after):
        self.r = r
        self.streams = streams
        self.group = group
        self.consumer = consumer
        self.count = count
        # One BLOCK per round over every shard.
        self.block_ms = max(block_ms // len(streams), BLOCK_MS_BOUNDS[0])
        self.min_idle_ms = min_idle_ms
        self.as_json = as_json
        self.die_after = die_after
        self.handled = 0
        self.stopping = False

    def ensure_group(self, stream, start):
        try:
            self.r.xgroup_create(stream, self.group, id=start, mkstream=True)
        except redis.exceptions.ResponseError as e:
            if not str(e).startswith("BUSYGROUP"):
                raise

    def handle(self, stream, entry_id, fields):
        """Prints the event as one line. Returns normally when it is handled (also an entry
        that is not an event: waiting would never make it one)."""
        event = fields.get("event", "?")
        try:
            body = json.loads(fields.get("body", ""))
            if not isinstance(body, dict):
                raise ValueError("not an object")
        except ValueError as e:
            log(f"{entry_id} {one_line(event)}: body is not an event ({e})")
            body = None
        if self.as_json:
            line = json.dumps({"stream": stream, "stream_id": entry_id, "event_id": fields.get("event_id"),
                               "event": event, "body": body}, separators=(",", ":"))
        elif body is not None:
            line = (f"{entry_id} {one_line(body.get('event', event))} "
                    f"{one_line(body.get('doc_id'))}#{body.get('chunk_index')} in {one_line(body.get('table'))}"
                    f" dlq={body.get('dlq_id')} generation={body.get('generation')} seq={body.get('seq')}"
                    f" event_id={one_line(fields.get('event_id'))}")
            if body.get("error_class"):
                line += f" ({one_line(body['error_class'])})"
        else:
            line = f"{entry_id} {one_line(event)} (unreadable body)"
        print(line, flush=True)
        self.handled += 1
        if self.die_after and self.handled >= self.die_after:
            # For the suite: a crash after handling, before the acknowledgement.
            log(f"exiting abruptly after {self.handled} events (--die-after), nothing acknowledged since the last batch")
            os._exit(3)

    def process(self, stream, entries):
        ids = []
        for entry_id, fields in entries:
            if fields is None:  # deleted from the stream while pending: nothing to handle
                ids.append(entry_id)
                continue
            self.handle(stream, entry_id, fields)
            ids.append(entry_id)
        if ids:
            self.r.xack(stream, self.group, *ids)
        return len(ids)

    def own_pending(self, stream):
        """This consumer's entries read before a restart and never acknowledged, oldest first."""
        after = "0-0"
        while True:
            reply = self.r.xreadgroup(self.group, self.consumer, {stream: after}, count=self.count)
            entries = reply_entries(reply)
            if not entries:
                return
            self.process(stream, entries)
            after = entries[-1][0]

    def claim_stale(self, stream):
        """Entries other consumers of the group left unacknowledged for min_idle_ms."""
        start = "0-0"
        while True:
            reply = self.r.xautoclaim(stream, self.group, self.consumer, self.min_idle_ms,
                                      start_id=start, count=self.count)
            start, claimed = reply[0], reply[1]
            self.process(stream, claimed)
            if start in ("0-0", "0"):
                return

    def resume(self, start):
        for stream in self.streams:
            self.ensure_group(stream, start)
            self.own_pending(stream)
            self.claim_stale(stream)

    def read_new(self, stream):
        reply = self.r.xreadgroup(self.group, self.consumer, {stream: ">"}, count=self.count, block=self.block_ms)
        return self.process(stream, reply_entries(reply))

    def run(self, start):
        backoff = Backoff()
        resumed = False
        shard = 0
        while not self.stopping:
            stream = self.streams[shard]
            try:
                if not resumed:
                    self.resume(start)
                    resumed = True
                self.read_new(stream)
                shard = (shard + 1) % len(self.streams)
                backoff.reset()
            except redis.exceptions.ResponseError as e:
                if str(e).startswith(("NOGROUP", "UNBLOCKED")):
                    # The stream or the group is gone (Redis lost its data, a FLUSHALL; a read
                    # blocked on a deleted stream is UNBLOCKED): the relay and `reconcile
                    # --repair` publish again; read it all.
                    log(f"{stream}: {e}; recreating the group from the oldest entry")
                    start, resumed = "0", False
                    continue
                raise
            except TRANSIENT as e:
                delay = backoff.next()
                log(f"{type(e).__name__}: {e}; retrying in {delay:.2f} s")
                resumed = False  # entries read before the error may be pending: take them first
                time.sleep(delay)
        return self.handled


class Backoff:
    """Capped exponential backoff with full jitter."""

    def __init__(self):
        self.attempt = 0

    def reset(self):
        self.attempt = 0

    def next(self):
        ceiling = min(BACKOFF_CAP_S, BACKOFF_BASE_S * (2 ** min(self.attempt, 16)))
        self.attempt += 1
        return random.uniform(0, ceiling)


def reply_entries(reply):
    """The (id, fields) entries of an XREADGROUP reply over one stream (RESP2, redis-py's
    default protocol: a list of [stream, entries])."""
    return [e for _, entries in (reply or []) for e in entries]


def main(argv=None):
    p = argparse.ArgumentParser(description="Consume the embed-dlq events streams with a consumer group.")
    p.add_argument("--redis-url", default=os.environ.get("REDIS_URL"),
                   help="redis://host:port/ (several, comma-separated: a Redis Cluster); env REDIS_URL")
    p.add_argument("--cluster", action="store_true", help="treat a single URL as a Redis Cluster seed")
    p.add_argument("--stream-prefix", default=os.environ.get("EMBED_DLQ_STREAM_PREFIX", DEFAULT_PREFIX),
                   help="the deployment's key prefix; env EMBED_DLQ_STREAM_PREFIX (default embed-dlq)")
    p.add_argument("--stream-shards", type=int, default=None,
                   help="shard count, only used while {prefix}:meta records none; env EMBED_DLQ_STREAM_SHARDS")
    p.add_argument("--group", default="example-consumers-py", help="consumer group name")
    p.add_argument("--consumer", default=None,
                   help="consumer name, stable across restarts so its pending entries are resumed "
                        "(default: the host name)")
    p.add_argument("--start", default="$", choices=["$", "0"],
                   help="where a new group starts: $ (new events) or 0 (everything held)")
    p.add_argument("--count", type=int, default=100, help="entries per read (1..=1000)")
    p.add_argument("--block-ms", type=int, default=2000, help="longest wait for new entries per round (10..=60000)")
    p.add_argument("--min-idle-ms", type=int, default=60_000,
                   help="take over other consumers' entries unacknowledged this long (1000..=86400000)")
    p.add_argument("--json", action="store_true", help="print each event as one JSON object")
    p.add_argument("--die-after", type=int, default=0, help=argparse.SUPPRESS)  # the suite's crash
    args = p.parse_args(argv)
    if not args.redis_url:
        p.error("set --redis-url or REDIS_URL")
    env_shards = os.environ.get("EMBED_DLQ_STREAM_SHARDS")
    configured = args.stream_shards if args.stream_shards is not None else (int(env_shards) if env_shards else None)
    if configured is not None and not 1 <= configured <= MAX_SHARDS:
        p.error(f"--stream-shards must be within 1..={MAX_SHARDS}")
    count = clamp("count", args.count, COUNT_BOUNDS)
    block_ms = clamp("block-ms", args.block_ms, BLOCK_MS_BOUNDS)
    min_idle_ms = clamp("min-idle-ms", args.min_idle_ms, MIN_IDLE_MS_BOUNDS)
    consumer = args.consumer or socket.gethostname() or "consumer"

    r = connect(args.redis_url, args.cluster)
    backoff = Backoff()
    while True:
        try:
            recorded = recorded_shards(r, args.stream_prefix)
            break
        except TRANSIENT as e:
            delay = backoff.next()
            log(f"{type(e).__name__}: {e}; retrying in {delay:.2f} s")
            time.sleep(delay)
    if recorded is not None and configured is not None and recorded != configured:
        log(f"the streams under {args.stream_prefix!r} have {recorded} shard(s) (recorded in "
            f"{{{args.stream_prefix}}}:meta); --stream-shards says {configured}")
        return 2
    shards = recorded or configured or 1
    if recorded is None:
        log(f"{{{args.stream_prefix}}}:meta records no shard count yet; assuming {shards}")
    streams = events_streams(args.stream_prefix, shards)

    c = Consumer(r, streams, args.group, consumer, count, block_ms, min_idle_ms, args.json, args.die_after)

    def stop(signum, _frame):
        log(f"signal {signum}: stopping after the current batch")
        c.stopping = True

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    log(f"consuming {len(streams)} shard(s) under {args.stream_prefix!r} as {consumer!r} of group {args.group!r}")
    try:
        handled = c.run(args.start)
    except redis.exceptions.RedisError as e:
        log(f"stopping on a permanent error: {type(e).__name__}: {e}")
        return 1
    log(f"handled {handled} events")
    return 0


if __name__ == "__main__":
    sys.exit(main())
