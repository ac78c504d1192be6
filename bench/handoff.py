"""Hand-offs per second through one forwarder, to a sidecar stand-in that accepts every call at once.

    .venv/bin/python bench/handoff.py [--handoffs 3000] [--runs 3]

The outbox of one app is filled with `--handoffs` entries (fired messages due for another
pubsub through daprd), then one Forwarder hands them to a gRPC server posing as daprd's runtime
API (`PublishEvent` answered at once, on a unix socket). Figures per run: wall time from the
forwarder's start to an empty outbox, hand-offs per second, and this process's CPU per
hand-off (the forwarder and the stand-in share it; the stand-in's share is the same on any
tree). Every entry must be handed off exactly once: the stand-in counts its calls per id.

For a before/after, run the same command with PYTHONPATH naming the other tree's
proto:middleware:components (the Forwarder's constructor is the same on both).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# The packages come from the venv (this tree) or PYTHONPATH (another tree); tests/ from here.
sys.path.append(str(ROOT))

import grpc  # noqa: E402
import redis  # noqa: E402
import redis.asyncio as aioredis  # noqa: E402
from dapr.proto.runtime.v1 import dapr_pb2_grpc  # noqa: E402
from google.protobuf import empty_pb2  # noqa: E402

from delayed_middleware.clock import SystemClock  # noqa: E402
from delayed_middleware.keys import EngineKeys, delayed_topic  # noqa: E402
from delayed_middleware.outbox import OutboxEntry, encode_outbox_entry  # noqa: E402
from delayed_pubsub.forwarder import Forwarder, ForwarderConfig  # noqa: E402
from tests.redis_server import RedisServer  # noqa: E402

PAYLOAD = b'{"specversion":"1.0","type":"com.example.order","data":{"n":1}}'


class AcceptAtOnce(dapr_pb2_grpc.DaprServicer):
    """daprd's runtime API as far as a hand-off uses it: every PublishEvent accepted at once."""

    def __init__(self, expected: int) -> None:
        self.calls: collections.Counter[str] = collections.Counter()
        self.expected = expected
        self.all_in = asyncio.Event()

    async def PublishEvent(self, request: Any, context: Any) -> empty_pb2.Empty:
        self.calls[request.data.decode()] += 1
        if len(self.calls) >= self.expected:
            self.all_in.set()
        return empty_pb2.Empty()


async def one_run(port: int, folder: Path, n: int, run: int) -> dict[str, float]:
    keys = EngineKeys.for_topic(delayed_topic(f"bench{run}"))
    filler = redis.Redis(host="127.0.0.1", port=port)
    for start in range(0, n, 1000):
        pipe = filler.pipeline(transaction=False)
        for i in range(start, min(n, start + 1000)):
            body = PAYLOAD[:-2] + b',"id":%d}}' % i
            pipe.xadd(keys.outbox, encode_outbox_entry(OutboxEntry("kafka", "orders", body, id=f"h{i}")))  # type: ignore[arg-type]
        pipe.execute()
    sidecar = AcceptAtOnce(n)
    server = grpc.aio.server()
    dapr_pb2_grpc.add_DaprServicer_to_server(sidecar, server)  # type: ignore[no-untyped-call]
    socket = folder / f"dapr-{run}.sock"
    server.add_insecure_port(f"unix://{socket}")
    await server.start()
    client = aioredis.Redis(host="127.0.0.1", port=port)
    forwarder = Forwarder(client, keys, SystemClock(), ForwarderConfig(address=f"unix://{socket}"), name="bench")
    cpu, wall = time.process_time(), time.perf_counter()
    forwarder.start()
    await sidecar.all_in.wait()
    # Then until each accepted hand-off is settled (acked, deleted, its history written).
    while filler.xlen(keys.outbox) > 0:  # noqa: ASYNC110 - Redis has no event for it
        await asyncio.sleep(0.005)
    wall = time.perf_counter() - wall
    cpu = time.process_time() - cpu
    await forwarder.close()
    await server.stop(0)
    await client.aclose()
    filler.close()
    assert len(sidecar.calls) == n, f"{len(sidecar.calls)} of {n} handed off"
    twice = sum(1 for c in sidecar.calls.values() if c > 1)
    assert twice == 0, f"{twice} handed off more than once"
    return {"wall_s": wall, "per_s": n / wall, "cpu_us": cpu / n * 1e6}


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--handoffs", type=int, default=3000)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="bench-handoff-"))
    server = RedisServer(folder / "redis")
    server.start()
    try:
        for run in range(args.runs):
            r = await one_run(server.port, folder, args.handoffs, run)
            print(
                f"run {run + 1}: {args.handoffs} hand-offs in {r['wall_s']:.2f} s = {r['per_s']:.0f}/s, "
                f"{r['cpu_us']:.0f} µs CPU per hand-off (forwarder + stand-in), each once"
            )
    finally:
        server.stop()


if __name__ == "__main__":
    asyncio.run(main())
