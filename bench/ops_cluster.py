"""Issue 14: what reading every shard costs the operator tools on Redis Cluster.

    .venv/bin/python bench/ops_cluster.py [--pending 100000] [--topics 30] [--shards 6]

A private 3-master Redis Cluster on loopback (AOF off). Two apps hold the same N pending
envelopes: `one` in one shard stream, `many` spread over `--shards` shard streams (the
engine's own ShardedEngine, spread as the component spreads publishes). Same run, same
cluster, so the ratio many/one is the cost of the shards:
- Inspector.pending (limit 100: the earliest 100 merged over every shard) and
  counts_by_topic (the pending-per-topic gauge's scan), CPU µs per envelope and wall s;
- the real CLI as a process: `pending --json` (limit 100 of N), `inspect` by scheduleId.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for sub in ("proto", "middleware", "components", "."):
    sys.path.insert(0, str(ROOT / sub))

import redis.asyncio.cluster as acluster  # noqa: E402

from bench.common import PAYLOAD, bench_engine, timed_cli  # noqa: E402
from delayed_middleware.clock import SystemClock  # noqa: E402
from delayed_middleware.envelope import Envelope  # noqa: E402
from delayed_middleware.inspector import Inspector  # noqa: E402
from tests.redis_server import RedisCluster  # noqa: E402

EXE = Path(sys.executable).with_name("delayed-pubsub")


async def populate(client: acluster.RedisCluster, app: str, shards: int, n: int, topics: int) -> None:
    props = {"consumerID": app, "redisType": "cluster", "delayShards": str(shards)}
    engine = bench_engine(client, SystemClock(), props)
    now = int(time.time() * 1000)
    for start in range(0, n, 1000):
        await engine.schedule(
            [
                Envelope(
                    id="",
                    topic=f"topic-{i % topics}",
                    due_ms=now + 3_600_000 + i,
                    published_at_ms=now,
                    message=PAYLOAD,
                    metadata={"cloudevent.id": str(i)},
                    schedule_id=f"sched-{i}" if i % 10 == 0 else "",
                )
                for i in range(start, min(n, start + 1000))
            ]
        )


async def scans(client: acluster.RedisCluster, app: str, shards: int, n: int) -> dict[str, float]:
    inspector = Inspector(client, app, shards=shards)
    t, w = time.process_time(), time.perf_counter()
    report = await inspector.pending(limit=100)
    pending_cpu, pending_wall = time.process_time() - t, time.perf_counter() - w
    assert report.matched == n, report.matched
    t, w = time.process_time(), time.perf_counter()
    counts, complete = await inspector.counts_by_topic()
    counts_cpu, counts_wall = time.process_time() - t, time.perf_counter() - w
    assert complete
    assert sum(counts.values()) == n
    return {
        "pending_us": pending_cpu / n * 1e6,
        "pending_wall": pending_wall,
        "counts_us": counts_cpu / n * 1e6,
        "counts_wall": counts_wall,
    }


def cli(address: str, app: str, shards: int, *args: str) -> str:
    """Wall and CPU seconds of one CLI run against the cluster, reading every shard."""
    return timed_cli(
        [
            str(EXE),
            *args,
            "--redis-host",
            address,
            "--redis-type",
            "cluster",
            "--delay-shards",
            str(shards),
            "--app-id",
            app,
        ]
    )


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pending", type=int, default=100_000)
    parser.add_argument("--topics", type=int, default=30)
    parser.add_argument("--shards", type=int, default=6)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-ops-cluster-") as d:
        cluster = RedisCluster(Path(d))
        cluster.start()
        client = acluster.RedisCluster(host="127.0.0.1", port=cluster.nodes[0].port)
        try:
            layouts = {"one": 1, "many": args.shards}
            for app, shards in layouts.items():
                t = time.perf_counter()
                await populate(client, app, shards, args.pending, args.topics)
                print(
                    f"{app}: {args.pending:,} pending in {shards} shard(s), stored in {time.perf_counter() - t:.1f} s"
                )
            results = {app: await scans(client, app, shards, args.pending) for app, shards in layouts.items()}
            address = cluster.nodes[0].address
            for app, shards in layouts.items():
                r = results[app]
                print(
                    f"{app} ({shards} shard(s)): Inspector.pending(limit=100) {r['pending_us']:.2f} µs CPU/envelope, "
                    f"{r['pending_wall']:.2f} s wall; counts_by_topic {r['counts_us']:.2f} µs CPU/envelope, "
                    f"{r['counts_wall']:.2f} s wall"
                )
                print(
                    f"  CLI pending --json (100 of {args.pending:,}): {cli(address, app, shards, 'pending', '--json')}"
                )
                # A scheduleId from the middle (every 10th message has one): sched-50000 at the default.
                sid = f"sched-{args.pending // 20 * 10}"
                print(f"  CLI inspect {sid}: {cli(address, app, shards, 'inspect', sid)}")
            one, many = results["one"], results["many"]
            print(
                f"ratio many/one: pending CPU {many['pending_us'] / one['pending_us']:.2f}, "
                f"counts CPU {many['counts_us'] / one['counts_us']:.2f}"
            )
        finally:
            await client.aclose()
            cluster.stop()


if __name__ == "__main__":
    asyncio.run(main())
