"""Schedule benchmarks through the real component process, over its gRPC socket as daprd drives it.

A private redis-server (AOF off), one `delayed-pubsub serve` process on a unix socket, and:

  - recurring: N (10,000) active `@every 1s` schedules in one instance, each with its own
    scheduleId, all on one topic. Over a measuring window: fire lateness p50/p99/max, fires/s,
    exactly-once (no (schedule, due) pair twice, no gap in any schedule's 1 s grid), and the CPU
    of `serve` (and of redis-server) as a share of one core. Each produced entry says when it was
    due: its `scheduleNext` metadata (the public contract) is the next due instant, one interval
    after its own; its landing time is the entry id Redis stamps when the fire script appends it
    (same machine, same clock). `--cron` runs `* * * * * *` instead: all N due at the same whole
    second, the burst case.
  - peer, same run: the same fire rate from one-shot delayed messages (scheduledSendTime), so the
    recurring path is judged against the one-shot path on the same machine and load.
  - cancels: M (100,000) pending one-shots (scheduleId, due `--cancel-lead` s ahead) cancelled
    with `scheduleCancel=true`, per second: unary (64 callers) against unary delayed publishes
    in the same run, and BulkPublish (entries of 1,000) against bulk delayed publishes. Then the
    due time passes and the target topic must stay empty: nothing cancelled is delivered.

  - zoned: N (100,000) `*/30 * * * * *` schedules in four time zones with `scheduleJitter` 20s,
    firing for a window (120 s), then, in the same run, the same N in UTC without jitter. For each:
    lateness against each fire's own (jittered) due time -- the `scheduleNext` its schedule's
    previous fire named -- and the CPU of `serve` and of redis-server per fired occurrence.

    .venv/bin/python bench/schedules.py [--schedules 10000] [--window 20] [--cron] [--spread] [--cancels 100000]
    .venv/bin/python bench/schedules.py --schedules 0 --cancels 100000 --cancel-lead 60   # cancels alone
    .venv/bin/python bench/schedules.py --schedules 0 --cancels 0 --zoned 100000 --zoned-window 120

Machine note for bench/RESULTS.md: 2 cores shared with other agents' work; quote ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import platform
import sys
import tempfile
import time
from collections import defaultdict
from datetime import UTC, datetime
from pathlib import Path
from typing import cast

import grpc
import redis

ROOT = Path(__file__).resolve().parents[1]
for sub in ("proto", "middleware", "components", "."):
    sys.path.insert(0, str(ROOT / sub))

from bench.common import MD, start_serve, stop  # noqa: E402
from delayed_middleware.instants import format_instant, parse_instant  # noqa: E402
from delayed_pubsub_pb.dapr.proto.components.v1 import common_pb2, pubsub_pb2, pubsub_pb2_grpc  # noqa: E402
from tests.redis_server import RedisServer  # noqa: E402

Stub = pubsub_pb2_grpc.PubSubStub
TICK = b'{"tick":1}'
CLK_TCK = os.sysconf("SC_CLK_TCK")


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def pct(values: list[int], p: float) -> int:
    s = sorted(values)
    return s[min(len(s) - 1, round(p / 100 * (len(s) - 1)))]


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far (/proc/<pid>/stat fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


async def init(stub: Stub, port: int) -> None:
    await stub.Init(
        pubsub_pb2.PubSubInitRequest(
            metadata=common_pb2.MetadataRequest(
                properties={
                    "redisHost": f"127.0.0.1:{port}",
                    "consumerID": "bench",
                    "enableDelayedMessaging": "true",
                }
            )
        ),
        metadata=MD,
    )


async def bulk(
    stub: Stub, topic: str, entries: list[tuple[bytes, dict[str, str]]], batch: int = 1000
) -> float:
    """BulkPublish (data, per-entry metadata) pairs in batches from 2 callers; returns entries/s.

    The requests are built before the clock starts: their cost is the
    client's (daprd's), not the component's, and it shares these 2 cores.
    """
    requests = [
        pubsub_pb2.BulkPublishRequest(
            pubsub_name="bench",
            topic=topic,
            entries=[
                pubsub_pb2.BulkMessageEntry(entry_id=str(i), event=data, metadata=md)
                for i, (data, md) in enumerate(entries[start : start + batch])
            ],
        )
        for start in range(0, len(entries), batch)
    ]
    queue = list(reversed(requests))

    async def caller() -> None:
        while queue:
            reply = await stub.BulkPublish(queue.pop(), metadata=MD)
            if reply.failed_entries:
                raise SystemExit(f"BulkPublish refused entries: {reply.failed_entries[:3]}")

    t0 = time.perf_counter()
    await asyncio.gather(caller(), caller())
    return len(entries) / (time.perf_counter() - t0)


async def unary(stub: Stub, topic: str, metadatas: list[dict[str, str]], data: bytes, callers: int) -> float:
    """One Publish per metadata, from `callers` concurrent callers; returns calls/s."""
    queue = [
        pubsub_pb2.PublishRequest(data=data, pubsub_name="bench", topic=topic, metadata=md)
        for md in reversed(metadatas)
    ]

    async def caller() -> None:
        while queue:
            await stub.Publish(queue.pop(), metadata=MD)

    t0 = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(callers)))
    return len(metadatas) / (time.perf_counter() - t0)


def entries_since(client: redis.Redis, topic: str, after_id: str) -> list[tuple[int, dict[str, str]]]:
    """(landing ms, metadata) of every entry of `topic` after `after_id`."""
    out: list[tuple[int, dict[str, str]]] = []
    last = after_id
    while True:
        page = cast(
            "list[tuple[bytes, dict[bytes, bytes]]]", client.xrange(topic, min=f"({last}", count=10_000)
        )
        if not page:
            return out
        for eid, fields in page:
            out.append((int(eid.split(b"-")[0]), json.loads(fields.get(b"metadata", b"{}"))))
        last = page[-1][0].decode()


def last_id(client: redis.Redis, topic: str) -> str:
    tail = cast("list[tuple[bytes, dict[bytes, bytes]]]", client.xrevrange(topic, count=1))
    return tail[0][0].decode() if tail else "0-0"


def analyse(rows: list[tuple[int, dict[str, str]]], interval_ms: int, a: int, b: int) -> dict[str, float]:
    """Lateness and exactly-once of fires due in [a, b)."""
    late: list[int] = []
    per_schedule: dict[str, list[int]] = defaultdict(list)
    for landed, md in rows:
        nxt = md.get("scheduleNext")
        if not nxt or nxt == "purge":
            continue
        due = parse_instant(nxt) - interval_ms
        if a <= due < b:
            late.append(landed - due)
            per_schedule[md.get("scheduler", "?")].append(due)
    if not late:
        raise SystemExit("no fire landed in the window: are schedules supported by this build?")
    duplicates = sum(len(d) - len(set(d)) for d in per_schedule.values())
    gaps = 0
    for dues in per_schedule.values():
        ordered = sorted(set(dues))
        gaps += sum((y - x) // interval_ms - 1 for x, y in itertools.pairwise(ordered) if y - x > interval_ms)
    return {
        "fires": len(late),
        "fires_per_s": len(late) / ((b - a) / 1000),
        "schedules_seen": len(per_schedule),
        "p50_ms": pct(late, 50),
        "p99_ms": pct(late, 99),
        "max_ms": max(late),
        "early": sum(1 for x in late if x < 0),
        "duplicates": duplicates,
        "skipped_fires": gaps,
    }


async def paced(stub: Stub, topic: str, entries: list[tuple[bytes, dict[str, str]]], span_s: float) -> float:
    """BulkPublish `entries` in 500 slices spread evenly over `span_s`; returns entries/s."""
    slices = min(500, len(entries))
    step = max(1, len(entries) // slices)
    t0 = time.perf_counter()
    for j, i in enumerate(range(0, len(entries), step)):
        await bulk(stub, topic, entries[i : i + step], batch=step)
        await asyncio.sleep(max(0.0, t0 + (j + 1) * span_s / slices - time.perf_counter()))
    return len(entries) / (time.perf_counter() - t0)


async def recurring(
    stub: Stub,
    client: redis.Redis,
    serve_pid: int,
    redis_pid: int,
    n: int,
    window_s: int,
    cron: bool,
    spread: bool,
) -> dict[str, float]:
    expr = "* * * * * *" if cron else "@every 1s"
    entries = [(TICK, {"schedule": expr, "scheduleId": f"tick-{i}"}) for i in range(n)]
    t0 = now_ms()
    # An @every grid starts when its schedule is accepted: created in one go (the
    # default) they all fall due within the ~0.5 s the creation took, every
    # second; --spread accepts them evenly over a second, as schedules created
    # over time are, so their fires spread like the one-shot peer's.
    create_rate = await (paced(stub, "ticks", entries, 1.0) if spread else bulk(stub, "ticks", entries))
    settle_s = 3  # let the phases of the first fires pass before measuring
    await asyncio.sleep(settle_s)
    start_id = last_id(client, "ticks")
    a = now_ms()
    serve0, redis0 = cpu_s(serve_pid), cpu_s(redis_pid)
    await asyncio.sleep(window_s)
    b = now_ms()
    serve1, redis1 = cpu_s(serve_pid), cpu_s(redis_pid)
    await asyncio.sleep(3)  # the last fires of the window land
    rows = entries_since(client, "ticks", start_id)
    # Fires due in the window, minus its first and last second (partial schedules' phases).
    result = analyse(rows, 1000, a + 1000, b - 1000)
    result.update(
        {
            "schedules": n,
            "create_per_s": create_rate,
            "created_in_s": (a - t0) / 1000 - settle_s,
            "serve_cpu_pct_of_core": 100 * (serve1 - serve0) / ((b - a) / 1000),
            "redis_cpu_pct_of_core": 100 * (redis1 - redis0) / ((b - a) / 1000),
        }
    )
    cancel_rate = await bulk(
        stub, "ticks", [(b"", {"scheduleId": f"tick-{i}", "scheduleCancel": "true"}) for i in range(n)]
    )
    await asyncio.sleep(2.5)  # fires already under way when the cancels returned land
    mark = last_id(client, "ticks")
    await asyncio.sleep(3)
    result["cancel_per_s"] = cancel_rate
    result["fires_after_cancel"] = len(entries_since(client, "ticks", mark))
    return result


async def one_shot_peer(
    stub: Stub, client: redis.Redis, serve_pid: int, rate: int, window_s: int
) -> dict[str, float]:
    """The same fire rate from one-shot delayed messages: `rate` per second over the window."""
    lead_ms = 5000 + rate * window_s // 20
    start = now_ms() + lead_ms
    dues = [start + (i * 1000) // rate for i in range(rate * window_s)]
    entries = [(b"x", {"scheduledSendTime": format_instant(d)}) for d in dues]
    ingest = await bulk(stub, "peer", entries)
    if now_ms() >= start:
        raise SystemExit("publishing the peer took longer than its lead time")
    serve0 = cpu_s(serve_pid)
    t0 = now_ms()
    await asyncio.sleep(max(0.0, (dues[-1] - now_ms()) / 1000))
    # Then wait for the stragglers (a slow machine drains late), at most a minute.
    for _ in range(600):  # polling Redis: there is no event to wait on here
        if client.xlen("peer") >= len(dues):
            break
        await asyncio.sleep(0.1)
    serve1 = cpu_s(serve_pid)
    span_s = (now_ms() - t0) / 1000
    landed = [ms for ms, _ in entries_since(client, "peer", "0-0")]
    if len(landed) != len(dues):
        raise SystemExit(
            f"peer: {len(landed)} of {len(dues)} one-shots landed within a minute of the last due"
        )
    # Entries land in due order (one index); pair them with the sorted dues.
    late = [x - d for x, d in zip(sorted(landed), dues, strict=True)]
    return {
        "fires": len(dues),
        "ingest_per_s": ingest,
        "p50_ms": pct(late, 50),
        "p99_ms": pct(late, 99),
        "max_ms": max(late),
        "serve_cpu_pct_of_core": 100 * (serve1 - serve0) / span_s,
    }


async def cancels(
    stub: Stub, client: redis.Redis, pids: tuple[int, int], m: int, lead_s: int, callers: int
) -> dict[str, float]:
    """`pids`: serve's and redis-server's, for CPU per cancel."""
    due = now_ms() + lead_s * 1000
    at = format_instant(due)
    # Unary: M/10 publishes, then the same ids cancelled, both from `callers` callers.
    k = max(1, m // 10)
    publish_unary = await unary(
        stub,
        "victims-u",
        [{"scheduledSendTime": at, "scheduleId": f"u-{i}"} for i in range(k)],
        TICK,
        callers,
    )
    cancel_unary = await unary(
        stub,
        "victims-u",
        [{"scheduleId": f"u-{i}", "scheduleCancel": "true"} for i in range(k)],
        b"",
        callers,
    )
    # Bulk: M publishes, then M cancels, 1,000 entries per call.
    publish_bulk = await bulk(
        stub, "victims-b", [(TICK, {"scheduledSendTime": at, "scheduleId": f"b-{i}"}) for i in range(m)]
    )
    history0 = client.xlen("{bench-delayed}:history")
    cpu0 = [cpu_s(p) for p in pids]
    cancel_bulk = await bulk(
        stub, "victims-b", [(b"", {"scheduleId": f"b-{i}", "scheduleCancel": "true"}) for i in range(m)]
    )
    cpu1 = [cpu_s(p) for p in pids]
    cancelled_records = client.xlen("{bench-delayed}:history") - history0
    if now_ms() >= due:
        raise SystemExit(f"publishing and cancelling took longer than --cancel-lead {lead_s}s")
    await asyncio.sleep((due - now_ms()) / 1000 + 3)
    delivered = client.xlen("victims-u") + client.xlen("victims-b")
    return {
        "unary_n": k,
        "unary_delayed_publish_per_s": publish_unary,
        "unary_cancel_per_s": cancel_unary,
        "unary_ratio": cancel_unary / publish_unary,
        "bulk_n": m,
        "bulk_delayed_publish_per_s": publish_bulk,
        "bulk_cancel_per_s": cancel_bulk,
        "bulk_ratio": cancel_bulk / publish_bulk,
        "serve_cpu_us_per_bulk_cancel": 1e6 * (cpu1[0] - cpu0[0]) / m,
        "redis_cpu_us_per_bulk_cancel": 1e6 * (cpu1[1] - cpu0[1]) / m,
        "history_records_of_bulk_cancels": cancelled_records,
        "pending_after": int(cast("bytes", client.get("{bench-delayed}:pending") or b"0")),
        "delivered_after_cancel": delivered,
    }


ZONES = ("America/New_York", "Europe/London", "Australia/Sydney", "Asia/Kathmandu")


async def zoned_phase(
    stub: Stub,
    client: redis.Redis,
    pids: tuple[int, int],
    n: int,
    window_s: int,
    *,
    zoned: bool,
) -> dict[str, float]:
    """N `*/30 * * * * *` schedules (zoned + jittered, or UTC plain) firing for `window_s`."""
    topic = "zoned" if zoned else "utc"

    def metadata(i: int) -> dict[str, str]:
        md = {"schedule": "*/30 * * * * *", "scheduleId": f"{topic}-{i}"}
        if zoned:
            md.update({"scheduleTimeZone": ZONES[i % len(ZONES)], "scheduleJitter": "20s"})
        return md

    create_rate = await bulk(stub, topic, [(TICK, metadata(i)) for i in range(n)])
    # The first fire of each schedule has no earlier scheduleNext to be measured against:
    # measure from the first whole 30 s cycle after creation.
    await asyncio.sleep(30 - (now_ms() / 1000) % 30 + 1)
    a = now_ms()
    cpu0 = [cpu_s(p) for p in pids]
    await asyncio.sleep(window_s)
    b = now_ms()
    cpu1 = [cpu_s(p) for p in pids]
    cancel_rate = await bulk(
        stub, topic, [(b"", {"scheduleId": f"{topic}-{i}", "scheduleCancel": "true"}) for i in range(n)]
    )
    await asyncio.sleep(2)
    rows = entries_since(client, topic, "0-0")
    named: dict[str, int] = {}  # scheduler -> the due time its last fire named
    late: list[int] = []
    fired = 0
    for landed, md in sorted(rows, key=lambda r: r[0]):
        sid, nxt = md.get("scheduler", "?"), md.get("scheduleNext", "")
        if a <= landed < b:
            fired += 1
            if sid in named:
                late.append(landed - named[sid])
        if nxt and nxt != "purge":
            named[sid] = parse_instant(nxt)
    if not late:
        raise SystemExit(f"{topic}: no fire landed in the window")
    client.delete(topic)
    return {
        "schedules": n,
        "create_per_s": create_rate,
        "fires": fired,
        "fires_per_s": fired / ((b - a) / 1000),
        "p50_ms": pct(late, 50),
        "p99_ms": pct(late, 99),
        "max_ms": max(late),
        "early": sum(1 for x in late if x < 0),
        "serve_cpu_us_per_fire": 1e6 * (cpu1[0] - cpu0[0]) / max(fired, 1),
        "redis_cpu_us_per_fire": 1e6 * (cpu1[1] - cpu0[1]) / max(fired, 1),
        "serve_cpu_pct_of_core": 100 * (cpu1[0] - cpu0[0]) / ((b - a) / 1000),
        "cancel_per_s": cancel_rate,
    }


class Serve:
    def __init__(self, folder: Path) -> None:
        self.socket = folder / "delayed-pubsub.sock"
        self.proc = start_serve(self.socket, folder / "serve.log")

    def stop(self) -> None:
        stop(self.proc)
        self.socket.unlink(missing_ok=True)


def show(name: str, res: dict[str, float]) -> None:
    print(f"{name}:", {k: round(v, 1) if isinstance(v, float) else v for k, v in res.items()}, flush=True)


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--schedules", type=int, default=10_000)
    ap.add_argument("--window", type=int, default=20, help="measuring window, seconds")
    ap.add_argument("--cron", action="store_true", help="'* * * * * *' instead of '@every 1s'")
    ap.add_argument("--no-peer", action="store_true", help="skip the one-shot peer")
    ap.add_argument(
        "--spread", action="store_true", help="accept the @every schedules evenly over one second"
    )
    ap.add_argument("--cancels", type=int, default=100_000)
    ap.add_argument(
        "--cancel-lead", type=int, default=120, help="seconds until the cancelled one-shots are due"
    )
    ap.add_argument("--callers", type=int, default=64)
    ap.add_argument(
        "--zoned", type=int, default=0, help="N zoned + jittered schedules, then N UTC ones (0 = skip)"
    )
    ap.add_argument("--zoned-window", type=int, default=120, help="seconds each set fires for")
    args = ap.parse_args()
    print(
        f"# {datetime.now(UTC):%Y-%m-%d %H:%M UTC} on {platform.node()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}, load {os.getloadavg()[0]:.1f}"
    )
    with tempfile.TemporaryDirectory(prefix="dpsb-sched-") as d:
        folder = Path(d)
        redis_server = RedisServer(folder / "redis", appendonly=False)
        redis_server.start()
        try:
            client = redis_server.client()
            redis_pid = int(cast("dict[str, int]", client.info("server"))["process_id"])
            serve = Serve(folder)
            try:
                async with grpc.aio.insecure_channel(f"unix://{serve.socket}") as ch:
                    stub = Stub(ch)  # type: ignore[no-untyped-call]
                    await init(stub, redis_server.port)
                    if args.schedules:
                        res = await recurring(
                            stub,
                            client,
                            serve.proc.pid,
                            redis_pid,
                            args.schedules,
                            args.window,
                            args.cron,
                            args.spread,
                        )
                        kind = "* * * * * *" if args.cron else "@every 1s"
                        show(f"recurring {kind}{' (spread)' if args.spread else ''}", res)
                        if not args.no_peer:
                            show(
                                "peer one-shots, same rate",
                                await one_shot_peer(
                                    stub, client, serve.proc.pid, args.schedules, min(args.window, 10)
                                ),
                            )
                    if args.zoned:
                        pids = (serve.proc.pid, redis_pid)
                        for zoned in (True, False):
                            name = "zoned + jitter 20s" if zoned else "UTC, no jitter"
                            res = await zoned_phase(
                                stub, client, pids, args.zoned, args.zoned_window, zoned=zoned
                            )
                            show(f"*/30 * * * * * x {args.zoned:,}, {name}", res)
                    if args.cancels:
                        show(
                            "cancels",
                            await cancels(
                                stub,
                                client,
                                (serve.proc.pid, redis_pid),
                                args.cancels,
                                args.cancel_lead,
                                args.callers,
                            ),
                        )
            finally:
                serve.stop()
        finally:
            redis_server.stop()


if __name__ == "__main__":
    asyncio.run(main())
