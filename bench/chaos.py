"""kill -9 cycles under a firing backlog: the delayed-message promise at scale.

A private redis-server with AOF `appendfsync always`; two `delayed-pubsub serve`
replicas (each on its own unix socket, Init'ed as daprd would) share one
consumerID. N delayed messages, each with a unique body, are scheduled through
BulkPublish with due times spread over a window; while they fire, a random
replica is killed with SIGKILL at a random moment, restarted and re-Init'ed,
for C cycles. At the end every target entry is counted:

  lost    = scheduled - distinct bodies that landed on the target stream
  doubled = entries landed - distinct bodies (a message fired twice)

Both must be 0. Also reported: the time from the last due time until all had
landed, and the lateness (entry id ms - due ms) p50/p99/max.

With --subscribe (default), each replica also serves one PullMessages stream
on the target topic, acking every message, as daprd would; a killed replica's
stream dies with it and is re-opened after the restart. Subscriber duplicates
(a message delivered again because its ack was lost with the process, or it
sat unacked past processingTimeout) are counted, not failed; a message never
delivered is a failure.

    .venv/bin/python bench/chaos.py [--messages 100000] [--cycles 20] [--window 60]
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import random
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc
import redis

ROOT = Path(__file__).resolve().parents[1]
for sub in ("proto", "middleware", "components", "."):
    sys.path.insert(0, str(ROOT / sub))

from bench.common import start_serve  # noqa: E402
from delayed_middleware.instants import format_instant  # noqa: E402
from delayed_pubsub_pb.dapr.proto.components.v1 import common_pb2, pubsub_pb2, pubsub_pb2_grpc  # noqa: E402
from tests.redis_server import RedisServer  # noqa: E402

TOPIC = "orders"
CHUNK = 1000


class Replica:
    """One `serve` process and its stub; `kill()` is SIGKILL, `start()` starts and re-Inits it."""

    def __init__(self, name: str, folder: Path, props: dict[str, str]) -> None:
        self.name = name
        self.socket = folder / f"{name}.sock"
        self.log = folder / f"{name}.log"
        self.props = props
        self.proc: Any = None
        self.md = (("x-component-instance", "chaos"),)
        self.subscriber: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self.socket.unlink(missing_ok=True)
        self.proc = await asyncio.to_thread(start_serve, self.socket, self.log)
        async with grpc.aio.insecure_channel(f"unix://{self.socket}") as ch:
            stub = pubsub_pb2_grpc.PubSubStub(ch)  # type: ignore[no-untyped-call]
            await stub.Init(
                pubsub_pb2.PubSubInitRequest(metadata=common_pb2.MetadataRequest(properties=self.props)),
                metadata=self.md,
                timeout=60,
            )

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        if self.subscriber is not None:
            self.subscriber.cancel()

    def subscribe(self, delivered: list[str]) -> None:
        """Open one PullMessages stream on the target topic; every message is recorded and acked."""
        self.subscriber = asyncio.create_task(self._pull(delivered))

    async def _pull(self, delivered: list[str]) -> None:
        try:
            async with grpc.aio.insecure_channel(f"unix://{self.socket}") as ch:
                stub = pubsub_pb2_grpc.PubSubStub(ch)  # type: ignore[no-untyped-call]
                call = stub.PullMessages(metadata=self.md)
                await call.write(pubsub_pb2.PullMessagesRequest(topic=pubsub_pb2.Topic(name=TOPIC)))
                while True:
                    msg = await call.read()
                    if msg is grpc.aio.EOF:  # type: ignore[attr-defined]
                        return
                    delivered.append(msg.data.decode())
                    await call.write(pubsub_pb2.PullMessagesRequest(ack_message_id=msg.id))
        except (grpc.aio.AioRpcError, asyncio.CancelledError):
            return  # the replica died; a new stream opens after its restart

    def stop(self) -> None:
        if self.subscriber is not None:
            self.subscriber.cancel()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


async def schedule(replica: Replica, n: int, start_ms: int, window_ms: int) -> dict[str, int]:
    """Schedule n messages through BulkPublish, each its own envelope; returns body -> due ms."""
    due: dict[str, int] = {}
    async with grpc.aio.insecure_channel(f"unix://{replica.socket}") as ch:
        stub = pubsub_pb2_grpc.PubSubStub(ch)  # type: ignore[no-untyped-call]
        for first in range(0, n, CHUNK):
            entries = []
            for i in range(first, min(n, first + CHUNK)):
                body = f"m{i}"
                due_ms = start_ms + (i * window_ms) // n
                due[body] = due_ms
                entries.append(
                    pubsub_pb2.BulkMessageEntry(
                        entry_id=str(i),
                        event=body.encode(),
                        metadata={"scheduledSendTime": format_instant(due_ms)},
                    )
                )
            reply = await stub.BulkPublish(
                pubsub_pb2.BulkPublishRequest(entries=entries, pubsub_name="chaos", topic=TOPIC),
                metadata=replica.md,
                timeout=120,
            )
            if reply.failed_entries:
                raise SystemExit(
                    f"{len(reply.failed_entries)} entries refused: {reply.failed_entries[0].error}"
                )
    return due


def landed(admin: redis.Redis) -> list[tuple[int, str]]:
    """(entry ms, body) of every entry on the target stream."""
    out: list[tuple[int, str]] = []
    last = "-"
    while True:
        batch: Any = admin.xrange(TOPIC, min=last, max="+", count=10_000)
        if last != "-":
            batch = batch[1:]
        if not batch:
            return out
        for raw_id, fields in batch:
            out.append((int(raw_id.split(b"-")[0]), fields[b"data"].decode()))
        last = batch[-1][0].decode()


async def run(args: argparse.Namespace) -> None:
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="dps-chaos-") as d:
        folder = Path(d)
        server = RedisServer(folder / "redis", extra_args=["--appendfsync", "always"])
        server.start()
        admin = server.client()
        props = {
            "redisHost": server.address,
            "consumerID": "app1",
            "enableDelayedMessaging": "true",
            # A dead stream's unacked messages come back within seconds.
            "processingTimeout": "5s",
            "redeliverInterval": "1s",
        }
        replicas = [Replica(name, folder, props) for name in ("a", "b")]
        delivered: list[str] = []
        try:
            await asyncio.gather(*(r.start() for r in replicas))
            if args.subscribe:
                for r in replicas:
                    r.subscribe(delivered)
            start_ms = int(time.time() * 1000) + args.lead * 1000
            t0 = time.monotonic()
            due = await schedule(replicas[0], args.messages, start_ms, args.window * 1000)
            print(
                f"scheduled {len(due)} in {time.monotonic() - t0:.1f}s; first due in "
                f"{(start_ms - time.time() * 1000) / 1000:.1f}s, window {args.window}s"
            )
            last_due_ms = max(due.values())
            # Kills spread over the firing window, at random moments.
            span = (last_due_ms - time.time() * 1000) / 1000
            moments = sorted(rng.uniform(0, max(span, 1.0)) for _ in range(args.cycles))
            began = time.monotonic()
            for k, at in enumerate(moments, 1):
                await asyncio.sleep(max(0.0, at - (time.monotonic() - began)))
                victim = rng.choice(replicas)
                victim.kill()
                await victim.start()
                if args.subscribe:
                    victim.subscribe(delivered)
                print(f"cycle {k}: killed and restarted {victim.name}; landed so far {admin.xlen(TOPIC)}")
            for _ in range(args.settle * 2):  # bounded: at most --settle seconds
                if admin.xlen(TOPIC) >= len(due):
                    break
                await asyncio.sleep(0.5)
            all_landed_s = time.time() - last_due_ms / 1000
            all_delivered_s = 0.0
            if args.subscribe:
                for _ in range(args.settle * 10):
                    if len(set(delivered)) >= len(due):
                        break
                    await asyncio.sleep(0.1)
                all_delivered_s = time.time() - last_due_ms / 1000
            # Anything fired twice would land by now, and anything redelivered
            # after processingTimeout (5 s) would arrive.
            await asyncio.sleep(7.0)
            entries = landed(admin)
        finally:
            for r in replicas:
                r.stop()
            admin.close()
            server.stop(kill=True)

    bodies = [b for _, b in entries]
    distinct = set(bodies)
    lost = len(due) - len(distinct & set(due))
    doubled = len(bodies) - len(distinct)
    lateness = sorted(ms - due[b] for ms, b in entries if b in due)
    q = statistics.quantiles(lateness, n=100) if len(lateness) > 1 else [0] * 99
    print()
    print(f"machine: {platform.node()}, {platform.machine()}, date {datetime.now(UTC):%Y-%m-%d %H:%M} UTC")
    print(f"messages {len(due)}, kill -9 cycles {args.cycles}, replicas 2, window {args.window}s")
    print(f"lost {lost}, doubled {doubled}, landed {len(bodies)}")
    print(f"all landed {all_landed_s:.1f}s after the last due time")
    print(f"lateness ms: p50 {q[49]:.0f}, p99 {q[98]:.0f}, max {lateness[-1] if lateness else 0}")
    failed = bool(lost or doubled)
    if args.subscribe:
        never = len(set(due) - set(delivered))
        again = len(delivered) - len(set(delivered))
        print(
            f"subscribers: delivered {len(delivered)}, never delivered {never}, "
            f"delivered again (lost acks / past processingTimeout) {again}, "
            f"all delivered {all_delivered_s:.1f}s after the last due time"
        )
        failed = failed or bool(never)
    if failed:
        raise SystemExit(1)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--messages", type=int, default=100_000, help="delayed messages scheduled")
    parser.add_argument("--cycles", type=int, default=20, help="kill -9 + restart cycles")
    parser.add_argument("--window", type=int, default=60, help="seconds over which due times are spread")
    parser.add_argument(
        "--lead", type=int, default=30, help="seconds from the start of scheduling to the first due"
    )
    parser.add_argument("--settle", type=int, default=120, help="seconds to wait for the last fires")
    parser.add_argument("--seed", type=int, default=12)
    parser.add_argument(
        "--subscribe",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="a PullMessages stream per replica, counting subscriber duplicates",
    )
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
