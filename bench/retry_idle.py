"""The retry pollers' cost in the gRPC process at idle: S open subscriptions with a retry policy
against the same S without one, same run.

    .venv/bin/python bench/retry_idle.py [--subscriptions 20] [--seconds 10] [--rounds 2]

An in-process ComponentServer on a unix socket and a private redis-server (AOF off), driven as
daprd drives it (tests/components/driver.py). Each subscription with a policy runs a retry poller
that looks at its retry schedule at least once a second; nothing is published, so what the
process spends is the idle cost. Reported as CPU ms per second of this process (server and the
idle driver), per variant and round, and the difference per subscription.
"""

from __future__ import annotations

import argparse
import asyncio
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
from tests.components.driver import Component  # noqa: E402
from tests.redis_server import RedisServer  # noqa: E402


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def idle_cpu(folder: Path, port: int, subscriptions: int, seconds: float, policy: bool) -> float:
    """CPU ms per second of this process while `subscriptions` streams stay open and idle."""
    sock = folder / f"idle-{int(policy)}.sock"
    server = ComponentServer(sock, SystemClock())
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"unix://{sock}") as channel:
            component = Component(channel, "bench")
            props = {"redisHost": f"127.0.0.1:{port}", "consumerID": f"idle-{int(policy)}"}
            if policy:
                props["retryInitialInterval"] = "1s"
            await component.init(props)
            streams = [await component.subscribe(f"t{i}") for i in range(subscriptions)]
            await asyncio.sleep(2.0)  # past the streams' start-up
            start = cpu_s()
            await asyncio.sleep(seconds)
            used = cpu_s() - start
            for stream in streams:
                await stream.cancel()
            return used / seconds * 1000
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
                plain = await idle_cpu(Path(d), redis_server.port, args.subscriptions, args.seconds, False)
                polled = await idle_cpu(Path(d), redis_server.port, args.subscriptions, args.seconds, True)
                print(
                    f"round {n}, {args.subscriptions} idle subscriptions: no policy {plain:.2f} ms CPU/s, "
                    f"retry policy {polled:.2f} ms CPU/s (ratio {polled / plain:.2f}; "
                    f"{(polled - plain) / args.subscriptions * 1000:.0f} µs CPU/s per poller)",
                    flush=True,
                )
        finally:
            redis_server.stop()


if __name__ == "__main__":
    asyncio.run(main())
