"""Process harness for the end-to-end tests: Redis, the component, daprd and a subscriber app.

Everything listens on free loopback ports and lives in a private temp dir. Each process runs
in its own process group and is stopped (SIGTERM, then SIGKILL) by the fixture that started it,
so a failed test leaves nothing behind. Missing binaries are failures, never skips.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest

from tests import waiting
from tests.redis_server import free_port

REPO = Path(__file__).resolve().parents[2]

# Component policy the tests assert against: redelivery after an ack_error comes after
# redeliverInterval; entries of a dead stream after processingTimeout.
REDELIVER_INTERVAL_S = 1.0
PROCESSING_TIMEOUT_S = 5.0

# A delayed message must never arrive before it is due, and at most this late under daprd
# (component fire + daprd's PullMessages hop + the HTTP call to the app).
LATENESS_TOLERANCE_MS = 1500

# E2E_COMPONENT=builtin runs the same stack on daprd's own pubsub.redis instead of ours: a check
# of the harness itself (the delayed tests are expected to fail there: pubsub.redis ignores delays).
BUILTIN = os.environ.get("E2E_COMPONENT", "") == "builtin"
COMPONENT_TYPE = "pubsub.redis" if BUILTIN else "pubsub.delayed-pubsub"


class HarnessError(RuntimeError):
    """A process of the stack did not start or answer; the message carries its log tail."""


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def rfc3339(ms: int, offset_hours: int = 0) -> str:
    """An RFC3339 instant with whole seconds, `Z` or a numeric offset (both are in the contract)."""
    if offset_hours == 0:
        return datetime.fromtimestamp(ms / 1000, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    from datetime import timedelta, timezone

    tz = timezone(timedelta(hours=offset_hours))
    return datetime.fromtimestamp(ms / 1000, tz).isoformat(timespec="seconds")


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


@dataclass
class ManagedProcess:
    """A child process in its own process group, logging to a file."""

    name: str
    args: Sequence[str]
    log_path: Path
    env: Mapping[str, str] | None = None
    cwd: Path | None = None
    proc: subprocess.Popen[bytes] | None = field(default=None, init=False)

    def start(self) -> ManagedProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("ab")
        try:
            self.proc = subprocess.Popen(
                list(self.args),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=dict(self.env) if self.env is not None else None,
                cwd=self.cwd,
                start_new_session=True,
            )
        finally:
            log.close()
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def fail(self, what: str) -> HarnessError:
        state = "running" if self.alive() else f"exited with {self.proc.returncode if self.proc else None}"
        return HarnessError(
            f"{self.name}: {what} ({state}); log {self.log_path}, last lines:\n{self.log_tail()}"
        )

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM the whole process group, then SIGKILL what is left."""
        if self.proc is None:
            return
        proc, self.proc = self.proc, None
        for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                continue
            # The leader is gone; children of the group may live on: make sure.
            with suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            break
        if proc.poll() is None:
            proc.wait(timeout=5)


# tests.waiting's blocking wait, as every e2e wait needs it: a socket or HTTP endpoint that does
# not answer yet is "not yet", and a timeout is a HarnessError (the tests catch it to add context).
wait_until_blocking = functools.partial(
    waiting.wait_until_blocking, tolerate=(OSError, httpx.HTTPError), error=HarnessError
)


def find_daprd() -> str:
    """The daprd of scripts/daprd.sh (honours $DAPRD; builds into ~/.cache if needed)."""
    script = REPO / "scripts" / "daprd.sh"
    result = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=3600, check=False)
    path = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    if result.returncode != 0 or not path:
        raise HarnessError(f"scripts/daprd.sh found no daprd (exit {result.returncode}):\n{result.stderr}")
    return path


def component_yaml(name: str, metadata: Mapping[str, str], component_type: str = COMPONENT_TYPE) -> str:
    """A Dapr Component resource; values are JSON-quoted (valid YAML) so nothing is mis-typed."""
    lines = [
        "apiVersion: dapr.io/v1alpha1",
        "kind: Component",
        "metadata:",
        f"  name: {name}",
        "spec:",
        f"  type: {component_type}",
        "  version: v1",
        "  metadata:",
    ]
    for key, value in metadata.items():
        lines += [f"    - name: {key}", f"      value: {json.dumps(str(value))}"]
    return "\n".join(lines) + "\n"


def component_metadata(redis_port: int, **extra: str) -> dict[str, str]:
    meta = {
        "redisHost": f"127.0.0.1:{redis_port}",
        "processingTimeout": f"{PROCESSING_TIMEOUT_S:g}s",
        "redeliverInterval": f"{REDELIVER_INTERVAL_S:g}s",
    }
    if not BUILTIN:
        meta["enableDelayedMessaging"] = "true"
    meta.update(extra)
    return meta


def start_component(workdir: Path, socket_dir: Path, *extra: str) -> ManagedProcess:
    """`delayed-pubsub serve --socket <dir>/delayed-pubsub.sock EXTRA`; returns once the socket exists."""
    socket_dir.mkdir(parents=True, exist_ok=True)
    sock = socket_dir / "delayed-pubsub.sock"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    exe = Path(sys.executable).with_name("delayed-pubsub")
    if exe.exists():
        args = [str(exe)]
    else:
        # Not installed (no `pip install -e .` yet): run it from the source tree.
        args = [sys.executable, "-m", "delayed_pubsub.cli"]
        src = os.pathsep.join(str(REPO / d) for d in ("proto", "middleware", "components"))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [src, env.get("PYTHONPATH", "")]))
    proc = ManagedProcess(
        "delayed-pubsub serve",
        [*args, "serve", "--socket", str(sock), *extra],
        workdir / "component.log",
        env=env,
    ).start()
    # daprd scans the socket folder once at start: the socket must be there before it starts.
    wait_until_blocking(sock.is_socket, f"socket {sock}", 30, process=proc)
    return proc


def start_subscriber(workdir: Path, port: int, subs: Sequence[str]) -> ManagedProcess:
    args = [sys.executable, str(REPO / "examples" / "subscriber.py"), "--port", str(port)]
    for sub in subs:
        args += ["--sub", sub]
    args += ["--arrivals", str(workdir / "arrivals.jsonl")]
    proc = ManagedProcess("subscriber", args, workdir / "subscriber.log").start()
    wait_until_blocking(
        lambda: httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200,
        "subscriber /healthz",
        15,
        process=proc,
    )
    return proc


@dataclass(frozen=True)
class DaprdPorts:
    http: int
    grpc: int
    metrics: int
    internal_grpc: int

    @classmethod
    def free(cls) -> DaprdPorts:
        return cls(free_port(), free_port(), free_port(), free_port())


def daprd_args(daprd: str, app_id: str, app_port: int, resources: Path, ports: DaprdPorts) -> list[str]:
    """Standalone daprd bound to loopback only, with no placement, scheduler or control plane."""
    return [
        daprd,
        "--mode", "standalone",
        "--app-id", app_id,
        "--app-port", str(app_port),
        "--app-protocol", "http",
        "--app-channel-address", "127.0.0.1",
        "--resources-path", str(resources),
        "--dapr-http-port", str(ports.http),
        "--dapr-grpc-port", str(ports.grpc),
        "--dapr-listen-addresses", "127.0.0.1",
        "--dapr-internal-grpc-port", str(ports.internal_grpc),
        "--dapr-internal-grpc-listen-address", "127.0.0.1",
        "--metrics-port", str(ports.metrics),
        "--metrics-listen-address", "127.0.0.1",
        "--enable-metrics=false",
        # Empty: no actors (no placement) and no scheduler, so nothing dials out.
        "--placement-host-address", "",
        "--scheduler-host-address", "",
        "--log-level", "info",
    ]  # fmt: skip


def start_daprd(
    daprd: str,
    workdir: Path,
    socket_dir: Path,
    app_id: str,
    app_port: int,
    resources: Path,
    ports: DaprdPorts,
) -> ManagedProcess:
    env = {**os.environ, "DAPR_COMPONENTS_SOCKETS_FOLDER": str(socket_dir)}
    # Keep daprd from reading or writing the user's ~/.dapr.
    env["HOME"] = str(workdir / "home")
    (workdir / "home").mkdir(exist_ok=True)
    proc = ManagedProcess(
        "daprd",
        daprd_args(daprd, app_id, app_port, resources, ports),
        workdir / "daprd.log",
        env=env,
        cwd=workdir,
    ).start()
    base = f"http://127.0.0.1:{ports.http}/v1.0"
    # /healthz is 204 once components are loaded and the app channel is up.
    wait_until_blocking(
        lambda: httpx.get(f"{base}/healthz", timeout=1).status_code == 204,
        "daprd /v1.0/healthz",
        60,
        process=proc,
    )
    return proc


@dataclass
class Stack:
    """A running Redis + component + daprd + subscriber, and helpers to drive it."""

    workdir: Path
    redis_port: int
    app_port: int
    ports: DaprdPorts
    pubsubs: tuple[str, ...]
    daprd: ManagedProcess
    component: ManagedProcess | None
    subscriber: ManagedProcess
    client: httpx.Client = field(default_factory=lambda: httpx.Client(timeout=30))

    @property
    def dapr_url(self) -> str:
        return f"http://127.0.0.1:{self.ports.http}"

    @property
    def app_url(self) -> str:
        return f"http://127.0.0.1:{self.app_port}"

    def publish(
        self,
        pubsub: str,
        topic: str,
        body: bytes | str | Mapping[str, Any],
        metadata: Mapping[str, str] | None = None,
        content_type: str = "application/json",
    ) -> httpx.Response:
        """`POST /v1.0/publish/<pubsub>/<topic>?metadata.K=V` exactly as curl would."""
        query = "&".join(f"metadata.{quote(k)}={quote(v, safe='')}" for k, v in (metadata or {}).items())
        url = f"{self.dapr_url}/v1.0/publish/{pubsub}/{topic}" + (f"?{query}" if query else "")
        content = json.dumps(body).encode() if isinstance(body, Mapping) else body
        return self.client.post(url, content=content, headers={"Content-Type": content_type})

    def bulk_publish(
        self,
        pubsub: str,
        topic: str,
        entries: Sequence[Mapping[str, Any]],
        metadata: Mapping[str, str] | None = None,
    ) -> httpx.Response:
        query = "&".join(f"metadata.{quote(k)}={quote(v, safe='')}" for k, v in (metadata or {}).items())
        url = f"{self.dapr_url}/v1.0-alpha1/publish/bulk/{pubsub}/{topic}" + (f"?{query}" if query else "")
        return self.client.post(url, json=list(entries))

    def arrivals(self) -> list[dict[str, Any]]:
        response = self.client.get(f"{self.app_url}/arrivals")
        response.raise_for_status()
        result: list[dict[str, Any]] = response.json()
        return result

    def arm_failure(self, match: str, times: int) -> None:
        self.client.post(f"{self.app_url}/fail", json={"match": match, "times": times}).raise_for_status()

    def wait_arrivals(
        self, match: Callable[[dict[str, Any]], bool], count: int, timeout: float
    ) -> list[dict[str, Any]]:
        """Arrivals selected by `match`, once there are at least `count` (or the timeout: fewer)."""
        deadline = time.monotonic() + timeout
        while True:
            found = [a for a in self.arrivals() if match(a)]
            if len(found) >= count or time.monotonic() > deadline:
                return found
            for proc in (self.daprd, self.component, self.subscriber):
                if proc is not None and not proc.alive():
                    raise proc.fail("died during the test")
            time.sleep(0.05)

    def logs(self) -> str:
        """The component's and the app's log tails, and daprd's warnings and errors (its info is noise)."""
        parts = [f"--- {p.name} ---\n{p.log_tail(40)}" for p in (self.component, self.subscriber) if p]
        try:
            daprd_lines = self.daprd.log_path.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            daprd_lines = []
        notable = [line for line in daprd_lines if "level=info" not in line and "level=debug" not in line]
        parts.append("--- daprd (warnings and errors) ---\n" + "\n".join(notable[-40:]))
        return "\n".join(parts)


@contextmanager
def started_stack(
    daprd_path: str,
    workdir: Path,
    resources: Path,
    *,
    redis_port: int,
    pubsubs: tuple[str, ...],
    subscriptions: Sequence[str],
    app_id: str,
    component: bool = True,
    component_args: Sequence[str] = (),
) -> Iterator[Stack]:
    """The component (unless `component` is False: daprd's built-in then serves the YAMLs; started
    with `component_args` added to `serve`), the subscriber app and daprd over `resources`; stopped
    in reverse order, daprd first (it holds the streams), then the component, then the app. A
    HarnessError fails the test with its message."""
    socket_dir = workdir / "sockets"
    started: list[ManagedProcess] = []
    try:
        proc = None
        if component:
            proc = start_component(workdir, socket_dir, *component_args)
            started.append(proc)
        app_port = free_port()
        subscriber = start_subscriber(workdir, app_port, subscriptions)
        started.append(subscriber)
        ports = DaprdPorts.free()
        daprd = start_daprd(daprd_path, workdir, socket_dir, app_id, app_port, resources, ports)
        started.append(daprd)
        s = Stack(
            workdir=workdir,
            redis_port=redis_port,
            app_port=app_port,
            ports=ports,
            pubsubs=pubsubs,
            daprd=daprd,
            component=proc,
            subscriber=subscriber,
        )
        yield s
        s.client.close()
    except HarnessError as exc:
        pytest.fail(str(exc), pytrace=False)
    finally:
        for p in reversed(started):
            p.stop()


@contextmanager
def dapr_client(stack: Stack, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The Dapr Python SDK's DaprClient on the stack's daprd (its health probe uses the HTTP port)."""
    from dapr.clients import DaprClient

    monkeypatch.setenv("DAPR_HTTP_ENDPOINT", stack.dapr_url)
    monkeypatch.setenv("DAPR_HEALTH_TIMEOUT", "10")
    client = DaprClient(address=f"127.0.0.1:{stack.ports.grpc}")
    try:
        yield client
    finally:
        client.close()  # type: ignore[no-untyped-call]


def carries(marker: str) -> Callable[[dict[str, Any]], bool]:
    """Arrivals whose body mentions `marker` (our payloads carry a unique id)."""
    return lambda a: (
        marker in a["body"] or marker in bytes.fromhex(a.get("raw_hex", "")).decode(errors="replace")
    )


# (test name, lateness in ms) of every delayed message a test saw arrive; printed at the end.
LATENESS: list[tuple[str, int]] = []
