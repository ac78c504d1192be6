"""Prefix operations at scale: `pending --prefix/--after` paging and `scheduleIdPrefix` cancels.

    .venv/bin/python bench/pause.py [--pending 1000000] [--cancel 100000]

A private redis-server (AOF off). Measures, the CLI run as a real process with its own peak RSS:
- with N pending (scheduleIds `t<i % 1000>:<i>`): `pending --prefix t7: --limit 100` (a sparse prefix:
  one id in 1000, so about the first 100,000 entries are read), `pending --prefix none: --limit 100`
  (matches nothing: the whole delayed topic is read, one page held), `pending --after 0-0 --limit 100`
  (the first page),
  and `pending --prefix t --limit 0 --json` (every message written out as read); the peer in the same
  run is `pending --limit 100` (earliest by due: reads everything, holds the earliest 100) and
  `pending --limit 0 --json` (holds every match before writing);
- the same at N/10, so the RSS of the paging modes can be seen not to grow with N;
- a prefix cancel of M ids (DelayEngine.cancel_prefix: HSCAN MATCH + CANCEL in 500s) against
  cancel_many of the same M ids given by name (the peer), same run: wall seconds and Redis
  script calls.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for sub in ("proto", "middleware", "components", "."):
    sys.path.insert(0, str(ROOT / sub))

import redis.asyncio as aioredis  # noqa: E402

from bench.common import bench_engine  # noqa: E402
from delayed_middleware.clock import SystemClock  # noqa: E402
from delayed_middleware.envelope import Envelope  # noqa: E402
from delayed_middleware.keys import EngineKeys, delayed_topic  # noqa: E402
from tests.redis_server import RedisServer  # noqa: E402

EXE = Path(sys.executable).with_name("delayed-pubsub")
KEYS = EngineKeys.for_topic(delayed_topic("bench"))
BODY = b'{"order":"66","note":"a small payload, as most delayed messages are"}'

# Runs the CLI and writes its peak RSS (KiB) to argv[1]: the launcher is small, so the
# child's ru_maxrss is its own (a child starts from what its parent held when it forked).
_LAUNCHER = """
import os, subprocess, sys
proc = subprocess.Popen(sys.argv[2:], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
_, status, usage = os.wait4(proc.pid, 0)
with open(sys.argv[1], "w") as f:
    f.write(str(usage.ru_maxrss))
sys.exit(os.waitstatus_to_exitcode(status))
"""


async def populate(port: int, n: int, start: int = 0) -> None:
    client = aioredis.Redis(port=port)
    engine = bench_engine(client, SystemClock(), {"consumerID": "bench"})
    now = int(time.time() * 1000)
    batch: list[Envelope] = []
    for i in range(start, start + n):
        sid = f"t{i % 1000}:{i}"
        batch.append(
            Envelope(
                id=sid,
                topic="orders",
                due_ms=now + 3_600_000 + i,
                published_at_ms=now,
                message=BODY,
                schedule_id=sid,
            )
        )
        if len(batch) == 500:
            await engine.schedule(batch)
            batch = []
    if batch:
        await engine.schedule(batch)
    await client.aclose()


def cli(port: int, *args: str) -> str:
    """Wall seconds and peak RSS of one CLI run (its output discarded)."""
    with tempfile.NamedTemporaryFile() as rss:
        t = time.perf_counter()
        subprocess.run(
            [
                sys.executable,
                "-c",
                _LAUNCHER,
                rss.name,
                str(EXE),
                *args,
                "--redis-host",
                f"127.0.0.1:{port}",
                "--app-id",
                "bench",
            ],
            check=True,
            env={**os.environ, "COLUMNS": "200"},
        )
        took = time.perf_counter() - t
        peak = int(Path(rss.name).read_text()) / 1024
    return f"{took:6.1f} s wall, peak RSS {peak:6.0f} MiB"


def listings(port: int, n: int) -> None:
    print(f"\n{n:,} pending:")
    for label, args in (
        (
            "pending --prefix t7: --limit 100 (sparse prefix)",
            ["pending", "--prefix", "t7:", "--limit", "100"],
        ),
        (
            "pending --prefix none: --limit 100 (matches nothing)",
            ["pending", "--prefix", "none:", "--limit", "100"],
        ),
        ("pending --after 0-0 --limit 100 (first page)", ["pending", "--after", "0-0", "--limit", "100"]),
        (
            "pending --prefix t --limit 0 --json (all, streamed)",
            ["pending", "--prefix", "t", "--limit", "0", "--json"],
        ),
        ("peer: pending --limit 100 (earliest by due)", ["pending", "--limit", "100"]),
        ("peer: pending --limit 0 --json (all, held)", ["pending", "--limit", "0", "--json"]),
    ):
        print(f"  {label:<55} {cli(port, *args)}")


async def cancels(port: int, m: int) -> None:
    client = aioredis.Redis(port=port)
    await client.flushall()
    engine = bench_engine(client, SystemClock(), {"consumerID": "bench"})
    results = {}
    for mode in ("by name (cancel_many)", "by prefix"):
        await client.flushall()
        await populate(port, m)
        ids = [f"t{i % 1000}:{i}" for i in range(m)]
        await client.config_resetstat()
        t = time.perf_counter()
        if mode == "by prefix":
            done = await engine.cancel_prefix("t")
        else:
            done = sum(1 for found, _ in await engine.cancel_many(ids) if found)
        took = time.perf_counter() - t
        assert done == m, done
        stats = (await client.info("commandstats"))["cmdstat_evalsha"]
        results[mode] = took
        print(
            f"  cancel {m:,} {mode:<22} {took:6.2f} s wall, {stats['calls']} script calls, "
            f"{stats['usec_per_call'] / 1000:.1f} ms Redis each"
        )
    print(f"  ratio prefix / by name: {results['by prefix'] / results['by name (cancel_many)']:.2f}")
    await client.aclose()


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pending", type=int, default=1_000_000)
    parser.add_argument("--cancel", type=int, default=100_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-pause-") as d:
        server = RedisServer(Path(d) / "redis", appendonly=False)
        server.start()
        try:
            small = args.pending // 10
            await populate(server.port, small)
            listings(server.port, small)
            await populate(server.port, args.pending - small, start=small)
            listings(server.port, args.pending)
            if args.cancel:
                print()
                await cancels(server.port, args.cancel)
        finally:
            server.stop()


if __name__ == "__main__":
    asyncio.run(main())
