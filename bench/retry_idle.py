"""The retry pollers' cost in the gRPC process at idle: S open subscriptions with a retry policy
against the same S without one, and the same two under `serve --workers 1`, same run.

    .venv/bin/python bench/retry_idle.py [--subscriptions 20] [--seconds 10] [--rounds 2]

An in-process ComponentServer on a unix socket and a private redis-server (AOF off), driven as
daprd drives it (tests/components/driver.py). Each subscription with a policy runs a retry poller
that looks at its retry schedule at least once a second; nothing is published, so what the
process spends is the idle cost. Reported as CPU ms per second of this process (server and the
idle driver), per variant and round, and the difference per subscription. With `--workers 1`
semantics (a WorkerPool of one worker process beside the server) the worker scans the retry
schedules and the pollers wait for its notices: this process's CPU is reported, and the
worker's own CPU over the same seconds beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for sub in ("proto", "middleware", "components", "."):
    sys.path.insert(0, str(ROOT / sub))

import grpc  # noqa: E402

from delayed_middleware.clock import SystemClock  # noqa: E402
from delayed_pubsub.server import ComponentServer  # noqa: E402
from delayed_pubsub.workers import WorkerPool  # noqa: E402
from tests.components.driver import Component  # noqa: E402
from tests.redis_server import RedisServer  # noqa: E402


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def proc_cpu_s(pids: list[int]) -> float:
    """User + system CPU seconds of processes `pids` (Linux /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / tick
    return total


async def idle_cpu(
    folder: Path, port: int, subscriptions: int, seconds: float, policy: bool, workers: int = 0
) -> tuple[float, float]:
    """CPU ms per second of this process, and of its workers, while `subscriptions` streams
    stay open and idle."""
    sock = folder / f"idle-{int(policy)}-{workers}.sock"
    pool = WorkerPool(workers, sock) if workers else None
    server = ComponentServer(sock, SystemClock(), workers=pool)
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"unix://{sock}") as channel:
            component = Component(channel, "bench")
            props = {"redisHost": f"127.0.0.1:{port}", "consumerID": f"idle-{int(policy)}-{workers}"}
            if policy:
                props["retryInitialInterval"] = "1s"
            await component.init(props)
            streams = [await component.subscribe(f"t{i}") for i in range(subscriptions)]
            # Past the streams' start-up (and the worker's: an interpreter and its imports).
            await asyncio.sleep(5.0 if workers else 2.0)
            pids = pool.pids() if pool is not None else []
            start, start_workers = cpu_s(), proc_cpu_s(pids)
            await asyncio.sleep(seconds)
            used, used_workers = cpu_s() - start, proc_cpu_s(pids) - start_workers
            for stream in streams:
                await stream.cancel()
            return used / seconds * 1000, used_workers / seconds * 1000
    finally:
        await server.stop(grace=1)


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--subscriptions", type=int, default=20)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-idle-") as d:
        redis_server = RedisServer(Path(d) / "redis", appendonly=False)
        redis_server.start()
        try:
            for n in range(args.rounds):
                plain, _ = await idle_cpu(Path(d), redis_server.port, args.subscriptions, args.seconds, False)
                polled, _ = await idle_cpu(Path(d), redis_server.port, args.subscriptions, args.seconds, True)
                plain_w, plain_worker = await idle_cpu(
                    Path(d), redis_server.port, args.subscriptions, args.seconds, False, workers=1
                )
                noticed, worker = await idle_cpu(
                    Path(d), redis_server.port, args.subscriptions, args.seconds, True, workers=1
                )
                print(
                    f"round {n}, {args.subscriptions} idle subscriptions: no policy {plain:.2f} ms CPU/s, "
                    f"retry policy {polled:.2f} ms CPU/s (ratio {polled / plain:.2f}; "
                    f"{(polled - plain) / args.subscriptions * 1000:.0f} µs CPU/s per poller); "
                    f"--workers 1: gRPC process no policy {plain_w:.2f}, retry policy {noticed:.2f} ms CPU/s "
                    f"(ratio {noticed / plain_w:.2f}; {(noticed - plain_w) / args.subscriptions * 1000:.0f} µs "
                    f"CPU/s per poller; policy gRPC process workers 1 / workers 0 {noticed / polled:.2f}), "
                    f"its worker {plain_worker:.2f} / {worker:.2f} ms CPU/s",
                    flush=True,
                )
        finally:
            redis_server.stop()


if __name__ == "__main__":
    asyncio.run(main())
