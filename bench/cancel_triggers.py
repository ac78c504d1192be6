"""What CANCEL's look at the triggers set costs (keys.EngineKeys.triggers, Redis Cluster's two-phase path).

    .venv/bin/python bench/cancel_triggers.py [--kind oneshot|recurring] [--pending 20000] [--cancels 1000]
        [--sizes 0,1000,10000,100000] [--runs 5]

A private redis-server (AOF off); an engine with the two-phase keys (EngineConfig.two_phase, as on
Cluster) on that one node. Per run and per set size S, in alternation: N one-shots (or `@every 1h`
schedules: only a recurring envelope's cancel reads the set, as only a schedule registers) are stored, the
triggers set is filled with S registrations of other schedules (what triggers in flight, or ones an
error or a crash left, look like: `<envelope id> t<ms>:<token>`, scored now), and C of the one-shots
are cancelled by one cancel_many (CANCEL_BATCH ids per script call). Reported: CANCEL's own time per
script call (commandstats, EVALSHA usec per call) and the wall time of the cancel_many; S = 0 is the
cost before the triggers set existed (a ZRANGE of a missing key). Each run checks the C ids are gone.
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
    client: aioredis.Redis, engine: DelayEngine, n: int, c: int, size: int, kind: str
) -> tuple[float, float]:
    """(CANCEL µs per script call, cancel_many wall ms) for one fill with `size` registrations."""
    await client.flushall()
    now = int(time.time() * 1000)
    recurring = kind == "recurring"
    for start in range(0, n, 500):
        await engine.schedule(
            [
                Envelope(id=f"r:{i}", topic="orders", due_ms=now + 3_600_000, published_at_ms=now, message=BODY,
                         schedule_id=f"r:{i}", kind=(Kind.RECURRING if recurring else Kind.ONESHOT).value,
                         schedule="@every 1h" if recurring else "")
                for i in range(start, min(n, start + 500))
            ]
        )  # fmt: skip
    await fill_triggers(client, KEYS, size, now)
    await client.config_resetstat()
    t0 = time.perf_counter()
    got = await engine.parts.canceller.cancel_many([f"r:{i}" for i in range(c)])
    wall = 1000 * (time.perf_counter() - t0)
    assert all(found for found, _ in got), "a cancel found nothing"
    stats = await client.info("commandstats")
    return float(stats["cmdstat_evalsha"]["usec_per_call"]), wall


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kind", choices=("oneshot", "recurring"), default="oneshot")
    parser.add_argument("--pending", type=int, default=20_000)
    parser.add_argument("--cancels", type=int, default=1_000)
    parser.add_argument("--sizes", default="0,1000,10000,100000")
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    sizes = [int(x) for x in args.sizes.split(",")]
    async with two_phase_engine(KEYS, "bench-cancel-triggers-") as (client, engine):
        await one(client, engine, 2_000, 500, 0, args.kind)  # scripts loaded, caches warm
        results: dict[int, list[tuple[float, float]]] = {s: [] for s in sizes}
        for _ in range(args.runs):
            for s in sizes:  # in alternation, so the machine's load falls on every size alike
                results[s].append(await one(client, engine, args.pending, args.cancels, s, args.kind))
    print(f"cancel_many of {args.cancels:,} {args.kind} ids over {args.pending:,} pending, {args.runs} runs:")
    base = statistics.median(r[0] for r in results[sizes[0]])
    for s in sizes:
        script = statistics.median(r[0] for r in results[s])
        wall = statistics.median(r[1] for r in results[s])
        print(
            f"  triggers set {s:>7,}: CANCEL {script:8.0f} µs/script call "
            f"({script / base:4.2f}x), cancel_many {wall:7.1f} ms (medians)"
        )


if __name__ == "__main__":
    asyncio.run(main())
