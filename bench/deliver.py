"""Delivery benchmark: a burst already on the topic, drained through PullMessages.

Starts a private redis-server and `delayed-pubsub serve` (its own process, as
beside daprd), writes N entries onto a topic in pubsub.redis's format (the
state right after N delayed messages fired at one instant), then opens S
PullMessages streams that read and ack each message as it arrives, the way
tests/components/driver.py (and daprd) do. It reports:
  - the time from opening the streams to the last message received,
  - the component's CPU per delivered message (utime+stime of serve and its worker processes),
  - that every message arrived exactly once and nothing is left pending.

    .venv/bin/python bench/deliver.py [--messages 100000] [--streams 1] [--concurrency 10]
        [--profile bench/flame-deliver.svg]   # py-spy record of the serve process meanwhile

Each stream runs in a client process of its own when --streams > 1, so the
client's Python does not cap several streams at one core's worth.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import redis

ROOT = Path(__file__).resolve().parents[1]
for sub in ("proto", "middleware", "components", "."):
    sys.path.insert(0, str(ROOT / sub))

from bench.common import MD, PAYLOAD, children_of, start_process, start_serve, stop  # noqa: E402
from delayed_middleware.entry import StreamEntry, encode_entry  # noqa: E402
from delayed_pubsub_pb.dapr.proto.components.v1 import (  # noqa: E402
    common_pb2,
    pubsub_pb2,
    pubsub_pb2_grpc,
)
from tests.redis_server import RedisServer  # noqa: E402

TOPIC = "orders"

# The floor under any PullMessages figure: a grpc.aio server that sends N
# prebuilt messages (same size and fields as ours) over the streams it is given,
# at most `window` unacked per stream, and reads the acks. No Redis, no logic.
BARE_STREAM_SERVER = """
import asyncio, sys
from delayed_pubsub_pb.dapr.proto.components.v1 import pubsub_pb2, pubsub_pb2_grpc
import grpc

left = int(sys.argv[2])
window_size = int(sys.argv[3])
payload = sys.argv[4].encode()

class Bare(pubsub_pb2_grpc.PubSubServicer):
    async def PullMessages(self, request_iterator, context):
        global left
        await anext(request_iterator)
        window = asyncio.Semaphore(window_size)

        async def pump():
            async for _ in request_iterator:
                window.release()

        acks = asyncio.create_task(pump())
        n = 0
        while left > 0:
            left -= 1
            n += 1
            await window.acquire()
            m = pubsub_pb2.PullMessagesResponse(
                data=payload, topic_name="orders", metadata={"cloudevent.id": "x"}, id=f"{left}-{n}"
            )
            m.metadata["deliveryAttempt"] = "1"
            yield m
        await acks

async def main():
    server = grpc.aio.server()
    pubsub_pb2_grpc.add_PubSubServicer_to_server(Bare(), server)
    server.add_insecure_port("unix:" + sys.argv[1])
    await server.start()
    await server.wait_for_termination()

asyncio.run(main())
"""
CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def component_cpu_seconds(pid: int) -> float:
    """CPU of the component: serve and its worker processes (their utime + stime; one gone meanwhile counts 0)."""
    total = 0.0
    for proc in (pid, *children_of(pid)):
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            total += cpu_seconds(proc)
    return total


def settle(pid: int, within_s: float = 15.0) -> None:
    """Waits until serve's workers have started their engines after Init (their imports and first
    calls are start-up, not delivery): the component's CPU grows by under 10 ms in half a second."""
    deadline = time.monotonic() + within_s
    last = component_cpu_seconds(pid)
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = component_cpu_seconds(pid)
        if now - last < 0.010:
            return
        last = now


def preload(port: int, n: int, expired: int = 0) -> None:
    """XADD n entries (the first `expired` with an expiresAt in the past), pipelined."""
    client = redis.Redis(port=port)
    fields = encode_entry(StreamEntry(PAYLOAD, {"cloudevent.id": "x"}))
    gone = encode_entry(StreamEntry(PAYLOAD, {}, expires_at_ms=1))
    pipe = client.pipeline(transaction=False)
    for i in range(n):
        pipe.xadd(TOPIC, gone if i < expired else fields)  # type: ignore[arg-type]
        if i % 5000 == 4999:
            pipe.execute()
    pipe.execute()
    client.close()


async def init(socket_path: Path, port: int, concurrency: int, queue_depth: int) -> None:
    async with grpc.aio.insecure_channel(f"unix://{socket_path}") as channel:
        stub = pubsub_pb2_grpc.PubSubStub(channel)  # type: ignore[no-untyped-call]
        props = {
            "redisHost": f"127.0.0.1:{port}",
            "consumerID": "bench",
            "concurrency": str(concurrency),
            "queueDepth": str(queue_depth),
        }
        await stub.Init(
            pubsub_pb2.PubSubInitRequest(metadata=common_pb2.MetadataRequest(properties=props)), metadata=MD
        )


@dataclass(frozen=True)
class StreamResult:
    ids: list[str]
    first_s: float
    last_s: float


async def drain(
    socket_path: str, expect: int, idle_s: float, start_at: float, app_s: float = 0.0
) -> StreamResult:
    """One daprd-like stream: read, ack at once (or after `app_s`, as daprd acks after the
    app's answer), until `expect` arrive or nothing comes for idle_s (several streams share
    the messages)."""
    ids: list[str] = []
    async with grpc.aio.insecure_channel(f"unix://{socket_path}") as channel:
        stub = pubsub_pb2_grpc.PubSubStub(channel)  # type: ignore[no-untyped-call]
        call = stub.PullMessages(metadata=MD)
        # All streams open at the same wall-clock instant.
        await asyncio.sleep(max(0.0, start_at - time.time()))
        await call.write(pubsub_pb2.PullMessagesRequest(topic=pubsub_pb2.Topic(name=TOPIC)))
        # Reads happen in a task of their own: cancelling a read would cancel the call.
        inbox: asyncio.Queue[Any] = asyncio.Queue()

        async def reader() -> None:
            with contextlib.suppress(grpc.aio.AioRpcError):
                while (msg := await call.read()) is not grpc.aio.EOF:  # type: ignore[attr-defined]
                    inbox.put_nowait(msg)
            inbox.put_nowait(None)

        reading = asyncio.create_task(reader())
        first = last = 0.0
        while len(ids) < expect:
            try:
                msg = await asyncio.wait_for(inbox.get(), idle_s)
            except TimeoutError:
                break
            if msg is None:
                break
            last = time.time()
            if not ids:
                first = last
            ids.append(msg.id)
            if app_s:
                await asyncio.sleep(app_s)
            await call.write(pubsub_pb2.PullMessagesRequest(ack_message_id=msg.id))
        await call.done_writing()
        # daprd's orderly end: the component ends the stream once it has read
        # every ack; closing the channel before that would drop acks in flight.
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(reading, 10)
    return StreamResult(ids, first, last)


def _drain_process(
    socket_path: str, expect: int, idle_s: float, start_at: float, out: Path, app_s: float
) -> None:
    result = asyncio.run(drain(socket_path, expect, idle_s, start_at, app_s))
    out.write_text(f"{result.first_s} {result.last_s}\n" + "\n".join(result.ids))


def run_streams(
    socket_path: Path, streams: int, expect: int, idle_s: float, work: Path, app_s: float = 0.0
) -> list[StreamResult]:
    start_at = time.time() + 0.5
    if streams == 1:
        return [asyncio.run(drain(str(socket_path), expect, idle_s, start_at, app_s))]
    ctx = multiprocessing.get_context("spawn")
    start_at += 2  # spawned interpreters take a moment
    outs = [work / f"stream{i}.txt" for i in range(streams)]
    procs = [
        ctx.Process(target=_drain_process, args=(str(socket_path), expect, idle_s, start_at, out, app_s))
        for out in outs
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    results = []
    for out in outs:
        head, *ids = out.read_text().split("\n")
        first, last = (float(x) for x in head.split())
        results.append(StreamResult([i for i in ids if i], first, last))
    return results


def start_spy(pid: int, out: Path, native: bool) -> subprocess.Popen[bytes]:
    """py-spy record of `pid` into `out` (raw folded stacks if it ends in .txt, else an SVG), or,
    if `out` ends in .perf, `perf record` (CPU samples of every thread, C and kernel frames included:
    py-spy samples a thread that waits for a core as busy, and the machine is shared)."""
    exe = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if out.suffix == ".perf":
        args = ["perf", "record", "-F", "999", "-g", "-p", str(pid), "-o", str(out)]
    else:
        args = [
            exe,
            "record",
            "--pid",
            str(pid),
            "--output",
            str(out),
            "--rate",
            "500" if native else "200",
            *(["--native"] if native else ["--nonblocking"]),
            *(["--format", "raw"] if out.suffix == ".txt" else []),
        ]
    spy = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1)
    return spy


def stop_spy(spy: subprocess.Popen[bytes]) -> None:
    spy.send_signal(2)  # SIGINT: py-spy writes its output and exits
    spy.wait(timeout=60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--messages", type=int, default=100_000)
    ap.add_argument("--expired", type=int, default=0, help="extra entries already expired (never delivered)")
    ap.add_argument("--streams", type=int, default=1)
    ap.add_argument(
        "--concurrency", type=int, default=10, help="component `concurrency` (default as shipped)"
    )
    ap.add_argument("--queue-depth", type=int, default=100)
    ap.add_argument(
        "--app-ms",
        type=float,
        default=0.0,
        help="the subscriber acks each message this long after it arrives (daprd waits for the app)",
    )
    ap.add_argument("--profile", type=Path, help="write a py-spy flame graph (SVG) of the serve process here")
    ap.add_argument("--profile-bare", type=Path, help="the same for the bare server (with --ceiling)")
    ap.add_argument(
        "--native", action="store_true", help="profile with py-spy --native at 500 Hz (grpc's C parts show)"
    )
    ap.add_argument(
        "--ceiling",
        action="store_true",
        help="also measure a bare grpc.aio stream server (no Redis) the same way",
    )
    a = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="dps-deliver-"))
    redis_server = RedisServer(work / "redis", appendonly=False)
    redis_server.start()
    socket_path = work / "delayed-pubsub.sock"
    serve = start_serve(socket_path, work / "serve.log")
    spy: subprocess.Popen[bytes] | None = None
    try:
        preload(redis_server.port, a.messages + a.expired, a.expired)
        asyncio.run(init(socket_path, redis_server.port, a.concurrency, a.queue_depth))
        if a.profile:
            spy = start_spy(serve.pid, a.profile, a.native)
        settle(serve.pid)
        cpu0, serve0 = component_cpu_seconds(serve.pid), cpu_seconds(serve.pid)
        t0 = time.time()
        results = run_streams(
            socket_path, a.streams, a.messages, 3.0 if a.streams > 1 else 5.0, work, a.app_ms / 1000
        )
        cpu1, serve1 = component_cpu_seconds(serve.pid), cpu_seconds(serve.pid)
        if spy is not None:
            stop_spy(spy)
        client = redis.Redis(port=redis_server.port)
        deadline = time.monotonic() + 10
        while True:  # the last acks land
            pending = int(client.xpending(TOPIC, "bench")["pending"])
            if pending == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        # Round trips the delivery made (the preload's XADDs left out): each costs serve
        # a socket write and a reply to parse, so this is what batching saves.
        stats: Any = client.info("commandstats")
        calls = {
            name.removeprefix("cmdstat_").upper(): int(stats[name]["calls"])
            for name in stats
            if name
            in ("cmdstat_xreadgroup", "cmdstat_xack", "cmdstat_xpending", "cmdstat_xclaim", "cmdstat_evalsha")
        }
        client.close()
    finally:
        if spy is not None and spy.poll() is None:
            spy.kill()
        stop(serve)
        redis_server.stop()

    ids = [i for r in results for i in r.ids]
    unique = len(set(ids))
    got = [r for r in results if r.ids]
    first = min((r.first_s for r in got), default=t0)
    last = max((r.last_s for r in got), default=t0)
    elapsed = last - first
    cpu = cpu1 - cpu0
    print(
        f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} {platform.node()} nproc {os.cpu_count()} "
        f"load {os.getloadavg()[0]:.1f}, grpcio {grpc.__version__}"
    )
    print(
        f"messages {a.messages} (+{a.expired} expired) streams {a.streams} concurrency {a.concurrency} "
        f"queueDepth {a.queue_depth}"
    )
    print(f"received {len(ids)} unique {unique} duplicates {len(ids) - unique} left pending {pending}")
    print(f"first -> last message: {elapsed:.2f} s ({len(ids) / max(elapsed, 1e-9):,.0f} msg/s)")
    print(
        f"component CPU: {cpu:.2f} s = {cpu / max(1, len(ids)) * 1e6:.1f} us per delivered message "
        f"(serve {(serve1 - serve0) / max(1, len(ids)) * 1e6:.1f}, its workers the rest)"
    )
    per = ", ".join(f"{name} {n / max(1, len(ids)):.3f}" for name, n in sorted(calls.items()))
    print(f"Redis calls per delivered message: {per}")
    if a.ceiling:
        bare_sock = work / "bare.sock"
        bare = start_process(
            [
                sys.executable,
                "-c",
                BARE_STREAM_SERVER,
                str(bare_sock),
                str(a.messages),
                str(a.concurrency),
                PAYLOAD.decode(),
            ],
            bare_sock,
            work / "bare.log",
        )
        bare_spy = start_spy(bare.pid, a.profile_bare, a.native) if a.profile_bare else None
        try:
            b0 = cpu_seconds(bare.pid)
            bare_results = run_streams(
                bare_sock, a.streams, a.messages, 3.0 if a.streams > 1 else 5.0, work, a.app_ms / 1000
            )
            b1 = cpu_seconds(bare.pid)
        finally:
            if bare_spy is not None:
                stop_spy(bare_spy)
            stop(bare)
        got = [r for r in bare_results if r.ids]
        n = sum(len(r.ids) for r in got)
        span = max(r.last_s for r in got) - min(r.first_s for r in got)
        print(
            f"bare grpc.aio stream server, same driver: {span:.2f} s ({n / span:,.0f} msg/s), "
            f"{(b1 - b0) / n * 1e6:.1f} us CPU per message; ours/bare time {elapsed / span:.2f}, "
            f"CPU {cpu / max(1, len(ids)) / ((b1 - b0) / n):.2f}"
        )
    shutil.rmtree(work, ignore_errors=True)
    if unique != a.messages or len(ids) != unique:
        raise SystemExit("LOST OR DOUBLED MESSAGES")


if __name__ == "__main__":
    main()
