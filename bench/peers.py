"""Side by side with NATS JetStream message schedules: the same workloads on both, interleaved.

    .venv/bin/python -m bench peers --quick     # <= 10 minutes here
    .venv/bin/python -m bench peers --full      # the sizes of the issue (1M pending)
    .venv/bin/python -m bench peers --quick --only burst --no-write   # one workload, both systems

Ours: a private redis-server (AOF, appendfsync everysec) and `delayed-pubsub serve`
(its own process), driven over its unix socket as daprd drives it (delays as
`scheduledSendTime` metadata, delivery on a PullMessages stream acking each
message as it arrives). Theirs: nats-server 2.14+ (found on PATH, or built once
with `go install github.com/nats-io/nats-server/v2@v2.14.9` into
~/.cache/dapr-delayed-pubsub/bin), file storage, one stream with
`allow_msg_schedules`, schedules published as messages with `Nats-Schedule: @at
<RFC3339>` and `Nats-Schedule-Target: orders`, delivered to a pull consumer
(batches of 100, each message acked), driven with nats-py.

Workloads (each run on ours, then on theirs, before the next):
  steady     `rate`/s delayed messages for `steady_s`, each due 1 s after publish,
             received by a subscriber in a process of its own (as daprd and the app
             are not the publisher's process; this one only publishes): lateness
             (received - due) percentiles, and a CDF chart of both;
  burst      N messages due at one instant T: T -> last one on the target
             topic (fired), T -> last one received by one subscriber;
  unary      N delayed publishes from 64 concurrent callers, one call each;
  pipelined  N delayed publishes pipelined (ours: BulkPublish of 1000, one
             delay per entry; theirs: publish_async);
  memory     N pending delayed messages (302-byte payload): Redis used_memory
             growth / N, against nats-server RSS growth / N (and its store bytes);
  restart    with those N pending, both servers stopped and started again:
             time until a message due at once is delivered again.
Server CPU (utime+stime of the server processes) is read around each workload.

Results go to stdout, a dated section appended to bench/RESULTS.md, and the CDF
chart to bench/peers-lateness-cdf.png.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import multiprocessing
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import grpc
import redis

ROOT = Path(__file__).resolve().parents[1]
for sub in ("proto", "middleware", "components", "."):
    sys.path.insert(0, str(ROOT / sub))

from bench.common import MD, children_of, probe_lag, start_serve, stop  # noqa: E402
from bench.deliver import cpu_seconds  # noqa: E402
from delayed_middleware.keys import EngineKeys, delayed_topic  # noqa: E402
from delayed_pubsub_pb.dapr.proto.components.v1 import (  # noqa: E402
    common_pb2,
    pubsub_pb2,
    pubsub_pb2_grpc,
)
from tests.redis_server import RedisServer, free_port  # noqa: E402

NATS_VERSION = "v2.14.9"
NATS_MIN = (2, 14)
CACHE_BIN = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "dapr-delayed-pubsub" / "bin"
RESULTS = ROOT / "bench" / "RESULTS.md"
CHART = ROOT / "bench" / "peers-lateness-cdf.png"
TOPIC = "orders"
CONSUMER_ID = "bench"
# The index of the warm-up message, outside every workload's range.
WARM_UP = b"999999998"
# 302 bytes, as in the memory figure: a CloudEvent-sized body.
PAYLOAD_BYTES = 302


@dataclass(frozen=True)
class Sizes:
    """How big each workload is."""

    rate: int
    steady_s: int
    burst: int
    unary: int
    pipelined: int
    pending: int


QUICK = Sizes(rate=1000, steady_s=10, burst=50_000, unary=10_000, pipelined=100_000, pending=200_000)
SMOKE = Sizes(rate=200, steady_s=2, burst=2_000, unary=640, pipelined=4_000, pending=5_000)
FULL = Sizes(rate=1000, steady_s=30, burst=100_000, unary=20_000, pipelined=200_000, pending=1_000_000)


def rfc3339(epoch_s: float) -> str:
    return datetime.fromtimestamp(epoch_s, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def body(i: int, due: float) -> bytes:
    """A payload of PAYLOAD_BYTES that carries its due time (ms) and index."""
    head = f"{int(due * 1000)}:{i}:".encode()
    # Random filler: a compressible body would flatter any store that compresses on disk.
    return head + os.urandom(PAYLOAD_BYTES).hex().encode()[: PAYLOAD_BYTES - len(head)]


def due_of(data: bytes) -> float:
    return int(data.split(b":", 1)[0]) / 1000


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def describe(error: Exception) -> str:
    """A short, countable description of a failed call (numbers in it, such as the calls in
    flight that an overload refusal names, read N: one line per kind of failure)."""
    if isinstance(error, grpc.aio.AioRpcError):
        text = f"{error.code().name}: {(error.details() or '')[:60]}"
    else:
        text = f"{type(error).__name__}: {str(error)[:60]}"
    return re.sub(r"\d+", "N", text)


def percentile(sorted_values: Sequence[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


# --- nats-server ---------------------------------------------------------------


def nats_server_path() -> str:
    """nats-server >= 2.14 from PATH or the cache, else built with go install into the cache."""
    for candidate in (shutil.which("nats-server"), str(CACHE_BIN / "nats-server")):
        if candidate and Path(candidate).exists():
            out = subprocess.run([candidate, "--version"], capture_output=True, text=True).stdout
            version = out.strip().rsplit("v", 1)[-1].split(".")
            if tuple(int(x) for x in version[:2]) >= NATS_MIN:
                return candidate
    if shutil.which("go") is None:
        raise SystemExit("nats-server 2.14+ not found and no Go toolchain to build it")
    CACHE_BIN.mkdir(parents=True, exist_ok=True)
    print(f"building nats-server {NATS_VERSION} into {CACHE_BIN} (once)...", flush=True)
    subprocess.run(
        ["go", "install", f"github.com/nats-io/nats-server/v2@{NATS_VERSION}"],
        check=True,
        env={**os.environ, "GOBIN": str(CACHE_BIN), "GOFLAGS": ""},
    )
    return str(CACHE_BIN / "nats-server")


class NatsServer:
    """One nats-server with JetStream on a private port and store directory."""

    def __init__(self, exe: str, workdir: Path) -> None:
        self.exe = exe
        self.store = workdir / "nats-store"
        self.log = workdir / "nats.log"
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [self.exe, "-js", "-sd", str(self.store), "-a", "127.0.0.1", "-p", str(self.port)],
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid


async def _quiet(error: Exception) -> None:
    """nats-py prints every connection error; refused connects while a server starts are expected."""


# --- the two systems behind one interface ---------------------------------------


class System:
    """What each workload needs from a system under test."""

    name = ""

    async def setup(self) -> None: ...
    async def close(self) -> None: ...
    def pids(self) -> list[int]:
        raise NotImplementedError

    def roles(self) -> list[tuple[str, int]]:
        """(role, pid) of each server process, for the burst's per-process core waits."""
        return [(self.name, pid) for pid in self.pids()]

    async def schedule(self, i: int, due: float) -> None:
        """One delayed message, one call, waiting for the server's acknowledgement."""
        raise NotImplementedError

    async def schedule_many(self, first: int, dues: Sequence[float]) -> None:
        """Many delayed messages, pipelined."""
        raise NotImplementedError

    async def subscribe(self, on_message: Callable[[bytes, float], None]) -> Callable[[], Awaitable[None]]:
        """Start receiving (acking each message); returns a coroutine function that stops it."""
        raise NotImplementedError

    def subscriber_address(self) -> str:
        """Where a subscriber in another process connects (see `SubscriberProcess`)."""
        raise NotImplementedError

    async def fired(self) -> int:
        """How many messages have landed on the target topic so far."""
        raise NotImplementedError

    async def reset_target(self) -> None:
        """Forget what fired before (so `fired` counts from 0)."""

    def memory(self) -> tuple[int, int]:
        """(bytes held in memory, bytes on disk) by the server side."""
        raise NotImplementedError

    async def pending(self) -> int:
        raise NotImplementedError

    async def restart(self) -> None:
        raise NotImplementedError


class Ours(System):
    name = "ours"

    def __init__(
        self,
        workdir: Path,
        workers: int | None = None,
        tree: Path | None = None,
        settings: dict[str, str] | None = None,
    ) -> None:
        self.workdir = workdir
        # Component metadata given with --ours (e.g. historyMaxLen=0), over the bench's own.
        self.settings = settings or {}
        # serve --workers (None: serve's default).
        self.workers = workers
        # Another checkout whose serve runs instead of this one's (--base: an A/B in one run).
        self.tree = tree
        if tree is not None:
            self.name = f"base ({tree.name})"
        self.redis = RedisServer(workdir / "redis", appendonly=True)
        self.socket = workdir / "delayed-pubsub.sock"
        self.serve: subprocess.Popen[bytes] | None = None
        self.channel: grpc.aio.Channel | None = None
        self.stub: Any = None
        self.client: redis.Redis | None = None
        self.keys = EngineKeys.for_topic(delayed_topic(CONSUMER_ID))

    def _start_serve(self) -> subprocess.Popen[bytes]:
        extra = () if self.workers is None else ("--workers", str(self.workers))
        path = (
            None
            if self.tree is None
            else os.pathsep.join(str(self.tree / p) for p in ("proto", "middleware", "components"))
        )
        return start_serve(self.socket, self.workdir / "serve.log", *extra, python_path=path)

    async def _start_component(self) -> None:
        self.serve = self._start_serve()
        self.channel = grpc.aio.insecure_channel(f"unix://{self.socket}")
        self.stub = pubsub_pb2_grpc.PubSubStub(self.channel)  # type: ignore[no-untyped-call]
        props = {
            "redisHost": self.redis.address,
            "consumerID": CONSUMER_ID,
            "enableDelayedMessaging": "true",
            "concurrency": "100",
            **self.settings,
        }
        await self.stub.Init(
            pubsub_pb2.PubSubInitRequest(metadata=common_pb2.MetadataRequest(properties=props)), metadata=MD
        )

    async def setup(self) -> None:
        self.redis.start()
        self.client = self.redis.client()
        await self._start_component()

    async def close(self) -> None:
        if self.channel is not None:
            await self.channel.close(None)
        if self.serve is not None:
            stop(self.serve)
        if self.client is not None:
            self.client.close()
        self.redis.stop()

    def pids(self) -> list[int]:
        assert self.serve is not None
        assert self.redis.proc is not None
        # serve's worker processes fire: their CPU is the server's too.
        return [self.serve.pid, *children_of(self.serve.pid), self.redis.proc.pid]

    def roles(self) -> list[tuple[str, int]]:
        assert self.serve is not None
        assert self.redis.proc is not None
        workers = [(f"worker {k}", pid) for k, pid in enumerate(children_of(self.serve.pid))]
        return [("serve (gRPC, delivery)", self.serve.pid), *workers, ("redis-server", self.redis.proc.pid)]

    async def schedule(self, i: int, due: float) -> None:
        await self.stub.Publish(
            pubsub_pb2.PublishRequest(
                data=body(i, due),
                pubsub_name="bench",
                topic=TOPIC,
                metadata={"scheduledSendTime": rfc3339(due)},
            ),
            metadata=MD,
        )

    async def schedule_many(self, first: int, dues: Sequence[float]) -> None:
        entries = [
            pubsub_pb2.BulkMessageEntry(
                entry_id=str(first + k),
                event=body(first + k, due),
                metadata={"scheduledSendTime": rfc3339(due)},
            )
            for k, due in enumerate(dues)
        ]
        reply = await self.stub.BulkPublish(
            pubsub_pb2.BulkPublishRequest(entries=entries, pubsub_name="bench", topic=TOPIC), metadata=MD
        )
        if reply.failed_entries:
            raise RuntimeError(f"{len(reply.failed_entries)} entries failed: {reply.failed_entries[0].error}")

    async def subscribe(self, on_message: Callable[[bytes, float], None]) -> Callable[[], Awaitable[None]]:
        return await pull_ours(self.stub, lambda msg_id, data, at: on_message(data, at))

    def subscriber_address(self) -> str:
        return str(self.socket)

    async def fired(self) -> int:
        assert self.client is not None
        return int(self.client.xlen(TOPIC))

    async def reset_target(self) -> None:
        assert self.client is not None
        # Exact: an approximate XTRIM removes at most 10,000 entries a call (its default
        # LIMIT), and what it left counted as fired in the next round's burst.
        self.client.xtrim(TOPIC, maxlen=0, approximate=False)

    def memory(self) -> tuple[int, int]:
        assert self.client is not None
        info: Any = self.client.info("memory")
        return int(info["used_memory"]), dir_bytes(self.redis.workdir)

    async def pending(self) -> int:
        assert self.client is not None
        return int(self.client.xlen(self.keys.stream))

    async def restart(self) -> None:
        assert self.serve is not None
        assert self.client is not None
        if self.channel is not None:
            await self.channel.close(None)
        stop(self.serve)
        self.client.close()
        self.redis.stop()
        self.redis.start()
        self.client = self.redis.client()
        await self._start_component()


class Nats(System):
    name = "NATS"

    def __init__(self, exe: str, workdir: Path) -> None:
        self.server = NatsServer(exe, workdir)
        self.nc: Any = None
        self.js: Any = None
        self.read_errors: Counter[str] = Counter()

    async def _connect(self) -> None:
        import nats

        deadline = time.monotonic() + 60
        while True:
            try:
                self.nc = await nats.connect(
                    f"nats://127.0.0.1:{self.server.port}", max_reconnect_attempts=0, error_cb=_quiet
                )
                self.js = self.nc.jetstream(timeout=30)
                await self.js.stream_info("BENCH")
                return
            except Exception:
                if self.nc is not None:
                    with contextlib.suppress(Exception):
                        await self.nc.close()
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.02)

    async def setup(self) -> None:
        from nats.js.api import StorageType, StreamConfig

        self.server.start()
        deadline = time.monotonic() + 30
        while True:
            try:
                import nats

                self.nc = await nats.connect(
                    f"nats://127.0.0.1:{self.server.port}", max_reconnect_attempts=0, error_cb=_quiet
                )
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.05)
        self.js = self.nc.jetstream(timeout=30)
        await self.js.add_stream(
            StreamConfig(
                name="BENCH",
                subjects=["sched.>", TOPIC],
                storage=StorageType.FILE,
                allow_msg_schedules=True,
            )
        )

    async def close(self) -> None:
        if self.nc is not None:
            with contextlib.suppress(Exception):
                await self.nc.close()
        self.server.stop()

    def pids(self) -> list[int]:
        return [self.server.pid]

    @staticmethod
    def _headers(due: float) -> dict[str, str]:
        return {"Nats-Schedule": f"@at {rfc3339(due)}", "Nats-Schedule-Target": TOPIC}

    async def schedule(self, i: int, due: float) -> None:
        await self.js.publish(f"sched.{i}", body(i, due), headers=self._headers(due))

    async def schedule_many(self, first: int, dues: Sequence[float]) -> None:
        futures = [
            await self.js.publish_async(
                f"sched.{first + k}", body(first + k, due), headers=self._headers(due)
            )
            for k, due in enumerate(dues)
        ]
        await asyncio.gather(*futures)

    async def subscribe(self, on_message: Callable[[bytes, float], None]) -> Callable[[], Awaitable[None]]:
        return await pull_nats(self.js, lambda msg_id, data, at: on_message(data, at), self.read_errors)

    def subscriber_address(self) -> str:
        return f"nats://127.0.0.1:{self.server.port}"

    async def fired(self) -> int:
        info = await self.js.stream_info("BENCH", subjects_filter=TOPIC)
        return int((info.state.subjects or {}).get(TOPIC, 0))

    async def reset_target(self) -> None:
        await self.js.purge_stream("BENCH", subject=TOPIC)

    def memory(self) -> tuple[int, int]:
        return rss_bytes(self.server.pid), dir_bytes(self.server.store)

    async def pending(self) -> int:
        # Every message of the stream that is not a fired one on the target
        # subject is a schedule (the subject filter's reply is capped, so count).
        info = await self.js.stream_info("BENCH")
        return int(info.state.messages) - await self.fired()

    async def restart(self) -> None:
        with contextlib.suppress(Exception):
            await self.nc.close()
        self.server.stop()
        self.server.start()
        await self._connect()


# --- the subscriber, in this process or in one of its own -----------------------

# on_message(message id, data, time.time() at arrival); the id is the stream entry's for ours, "" for NATS.
OnMessage = Callable[[str, bytes, float], None]


async def pull_ours(stub: Any, on_message: OnMessage) -> Callable[[], Awaitable[None]]:
    """A PullMessages stream on TOPIC, as daprd opens one: each message acked as it arrives."""
    call = stub.PullMessages(metadata=MD)
    await call.write(pubsub_pb2.PullMessagesRequest(topic=pubsub_pb2.Topic(name=TOPIC)))

    async def read() -> None:
        while True:
            msg = await call.read()
            if msg is grpc.aio.EOF:  # type: ignore[attr-defined]
                return
            on_message(msg.id, msg.data, time.time())
            await call.write(pubsub_pb2.PullMessagesRequest(ack_message_id=msg.id))

    reader = asyncio.create_task(read())

    async def stop_it() -> None:
        with contextlib.suppress(Exception):
            await call.done_writing()
            await asyncio.wait_for(reader, 10)
        reader.cancel()
        with contextlib.suppress(BaseException):
            await reader

    return stop_it


async def pull_nats(
    js: Any, on_message: OnMessage, read_errors: Counter[str]
) -> Callable[[], Awaitable[None]]:
    """A new durable pull consumer on TOPIC (batches of 100, each message acked); a failed
    read is counted in `read_errors` and read on."""
    import nats.errors
    from nats.js.api import ConsumerConfig, DeliverPolicy

    # Only what fires from now on, as a new consumer group of ours sees it.
    psub = await js.pull_subscribe(
        TOPIC,
        durable=f"bench{time.monotonic_ns()}",
        stream="BENCH",
        config=ConsumerConfig(deliver_policy=DeliverPolicy.NEW),
    )
    running = True

    async def read() -> None:
        while running:
            try:
                msgs = await psub.fetch(100, timeout=0.5)
            except nats.errors.TimeoutError:
                continue
            except Exception as e:
                # A reader that ended on an error received nothing more, silently:
                # count it (the run's notes say it) and read on.
                read_errors[describe(e)] += 1
                await asyncio.sleep(0.1)
                continue
            for m in msgs:
                on_message("", m.data, time.time())
                await m.ack()

    reader = asyncio.create_task(read())

    async def stop_it() -> None:
        nonlocal running
        running = False
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(reader, 5)
        with contextlib.suppress(Exception):
            await psub.unsubscribe()

    return stop_it


@dataclass(frozen=True)
class Arrival:
    """One message as a subscriber received it."""

    id: str  # ours: the stream entry id; NATS: ""
    head: bytes  # the payload's b"<due ms>:<index>:"
    at: float  # time.time() when the subscriber's read returned it


@dataclass
class Received:
    """What a subscriber process hands back when it stops."""

    pid: int
    arrivals: list[Arrival]
    read_errors: dict[str, int]
    lags_ms: list[float]  # its own loop's lag (5 ms probe)


async def _connection_recv(conn: Connection, within_s: float) -> Any:
    """The next object on a pipe, without blocking the loop (EOFError if the other end died)."""
    loop = asyncio.get_running_loop()
    readable = loop.create_future()

    def ready() -> None:
        if not readable.done():
            readable.set_result(None)

    loop.add_reader(conn.fileno(), ready)
    try:
        await asyncio.wait_for(readable, within_s)
    finally:
        loop.remove_reader(conn.fileno())
    return conn.recv()


async def _subscribe_and_report(system: str, address: str, conn: Connection) -> None:
    arrivals: list[Arrival] = []
    seen: set[bytes] = set()
    warm = asyncio.Event()
    read_errors: Counter[str] = Counter()

    def got(msg_id: str, data: bytes, at: float) -> None:
        due_ms, index, _ = data.split(b":", 2)
        if index == WARM_UP:
            warm.set()
            return
        seen.add(index)
        arrivals.append(Arrival(msg_id, due_ms + b":" + index + b":", at))

    lags: list[float] = []
    prober = asyncio.create_task(probe_lag(lags))
    # Ours and --base's serve (named "base (<tree>)") both listen on a unix socket.
    if system != "NATS":
        channel = grpc.aio.insecure_channel(f"unix://{address}")
        stop_sub = await pull_ours(pubsub_pb2_grpc.PubSubStub(channel), got)  # type: ignore[no-untyped-call]

        async def close() -> None:
            await channel.close(None)
    else:
        import nats

        nc = await nats.connect(address, max_reconnect_attempts=0, error_cb=_quiet)
        stop_sub = await pull_nats(nc.jetstream(timeout=30), got, read_errors)

        async def close() -> None:
            await nc.close()

    conn.send(("subscribed", os.getpid()))
    await asyncio.wait_for(warm.wait(), 60)
    conn.send(("warm", None))
    expect, within_s = await _connection_recv(conn, 3600)
    deadline = time.time() + within_s
    while len(seen) < expect and time.time() < deadline:  # noqa: ASYNC110 (a bounded poll of a plain counter)
        await asyncio.sleep(0.05)
    await stop_sub()
    await close()
    prober.cancel()
    conn.send(("received", Received(os.getpid(), arrivals, dict(read_errors), lags)))


def subscriber_main(system: str, address: str, conn: Connection) -> None:
    """The body of a subscriber process (see `SubscriberProcess`)."""
    # Its start-up heap out of the full collections that would pause its loop.
    gc.collect()
    gc.freeze()
    asyncio.run(_subscribe_and_report(system, address, conn))


class SubscriberGone(RuntimeError):
    """The subscriber process ended before handing back what it received."""


class SubscriberProcess:
    """A subscriber in a process of its own, as daprd and the app are in a deployment: the
    bench process only publishes, so a stall of its loop under the publish load does not
    stamp arrivals late. It subscribes, waits for a warm-up message (a delayed message due
    at once, fired and received: the steady state is measured, not a fresh server's start),
    then receives until `finish` says how many to wait for, stamping each arrival with
    time.time() in its own process. (Without the warm-up, our worker process still importing
    and opening the instance held the first due messages back by up to 0.3 s on a busy machine.)"""

    def __init__(self, system: System) -> None:
        ctx = multiprocessing.get_context("spawn")  # never fork a process that holds grpc and loops
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=subscriber_main, args=(system.name, system.subscriber_address(), child), daemon=True
        )
        self.system = system
        self.pid = 0

    async def start(self, within_s: float = 60) -> None:
        self.proc.start()
        self.pid = await self._expect("subscribed", within_s)
        await self.system.schedule(int(WARM_UP), time.time() + 0.05)
        await self._expect("warm", within_s)

    async def finish(self, expect: int, within_s: float) -> Received:
        """Stop once `expect` distinct messages arrived or `within_s` passed; what it received."""
        try:
            self.conn.send((expect, within_s))
        except OSError as e:
            raise self._gone() from e
        received: Received = await self._expect("received", within_s + 60)
        return received

    async def _expect(self, kind: str, within_s: float) -> Any:
        try:
            got, value = await _connection_recv(self.conn, within_s)
        except (EOFError, OSError) as e:
            raise self._gone() from e
        assert got == kind, (got, kind)
        return value

    def _gone(self) -> SubscriberGone:
        self.proc.join(5)
        return SubscriberGone(
            f"the {self.system.name} subscriber process (pid {self.proc.pid}) ended, exit code {self.proc.exitcode}"
        )

    def close(self) -> None:
        if self.proc.pid is None:  # never started
            self.conn.close()
            return
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        self.conn.close()


# --- workloads ------------------------------------------------------------------


@dataclass
class Row:
    workload: str
    unit: str
    ours: float = float("nan")
    theirs: float = float("nan")
    better: str = "lower"  # which direction wins
    note: str = ""


@dataclass
class Run:
    sizes: Sizes
    # The burst with no subscriber (--burst-alone): what the fire takes without the delivery beside it.
    burst_alone: bool = False
    rows: list[Row] = field(default_factory=list)
    lateness: dict[str, list[float]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    # Pipelined store rate per system (msg/s), to give a burst time to be stored.
    store_rate: dict[str, float] = field(default_factory=dict)
    # The steady workload's arrivals and its subscriber process's loop lag (ms), per system.
    arrivals: dict[str, list[Arrival]] = field(default_factory=dict)
    subscriber_lags: dict[str, list[float]] = field(default_factory=dict)
    # Every value put, per (workload, unit, system), in order: several rounds (--rounds) or systems (--base).
    samples: dict[tuple[str, str, str], list[float]] = field(default_factory=dict)

    def put(self, workload: str, unit: str, system: str, value: float, better: str = "lower") -> None:
        self.samples.setdefault((workload, unit, system), []).append(value)
        row = next((r for r in self.rows if r.workload == workload), None)
        if row is None:
            row = Row(workload, unit, better=better)
            self.rows.append(row)
        if system == "ours":
            row.ours = value
        elif system == "NATS":
            row.theirs = value


@contextlib.contextmanager
def cpu_of(system: System, into: list[float]) -> Iterator[None]:
    pids = system.pids()
    before = sum(cpu_seconds(p) for p in pids)
    yield
    into.append(sum(cpu_seconds(p) for p in pids) - before)


async def steady(system: System, run: Run) -> None:
    """`rate`/s delayed unary publishes from this process, each due 1 s later, received by a
    subscriber in a process of its own (`SubscriberProcess`)."""
    s = run.sizes
    n = s.rate * s.steady_s
    failed: Counter[str] = Counter()

    async def publish(i: int, due: float) -> None:
        # A refused publish is counted, not fatal: the run goes on and says so.
        try:
            await system.schedule(i, due)
        except Exception as e:
            failed[describe(e)] += 1

    subscriber = SubscriberProcess(system)
    try:
        await subscriber.start()
        start = time.time() + 0.2
        tick = 0.01
        per_tick = max(1, int(s.rate * tick))
        calls: list[Awaitable[Any]] = []
        cpu: list[float] = []
        with cpu_of(system, cpu):
            for k in range(0, n, per_tick):
                send_at = start + k / s.rate
                await asyncio.sleep(max(0.0, send_at - time.time()))
                batch = range(k, min(n, k + per_tick))
                calls.append(asyncio.gather(*(publish(i, send_at + 1.0) for i in batch)))
            await asyncio.gather(*calls)
            expect = n - sum(failed.values())
            received = await subscriber.finish(expect, 30)
    finally:
        subscriber.close()
    late: list[float] = []
    seen = set()
    for a in received.arrivals:
        i = a.head.split(b":", 2)[1]
        if i not in seen:
            seen.add(i)
            late.append(a.at - due_of(a.head))
    late.sort()
    run.lateness[system.name] = late
    run.arrivals[system.name] = received.arrivals
    run.subscriber_lags[system.name] = received.lags_ms
    lags = sorted(received.lags_ms)
    run.notes.append(
        f"{system.name}, steady: received in a subscriber process of its own (pid {received.pid}, loop lag "
        f"p99 {percentile(lags, 0.99):.1f} ms, max {lags[-1] if lags else 0:.1f} ms); "
        "the bench process only publishes"
    )
    for error, times in received.read_errors.items():
        run.notes.append(f"{system.name}, steady: its subscriber's reads failed {times}x: {error}")
    if failed:
        run.notes.append(
            f"{system.name}, steady: {sum(failed.values())} of {n} publishes failed: {dict(failed)}"
        )
    if len(late) < expect:
        run.notes.append(
            f"{system.name}, steady: only {len(late)} of {expect} accepted messages arrived in time"
        )
    run.put(f"steady {s.rate}/s, due -> subscriber p50", "ms", system.name, percentile(late, 0.5) * 1000)
    run.put(f"steady {s.rate}/s, due -> subscriber p99", "ms", system.name, percentile(late, 0.99) * 1000)
    run.put(f"steady {s.rate}/s, due -> subscriber max", "ms", system.name, late[-1] * 1000 if late else 0)
    # Publish, fire and deliver, over every server process (serve, its workers, Redis;
    # nats-server), not the bench's publisher or subscriber.
    run.put(
        f"server CPU per steady message ({s.rate}/s)", "us", system.name, cpu[0] / max(1, len(late)) * 1e6
    )


def schedstat(pid: int) -> tuple[int, int]:
    """(ns on a core, ns waiting for one) of every thread of `pid` so far (/proc/<pid>/task/*/schedstat)."""
    ran = waited = 0
    for task in Path(f"/proc/{pid}/task").glob("*/schedstat"):
        with contextlib.suppress(OSError, ValueError):
            on, wait, _ = task.read_text().split()
            ran, waited = ran + int(on), waited + int(wait)
    return ran, waited


def core_waits(roles: Sequence[tuple[str, int]], before: dict[int, tuple[int, int]], seconds: float) -> str:
    """What each process did over a window of `seconds`: ms on a core, ms waiting in the run queue."""
    parts = []
    for role, pid in roles:
        ran, waited = (a - b for a, b in zip(schedstat(pid), before.get(pid, (0, 0)), strict=True))
        parts.append(f"{role} ran {ran / 1e6:.0f} ms, waited {waited / 1e6:.0f} ms")
    return f"over {seconds:.2f} s: " + "; ".join(parts)


async def burst(system: System, run: Run) -> None:
    n = run.sizes.burst
    await system.reset_target()
    received = 0
    last = 0.0

    def got(data: bytes, at: float) -> None:
        nonlocal received, last
        received += 1
        last = at

    # Due late enough for the system to have stored all of them first (at the
    # rate its pipelined ingest showed, with room to spare; run alone, at the rate
    # of a probe of 1000 due in a day: on a loaded machine a guessed rate left
    # storing running past the due time).
    rate = run.store_rate.get(system.name)
    if rate is None:
        probe = time.perf_counter()
        await system.schedule_many(
            40_000_000 + 1000 * sum(map(len, run.samples.values())), [time.time() + 86_400] * 1000
        )
        rate = 1000 / (time.perf_counter() - probe)
    due = time.time() + 3 + 3 * n / rate
    for first in range(0, n, 1000):
        await system.schedule_many(first, [due] * min(1000, n - first))
    if time.time() > due:
        run.notes.append(f"{system.name}, burst: storing took past the due time; figures include that")
    stop_sub = None if run.burst_alone else await system.subscribe(got)
    cpu: list[float] = []
    # Who waits for a core while the burst fires: the server's processes, and this one (the subscriber).
    roles = [*system.roles(), ("bench (subscriber)", os.getpid())]
    with cpu_of(system, cpu):
        await asyncio.sleep(max(0.0, due - time.time()))
        at_due = {pid: schedstat(pid) for _, pid in roles}
        fired_at = None
        fire_window = ""
        deadline = time.time() + 300
        seen, moved_at = 0, time.time()
        while received < n and time.time() < deadline:
            if fired_at is None and await system.fired() >= n:
                fired_at = time.time()
                fire_window = core_waits(roles, at_due, fired_at - due)
                if stop_sub is None:
                    break
            if received != seen:
                seen, moved_at = received, time.time()
            elif fired_at is not None and time.time() - moved_at > 30:
                break  # all fired, and the subscriber has stopped receiving: waiting on is no measurement
            await asyncio.sleep(0.05)
    if stop_sub is None:
        run.put(
            f"{n // 1000}k due at one instant, no subscriber: T -> all fired",
            "s",
            system.name,
            (fired_at or due) - due,
        )
        run.notes.append(f"{system.name}, burst with no subscriber, due -> all fired, {fire_window}")
        return
    await stop_sub()
    if fire_window:
        run.notes.append(f"{system.name}, burst, due -> all fired, {fire_window}")
    if received < n:
        run.notes.append(f"{system.name}, burst: only {received} of {n} received")
    for error, times in getattr(system, "read_errors", Counter()).items():
        run.notes.append(f"{system.name}: its subscriber's reads failed {times}x: {error}")
    # `fired` counts what landed on the target topic (acked or not), polled every 50 ms.
    run.put(f"{n // 1000}k due at one instant: T -> all fired", "s", system.name, (fired_at or last) - due)
    run.put(f"{n // 1000}k due at one instant: T -> last delivered", "s", system.name, last - due)
    run.put("server CPU per delivered message (burst)", "us", system.name, cpu[0] / max(1, received) * 1e6)


async def unary(system: System, run: Run, callers: int = 64) -> None:
    n = run.sizes.unary
    per = n // callers
    due = time.time() + 3600
    base = 10_000_000

    async def caller(c: int) -> None:
        for k in range(per):
            await system.schedule(base + c * per + k, due)

    cpu: list[float] = []
    with cpu_of(system, cpu):
        t0 = time.perf_counter()
        await asyncio.gather(*(caller(c) for c in range(callers)))
        elapsed = time.perf_counter() - t0
    run.put(f"unary ingest, {callers} callers", "msg/s", system.name, per * callers / elapsed, "higher")
    run.put("server CPU per unary publish", "us", system.name, cpu[0] / (per * callers) * 1e6)


async def pipelined(system: System, run: Run) -> None:
    n = run.sizes.pipelined
    due = time.time() + 3600
    base = 20_000_000
    cpu: list[float] = []
    with cpu_of(system, cpu):
        t0 = time.perf_counter()
        batches = [system.schedule_many(base + f, [due] * min(1000, n - f)) for f in range(0, n, 1000)]
        for k in range(0, len(batches), 4):  # 4 batches in flight
            await asyncio.gather(*batches[k : k + 4])
        elapsed = time.perf_counter() - t0
    run.store_rate[system.name] = n / elapsed
    run.put("pipelined ingest (ours: BulkPublish)", "msg/s", system.name, n / elapsed, "higher")
    run.put("server CPU per pipelined publish", "us", system.name, cpu[0] / n * 1e6)


async def memory_and_restart(system: System, run: Run) -> None:
    n = run.sizes.pending
    due = time.time() + 86_400
    base = 30_000_000
    mem0, disk0 = system.memory()
    before = await system.pending()
    batches = [range(f, min(n, f + 1000)) for f in range(0, n, 1000)]
    for k in range(0, len(batches), 4):
        await asyncio.gather(
            *(system.schedule_many(base + b.start, [due] * len(b)) for b in batches[k : k + 4])
        )
    await asyncio.sleep(2)  # background flushes settle
    mem1, disk1 = system.memory()
    label = f"{n // 1000}k pending, {PAYLOAD_BYTES} B payload"
    run.put(f"{label}: memory per message", "B", system.name, (mem1 - mem0) / n)
    run.put(f"{label}: disk per message", "B", system.name, (disk1 - disk0) / n)
    pending = await system.pending()

    # Restart with them pending: until a message due at once is delivered again.
    await system.reset_target()
    t0 = time.perf_counter()
    await system.restart()
    arrived = asyncio.Event()

    def got(data: bytes, at: float) -> None:
        if data.split(b":", 2)[1] == b"999999999":
            arrived.set()

    stop_sub = await system.subscribe(got)
    await system.schedule(999_999_999, time.time())
    await asyncio.wait_for(arrived.wait(), 300)
    restart_s = time.perf_counter() - t0
    await stop_sub()
    after = await system.pending()
    run.put(f"restart with {n // 1000}k pending: until firing again", "s", system.name, restart_s)
    if after < pending - 1 or pending - before < n:
        run.notes.append(
            f"{system.name}, restart: pending before restart {pending}, after {after} (stored {pending - before})"
        )


FRESH = {"memory+restart"}
WORKLOADS: list[tuple[str, Callable[[System, Run], Awaitable[None]]]] = [
    ("steady", steady),
    ("unary", unary),
    ("pipelined", pipelined),
    ("burst", burst),
    ("memory+restart", memory_and_restart),
]


async def run_all(
    sizes: Sizes,
    workdir: Path,
    nats_exe: str,
    only: Sequence[str] = (),
    workers: int | None = None,
    rounds: int = 1,
    base: Path | None = None,
    burst_alone: bool = False,
    settings: dict[str, str] | None = None,
) -> Run:
    from tqdm import tqdm

    # The client's start-up heap out of its full collections, which otherwise
    # paused its loop for 50-190 ms: a message that arrives during a pause is
    # stamped late, whichever system sent it.
    gc.collect()
    gc.freeze()
    run = Run(sizes, burst_alone=burst_alone)
    workloads = [(name, w) for name, w in WORKLOADS if not only or name in only]
    generation = 0

    def fresh() -> list[System]:
        nonlocal generation
        generation += 1
        dirs = [workdir / f"ours{generation}", workdir / f"base{generation}", workdir / f"nats{generation}"]
        for d in dirs:
            d.mkdir(parents=True, exist_ok=True)
        made: list[System] = [Ours(dirs[0], workers, settings=settings)]
        if base is not None:
            made.append(Ours(dirs[1], workers, tree=base, settings=settings))
        return [*made, Nats(nats_exe, dirs[2])]

    systems: list[System] = []
    with tqdm(total=len(workloads) * rounds * (3 if base else 2), unit="step", ncols=90) as bar:
        try:
            for name, workload in workloads:
                for k in range(rounds):
                    # Memory is measured on servers that hold nothing else (and
                    # restarted with only those messages pending).
                    if not systems or name in FRESH:
                        for s in systems:
                            await s.close()
                        systems = fresh()
                        for s in systems:
                            await s.setup()
                    # Rounds alternate the order, so neither system always goes first.
                    for s in systems if k % 2 == 0 else systems[::-1]:
                        bar.set_description(f"{name} {k + 1}/{rounds}: {s.name}")
                        await workload(s, run)
                        bar.update()
        finally:
            for s in systems:
                with contextlib.suppress(Exception):
                    await s.close()
    return run


def chart(run: Run, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, values in run.lateness.items():
        if values:
            ms = [v * 1000 for v in values]
            ax.plot(ms, [(k + 1) / len(ms) for k in range(len(ms))], label=name)
    ax.set_xscale("symlog", linthresh=1)
    ax.set_xlabel("lateness: received - due (ms)")
    ax.set_ylabel("fraction of messages")
    ax.set_title(f"Steady {run.sizes.rate}/s delayed messages, due 1 s after publish")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(run: Run) -> list[str]:
    lines = ["| workload | unit | ours | NATS 2.14 | ours / NATS |", "|---|---|---:|---:|---:|"]
    for r in run.rows:
        ratio = r.ours / r.theirs if r.theirs else float("nan")
        lines.append(f"| {r.workload} | {r.unit} | {r.ours:,.1f} | {r.theirs:,.1f} | {ratio:.2f} |")
    return lines


def rounds_table(run: Run) -> list[str]:
    """Every round's value per system, their median, and each system's median ratio to NATS
    over the rounds (paired: a round's value over NATS's in the same round)."""
    systems = list(dict.fromkeys(system for _, _, system in run.samples))
    others = [s for s in systems if s != "NATS"]
    lines = [
        "| workload | unit | "
        + " | ".join(f"{s} (rounds; median)" for s in systems)
        + " | "
        + " | ".join(f"{s} / NATS, median of rounds" for s in others)
        + " |",
        "|---|---|" + "---|" * (len(systems) + len(others)),
    ]
    for workload, unit in dict.fromkeys((w, u) for w, u, _ in run.samples):
        got = {s: run.samples.get((workload, unit, s), []) for s in systems}
        cells = [
            ", ".join(f"{v:,.2f}" for v in got[s])
            + f"; {statistics.median(got[s]) if got[s] else float('nan'):,.2f}"
            for s in systems
        ]
        nats = got.get("NATS", [])
        ratios = [
            f"{statistics.median([a / b for a, b in zip(got[s], nats, strict=False) if b] or [float('nan')]):.2f}"
            if nats
            else "-"
            for s in others
        ]
        lines.append(f"| {workload} | {unit} | " + " | ".join(cells + ratios) + " |")
    return lines


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="bench peers", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="smaller sizes, <= 10 minutes (default)")
    mode.add_argument("--full", action="store_true", help="the issue's sizes (1M pending)")
    mode.add_argument("--smoke", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument(
        "--no-write",
        action="store_true",
        help="do not append to bench/RESULTS.md; the lateness chart goes to the temp dir",
    )
    ap.add_argument(
        "--only",
        action="append",
        choices=[name for name, _ in WORKLOADS],
        default=[],
        help="run only this workload (repeatable); burst alone waits for storing at a default rate",
    )
    ap.add_argument(
        "--workers", type=int, default=None, metavar="N", help="run `serve --workers N` (default: serve's)"
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        metavar="R",
        help="run each workload R times, alternating the order (medians)",
    )
    ap.add_argument(
        "--base",
        type=Path,
        default=None,
        metavar="DIR",
        help="also run the serve of another checkout (e.g. main's), in the same rounds: an A/B in one run",
    )
    ap.add_argument(
        "--burst-alone",
        action="store_true",
        help="the burst with no subscriber: the fire without the delivery sharing the cores",
    )
    ap.add_argument(
        "--ours",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="component metadata for our Init (repeatable), e.g. historyMaxLen=0 for the fire without history",
    )
    a = ap.parse_args(argv)
    bad = [kv for kv in a.ours if "=" not in kv]
    if bad:
        ap.error(f"--ours wants KEY=VALUE, got {bad[0]!r}")
    settings = dict(kv.split("=", 1) for kv in a.ours)
    sizes = FULL if a.full else SMOKE if a.smoke else QUICK
    exe = nats_server_path()
    version = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout.strip()
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="dps-peers-") as d:
        run = asyncio.run(
            run_all(sizes, Path(d), exe, a.only, a.workers, a.rounds, a.base, a.burst_alone, settings)
        )
    took = time.time() - started
    # --no-write leaves the tree as it was: its chart goes to the temp dir.
    drawn = CHART if not (a.no_write or a.smoke) else Path(tempfile.gettempdir()) / CHART.name
    if run.lateness:  # no steady workload run (--only): keep the last chart
        chart(run, drawn)
    head = (
        f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC, `{platform.node()}`, {os.cpu_count()} cores shared with other "
        f"agents' work, load {os.getloadavg()[0]:.1f}; {version}; "
        f"`python -m bench peers {' '.join(argv if argv is not None else sys.argv[1:]) or '--quick'}` "
        f"took {took / 60:.1f} min"
    )
    lines = table(run) + [f"\n- note: {note}" for note in run.notes]
    if a.rounds > 1 or a.base is not None:
        lines = [*rounds_table(run), "", *lines]
    print(head)
    print("\n".join(lines))
    if run.lateness:
        print(f"lateness CDF: {drawn}")
    if not (a.no_write or a.smoke):
        with RESULTS.open("a") as out:
            out.write(
                f"\n### peers run {head}\n\n" + "\n".join(lines) + f"\n\n![lateness CDF]({CHART.name})\n"
            )


if __name__ == "__main__":
    main()
