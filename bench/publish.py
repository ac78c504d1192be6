"""Publish benchmarks through the real gRPC server over its unix socket.

Starts a private redis-server and `delayed-pubsub serve` (a separate process, as
beside daprd), then measures:
  - unary Publish throughput with N concurrent callers,
  - BulkPublish throughput for a few batch sizes,
  - end-to-end publish -> PullMessages -> ack rate on one stream,
and runs redis-benchmark XADD on the same Redis as the ceiling, printing ratios.

    .venv/bin/python bench/publish.py [--messages 20000] [--callers 64]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parents[1]
for sub in ("proto", "middleware", "components", "."):
    sys.path.insert(0, str(ROOT / sub))

from bench.common import MD, PAYLOAD, start_serve, stop  # noqa: E402
from delayed_pubsub_pb.dapr.proto.components.v1 import (  # noqa: E402
    common_pb2,
    pubsub_pb2,
    pubsub_pb2_grpc,
)
from tests.redis_server import RedisServer  # noqa: E402


def redis_benchmark(port: int, clients: int, requests: int, pipeline: int) -> float:
    """XADD requests/s from redis-benchmark, the ceiling any figure here is judged against."""
    exe = shutil.which("redis-benchmark")
    if exe is None:
        raise SystemExit("redis-benchmark not found (apt-get install redis-tools)")
    out = subprocess.run(
        [
            exe,
            "-p",
            str(port),
            "-c",
            str(clients),
            "-n",
            str(requests),
            "-P",
            str(pipeline),
            "-q",
            "XADD",
            "bench-ceiling",
            "*",
            "data",
            PAYLOAD.decode(),
            "metadata",
            "{}",
        ],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    # -q prints progress lines separated by \r; the final figure is the last one.
    matches = re.findall(r"([\d.]+) requests per second", out)
    if not matches:
        raise SystemExit(f"cannot parse redis-benchmark output: {out!r}")
    return float(matches[-1])


async def bench_unary(stub: pubsub_pb2_grpc.PubSubStub, total: int, callers: int, topic: str) -> float:
    per_caller = total // callers
    req = pubsub_pb2.PublishRequest(data=PAYLOAD, pubsub_name="delayed", topic=topic)

    async def caller() -> None:
        for _ in range(per_caller):
            await stub.Publish(req, metadata=MD)

    start = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(callers)))
    return per_caller * callers / (time.perf_counter() - start)


async def bench_features(stub: pubsub_pb2_grpc.PubSubStub, total: int, callers: int) -> float:
    """Unary calls that touch no Redis: the grpc.aio ceiling for unary Publish on this machine."""
    per_caller = total // callers

    async def caller() -> None:
        for _ in range(per_caller):
            await stub.Features(common_pb2.FeaturesRequest(), metadata=MD)

    start = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(callers)))
    return per_caller * callers / (time.perf_counter() - start)


async def bench_bulk(
    stub: pubsub_pb2_grpc.PubSubStub, total: int, batch: int, callers: int, topic: str
) -> float:
    req = pubsub_pb2.BulkPublishRequest(
        entries=[pubsub_pb2.BulkMessageEntry(entry_id=str(i), event=PAYLOAD) for i in range(batch)],
        pubsub_name="delayed",
        topic=topic,
    )
    batches = max(callers, total // batch)
    per_caller = batches // callers

    async def caller() -> None:
        for _ in range(per_caller):
            reply = await stub.BulkPublish(req, metadata=MD)
            assert not reply.failed_entries

    start = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(callers)))
    return per_caller * callers * batch / (time.perf_counter() - start)


async def bench_e2e(stub: pubsub_pb2_grpc.PubSubStub, total: int, topic: str) -> float:
    """Bulk-publish while one stream receives and acks each message as it arrives."""
    call = stub.PullMessages(metadata=MD)
    await call.write(pubsub_pb2.PullMessagesRequest(topic=pubsub_pb2.Topic(name=topic)))
    batch = 500
    req = pubsub_pb2.BulkPublishRequest(
        entries=[pubsub_pb2.BulkMessageEntry(entry_id=str(i), event=PAYLOAD) for i in range(batch)],
        pubsub_name="delayed",
        topic=topic,
    )
    total = total // batch * batch

    async def publisher() -> None:
        for _ in range(total // batch):
            await stub.BulkPublish(req, metadata=MD)

    start = time.perf_counter()
    pub = asyncio.create_task(publisher())
    for _ in range(total):
        msg = await call.read()
        await call.write(pubsub_pb2.PullMessagesRequest(ack_message_id=msg.id))
    elapsed = time.perf_counter() - start
    await pub
    await call.done_writing()
    return total / elapsed


async def measure(args: argparse.Namespace, socket_path: Path, redis_port: int) -> dict[str, float]:
    results: dict[str, float] = {}
    async with grpc.aio.insecure_channel(f"unix://{socket_path}") as channel:
        stub = pubsub_pb2_grpc.PubSubStub(channel)  # type: ignore[no-untyped-call]
        await stub.Init(
            pubsub_pb2.PubSubInitRequest(
                metadata=common_pb2.MetadataRequest(
                    properties={
                        "redisHost": f"127.0.0.1:{redis_port}",
                        "consumerID": "bench",
                        "concurrency": str(args.concurrency),
                        "queueDepth": str(args.queue_depth),
                    }
                )
            ),
            metadata=MD,
        )
        # Warm up connections and code paths.
        await bench_unary(stub, 1000, 10, "warmup")
        results[f"unary Features (no Redis; gRPC ceiling), {args.callers} callers"] = await bench_features(
            stub, args.messages, args.callers
        )
        results[f"unary Publish, {args.callers} callers"] = await bench_unary(
            stub, args.messages, args.callers, "unary"
        )
        for batch in (100, 1000):
            results[f"BulkPublish, batches of {batch}, {args.bulk_callers} callers"] = await bench_bulk(
                stub, args.messages * 5, batch, args.bulk_callers, f"bulk{batch}"
            )
        results[f"publish->PullMessages->ack, 1 stream, concurrency {args.concurrency}"] = await bench_e2e(
            stub, args.messages, "e2e"
        )
    return results


def run(args: argparse.Namespace) -> None:
    workdir = Path(tempfile.mkdtemp(prefix="dps-bench-"))
    redis_server = RedisServer(workdir / "redis", appendonly=False)
    redis_server.start()
    socket_path = workdir / "delayed-pubsub.sock"
    serve = start_serve(socket_path, workdir / "serve.log")
    try:
        results = asyncio.run(measure(args, socket_path, redis_server.port))
        ceiling = redis_benchmark(redis_server.port, 50, 200_000, 1)
        ceiling_pipelined = redis_benchmark(redis_server.port, 50, 1_000_000, 50)
    finally:
        stop(serve)
        redis_server.stop()
        shutil.rmtree(workdir, ignore_errors=True)

    print(
        f"machine: {platform.node()}, nproc {os.cpu_count()}, Python {platform.python_version()}, "
        f"grpcio {grpc.__version__}"
    )
    print(f"redis-benchmark -c 50 -n 200000 XADD (unpipelined):  {ceiling:>10,.0f} msg/s")
    print(f"redis-benchmark -c 50 -n 1000000 -P 50 XADD (pipelined): {ceiling_pipelined:>10,.0f} msg/s")
    print()
    print(f"{'measurement':<64} {'msg/s':>10} {'vs XADD':>8} {'vs XADD -P50':>13}")
    for name, rate in results.items():
        print(f"{name:<64} {rate:>10,.0f} {rate / ceiling:>8.2f} {rate / ceiling_pipelined:>13.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--messages", type=int, default=20_000, help="messages per unary / e2e run (bulk: x5)"
    )
    parser.add_argument("--callers", type=int, default=64, help="concurrent unary Publish callers")
    parser.add_argument("--bulk-callers", type=int, default=4, help="concurrent BulkPublish callers")
    parser.add_argument(
        "--concurrency", type=int, default=100, help="component `concurrency` for the e2e run"
    )
    parser.add_argument("--queue-depth", type=int, default=100, help="component `queueDepth`")
    run(parser.parse_args())


if __name__ == "__main__":
    main()
