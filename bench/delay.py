"""Delay-engine benchmarks through the real component process.

A private redis-server (AOF off, as a throughput figure should be), one
`delayed-pubsub serve` process on a unix socket driven over gRPC as daprd
drives it, and these measurements:
  - lateness (landed - due) p50/p99/max at a steady 1,000 fires/s;
  - a burst of N messages due at the same instant: time to drain, p99;
  - delayed ingest (unary and bulk) against plain ingest in the same run;
  - M pending: Redis bytes per pending message, component RSS, start-up time.

Lateness is read from the target stream's entry ids, which Redis stamps with
its own clock in ms when the fire script appends the entry (same machine, same
clock as the publisher).

    .venv/bin/python bench/delay.py [--steady-seconds 10] [--burst 100000] [--pending 1000000]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import cast

import grpc
import redis

ROOT = Path(__file__).resolve().parents[1]
for sub in ("proto", "middleware", "components", "."):
    sys.path.insert(0, str(ROOT / sub))

from bench.common import MD, PAYLOAD, start_serve, stop  # noqa: E402
from delayed_middleware.instants import format_instant  # noqa: E402
from delayed_pubsub_pb.dapr.proto.components.v1 import common_pb2, pubsub_pb2, pubsub_pb2_grpc  # noqa: E402
from tests.redis_server import RedisServer  # noqa: E402

SMALL = b'{"orderId":66}'


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def pct(values: list[int], p: float) -> int:
    s = sorted(values)
    return s[min(len(s) - 1, round(p / 100 * (len(s) - 1)))]


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


class Serve:
    def __init__(self, folder: Path) -> None:
        self.socket = folder / "delayed-pubsub.sock"
        t0 = time.perf_counter()
        self.proc = start_serve(self.socket, folder / "serve.log")
        self.socket_ready_s = time.perf_counter() - t0

    def stop(self) -> None:
        stop(self.proc)
        self.socket.unlink(missing_ok=True)


HISTORY_MAX_LEN: list[str] = []  # --history-max-len, when given


async def init(stub: pubsub_pb2_grpc.PubSubStub, port: int) -> float:
    t0 = time.perf_counter()
    await stub.Init(
        pubsub_pb2.PubSubInitRequest(
            metadata=common_pb2.MetadataRequest(
                properties={
                    "redisHost": f"127.0.0.1:{port}",
                    "consumerID": "bench",
                    "enableDelayedMessaging": "true",
                    **({"historyMaxLen": HISTORY_MAX_LEN[0]} if HISTORY_MAX_LEN else {}),
                }
            )
        ),
        metadata=MD,
    )
    return time.perf_counter() - t0


async def bulk_schedule(
    stub: pubsub_pb2_grpc.PubSubStub,
    topic: str,
    dues: list[int],
    payload: bytes,
    batch: int = 1000,
    callers: int = 2,
) -> float:
    """Publish one delayed message per due time (each its own envelope); returns msg/s."""
    chunks = [dues[i : i + batch] for i in range(0, len(dues), batch)]
    queue = list(reversed(chunks))

    async def caller() -> None:
        while queue:
            chunk = queue.pop()
            req = pubsub_pb2.BulkPublishRequest(
                pubsub_name="bench",
                topic=topic,
                entries=[
                    pubsub_pb2.BulkMessageEntry(
                        entry_id=str(i), event=payload, metadata={"scheduledSendTime": format_instant(d)}
                    )
                    for i, d in enumerate(chunk)
                ],
            )
            reply = await stub.BulkPublish(req, metadata=MD)
            assert not reply.failed_entries, reply.failed_entries[:3]

    t0 = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(callers)))
    return len(dues) / (time.perf_counter() - t0)


def landed(client: redis.Redis, topic: str, count: int, timeout_s: float) -> list[tuple[int, bytes]]:
    """(landing ms, data) of every entry on `topic`, once `count` have landed."""
    deadline = time.monotonic() + timeout_s
    while client.xlen(topic) < count:
        if time.monotonic() > deadline:
            raise SystemExit(f"{topic}: only {client.xlen(topic)} of {count} landed in {timeout_s}s")
        time.sleep(0.05)
    out: list[tuple[int, bytes]] = []
    last = "-"
    while True:
        page = cast("list[tuple[bytes, dict[bytes, bytes]]]", client.xrange(topic, min=last, count=10_000))
        if last != "-":
            page = page[1:]
        if not page:
            return out
        for eid, fields in page:
            out.append((int(eid.split(b"-")[0]), fields[b"data"]))
        last = page[-1][0].decode()


async def steady(stub: pubsub_pb2_grpc.PubSubStub, client: redis.Redis, seconds: int) -> dict[str, int]:
    n = seconds * 1000
    start = now_ms() + 3000 + seconds * 100  # after the publishing is done
    dues = [start + i for i in range(n)]
    # The due time rides in the payload so lateness needs no bookkeeping here.
    chunks = [dues[i : i + 1000] for i in range(0, n, 1000)]
    for chunk in chunks:
        req = pubsub_pb2.BulkPublishRequest(
            pubsub_name="bench",
            topic="steady",
            entries=[
                pubsub_pb2.BulkMessageEntry(
                    entry_id=str(d), event=str(d).encode(), metadata={"scheduledSendTime": format_instant(d)}
                )
                for d in chunk
            ],
        )
        await stub.BulkPublish(req, metadata=MD)
    assert now_ms() < start, "publishing took longer than the lead time"
    rows = landed(client, "steady", n, timeout_s=seconds + 30)
    late = [ms - int(data) for ms, data in rows]
    assert min(late) >= 0, f"a message landed {-min(late)} ms early"
    return {"n": n, "p50": pct(late, 50), "p99": pct(late, 99), "max": max(late)}


async def burst(stub: pubsub_pb2_grpc.PubSubStub, client: redis.Redis, n: int) -> dict[str, float]:
    lead_ms = 5000 + n // 20
    due = now_ms() + lead_ms
    ingest = await bulk_schedule(stub, "burst", [due] * n, SMALL)
    assert now_ms() < due, "publishing took longer than the lead time"
    # Every command slower than 1 ms while the burst fires: no script may hold
    # Redis for more than ~20 ms (engine v2's fire budget).
    client.config_set("slowlog-log-slower-than", 1000)
    client.config_set("slowlog-max-len", 100_000)
    client.slowlog_reset()
    rows = landed(client, "burst", n, timeout_s=60)
    slow = [int(e["duration"]) for e in client.slowlog_get(100_000)]
    client.config_set("slowlog-log-slower-than", 10_000)
    late = [ms - due for ms, _ in rows]
    assert min(late) >= 0
    history = client.xlen("{bench-delayed}:history")
    return {
        "n": n,
        "ingest_per_s": ingest,
        "drain_ms": max(late),
        "p50": pct(late, 50),
        "p99": pct(late, 99),
        "slowest_command_us": max(slow, default=0),
        "commands_over_20ms": sum(1 for us in slow if us > 20_000),
        "history_entries": history,
    }


async def ingest(stub: pubsub_pb2_grpc.PubSubStub, n: int, callers: int) -> dict[str, float]:
    async def unary(md: dict[str, str], topic: str) -> float:
        per = n // callers
        req = pubsub_pb2.PublishRequest(data=PAYLOAD, pubsub_name="bench", topic=topic, metadata=md)

        async def caller() -> None:
            for _ in range(per):
                await stub.Publish(req, metadata=MD)

        t0 = time.perf_counter()
        await asyncio.gather(*(caller() for _ in range(callers)))
        return per * callers / (time.perf_counter() - t0)

    async def bulk(md: dict[str, str], topic: str) -> float:
        req = pubsub_pb2.BulkPublishRequest(
            pubsub_name="bench",
            topic=topic,
            metadata=md,
            entries=[pubsub_pb2.BulkMessageEntry(entry_id=str(i), event=PAYLOAD) for i in range(1000)],
        )
        t0 = time.perf_counter()
        for _ in range(n * 5 // 1000):
            await stub.BulkPublish(req, metadata=MD)
        return n * 5 / (time.perf_counter() - t0)

    far = {"scheduledSendDelay": "1h"}
    return {
        "unary_plain": await unary({}, "plain"),
        "unary_delayed": await unary(far, "ingest"),
        # Request-level delay: the bulk is one envelope (fires as one batch).
        "bulk_plain": await bulk({}, "plain"),
        "bulk_delayed_one_envelope": await bulk(far, "ingest"),
        # Entry-level delays: one envelope per message, the costly case.
        "bulk_delayed_per_entry": await bulk_schedule(
            stub, "ingest2", [now_ms() + 3_600_000] * (n * 5), PAYLOAD
        ),
    }


async def pending(folder: Path, redis_server: RedisServer, m: int) -> dict[str, float]:
    client = redis_server.client()
    client.flushall()
    base = int(client.info("memory")["used_memory"])
    serve = Serve(folder)
    try:
        async with grpc.aio.insecure_channel(f"unix://{serve.socket}") as ch:
            stub = pubsub_pb2_grpc.PubSubStub(ch)  # type: ignore[no-untyped-call]
            await init(stub, redis_server.port)
            rss0 = rss_kib(serve.proc.pid)
            far = now_ms() + 86_400_000
            rate = await bulk_schedule(stub, "pending", [far + i for i in range(m)], PAYLOAD, batch=2000)
            await asyncio.sleep(1)
            rss1 = rss_kib(serve.proc.pid)
        used = int(client.info("memory")["used_memory"]) - base
        assert int(client.get("{bench-delayed}:pending") or 0) == m
    finally:
        serve.stop()
    # Start-up with M pending: process start to socket, Init, then one due fire.
    t0 = time.perf_counter()
    serve = Serve(folder)
    try:
        async with grpc.aio.insecure_channel(f"unix://{serve.socket}") as ch:
            stub = pubsub_pb2_grpc.PubSubStub(ch)  # type: ignore[no-untyped-call]
            init_s = await init(stub, redis_server.port)
            ready_s = time.perf_counter() - t0
            await stub.Publish(
                pubsub_pb2.PublishRequest(
                    data=b"x", pubsub_name="bench", topic="probe", metadata={"scheduledSendDelay": "0s"}
                ),
                metadata=MD,
            )
            landed(client, "probe", 1, timeout_s=10)
            first_fire_s = time.perf_counter() - t0
            rss2 = rss_kib(serve.proc.pid)
    finally:
        serve.stop()
    return {
        "m": m,
        "ingest_per_s": rate,
        "payload_b": len(PAYLOAD),
        "redis_b_per_msg": used / m,
        "overhead_b_per_msg": used / m - len(PAYLOAD),
        "rss_idle_mib": rss0 / 1024,
        "rss_after_ingest_mib": rss1 / 1024,
        "rss_restart_with_pending_mib": rss2 / 1024,
        "startup_socket_s": serve.socket_ready_s,
        "startup_init_s": init_s,
        "startup_ready_s": ready_s,
        "startup_first_fire_s": first_fire_s,
    }


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steady-seconds", type=int, default=10)
    ap.add_argument("--burst", type=int, default=100_000)
    ap.add_argument("--ingest", type=int, default=20_000)
    ap.add_argument("--callers", type=int, default=64)
    ap.add_argument("--pending", type=int, default=1_000_000)
    ap.add_argument("--history-max-len", default=None, help="the component's historyMaxLen (0 = no history)")
    args = ap.parse_args()
    if args.history_max_len is not None:
        HISTORY_MAX_LEN.append(args.history_max_len)
    print(
        f"# {datetime.now(UTC):%Y-%m-%d %H:%M UTC} on {platform.node()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}, load {os.getloadavg()[0]:.1f}"
    )
    with tempfile.TemporaryDirectory(prefix="dpsb-") as d:
        folder = Path(d)
        redis_server = RedisServer(folder / "redis", appendonly=False)
        redis_server.start()
        try:
            client = redis_server.client()
            serve = Serve(folder)
            try:
                async with grpc.aio.insecure_channel(f"unix://{serve.socket}") as ch:
                    stub = pubsub_pb2_grpc.PubSubStub(ch)  # type: ignore[no-untyped-call]
                    await init(stub, redis_server.port)
                    print("steady 1k fires/s:", await steady(stub, client, args.steady_seconds), flush=True)
                    client.delete("steady")
                    print("burst:", await burst(stub, client, args.burst), flush=True)
                    client.delete("burst")
                    print(
                        "ingest:",
                        {k: round(v) for k, v in (await ingest(stub, args.ingest, args.callers)).items()},
                        flush=True,
                    )
            finally:
                serve.stop()
            if args.pending:
                res = await pending(folder, redis_server, args.pending)
                print(
                    "pending:",
                    {k: round(v, 3) if isinstance(v, float) else v for k, v in res.items()},
                    flush=True,
                )
        finally:
            redis_server.stop()


if __name__ == "__main__":
    asyncio.run(main())
