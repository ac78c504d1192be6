"""Issue 9: what operating costs — inspection scans, the operator CLI, and the retry path.

    .venv/bin/python bench/ops.py [--pending 100000] [--topics 30] [--nacks 2000]

A private redis-server (AOF off). Measures:
- Inspector.pending (full decode, due lookup) and counts_by_topic (the metrics gauge's
  topic-only scan) over N pending envelopes, in µs per envelope;
- the real CLI as a process: `pending --json` (limit 100 of N), `inspect` by scheduleId
  (one HGET) and by an id found only by scanning;
- the nack path in-process (Broker + Subscription, no gRPC): M messages each failed once
  then acked, with no policy (the redeliverInterval timer) vs a retry policy with a zero
  initial interval (durable record + poller), same run: the ratio is the record's cost;
  and the retry policy as `serve --workers N` runs it (the poller waits for the due scan's
  notices, 30 s cap), with the due scan run in this same process (in serve it runs in a
  worker: this variant is the pessimistic one); `--nacks-only` measures only this part;
- hand-offs waiting in the outbox (`--handoffs H`, fired messages the sidecar has not
  accepted): Inspector.handoffs in µs per entry (its peer: Inspector.pending per
  envelope above), and `pending --json` again with them waiting beside the N envelopes;
- a history append as the retrier and the forwarder write it (XADD MAXLEN ~ plus XTRIM
  MINID ~ for historyMaxAge): Redis CPU per call of each, from INFO commandstats.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for sub in ("proto", "middleware", "components", "."):
    sys.path.insert(0, str(ROOT / sub))

import redis.asyncio as aioredis  # noqa: E402

from bench.common import PAYLOAD, bench_engine, timed_cli  # noqa: E402
from delayed_middleware.clock import SystemClock  # noqa: E402
from delayed_middleware.entry import StreamEntry  # noqa: E402
from delayed_middleware.envelope import Envelope  # noqa: E402
from delayed_middleware.history import FIELDS, Retention  # noqa: E402
from delayed_middleware.inspector import Inspector  # noqa: E402
from delayed_middleware.keys import EngineKeys, delayed_topic  # noqa: E402
from delayed_middleware.outbox import OutboxEntry, encode_outbox_entry  # noqa: E402
from delayed_pubsub.broker import Broker  # noqa: E402
from delayed_pubsub.connection import connect  # noqa: E402
from delayed_pubsub.metrics import Metrics  # noqa: E402
from delayed_pubsub.redelivery import Retrier  # noqa: E402
from delayed_pubsub.retry_notices import DueScan, RetryNotices  # noqa: E402
from delayed_pubsub.settings import parse_settings  # noqa: E402
from tests.redis_server import RedisServer  # noqa: E402

EXE = Path(sys.executable).with_name("delayed-pubsub")


async def populate(port: int, n: int, topics: int) -> None:
    client = aioredis.Redis(port=port)
    engine = bench_engine(client, SystemClock(), {"consumerID": "bench"})
    now = int(time.time() * 1000)
    batch: list[Envelope] = []
    for i in range(n):
        batch.append(
            Envelope(
                id="",
                topic=f"topic-{i % topics}",
                due_ms=now + 3_600_000 + i,
                published_at_ms=now,
                message=PAYLOAD,
                metadata={"cloudevent.id": str(i)},
                schedule_id=f"sched-{i}" if i % 10 == 0 else "",
            )
        )
        if len(batch) == 1000:
            await engine.schedule(batch)
            batch = []
    if batch:
        await engine.schedule(batch)
    await client.aclose()


async def scans(port: int, n: int) -> dict[str, float]:
    client = aioredis.Redis(port=port)
    inspector = Inspector(client, "bench")
    t = time.process_time()
    report = await inspector.pending(limit=100)
    pending_s = time.process_time() - t
    assert report.matched == n, report.matched
    t = time.process_time()
    counts, complete = await inspector.counts_by_topic()
    counts_s = time.process_time() - t
    assert complete
    assert sum(counts.values()) == n
    await client.aclose()
    return {
        "pending_us": pending_s / n * 1e6,
        "pending_s": pending_s,
        "counts_us": counts_s / n * 1e6,
        "counts_s": counts_s,
    }


async def handoffs(port: int, h: int) -> float:
    """Fill the outbox with `h` entries, half of them read once (tried); CPU µs per entry of the listing."""
    client = aioredis.Redis(port=port)
    keys = EngineKeys.for_topic(delayed_topic("bench"))
    await client.xgroup_create(keys.outbox, "forwarder", id="0", mkstream=True)
    for start in range(0, h, 1000):
        pipe = client.pipeline(transaction=False)
        for i in range(start, min(h, start + 1000)):
            entry = OutboxEntry("kafka", f"topic-{i % 30}", PAYLOAD, id=f"sched-h{i}", metadata={"n": str(i)})
            pipe.xadd(keys.outbox, encode_outbox_entry(entry))  # type: ignore[arg-type]
        await pipe.execute()
    await client.xreadgroup("forwarder", "bench", {keys.outbox: ">"}, count=h // 2)
    inspector = Inspector(client, "bench")
    t = time.process_time()
    listed = [m async for m in inspector.handoffs()]
    took = time.process_time() - t
    assert len(listed) == h, len(listed)
    await client.aclose()
    return took / h * 1e6


async def history_appends(port: int, n: int) -> tuple[float, float]:
    """Redis CPU µs per XADD and per XTRIM of `n` history appends (historyMaxLen/historyMaxAge defaults)."""
    client = aioredis.Redis(port=port)
    record = dict.fromkeys(FIELDS, "x")
    await client.config_resetstat()
    for _ in range(n):
        pipe = client.pipeline(transaction=False)
        Retention().append(pipe, "{bench-delayed}:history", record, int(time.time() * 1000))
        await pipe.execute()
    stats = await client.info("commandstats")
    await client.aclose()
    return float(stats["cmdstat_xadd"]["usec_per_call"]), float(stats["cmdstat_xtrim"]["usec_per_call"])


def cli(port: int, *args: str) -> str:
    """Wall and CPU seconds of one CLI run against the single node."""
    return timed_cli([str(EXE), *args, "--redis-host", f"127.0.0.1:{port}", "--app-id", "bench"])


async def nack_path(port: int, m: int, policy: bool, noticed: bool = False) -> float:
    props = {
        "redisHost": f"127.0.0.1:{port}",
        "consumerID": f"nack-{policy}-{noticed}",
        "redeliverInterval": "1",  # ms: the legacy timer's wait; equal work for both variants otherwise
        "processingTimeout": "60s",
    }
    if policy:
        props["retryInitialInterval"] = "0"
    settings = parse_settings(props)
    connection = connect(settings)
    metrics = Metrics().for_instance("bench")
    broker = Broker(connection.client, settings, SystemClock(), metrics)
    topic = f"nack-{policy}-{noticed}"
    sub = broker.subscription(topic, "c")
    notices = RetryNotices(connection.client, settings.consumer_id, metrics) if noticed else None
    scan: asyncio.Task[None] | None = None
    stop_scan = asyncio.Event()
    if noticed:
        due = DueScan(connection.client, settings.consumer_id, SystemClock(), metrics, call_timeout=5.0)
        scan = asyncio.create_task(due.run(stop_scan))
    if policy:
        sub.retry = Retrier(
            connection.client,
            settings.retry,
            topic=topic,
            group=settings.consumer_id,
            consumer=sub.consumer,
            clock=SystemClock(),
            metrics=metrics,
            call_timeout=5.0,
            notices=notices,
        )
    await sub.start()
    for i in range(0, m, 500):
        from delayed_pubsub.broker import BulkEntry

        await broker.bulk_publish(
            topic, [BulkEntry(str(j), StreamEntry(PAYLOAD)) for j in range(i, min(m, i + 500))]
        )
    acked = 0
    t = time.perf_counter()
    async for d in sub.deliveries():
        if d.attempt == 1:
            sub.nack(d.id, "bench")
        else:
            await sub.ack(d.id)
            acked += 1
            if acked == m:
                break
    took = time.perf_counter() - t
    await sub.close()
    if notices is not None and scan is not None:
        stop_scan.set()
        await scan
        await notices.close()
    await connection.aclose()
    return took


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pending", type=int, default=100_000)
    parser.add_argument("--topics", type=int, default=30)
    parser.add_argument("--nacks", type=int, default=2000)
    parser.add_argument("--handoffs", type=int, default=10_000)
    parser.add_argument("--nacks-only", action="store_true", help="measure the nack path alone")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-ops-") as d:
        server = RedisServer(Path(d) / "redis", appendonly=False)
        server.start()
        try:
            if args.nacks_only:
                for n in range(2):
                    legacy = await nack_path(server.port, args.nacks, policy=False)
                    durable = await nack_path(server.port, args.nacks, policy=True)
                    noticed = await nack_path(server.port, args.nacks, policy=True, noticed=True)
                    print(
                        f"round {n}, nack once then ack, {args.nacks} messages: redeliverInterval timer "
                        f"{args.nacks / legacy:.0f} msg/s, retry policy {args.nacks / durable:.0f} msg/s, "
                        f"retry policy as under --workers (notices, scan in-process) {args.nacks / noticed:.0f} "
                        f"msg/s (ratio to workers 0 {durable / noticed:.2f})",
                        flush=True,
                    )
                return
            await populate(server.port, args.pending, args.topics)
            s = await scans(server.port, args.pending)
            print(
                f"Inspector.pending over {args.pending}: {s['pending_s']:.2f} s CPU ({s['pending_us']:.1f} µs/envelope)"
            )
            print(f"Inspector.counts_by_topic: {s['counts_s']:.2f} s CPU ({s['counts_us']:.1f} µs/envelope)")
            print(f"CLI pending --json (100 of {args.pending}): {cli(server.port, 'pending', '--json')}")
            print(f"CLI inspect sched-500 (by scheduleId): {cli(server.port, 'inspect', 'sched-500')}")
            print(f"CLI dead (nothing to list: start-up and connect): {cli(server.port, 'dead')}")
            legacy = await nack_path(server.port, args.nacks, policy=False)
            durable = await nack_path(server.port, args.nacks, policy=True)
            print(
                f"nack once then ack, {args.nacks} messages: redeliverInterval timer {args.nacks / legacy:.0f} msg/s, "
                f"retry policy {args.nacks / durable:.0f} msg/s (ratio {legacy / durable:.2f})"
            )
            xadd_us, xtrim_us = await history_appends(server.port, 20_000)
            print(
                f"history append, 20000: Redis CPU {xadd_us:.2f} µs per XADD, {xtrim_us:.2f} µs per XTRIM MINID ~ "
                f"(ratio {xtrim_us / xadd_us:.2f})"
            )
            if args.handoffs:
                us = await handoffs(server.port, args.handoffs)
                print(f"Inspector.handoffs over {args.handoffs} waiting hand-offs: {us:.1f} µs/entry CPU")
                print(
                    f"CLI pending --json (100 of {args.pending} + {args.handoffs} hand-offs): "
                    f"{cli(server.port, 'pending', '--json')}"
                )
        finally:
            server.stop()


if __name__ == "__main__":
    asyncio.run(main())
