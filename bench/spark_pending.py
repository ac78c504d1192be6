"""What the delayed-pending reader costs before and after a compaction pass moved every envelope.

    .venv/bin/python bench/spark_pending.py [--envelopes 50000] [--partitions 4]

Schedules the envelopes through the real engine on a private redis-server, then
reads them with the data source's own reader (partitions(), then read() of each,
in this process, no Spark session): once with no envelope moved, once after a
whole compaction pass (lua/compact.lua) re-homed them all, so each partition
also scans the moved hash. Wall seconds, best of 3. Run it against another
checkout with PYTHONPATH=DIR/proto:DIR/middleware:DIR/components for a ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import redis
import redis.asyncio as aioredis

ROOT = Path(__file__).resolve().parents[1]
for sub in ("proto", "middleware", "components"):
    if str(ROOT / sub) not in sys.path:
        sys.path.append(str(ROOT / sub))  # after PYTHONPATH: another checkout given there wins
sys.path.insert(0, str(ROOT))

from bench.common import bench_engine  # noqa: E402
from delayed_middleware import lua_scripts  # noqa: E402
from delayed_middleware.clock import ManualClock  # noqa: E402
from delayed_middleware.envelope import Envelope  # noqa: E402
from delayed_middleware.keys import EngineKeys, delayed_topic  # noqa: E402
from delayed_pubsub.spark.datasource import PendingDataSource  # noqa: E402
from tests.redis_server import RedisServer  # noqa: E402

APP = "bench"
DUE = 1_800_000_000_000


async def schedule(port: int, n: int) -> None:
    client = aioredis.Redis(port=port)
    engine = bench_engine(client, ManualClock(DUE - 3_600_000), {"consumerID": APP})
    env = Envelope(id="", topic="later", due_ms=DUE, published_at_ms=DUE - 3_600_000, message=b"x" * 200)
    for _ in range(n // 1000):
        await engine.schedule([env] * 1000)
    await client.aclose()


def read_all(options: dict[str, str]) -> tuple[float, int]:
    best, rows = float("inf"), 0
    for _ in range(3):
        reader: Any = PendingDataSource(options).reader(None)
        t = time.perf_counter()
        rows = sum(b.num_rows for p in reader.partitions() for b in reader.read(p))
        best = min(best, time.perf_counter() - t)
    return best, rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--envelopes", type=int, default=50_000)
    parser.add_argument("--partitions", type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        server = RedisServer(Path(folder), appendonly=False)
        server.start()
        try:
            client = redis.Redis(port=server.port)
            asyncio.run(schedule(server.port, args.envelopes))
            options = {"redisHost": f"127.0.0.1:{server.port}", "consumerID": APP, "numPartitions": str(args.partitions)}
            plain = read_all(options)
            keys = EngineKeys.for_topic(delayed_topic(APP))
            top: Any = client.xrevrange(keys.stream, count=1)
            compact = client.register_script(lua_scripts.COMPACT)
            cursor: Any = b"-"
            while cursor:
                cursor, _ = compact(keys=keys.script_keys, args=[cursor, top[0][0], 5000, 0])
            moved = read_all(options)
            print(
                f"machine {platform.node()}, {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, "
                f"{args.envelopes:,} envelopes, {args.partitions} partitions, wall s best of 3"
            )
            print("| stream | rows | read s |")
            print("|---|---|---|")
            print(f"| never compacted | {plain[1]:,} | {plain[0]:.2f} |")
            print(f"| after a pass moved all (moved hash {client.hlen(keys.moved):,}) | {moved[1]:,} | {moved[0]:.2f} |")
        finally:
            server.stop()


if __name__ == "__main__":
    main()
