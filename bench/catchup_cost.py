"""The cost of a catch-up: a 1-minute schedule missed for 3 days (4,320 occurrences), caught up with
`scheduleCatchup: all`, against `one` (a single catch-up delivery) on the same Redis.

    .venv/bin/python bench/catchup_cost.py [--days 3] [--runs 1]

A private redis-server (AOF off); the engine the component builds (bench_engine), its clock
injected: the schedule fires once, the clock jumps `--days` ahead, then the engine fires as the
loop would, the clock moved to each head (so the paced catch-up takes its 50 ms per occurrence
of clock time, not of wall time). Prints, for the catch-up phase: deliveries, simulated time,
wall seconds, this process's CPU and Redis CPU (used_cpu_user + used_cpu_sys) per delivery,
Redis commands per delivery (INFO commandstats), and Redis used_memory before and after
(used_memory_peak beside), so the pacing's cost in Redis memory shows (it holds one envelope).
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
from bench.fire_cost import commands  # noqa: E402
from bench.history_index import redis_cpu  # noqa: E402
from delayed_middleware.clock import ManualClock  # noqa: E402
from delayed_middleware.instants import parse_instant  # noqa: E402
from delayed_middleware.plan import PlanContext, plan_publish  # noqa: E402
from delayed_middleware.schedules import EnvelopeRecurrence  # noqa: E402
from tests.redis_server import RedisServer  # noqa: E402

MINUTE = 60_000
T0 = parse_instant("2026-11-29T09:00:30Z")


async def run(port: int, days: int, policy: str) -> dict[str, Any]:
    client = aioredis.Redis(port=port)
    await client.flushall()
    clock = ManualClock(T0)
    engine = bench_engine(client, clock, {"consumerID": "bench"}, recurrence=EnvelopeRecurrence())
    metadata = {"schedule": "@every 1m", "scheduleId": "tick", "scheduleCatchup": policy}
    metadata["scheduleCatchupWindow"] = f"{days * 24 + 24}h"
    plan = plan_publish("orders", b"x" * 100, metadata, "", PlanContext(T0, "p", enabled=True))
    await engine.schedule([d.envelope for d in plan.delayed])
    clock.set(T0 + MINUTE)
    await engine.fire_due()
    missed = days * 24 * 60
    clock.set(T0 + MINUTE + missed * MINUTE + 5_000)
    start = clock.now_ms()
    await client.config_resetstat()
    memory: dict[str, Any] = await client.info("memory")
    mem_before = int(memory["used_memory"])
    cpu, wall, own = await redis_cpu(client), time.perf_counter(), time.process_time()
    # Until every missed occurrence (and nothing after now) was delivered.
    while await client.xlen("orders") < 1 + (missed if policy == "all" else 1):
        _, head = await engine.fire_due()
        if head is not None:
            clock.set(max(head, clock.now_ms()))
    wall, own = time.perf_counter() - wall, time.process_time() - own
    cpu = await redis_cpu(client) - cpu
    calls = await commands(client)
    memory = await client.info("memory")
    delivered = await client.xlen("orders") - 1
    await client.aclose()
    return {
        "policy": policy,
        "delivered": delivered,
        "simulated_s": (clock.now_ms() - start) / 1000,
        "wall_s": wall,
        "own_cpu_us": own / delivered * 1e6,
        "redis_cpu_us": cpu / delivered * 1e6,
        "commands": (calls - 1) / delivered,
        "mem_before": mem_before,
        "mem_after": int(memory["used_memory"]),
        "mem_peak": int(memory["used_memory_peak"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--days", type=int, default=3)
    parser.add_argument("--runs", type=int, default=1)
    args = parser.parse_args()
    for _ in range(args.runs):
        for policy in ("all", "one"):
            with tempfile.TemporaryDirectory(prefix="bench-catchup-") as d:
                server = RedisServer(Path(d) / "redis")
                server.start()
                try:
                    r = asyncio.run(run(server.port, args.days, policy))
                finally:
                    server.stop()
            print(
                f"catch-up {r['policy']}: {r['delivered']} delivered over {r['simulated_s']:.1f} s simulated, "
                f"{r['wall_s']:.2f} s wall; per delivery: {r['own_cpu_us']:.0f} us engine CPU, "
                f"{r['redis_cpu_us']:.0f} us Redis CPU, {r['commands']:.1f} Redis commands; "
                f"Redis used_memory {r['mem_before'] / 1024:.0f} -> {r['mem_after'] / 1024:.0f} KiB "
                f"(peak {r['mem_peak'] / 1024:.0f} KiB)"
            )


if __name__ == "__main__":
    main()
