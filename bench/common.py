"""What every benchmark here shares: the payload, the daprd-like call metadata,
and `delayed-pubsub serve` as its own process (as beside daprd, so the server
does not share a GIL with the benchmark's client)."""

from __future__ import annotations

import asyncio
import json
import os
import platform
import resource
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import redis.asyncio as aioredis

    from delayed_middleware.engine import DelayEngine, ShardedEngine
    from delayed_middleware.keys import EngineKeys

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_PATH = os.pathsep.join(str(ROOT / p) for p in ("proto", "middleware", "components"))

# daprd names the component instance on every call.
MD = (("x-component-instance", "bench"),)

# A CloudEvent as daprd builds one around a small JSON order (~300 bytes).
PAYLOAD = json.dumps(
    {
        "specversion": "1.0",
        "id": "5929aaac-a5e2-4ca1-859c-edfe73f11565",
        "source": "bench",
        "type": "com.dapr.event.sent",
        "datacontenttype": "application/json",
        "data": {"orderId": 66, "item": "x" * 64},
        "topic": "orders",
        "pubsubname": "delayed",
    }
).encode()


def start_process(
    args: list[str], socket: Path, log: Path, within_s: float = 30, python_path: str | None = None
) -> subprocess.Popen[bytes]:
    """Start a server process with our packages (or `python_path`'s) importable; return once its socket exists."""
    with log.open("ab") as out:
        proc = subprocess.Popen(
            args,
            env={**os.environ, "PYTHONPATH": python_path or PACKAGE_PATH},
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + within_s
    while not socket.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"{args[:4]} did not start; see {log}")
        time.sleep(0.01)
    return proc


def children_of(pid: int) -> list[int]:
    """The pids of `pid`'s child processes (serve's workers), from /proc: the children of each
    of its threads (a child started from another thread is listed under that thread); [] once
    it is gone."""
    found: list[int] = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return []
    for task in tasks:
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return found


def start_serve(
    socket: Path, log: Path, *extra: str, python_path: str | None = None
) -> subprocess.Popen[bytes]:
    """`delayed-pubsub serve EXTRA` on `socket`, logging warnings to `log` (another checkout's: `python_path`)."""
    return start_process(
        [
            sys.executable,
            "-m",
            "delayed_pubsub",
            "serve",
            "--socket",
            str(socket),
            "--log-level",
            os.environ.get("DPS_BENCH_LOG", "warning"),
            *extra,
        ],
        socket,
        log,
        python_path=python_path,
    )


def start_http_app(args: list[str], port: int, log: Path, within_s: float = 15) -> subprocess.Popen[bytes]:
    """A bench's HTTP app (`args`, listening on `port`); returns once its GET /healthz answers 200."""
    import httpx  # here: most benches have no HTTP app

    from tests.waiting import wait_until_blocking

    with log.open("ab") as out:
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=out)
    try:
        wait_until_blocking(
            lambda: (
                proc.poll() is None
                and httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200
            ),
            f"{args[0]} to answer /healthz (log {log})",
            within_s,
            tolerate=(httpx.HTTPError,),
            error=RuntimeError,
        )
    except BaseException:
        proc.kill()
        raise
    return proc


def stop_all(procs: list[Any]) -> None:
    """Stop what a bench started, the last started first: a Popen by stop(), anything else
    (tests.e2e.harness.ManagedProcess, RedisServer) by its own stop()."""
    for p in reversed(procs):
        if isinstance(p, subprocess.Popen):
            stop(p)
        else:
            p.stop()


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


async def probe_lag(into: list[float], every_s: float = 0.005) -> None:
    """How late the running loop runs a timer due every `every_s`, appended to `into` (ms),
    until cancelled: a stalled loop stamps whatever arrives during the stall late."""
    loop = asyncio.get_running_loop()
    into.append(0.0)
    while True:
        due = loop.time() + every_s
        await asyncio.sleep(every_s)
        into.append((loop.time() - due) * 1000)


def timed_cli(argv: list[str]) -> str:
    """Wall and CPU seconds of one CLI run (CPU: the machine is shared, wall is mostly waiting)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    out = subprocess.run(argv, capture_output=True, check=False, env={**os.environ, "COLUMNS": "200"})
    took = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert out.returncode == 0, out.stderr.decode()
    return f"{took:.2f} s wall, {cpu:.2f} s CPU"


def daprd_heading(daprd_path: str, run: str) -> str:
    """The first line of a bench through daprd: when, which machine and load, which daprd, then `run`
    (what the figures below it are). Said once so every such bench describes its run alike."""
    return (
        f"# {datetime.now(UTC):%Y-%m-%d %H:%M UTC} on {platform.node()}, {os.cpu_count()} cores "
        f"(shared), Python {platform.python_version()}, load {os.getloadavg()[0]:.1f}; "
        f"daprd {Path(daprd_path).name}; {run}"
    )


def bench_engine(
    client: Any,
    clock: Any,
    props: Mapping[str, str],
    *,
    config: Mapping[str, Any] | None = None,
    **build: Any,
) -> ShardedEngine:
    """The engine the component would build for these Init properties (the YAML's
    spec.metadata): Settings parsed as Init parses them, then build_engine.

    `redisHost` may be left out (the client is already connected). `config` overrides
    EngineConfig fields beyond what the settings decide (a bench's own knobs, such as
    compaction off); `build` goes to build_engine (on_batch, …).
    """
    # Imported here: most benches never build an engine and need not load it.
    from delayed_pubsub.engines import build_engine, engine_config
    from delayed_pubsub.settings import parse_settings

    settings = parse_settings({"redisHost": "127.0.0.1", **props})
    cfg = engine_config(settings, **(config or {}))
    return build_engine(settings, client, clock, config=cfg, **build)


async def fill_triggers(client: aioredis.Redis, keys: EngineKeys, size: int, now_ms: int) -> None:
    """Puts `size` registrations of other schedules' triggers (scored `now_ms`) in the triggers
    set (keys.EngineKeys.triggers), 10,000 per ZADD: what a cancel or a trigger's lookup reads."""
    for start in range(0, size, 10_000):
        members = {f"{now_ms}-{i} t{now_ms}:{i:08x}": now_ms for i in range(start, min(size, start + 10_000))}
        await client.zadd(keys.triggers, members)


@asynccontextmanager
async def two_phase_engine(
    keys: EngineKeys, prefix: str
) -> AsyncIterator[tuple[aioredis.Redis, DelayEngine]]:
    """A private redis-server (AOF off) and an engine on it with Redis Cluster's two-phase keys
    (EngineConfig.two_phase) and a real clock: what the benches of Cluster's steps on one node use."""
    import tempfile

    import redis.asyncio as aioredis

    from delayed_middleware.clock import SystemClock
    from delayed_middleware.engine import DelayEngine, EngineConfig
    from delayed_middleware.schedules import EnvelopeRecurrence
    from tests.redis_server import RedisServer

    with tempfile.TemporaryDirectory(prefix=prefix) as d:
        server = RedisServer(Path(d) / "redis", appendonly=False)
        server.start()
        try:
            client = aioredis.Redis(port=server.port)
            config = EngineConfig(two_phase=True)
            yield (
                client,
                DelayEngine(client, keys, SystemClock(), config=config, recurrence=EnvelopeRecurrence()),
            )
            await client.aclose()
        finally:
            server.stop()
