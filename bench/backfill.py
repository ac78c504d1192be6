"""Backfill: 4,320 occurrences of one schedule delivered by `delayed-pubsub backfill`'s function.

    .venv/bin/python bench/backfill.py [--runs 3]

A private redis-server (AOF off). Two schedules, each with 4,320 occurrences in its range:
- `@every 1m` (from a scheduleStart) over 3 days: the calendar costs nothing, so this is the
  delivery's own cost;
- cron `0 */10 * * * *` in Europe/Berlin over 30 days: the calendar is croniter's, stepped per occurrence.
For each: the dry run, the backfill (no rate cap, to measure its cost rather than its pacing: at the
default 100/s it takes 43.2 s by design), and the same backfill again (delivers nothing). Measured:
wall seconds, this process's CPU seconds, Redis CPU seconds (INFO cpu, user + sys), and from INFO
commandstats the lua/backfill.lua calls (EVALSHA) with their mean time each, and the EVAL calls (one per
`backfilled` history record, and the pages of the schedule's history read).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import resource
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for sub in ("proto", "middleware", "components", "."):
    sys.path.insert(0, str(ROOT / sub))

import redis.asyncio as aioredis  # noqa: E402

from bench.common import bench_engine  # noqa: E402
from delayed_middleware.backfill import backfill  # noqa: E402
from delayed_middleware.clock import SystemClock  # noqa: E402
from delayed_middleware.instants import format_instant  # noqa: E402
from delayed_middleware.plan import PlanContext, plan_publish  # noqa: E402
from delayed_middleware.schedules import EnvelopeRecurrence  # noqa: E402
from tests.redis_server import RedisServer  # noqa: E402

OCCURRENCES = 4_320
MINUTE, DAY = 60_000, 86_400_000
BODY = b'{"report":"daily","note":"a small payload, as most scheduled messages are"}'


def schedules(now_ms: int) -> list[tuple[str, dict[str, str], int, int]]:
    """(label, publish metadata, --from, --to) of each schedule measured."""
    day0 = now_ms // DAY * DAY
    every_from = day0 - 3 * DAY
    return [
        (
            "@every 1m, 3 days",
            {"schedule": "@every 1m", "scheduleId": "every", "scheduleStart": format_instant(every_from)},
            every_from,
            every_from + OCCURRENCES * MINUTE,
        ),
        (
            "cron 0 */10 * * * * Europe/Berlin, 30 days",
            {"schedule": "0 */10 * * * *", "scheduleTimeZone": "Europe/Berlin", "scheduleId": "cron"},
            day0 - 30 * DAY,
            day0,
        ),
    ]


async def redis_cpu(client: Any) -> tuple[float, int, int, int]:
    """Redis's CPU seconds so far; its EVALSHA calls (the backfill chunks and history walks) and
    their µs; its EVAL calls (one `backfilled` history record each)."""
    cpu = await client.info("cpu")
    stats = await client.info("commandstats")
    sha = stats.get("cmdstat_evalsha", {})
    plain = stats.get("cmdstat_eval", {})
    return (
        float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"]),
        int(sha.get("calls", 0)),
        int(sha.get("usec", 0)),
        int(plain.get("calls", 0)),
    )


async def measured(client: Any, what: str, run: Any) -> str:
    r0, c0, u0, e0 = await redis_cpu(client)
    before = resource.getrusage(resource.RUSAGE_SELF)
    t = time.perf_counter()
    result = await run()
    took = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_SELF)
    r1, c1, u1, e1 = await redis_cpu(client)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    calls = c1 - c0
    per_call = (u1 - u0) / calls / 1000 if calls else 0.0
    return (
        f"| {what} | {len(result.occurrences)} | {result.delivered} | {took:.2f} | {cpu:.2f} | {r1 - r0:.2f} "
        f"| {calls} | {per_call:.2f} | {e1 - e0} |"
    )


async def one_round(port: int) -> list[str]:
    client = aioredis.Redis(port=port)
    await client.flushall()
    now = SystemClock().now_ms()
    engine = bench_engine(client, SystemClock(), {"consumerID": "bench"}, recurrence=EnvelopeRecurrence())
    rows = []
    for label, metadata, start, end in schedules(now):
        plan = plan_publish(
            "orders", BODY, metadata, "", PlanContext(now_ms=now, pubsub_name="p", enabled=True)
        )
        await engine.schedule([d.envelope for d in plan.delayed])
        sid = metadata["scheduleId"]

        def run(dry: bool, sid: str = sid, start: int = start, end: int = end) -> Any:
            return lambda: backfill(client, "bench", sid, start, end, rate=1e9, dry_run=dry)

        rows.append(await measured(client, f"{label}: dry run", run(True)))
        rows.append(await measured(client, f"{label}: backfill", run(False)))
        rows.append(await measured(client, f"{label}: again", run(False)))
    await client.aclose()
    return rows


async def main_async(runs: int) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-backfill-") as d:
        server = RedisServer(Path(d))
        server.start()
        try:
            print(
                f"# {datetime.now(UTC):%Y-%m-%d %H:%M UTC} on {platform.node()}, {os.cpu_count()} cores "
                f"(shared), load {os.getloadavg()[0]:.1f}"
            )
            print(
                "| run | occurrences | delivered | wall s | client CPU s | Redis CPU s | backfill.lua calls | ms each "
                "| history EVALs |"
            )
            print("|---|---|---|---|---|---|---|---|---|")
            for _ in range(runs):
                for row in await one_round(server.port):
                    print(row, flush=True)
        finally:
            server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="rounds (each on a flushed Redis)")
    args = parser.parse_args()
    asyncio.run(main_async(args.runs))


if __name__ == "__main__":
    main()
