"""Memory per pending delayed message, and where each byte goes.

Starts a private redis-server (no persistence: only memory counts here) and
`delayed-pubsub serve`, schedules N delayed messages through the real gRPC
path (BulkPublish, one delay per entry, due in a day), then reads Redis:
  - used_memory growth / N (what the issue's "memory per message" means),
  - MEMORY USAGE of every key, grouped by its role in the engine's key layout
    (delayed_middleware.keys.EngineKeys), / N,
  - the envelope's own bytes: the user's payload and metadata, against the
    rest of the DelayedMessage encoding and the stream entry around it.

    .venv/bin/python bench/memory.py [--messages 200000] [--payload 302] [--metadata-keys 2]

`--mix` measures instead what fired messages leave behind while neighbours wait:
40,000 messages due in 1-3 s, one in every 100 delayed by an hour (300 B payloads,
history off), fired by the delay engine's own run loop on the real clock; after the
short ones fired (their topic deleted, as after acks and trimming) and 40 s passed,
per remaining pending message: the used_memory that deleting the delayed topic's keys
frees (what they hold), used_memory growth since start (with fixed costs such as the
slowlog's copies of slow calls in it) and MEMORY USAGE; with compaction on (the
default) and off, each on a fresh redis-server, and the same 400 long messages
scheduled alone (the floor):

    .venv/bin/python bench/memory.py --mix [--messages 40000] [--settle 40]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import sys
import tempfile
import time
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc

ROOT = Path(__file__).resolve().parents[1]
for sub in ("proto", "middleware", "components", "."):
    sys.path.insert(0, str(ROOT / sub))

import redis.asyncio as aioredis  # noqa: E402

from bench.common import MD, bench_engine, start_serve, stop  # noqa: E402
from delayed_middleware import lua_scripts  # noqa: E402
from delayed_middleware.clock import SystemClock  # noqa: E402
from delayed_middleware.envelope import Envelope  # noqa: E402
from delayed_middleware.keys import EngineKeys, delayed_topic  # noqa: E402
from delayed_pubsub_pb.dapr.proto.components.v1 import (  # noqa: E402
    common_pb2,
    pubsub_pb2,
    pubsub_pb2_grpc,
)
from tests.redis_server import RedisServer  # noqa: E402

CONSUMER_ID = "bench"


def role(key: str, keys: EngineKeys) -> str:
    """The engine's name for what `key` holds."""
    named = {
        keys.stream: "envelopes (the delayed topic stream)",
        keys.due: "due index: top",
        keys.seq: "due index: bucket sequence",
        keys.count: "pending count",
        keys.ids: "scheduleId hash",
        keys.history: "lifecycle history (own retention)",
        keys.parked: "parked",
        keys.calls: "idempotency records (own retention)",
        keys.refill: "recurring refill",
        keys.outbox: "outbox",
        keys.moved: "compaction: moved hash",
    }
    if key in named:
        return named[key]
    if key.startswith(keys.buckets):
        return "due index: buckets"
    return f"other: {key}"


async def schedule(socket: Path, port: int, n: int, payload: bytes, metadata: dict[str, str]) -> float:
    base = time.time() + 86_400

    def due(i: int) -> str:
        # Distinct due times, 1 ms apart, as real traffic has them (one instant
        # shared by all would keep the due index from splitting into buckets).
        return datetime.fromtimestamp(base + i / 1000, UTC).isoformat(timespec="milliseconds")

    async with grpc.aio.insecure_channel(f"unix://{socket}") as channel:
        stub = pubsub_pb2_grpc.PubSubStub(channel)  # type: ignore[no-untyped-call]
        props = {
            "redisHost": f"127.0.0.1:{port}",
            "consumerID": CONSUMER_ID,
            "enableDelayedMessaging": "true",
        }
        await stub.Init(
            pubsub_pb2.PubSubInitRequest(metadata=common_pb2.MetadataRequest(properties=props)), metadata=MD
        )
        t0 = time.perf_counter()
        for first in range(0, n, 1000):
            entries = [
                pubsub_pb2.BulkMessageEntry(
                    entry_id=str(i), event=payload, metadata={**metadata, "scheduledSendTime": due(i)}
                )
                for i in range(first, min(n, first + 1000))
            ]
            reply = await stub.BulkPublish(
                pubsub_pb2.BulkPublishRequest(entries=entries, pubsub_name="bench", topic="orders"),
                metadata=MD,
            )
            assert not reply.failed_entries, reply.failed_entries[0].error
        return time.perf_counter() - t0


async def mix_run(
    work: Path, n: int, settle_s: float, *, compact: bool, longs_only: bool
) -> dict[str, float]:
    """One fresh redis-server: schedule the mix, let the engine fire the short ones, wait `settle_s`."""
    redis_server = RedisServer(work, appendonly=False)
    redis_server.start()
    keys = EngineKeys.for_topic(delayed_topic(CONSUMER_ID))
    client = aioredis.Redis(port=redis_server.port)
    props = {"consumerID": CONSUMER_ID, "historyMaxLen": "0"}
    engine = bench_engine(
        client, SystemClock(), props, config={"compact_check_every": 1_000 if compact else 0}
    )
    probe = aioredis.Redis(port=redis_server.port)
    try:
        # Not per message, so kept out of the figure: the scripts (cached once by Redis,
        # loaded before the baseline) and the engine's connection buffers (closed before
        # the measure).
        for script in (lua_scripts.SCHEDULE, lua_scripts.FIRE, lua_scripts.REFILL, lua_scripts.COMPACT):
            await probe.script_load(script)
        before = int((await probe.info("memory"))["used_memory"])
        now = SystemClock().now_ms()
        envs = []
        for i in range(n):
            if i % 100 == 0:
                envs.append(Envelope(id="", topic="orders", due_ms=now + 3_600_000, published_at_ms=now,
                                     message=b"x" * 300))  # fmt: skip
            elif not longs_only:
                envs.append(Envelope(id="", topic="short", due_ms=now + 1_000 + i % 2_000, published_at_ms=now,
                                     message=b"x" * 300))  # fmt: skip
        for first in range(0, len(envs), 500):
            await engine.schedule(envs[first : first + 500])
        waiting = n // 100
        runner = asyncio.create_task(engine.run())
        try:
            while await engine.pending() > waiting:  # noqa: ASYNC110 (polls a Redis counter)
                await asyncio.sleep(0.1)
            await client.delete("short")
            await asyncio.sleep(settle_s)
        finally:
            runner.cancel()
            await asyncio.gather(runner, return_exceptions=True)
        await client.aclose()
        after = int((await probe.info("memory"))["used_memory"])
        stream = int(await probe.memory_usage(keys.stream, samples=0) or 0)
        moved = int(await probe.memory_usage(keys.moved, samples=0) or 0)
        info = await probe.xinfo_stream(keys.stream)
        # What the pending messages hold: used_memory freed by deleting the delayed
        # topic's keys (fixed costs such as the slowlog's copies of big calls stay out).
        names = [keys.stream, *[k async for k in probe.scan_iter(match="{" + keys.stream + "}*")]]
        await probe.delete(*names)
        freed = after - int((await probe.info("memory"))["used_memory"])
        return {
            "freed": freed / waiting,
            "used_memory": (after - before) / waiting,
            "stream": stream / waiting,
            "moved": moved / waiting,
            "nodes": float(info["radix-tree-keys"]),
            "pending": float(waiting),
        }
    finally:
        await client.aclose()
        await probe.aclose()
        redis_server.stop()


def mix(n: int, settle_s: float) -> None:
    runs = [
        ("compaction on", True, False),
        ("compaction off", False, False),
        ("the long ones alone", True, True),
    ]
    out = {}
    with tempfile.TemporaryDirectory(prefix="dps-mix-") as d:
        for i, (name, compact, alone) in enumerate(runs):
            out[name] = asyncio.run(mix_run(Path(d) / str(i), n, settle_s, compact=compact, longs_only=alone))
    print(
        f"# {datetime.now(UTC):%Y-%m-%d %H:%M} UTC {platform.node()} nproc {os.cpu_count()}; {n} messages due "
        f"in 1-3 s, 1 in 100 in 1 h, 300 B payloads, history off; measured {settle_s:.0f} s after the short ones fired"
    )
    print(
        f"{'run':22s} {'freed/pending':>14s} {'used_memory growth/pending':>27s} {'stream/pending':>15s} "
        f"{'moved/pending':>14s} {'nodes':>6s}"
    )
    for name, r in out.items():
        print(
            f"{name:22s} {r['freed']:14.1f} {r['used_memory']:27.1f} {r['stream']:15.1f} "
            f"{r['moved']:14.1f} {r['nodes']:6.0f}"
        )
    on, off = out["compaction on"]["freed"], out["compaction off"]["freed"]
    print(
        f"freed per pending, off/on: {off / on:.2f}x; on/alone: {on / out['the long ones alone']['freed']:.2f}x"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mix", action="store_true", help="the interleaved short/long mix (see above)")
    ap.add_argument(
        "--settle", type=float, default=40.0, help="--mix: seconds to wait after the short ones fired"
    )
    ap.add_argument("--messages", type=int, default=200_000)
    ap.add_argument("--payload", type=int, default=302, help="bytes of message body")
    ap.add_argument(
        "--metadata-keys", type=int, default=2, help="user metadata keys per message (~20 B each)"
    )
    a = ap.parse_args()
    if a.mix:
        mix(a.messages if a.messages != 200_000 else 40_000, a.settle)
        return
    payload = b"x" * a.payload
    metadata = {f"key{k}": f"value-{k:08d}" for k in range(a.metadata_keys)}
    # The user's metadata counts as payload, the delay key and its value too.
    due_example = datetime.fromtimestamp(time.time(), UTC).isoformat(timespec="milliseconds")
    user_bytes = (
        a.payload
        + sum(len(k) + len(v) for k, v in metadata.items())
        + len("scheduledSendTime")
        + len(due_example)
    )
    keys = EngineKeys.for_topic(delayed_topic(CONSUMER_ID))
    with tempfile.TemporaryDirectory(prefix="dps-mem-") as d:
        work = Path(d)
        redis_server = RedisServer(work / "redis", appendonly=False)
        redis_server.start()
        serve = start_serve(work / "dps.sock", work / "serve.log")
        try:
            client = redis_server.client()
            before = int(client.info("memory")["used_memory"])
            took = asyncio.run(schedule(work / "dps.sock", redis_server.port, a.messages, payload, metadata))
            time.sleep(1)
            after = int(client.info("memory")["used_memory"])
            by_role: Counter[str] = Counter()
            for raw in client.scan_iter(count=1000):
                key = raw.decode()
                usage: Any = client.memory_usage(key, samples=0)
                by_role[role(key, keys)] += int(usage or 0)
            sample: Any = client.xrange(keys.stream, count=1)
            fields = sample[0][1] if sample else {}
            envelope = sum(len(k) + len(v) for k, v in fields.items())
            xlen = int(client.xlen(keys.stream))
            client.close()
        finally:
            stop(serve)
            redis_server.stop()
    n = a.messages
    print(
        f"# {datetime.now(UTC):%Y-%m-%d %H:%M} UTC {platform.node()} nproc {os.cpu_count()}; {n} pending, "
        f"payload {a.payload} B + {a.metadata_keys} metadata keys + scheduledSendTime = {user_bytes} user bytes; "
        f"scheduled in {took:.1f} s ({n / took:,.0f}/s); envelopes on the stream: {xlen}"
    )
    print(f"used_memory growth: {(after - before) / n:8.1f} B per message ({user_bytes} of it the user's)")
    print(f"{'key role':44s} {'B per message':>14s}")
    for name, total in by_role.most_common():
        print(f"{name:44s} {total / n:14.1f}")
    counted = sum(v for k, v in by_role.items() if "own retention" not in k)
    print(
        f"{'sum without history/idempotency':44s} {counted / n:14.1f}  (user bytes + {counted / n - user_bytes:.1f})"
    )
    print(
        f"one envelope entry's fields: {envelope} B (field names + DelayedMessage bytes), "
        f"{envelope - user_bytes} B beyond the user's bytes"
    )


if __name__ == "__main__":
    main()
