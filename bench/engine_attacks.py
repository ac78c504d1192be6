"""How long hostile envelopes hold Redis in one engine script call (SLOWLOG).

Each case schedules envelopes straight through DelayEngine (no publish-side
limits: the plan refuses a single envelope above its bounds, and this shows
why) on a private redis-server, fires everything due, and reports the longest
EVALSHA of the fire calls and how many envelopes the busiest call fired. Min
of three rounds: the machine may be shared.

    .venv/bin/python bench/engine_attacks.py
"""

from __future__ import annotations

import asyncio
import os
import platform
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path

import redis.asyncio as aioredis

ROOT = Path(__file__).resolve().parents[1]
for sub in ("proto", "middleware", "components", "."):
    sys.path.insert(0, str(ROOT / sub))

from bench.common import bench_engine  # noqa: E402
from delayed_middleware.clock import ManualClock  # noqa: E402
from delayed_middleware.engine import FireReport  # noqa: E402
from delayed_middleware.envelope import BulkEntry, Envelope  # noqa: E402
from delayed_middleware.keys import EngineKeys, delayed_topic  # noqa: E402
from tests.redis_server import RedisServer  # noqa: E402

T0 = 1_800_000_000_000
KEYS = EngineKeys.for_topic(delayed_topic("bench"))


def one(**kw: object) -> Envelope:
    return Envelope(id="", topic="orders", due_ms=T0, published_at_ms=T0, **kw)  # type: ignore[arg-type]


CASES: dict[str, list[Envelope]] = {
    "500 plain (300 B)": [one(message=b"x" * 300) for _ in range(500)],
    "1 x 10,000 metadata keys": [one(message=b"x", metadata={f"k{i}": "v" for i in range(10_000)})],
    "1 x 4 MiB payload": [one(message=b"x" * (4 << 20))],
    "1 bulk 1,000 x 1 KiB": [one(bulk_entries=[BulkEntry(str(i), b"x" * 1024) for i in range(1000)])],
    "20 x 4,000 metadata keys": [
        one(message=b"x", metadata={f"k{i}": "v" for i in range(4_000)}) for _ in range(20)
    ],
    "20 x 1 MiB metadata value": [one(message=b"x", metadata={"big": "v" * (1 << 20)}) for _ in range(20)],
}


async def measure(client: aioredis.Redis, envs: list[Envelope]) -> tuple[float, int]:
    await client.flushall()
    reports: list[FireReport] = []
    engine = bench_engine(client, ManualClock(T0), {"consumerID": "bench"}, on_batch=lambda _: reports.append)
    await engine.schedule(envs)
    await client.slowlog_reset()
    while (await engine.fire_due())[0]:
        pass
    log = await client.slowlog_get(1000)
    longest = max((e["duration"] for e in log if e["command"].startswith(b"EVALSHA")), default=0)
    return longest / 1000, max(r.fired for r in reports)


async def main() -> None:
    print(
        f"# {datetime.now(UTC):%Y-%m-%d %H:%M UTC} on {platform.node()}, {os.cpu_count()} cores, "
        f"load {os.getloadavg()[0]:.1f}"
    )
    with tempfile.TemporaryDirectory(prefix="dpsa-") as d:
        server = RedisServer(Path(d), appendonly=False)
        server.start()
        client = aioredis.Redis(port=server.port)
        try:
            await client.config_set("slowlog-log-slower-than", 0)
            await client.config_set("slowlog-max-len", 1000)
            for name, envs in CASES.items():
                runs = [await measure(client, envs) for _ in range(3)]
                ms = min(r[0] for r in runs)
                print(f"{name:28} longest fire call {ms:7.1f} ms   busiest call fired {runs[0][1]}")
        finally:
            await client.aclose()
            server.stop()


if __name__ == "__main__":
    asyncio.run(main())
