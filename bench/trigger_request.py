"""What a schedule's trigger with a request identity costs on Redis Cluster's two-phase path (the
TIMECONTROL decision looks in the triggers set for the request's first attempt, keys.EngineKeys.triggers).

    .venv/bin/python bench/trigger_request.py [--triggers 500] [--sizes 0,1000,10000] [--runs 5]

A private redis-server (AOF off); an engine with the two-phase keys (EngineConfig.two_phase, as on
Cluster) on that one node. Per run and per set size S, in alternation: one `@every 1h` schedule is
stored, the triggers set is filled with S registrations of other schedules scored now (triggers in
flight, or ones a crash left within the token window: `<envelope id> t<ms>:<token>`), and it is
triggered T times, each with its own request id (TIMECONTROL, APPEND, TIMECONTROL 'record').
Reported: the scripts' own time per trigger (commandstats, EVALSHA usec summed over the calls / T)
and the wall time per trigger. Each run checks T occurrences went out.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for sub in ("proto", "middleware", "components", "."):
    sys.path.insert(0, str(ROOT / sub))

import redis.asyncio as aioredis  # noqa: E402

from bench.common import fill_triggers, two_phase_engine  # noqa: E402
from delayed_middleware.engine import DelayEngine  # noqa: E402
from delayed_middleware.envelope import Envelope  # noqa: E402
from delayed_middleware.keys import EngineKeys, delayed_topic  # noqa: E402
from delayed_middleware.kinds import Kind  # noqa: E402

KEYS = EngineKeys.for_topic(delayed_topic("bench"))
BODY = b'{"order":"66"}'


async def one(
    client: aioredis.Redis, engine: DelayEngine, t: int, size: int, run: int
) -> tuple[float, float]:
    """(scripts' µs per trigger, wall µs per trigger) with `size` other registrations."""
    await client.flushall()
    now = int(time.time() * 1000)
    await engine.schedule(
        [Envelope(id="tick", topic="orders", due_ms=now + 3_600_000, published_at_ms=now, message=BODY,
                  schedule_id="tick", kind=Kind.RECURRING.value, schedule="@every 1h")]
    )  # fmt: skip
    await fill_triggers(client, KEYS, size, now)
    await client.config_resetstat()
    t0 = time.perf_counter()
    for i in range(t):
        got = await engine.trigger("tick", request=f"ce-{run}-{i}")
        assert got.status == "triggered", got
    wall = 1e6 * (time.perf_counter() - t0) / t
    assert await client.xlen("orders") == t, "not one occurrence per trigger"
    stats = await client.info("commandstats")
    return float(stats["cmdstat_evalsha"]["usec"]) / t, wall


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--triggers", type=int, default=500)
    parser.add_argument("--sizes", default="0,1000,10000")
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    sizes = [int(x) for x in args.sizes.split(",")]
    async with two_phase_engine(KEYS, "bench-trigger-request-") as (client, engine):
        await one(client, engine, 50, 0, -1)  # scripts loaded, caches warm
        results: dict[int, list[tuple[float, float]]] = {s: [] for s in sizes}
        for run in range(args.runs):
            for s in sizes:  # in alternation, so the machine's load falls on every size alike
                results[s].append(await one(client, engine, args.triggers, s, run))
    print(f"{args.triggers:,} triggers of one schedule, each its own request, {args.runs} runs:")
    for s in sizes:
        script = statistics.median(r[0] for r in results[s])
        wall = statistics.median(r[1] for r in results[s])
        print(
            f"  triggers set {s:>7,}: scripts {script:7.0f} µs/trigger, wall {wall:7.0f} µs/trigger (medians)"
        )


if __name__ == "__main__":
    asyncio.run(main())
