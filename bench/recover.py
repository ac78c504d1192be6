"""What the start-up recovery sweep costs: one shard's stream checked for envelopes no index entry refers to.

    .venv/bin/python bench/recover.py [--pending 100000] [--orphans-every 10]

At format 2 each delay shard sweeps its delayed topic once when it starts, and puts back in the due
index every pending envelope that no index entry refers to (what the previous release leaves when it
runs on data it cannot read). This fills one shard with `--pending` indexed envelopes, then times
two sweeps: one that finds nothing (the cost every start pays), and one after the index entries of
every `--orphans-every`-th envelope were removed by hand (the recovery itself). Figures: the wall time
of the sweep (it is paced to keep Redis free at least half the time), the number of script calls, and
the mean and longest call as Redis's SLOWLOG measures it (the aim: no call over ~20 ms).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))

import redis.asyncio as aioredis  # noqa: E402

from delayed_middleware.clock import ManualClock  # noqa: E402
from delayed_middleware.engine import DelayEngine, EngineConfig  # noqa: E402
from tests.middleware.engine.helpers import KEYS, T0, engine_libraries, env  # noqa: E402
from tests.redis_server import RedisServer  # noqa: E402


def script_calls(client: Any) -> list[float]:
    """Milliseconds of each script call in the SLOWLOG since it was reset."""
    rows = client.slowlog_get(1_000_000)
    return [r["duration"] / 1000 for r in rows if (r["command"] or b"").lower().startswith(b"evalsha")]


async def sweep(engine: DelayEngine, client: Any, label: str) -> None:
    client.slowlog_reset()
    started = time.perf_counter()
    recovered, dropped = await engine.recover_orphans()
    wall = time.perf_counter() - started
    calls = script_calls(client)
    print(
        f"{label}: {recovered} recovered, {dropped} dropped; {wall:.2f} s wall, {len(calls)} calls, "
        f"mean {sum(calls) / max(1, len(calls)):.2f} ms, longest {max(calls, default=0):.2f} ms"
    )


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pending", type=int, default=100_000)
    parser.add_argument("--orphans-every", type=int, default=10)
    args = parser.parse_args()
    server = RedisServer(Path(tempfile.mkdtemp(prefix="bench-recover-")), appendonly=False)
    server.start()
    try:
        client = server.client()
        client.config_set("slowlog-log-slower-than", "0")
        client.config_set("slowlog-max-len", "1000000")
        aio = aioredis.from_url(server.url)
        engine = DelayEngine(aio, KEYS, ManualClock(T0), config=EngineConfig(history_max_len=0))
        n = args.pending
        for start in range(0, n, 500):
            batch = [dataclasses.replace(env(k, T0 + 10_000 + k), id="") for k in range(start, min(n, start + 500))]
            await engine.schedule(batch)
        await sweep(engine, client, f"{n:,} pending, none orphaned")
        # What the previous release leaves: index entries gone, envelopes still in the stream.
        remove = engine_libraries("index.lua") + "\nfor i = 2, #ARGV, 2 do remove(ARGV[i], ARGV[i+1]) end return 1"
        rows: Any = client.xrange(KEYS.stream, "-", "+")
        ids = [row[0].decode() for row in rows]
        pairs: list[Any] = []
        for k in range(0, n, args.orphans_every):
            pairs += [ids[k], T0 + 10_000 + k]
        for j in range(0, len(pairs), 2000):
            client.eval(remove, len(KEYS.script_keys), *KEYS.script_keys, KEYS.buckets, *pairs[j : j + 2000])
        await sweep(engine, client, f"{n:,} pending, {len(pairs) // 2:,} orphaned")
        await aio.aclose()
    finally:
        server.stop()


if __name__ == "__main__":
    asyncio.run(main())
