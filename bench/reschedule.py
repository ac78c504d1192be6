"""What scheduleReschedule costs: 10,000 moves of pending one-shots, against 10,000 cancels.

    .venv/bin/python bench/reschedule.py [--pending 100000] [--moves 10000] [--concurrency 1,50] [--runs 3]

A private redis-server (AOF off). N one-shots wait (scheduleIds `r:<i>`, due in an hour, spread over a
minute); M of them are moved one call each (DelayEngine.reschedule, as the component runs a
scheduleReschedule publish and the CLI one command), each to a time in the next hour (half earlier,
half later), c calls in flight at once. Per mode: wall seconds and µs per call; this process's CPU
per call; Redis CPU per call (INFO used_cpu_user+sys, the whole server) and the script's own time
(commandstats, TIMECONTROL's EVALSHA usec per call), and the Redis commands each script call ran
(commandstats: a count the machine's load does not change). The peer in the same run: the same M ids
cancelled one call each (Canceller.cancel, scheduleCancel's path), on a fresh fill; and the floor, a
script that does nothing, called as often (what a script call costs Redis under the same load). Each run checks
the moves: every moved id waits at its new time, the index holds N.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for sub in ("proto", "middleware", "components", "."):
    sys.path.insert(0, str(ROOT / sub))

import redis.asyncio as aioredis  # noqa: E402

from bench.common import bench_engine  # noqa: E402
from delayed_middleware.clock import SystemClock  # noqa: E402
from delayed_middleware.engine import ShardedEngine  # noqa: E402
from delayed_middleware.envelope import Envelope  # noqa: E402
from tests.redis_server import RedisServer  # noqa: E402

BODY = b'{"order":"66","note":"a small payload, as most delayed messages are"}'


async def fill(client: aioredis.Redis, engine: ShardedEngine, n: int, now: int) -> None:
    await client.flushall()
    batch: list[Envelope] = []
    for i in range(n):
        sid = f"r:{i}"
        batch.append(
            Envelope(
                id=sid, topic="orders", due_ms=now + 3_600_000 + (i * 60_000) // n, published_at_ms=now,
                message=BODY, schedule_id=sid,
            )
        )  # fmt: skip
        if len(batch) == 500:
            await engine.schedule(batch)
            batch = []
    if batch:
        await engine.schedule(batch)


async def redis_cpu(client: aioredis.Redis) -> float:
    info = await client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


async def timed(
    client: aioredis.Redis, m: int, concurrency: int, call: Callable[[int], Awaitable[bool]]
) -> tuple[float, float, float, float, float]:
    """(wall s, this process's CPU s, Redis CPU s, script µs per call, Redis commands the script ran
    per call) of m calls, c at a time."""
    await client.config_resetstat()
    cpu0, rcpu0, t0 = time.process_time(), await redis_cpu(client), time.perf_counter()
    done = 0
    for start in range(0, m, concurrency):
        got = await asyncio.gather(*(call(i) for i in range(start, min(m, start + concurrency))))
        done += sum(got)
    wall = time.perf_counter() - t0
    cpu, rcpu = time.process_time() - cpu0, await redis_cpu(client) - rcpu0
    assert done == m, (done, m)
    stats = await client.info("commandstats")
    # Commands the scripts ran (every command but the EVALSHA calls and INFO/CONFIG of this bench).
    inner = sum(
        int(v["calls"])
        for k, v in stats.items()
        if k not in ("cmdstat_evalsha", "cmdstat_info", "cmdstat_config|resetstat")
    )
    return wall, cpu, rcpu, float(stats["cmdstat_evalsha"]["usec_per_call"]), inner / m


async def one_run(
    port: int, n: int, m: int, concurrency: int
) -> dict[str, tuple[float, float, float, float, float]]:
    client = aioredis.Redis(port=port, max_connections=max(concurrency * 2, 10))
    engine = bench_engine(client, SystemClock(), {"consumerID": "bench"})
    out = {}
    now = int(time.time() * 1000)
    await fill(client, engine, n, now)

    async def move(i: int) -> bool:
        # Even ids earlier (into the next minute), odd ones later (to an hour and a half).
        to = now + 60_000 + i if i % 2 == 0 else now + 5_400_000 + i
        return (await engine.reschedule(f"r:{i}", to)).done

    out["reschedule"] = await timed(client, m, concurrency, move)
    assert await engine.pending() == n
    e = engine.engines[0]
    for i in (0, 1, m - 1):
        raw = await client.hget(e.keys.ids, f"r:{i}")
        ref = (raw.decode() if isinstance(raw, bytes) else str(raw)).split()
        want = now + 60_000 + i if i % 2 == 0 else now + 5_400_000 + i
        assert int(ref[1]) == want, (i, ref)

    await fill(client, engine, n, now)

    async def cancel(i: int) -> bool:
        return await engine.cancel(f"r:{i}")

    out["peer: cancel"] = await timed(client, m, concurrency, cancel)

    # The floor under the same load: a script call that does nothing (EVALSHA's own cost).
    empty = client.register_script("return 1")

    async def nothing(i: int) -> bool:
        return bool(await empty(keys=[e.keys.ids], args=[i]))

    out["floor: empty script"] = await timed(client, m, concurrency, nothing)
    await client.aclose()
    return out


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pending", type=int, default=100_000)
    parser.add_argument("--moves", type=int, default=10_000)
    parser.add_argument("--concurrency", default="1,50")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="1 run of 2,000 moves over 20,000 pending")
    args = parser.parse_args()
    if args.quick:
        args.pending, args.moves, args.runs = 20_000, 2_000, 1
    with tempfile.TemporaryDirectory(prefix="bench-reschedule-") as d:
        server = RedisServer(Path(d) / "redis", appendonly=False)
        server.start()
        try:
            for c in (int(x) for x in args.concurrency.split(",")):
                runs = [await one_run(server.port, args.pending, args.moves, c) for _ in range(args.runs)]
                print(
                    f"\n{args.moves:,} calls over {args.pending:,} pending, {c} in flight, {args.runs} run(s):"
                )
                for mode in runs[0]:
                    walls = [r[mode][0] for r in runs]
                    per = [1e6 * r[mode][0] / args.moves for r in runs]
                    cpu = [1e6 * r[mode][1] / args.moves for r in runs]
                    rcpu = [1e6 * r[mode][2] / args.moves for r in runs]
                    script = [r[mode][3] for r in runs]
                    commands = statistics.median(r[mode][4] for r in runs)
                    print(
                        f"  {mode:<14} wall {', '.join(f'{w:.2f}' for w in walls)} s "
                        f"(median {statistics.median(per):.0f} µs/call); client CPU "
                        f"{statistics.median(cpu):.0f} µs/call; Redis CPU {', '.join(f'{x:.1f}' for x in rcpu)} "
                        f"µs/call; script {', '.join(f'{x:.1f}' for x in script)} µs/call; "
                        f"{commands:.1f} commands/call"
                    )
        finally:
            server.stop()


if __name__ == "__main__":
    asyncio.run(main())
