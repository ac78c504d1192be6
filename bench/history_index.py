"""What the history's by-id index costs the fire path: 50,000 one-shots due at one instant, fired.

    .venv/bin/python bench/history_index.py [--messages 50000] [--with-ids | --without-ids]

A private redis-server (AOF off). The messages are scheduled through the engine
(with a scheduleId each, or none: a record of a stream id is not indexed), all
due at one instant; then fire_due runs until all are fired. Prints the fire
phase's wall seconds and Redis CPU seconds (the server's used_cpu_user +
used_cpu_sys). Run it on another checkout with PYTHONPATH set to its proto,
middleware and components for a before/after pair in the same sitting.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))

from bench.common import bench_engine  # noqa: E402
from delayed_middleware.clock import ManualClock  # noqa: E402
from delayed_middleware.envelope import Envelope  # noqa: E402
from tests.redis_server import RedisServer  # noqa: E402

T0 = 1_800_000_000_000


async def redis_cpu(client: aioredis.Redis) -> float:
    info = await client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


async def fire_all(engine: Any) -> int:
    """Runs fire_due until a call fires nothing; returns how many fired."""
    fired = 0
    while True:
        count, _ = await engine.fire_due()
        if not count:
            return fired
        fired += count


async def schedule_due(engine: Any, n: int, ids: bool, metadata: dict[str, str]) -> None:
    """Schedules n one-shots (100 B payload, this metadata; a scheduleId each if `ids`) due at T0 + 1 s."""
    for start in range(0, n, 1000):
        await engine.schedule(
            [
                Envelope(
                    id=f"sched-{i}" if ids else "",
                    topic="orders",
                    due_ms=T0 + 1_000,
                    published_at_ms=T0,
                    message=b"x" * 100,
                    metadata=metadata,
                    schedule_id=f"sched-{i}" if ids else "",
                )
                for i in range(start, min(n, start + 1000))
            ]
        )


async def run(port: int, n: int, ids: bool) -> tuple[float, float]:
    client = aioredis.Redis(port=port)
    clock = ManualClock(T0)
    engine = bench_engine(client, clock, {"consumerID": "bench"})
    await schedule_due(engine, n, ids, {})
    clock.advance(1_000)
    cpu, wall = await redis_cpu(client), time.perf_counter()
    fired = await fire_all(engine)
    wall, cpu = time.perf_counter() - wall, await redis_cpu(client) - cpu
    assert fired == n, fired
    await client.aclose()
    return wall, cpu


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--messages", type=int, default=50_000)
    parser.add_argument("--without-ids", action="store_true", help="no scheduleIds (nothing indexed)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-histidx-") as d:
        server = RedisServer(Path(d) / "redis", appendonly=False)
        server.start()
        try:
            wall, cpu = asyncio.run(run(server.port, args.messages, not args.without_ids))
        finally:
            server.stop()
    what = "without scheduleIds" if args.without_ids else "with scheduleIds"
    print(
        f"fired {args.messages} {what}: {wall:.2f} s wall, {cpu:.2f} s Redis CPU, {args.messages / wall:,.0f}/s"
    )


if __name__ == "__main__":
    main()
