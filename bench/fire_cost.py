"""Redis's cost per fired message: 50,000 one-shots due at one instant, fired by the engine.

    .venv/bin/python bench/fire_cost.py [--messages 50000] [--aof] [--runs 3] [--history-off] [--loop] [--two-phase]

A private redis-server (AOF off, or everysec with --aof). The messages (100 B
payload, one metadata key, no scheduleId) are scheduled through the engine,
all due at one instant; then fire_due runs until all are fired. Prints, for
the fire phase: wall seconds, Redis CPU (used_cpu_user + used_cpu_sys) per
fired message, this process's CPU per fired message (the engine's Python side:
script calls, reply parsing, reports), and Redis commands per fired message (INFO commandstats, the
FIRE script's own EVALSHA included). --history-off: `historyMaxLen: 0`, what
the lifecycle history costs the fire path. Run it on another checkout with
PYTHONPATH set to its proto, middleware and components for a before/after pair.
--loop: fired by the engine's run loop instead of
fire_due called in turn. --two-phase: through Redis Cluster's path (CLAIM, APPEND,
RELEASE), on the same single node.
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
from bench.history_index import T0, fire_all, redis_cpu, schedule_due  # noqa: E402
from delayed_middleware.clock import ManualClock  # noqa: E402
from tests.redis_server import RedisServer  # noqa: E402


async def commands(client: aioredis.Redis) -> int:
    stats: dict[str, Any] = await client.info("commandstats")
    return sum(int(v["calls"]) for v in stats.values())


async def fire_by_loop(engine: Any, client: aioredis.Redis, n: int) -> int:
    """Shard 0's run loop (the only shard on a single node) until the target holds n messages."""
    stop = asyncio.Event()
    task = asyncio.create_task(engine.engines[0].run(stop))
    # Polled: what is fired shows only on the target topic.
    for _ in iter(int, 1):
        if await client.xlen("orders") >= n or task.done():
            break
        await asyncio.sleep(0.002)
    stop.set()
    await task
    return int(await client.xlen("orders"))


async def run(
    port: int, n: int, history: bool = True, loop: bool = False, two_phase: bool = False
) -> tuple[float, float, float, float]:
    client = aioredis.Redis(port=port)
    clock = ManualClock(T0)
    props = {"consumerID": "bench"} | ({} if history else {"historyMaxLen": "0"})
    engine = bench_engine(client, clock, props, config={"two_phase": True} if two_phase else None)
    await schedule_due(
        engine, n, False, {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}
    )
    clock.advance(1_000)
    await client.config_resetstat()
    cpu, wall, own = await redis_cpu(client), time.perf_counter(), time.process_time()
    fired = await (fire_by_loop(engine, client, n) if loop else fire_all(engine))
    wall, own = time.perf_counter() - wall, time.process_time() - own
    cpu = await redis_cpu(client) - cpu
    calls = await commands(client)
    assert fired == n, fired
    assert await client.xlen("orders") == n
    await client.aclose()
    # Less the stats calls themselves (INFO cpu at the end).
    return wall, cpu / n * 1e6, own / n * 1e6, (calls - 1) / n


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--messages", type=int, default=50_000)
    parser.add_argument("--aof", action="store_true", help="appendonly yes, appendfsync everysec")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--history-off", action="store_true", help="historyMaxLen 0: no lifecycle records")
    parser.add_argument(
        "--loop", action="store_true", help="fire with the engine's run loop, not fire_due in turn"
    )
    parser.add_argument("--two-phase", action="store_true", help="CLAIM, APPEND and RELEASE instead of FIRE")
    args = parser.parse_args()
    for _ in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="bench-firecost-") as d:
            server = RedisServer(Path(d) / "redis", appendonly=args.aof)
            server.start()
            try:
                wall, us, py, per = asyncio.run(
                    run(server.port, args.messages, not args.history_off, args.loop, args.two_phase)
                )
            finally:
                server.stop()
        aof = ("AOF everysec" if args.aof else "AOF off") + (", history off" if args.history_off else "")
        aof += ", run loop" if args.loop else ""
        aof += ", two-phase" if args.two_phase else ""
        print(
            f"fired {args.messages} ({aof}): {wall:.2f} s wall, {us:.1f} us Redis CPU/msg, {py:.1f} us engine CPU/msg, "
            f"{per:.2f} Redis commands/msg"
        )


if __name__ == "__main__":
    main()
