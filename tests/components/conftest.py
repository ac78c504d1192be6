"""A component server on a unix socket and a daprd-like driver for it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc
import httpx
import pytest
import redis
from playwright.async_api import Browser, async_playwright

from delayed_middleware.clock import SystemClock
from delayed_pubsub.server import ComponentServer
from tests.chaos.proxy import DelayingProxy, LateReplyProxy, LosingProxy
from tests.components.driver import Component
from tests.redis_server import RedisServer, free_port

P = TypeVar("P", DelayingProxy, LateReplyProxy, LosingProxy)

# Small timeouts keep redelivery tests fast; values a user could set.
FAST = {"processingTimeout": "500ms", "redeliverInterval": "200ms"}


@pytest.fixture
def socket_path(tmp_path: Path) -> Iterator[Path]:
    """A socket path in tmp_path, or in a short temp dir when tmp_path would
    exceed the 107-byte limit on unix socket paths."""
    path = tmp_path / "delayed-pubsub.sock"
    if len(str(path)) < 100:
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="dps-") as short:
        yield Path(short) / "delayed-pubsub.sock"


@pytest.fixture
def folder() -> Iterator[Path]:
    """A short temporary folder for serve processes' sockets and logs (unix socket paths are
    limited to 107 bytes)."""
    with tempfile.TemporaryDirectory(prefix="dps-") as d:
        yield Path(d)


@pytest.fixture
def props(redis_server: RedisServer, redis_client: object) -> dict[str, str]:
    """Init metadata for the test Redis (flushed: redis_client is requested for that)."""
    return {"redisHost": f"127.0.0.1:{redis_server.port}", "consumerID": "app1", **FAST}


@contextlib.asynccontextmanager
async def running(proxy: P) -> AsyncIterator[P]:
    """`proxy` listening for the length of the block."""
    await proxy.start()
    try:
        yield proxy
    finally:
        await proxy.stop()


@pytest.fixture
async def slow_claims(redis_server: RedisServer) -> AsyncIterator[DelayingProxy]:
    """A proxy in front of the test Redis that, once armed, holds every command naming XCLAIM
    (XCLAIM itself, or a script that claims) `delay_s` on the wire (the test sets it)."""
    async with running(DelayingProxy(redis_server.port, b"XCLAIM", delay_s=0.0)) as proxy:
        yield proxy


@pytest.fixture
async def slow_retry_records(redis_server: RedisServer) -> AsyncIterator[DelayingProxy]:
    """A proxy in front of the test Redis that, once armed, holds a nack's retry record (the
    round trip that writes its `retried` history entry) `delay_s` on the wire (the test sets it)."""
    async with running(DelayingProxy(redis_server.port, b"retried", delay_s=0.0)) as proxy:
        yield proxy


@pytest.fixture
async def lost_claim_reply(redis_server: RedisServer) -> AsyncIterator[LosingProxy]:
    """A proxy in front of the test Redis that, once armed, lets the next conditional claim
    (lua/claim_unchanged.lua) run and cuts the connection before its reply gets back."""
    async with running(LosingProxy(redis_server.port, b"CLAIM_UNCHANGED (broker")) as proxy:
        yield proxy


@pytest.fixture
async def server(socket_path: Path) -> AsyncIterator[ComponentServer]:
    srv = ComponentServer(socket_path, SystemClock())
    await srv.start()
    yield srv
    await srv.stop(grace=1)


@pytest.fixture
async def channel(server: ComponentServer) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(f"unix://{server.socket_path}") as ch:
        yield ch


@pytest.fixture
def component(channel: grpc.aio.Channel) -> Callable[[str], Component]:
    """Factory: the component instance `name` on the shared socket."""
    return lambda name: Component(channel, name)


@dataclass(frozen=True)
class CliRun:
    """One `delayed-pubsub` process: exit code, output and its own peak RSS."""

    code: int
    out: str
    err: str
    peak_rss_mb: float

    def json(self) -> Any:
        return json.loads(self.out)


# Starts the CLI and writes its own peak RSS (KB) to argv[1]. A child's ru_maxrss starts at
# what its parent held when it forked; this small launcher, not the test process (hundreds
# of MB once Spark has run), is the parent the measure starts from.
_LAUNCHER = """
import os, subprocess, sys
proc = subprocess.Popen(sys.argv[2:])
_, status, usage = os.wait4(proc.pid, 0)
with open(sys.argv[1], "w") as f:
    f.write(str(usage.ru_maxrss))
sys.exit(os.waitstatus_to_exitcode(status))
"""


def run_cli(*args: str, timeout: float = 120.0) -> CliRun:
    """Run the CLI as a real process (the venv's console script) and measure its peak RSS."""
    exe = Path(sys.executable).with_name("delayed-pubsub")
    with tempfile.TemporaryDirectory() as work:
        out_path, err_path, rss_path = (Path(work) / name for name in ("out", "err", "rss"))
        with out_path.open("wb") as out, err_path.open("wb") as err:
            proc = subprocess.Popen(
                [sys.executable, "-c", _LAUNCHER, str(rss_path), str(exe), *args],
                stdout=out,
                stderr=err,
                env={**os.environ, "COLUMNS": "250"},
                start_new_session=True,
            )
            try:
                code = proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                raise AssertionError(
                    f"delayed-pubsub {' '.join(args)} still running after {timeout} s"
                ) from None
        rss_kb = int(rss_path.read_text())
        return CliRun(code, out_path.read_text(), err_path.read_text(), rss_kb / 1024)


def write_history(client: redis.Redis, key: str, records: Iterable[tuple[str, Mapping[str, str]]]) -> None:
    """Write hand-made history records (explicit stream ids) as the engine's scripts lay them out."""
    pipe = client.pipeline(transaction=False)
    for n, (entry_id, fields) in enumerate(records, 1):
        pipe.xadd(key, dict(fields), id=entry_id)  # type: ignore[arg-type]
        if n % 5_000 == 0:
            pipe.execute()
    pipe.execute()


def history_fields(event: str, id: str, at_ms: int, **more: str) -> dict[str, str]:
    """Every field of a history record (delayed_middleware.history), in the scripts' order."""
    fields = {
        "event": event,
        "at": str(at_ms),
        "id": id,
        "sid": "",
        "topic": "orders",
        "kind": "oneshot",
        "due": str(at_ms),
        "late": "",
        "size": "3",
        "attempt": "1",
        "reason": "",
        "schedule": "",
    }
    fields.update(more)
    return fields


# --- the dashboard: a real `delayed-pubsub dashboard` process and a real headless Chromium ------


@dataclass(frozen=True)
class Dashboard:
    """A running `delayed-pubsub dashboard`: its base URL and process."""

    url: str
    proc: subprocess.Popen[bytes]
    log: Path

    def health(self) -> Any:
        return httpx.get(f"{self.url}/healthz", timeout=5).json()


@pytest.fixture
def dashboard(tmp_path: Path) -> Iterator[Callable[..., Dashboard]]:
    """Factory: start `delayed-pubsub dashboard *args` (with `env` over ours), wait until it answers."""
    started: list[Dashboard] = []

    def start(*args: str, env: Mapping[str, str] | None = None) -> Dashboard:
        port = free_port()
        log = tmp_path / f"dashboard-{port}.log"
        exe = Path(sys.executable).with_name("delayed-pubsub")
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [str(exe), "dashboard", "--port", str(port), *args],
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {})},
            )
        d = Dashboard(f"http://127.0.0.1:{port}", proc, log)
        started.append(d)
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"{d.url}/healthz", timeout=1).status_code == 200:
                    return d
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"the dashboard did not start: {log.read_text()}")
            time.sleep(0.1)

    yield start
    for d in started:
        d.proc.send_signal(signal.SIGTERM)
        try:
            d.proc.wait(10)
        except subprocess.TimeoutExpired:
            d.proc.kill()
            d.proc.wait()


def chromium_path() -> str:
    """The Debian chromium (scripts/setup.sh installs it): a missing browser fails the test."""
    path = shutil.which("chromium")
    if path is None:
        pytest.fail("chromium is not installed (scripts/setup.sh installs it: apt-get install chromium)")
    return path


@pytest.fixture
async def browser() -> AsyncIterator[Browser]:
    """A headless Chromium from Debian packages, driven by Playwright (never its own browser build)."""
    async with async_playwright() as p:
        b = await p.chromium.launch(executable_path=chromium_path(), headless=True, args=["--no-sandbox"])
        try:
            yield b
        finally:
            await b.close()


@dataclass(frozen=True)
class GhzRun:
    """One ghz run: requests sent, calls/s, the count per status code name, the distinct error texts."""

    requests: int
    rps: float
    codes: dict[str, int]
    errors: list[str]


class Ghz:
    """ghz (a Go gRPC load generator, as daprd is a Go client) driving the component's Publish."""

    PROTO_ROOT = Path(__file__).resolve().parents[2] / "proto"

    def __init__(self, exe: str) -> None:
        self.exe = exe

    async def publish(
        self,
        sock: Path,
        instance: str,
        topic: str,
        requests: int,
        callers: int,
        rps: float = 0,
        timeout_s: float = 0,
    ) -> GhzRun:
        """`requests` delayed publishes (due in 1 s) to `topic` from `callers` concurrent callers on
        one connection, at most `rps` a second if given, each with a deadline of `timeout_s` if
        given (else ghz's 20 s); each carries its request number as metadata `n`."""
        request = {
            "pubsub_name": instance,
            "topic": topic,
            "data": "e30=",  # {}
            "metadata": {"scheduledSendDelay": "1s", "n": "{{.RequestNumber}}"},
        }
        args = [
            self.exe,
            "--insecure",
            "--proto",
            str(self.PROTO_ROOT / "dapr/proto/components/v1/pubsub.proto"),
            "--import-paths",
            str(self.PROTO_ROOT),
            "--call",
            "dapr.proto.components.v1.PubSub/Publish",
            "-m",
            json.dumps({"x-component-instance": instance}),
            "-d",
            json.dumps(request),
            "-n",
            str(requests),
            "-c",
            str(callers),
            "--connections",
            "1",
            "--format",
            "json",
        ]
        if rps:
            args += ["--rps", str(int(rps))]
        if timeout_s:
            args += ["--timeout", f"{timeout_s}s"]
        proc = await asyncio.create_subprocess_exec(
            *args, f"unix://{sock}", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
        )
        out, err = await proc.communicate()
        assert proc.returncode == 0, err.decode()
        report = json.loads(out)
        return GhzRun(
            requests=requests,
            rps=float(report["rps"]),
            codes=dict(report.get("statusCodeDistribution") or {}),
            errors=list(report.get("errorDistribution") or {}),
        )


@pytest.fixture(scope="session")
def ghz() -> Ghz:
    """ghz, found on PATH or built once from the Go module proxy into ~/.cache (as the benches do)."""
    from bench.grpc_ceiling import ghz_path

    return Ghz(ghz_path())
