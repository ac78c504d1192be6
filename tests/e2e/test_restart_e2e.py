"""The component restarted under a running daprd (SIGKILL, then a new `serve`), end to end.

A stack of its own (Redis is shared, everything else is private): killing the
session stack's component would orphan the other tests' subscriptions.

What a user checks: the next HTTP publishes through daprd succeed (plain and
delayed, and the delayed one fires); the subscription that died is reported in the
component's log, its metrics and its grpc.health.v1 service; restarting daprd
resumes it and delivers what was published meanwhile: nothing is lost.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.e2e import harness
from tests.e2e.harness import ManagedProcess
from tests.redis_server import RedisServer, free_port

APP_ID = "restart-app"
PUBSUB = "delayed"
TOPIC = "restart-orders"
SUBS_HEALTH = "delayed-pubsub.subscriptions"
# The built-in pubsub.redis component of the fast-path layout.
FAST = "fast"


@dataclass
class RestartStack:
    workdir: Path
    socket_dir: Path
    resources: Path
    daprd_path: str
    redis: RedisServer
    ports: harness.DaprdPorts
    app_port: int
    metrics_port: int
    component: ManagedProcess
    subscriber: ManagedProcess
    daprd: ManagedProcess
    client: httpx.Client

    @property
    def socket(self) -> Path:
        return self.socket_dir / "delayed-pubsub.sock"

    def start_component(self) -> None:
        self.component = start_component(self.workdir, self.socket_dir, self.metrics_port)

    def start_daprd(self) -> None:
        self.daprd = harness.start_daprd(
            self.daprd_path, self.workdir, self.socket_dir, APP_ID, self.app_port, self.resources, self.ports
        )

    def publish(
        self, body: dict[str, str], metadata: dict[str, str] | None = None, pubsub: str = PUBSUB
    ) -> httpx.Response:
        query = "&".join(f"metadata.{k}={v}" for k, v in (metadata or {}).items())
        url = f"http://127.0.0.1:{self.ports.http}/v1.0/publish/{pubsub}/{TOPIC}" + (
            f"?{query}" if query else ""
        )
        return self.client.post(url, json=body)

    def arrivals(self, marker: str) -> list[dict[str, object]]:
        got = self.client.get(f"http://127.0.0.1:{self.app_port}/arrivals").json()
        return [a for a in got if marker in a["body"]]

    def wait_arrival(self, marker: str, timeout: float) -> list[dict[str, object]]:
        deadline = time.monotonic() + timeout
        while not (found := self.arrivals(marker)) and time.monotonic() < deadline:
            time.sleep(0.05)
        return found

    def orphan_gauge(self) -> float | None:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
            body = r.read().decode()
        m = re.search(rf'^delayed_pubsub_orphaned_subscriptions\{{instance="{PUBSUB}"\}} (\S+)$', body, re.M)
        return float(m.group(1)) if m else None

    def health(self, service: str) -> int:
        with grpc.insecure_channel(f"unix://{self.socket}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        return int(reply.status)


def _entries(db: redis.Redis) -> list[tuple[bytes, dict[bytes, bytes]]]:
    entries: list[tuple[bytes, dict[bytes, bytes]]] = db.xrange(TOPIC)  # type: ignore[assignment]
    return entries


def start_component(workdir: Path, socket_dir: Path, metrics_port: int) -> ManagedProcess:
    """`delayed-pubsub serve` with metrics, appending to one log across restarts."""
    socket_dir.mkdir(parents=True, exist_ok=True)
    sock = socket_dir / "delayed-pubsub.sock"
    exe = Path(sys.executable).with_name("delayed-pubsub")
    args = [str(exe), "serve", "--socket", str(sock), "--metrics-port", str(metrics_port)]
    proc = ManagedProcess(
        "delayed-pubsub serve", args, workdir / "component.log", env={**os.environ, "PYTHONUNBUFFERED": "1"}
    ).start()
    harness.wait_until_blocking(lambda: _answers(sock), f"socket {sock}", 30, process=proc)
    return proc


def _answers(sock: Path) -> bool:
    import socket

    if not sock.is_socket():
        return False
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(str(sock))  # a stale socket left by SIGKILL refuses: wait for the new one
    return True


@contextmanager
def build_stack(
    daprd_path: str, redis_server: RedisServer, workdir: Path, yamls: dict[str, str], subs: list[str]
) -> Iterator[RestartStack]:
    """Component (with metrics), subscriber app and daprd, in that order; all stopped at the end."""
    if harness.BUILTIN:
        pytest.fail("the restart tests are about our component: run them without E2E_COMPONENT=builtin")
    socket_dir = workdir / "sockets"
    resources = workdir / "resources"
    resources.mkdir()
    for name, text in yamls.items():
        (resources / f"{name}.yaml").write_text(text)
    metrics_port = free_port()
    started: list[ManagedProcess] = []
    try:
        component = start_component(workdir, socket_dir, metrics_port)
        started.append(component)
        app_port = free_port()
        subscriber = harness.start_subscriber(workdir, app_port, subs)
        started.append(subscriber)
        ports = harness.DaprdPorts.free()
        daprd = harness.start_daprd(daprd_path, workdir, socket_dir, APP_ID, app_port, resources, ports)
        s = RestartStack(
            workdir, socket_dir, resources, daprd_path, redis_server, ports, app_port, metrics_port,
            component, subscriber, daprd, httpx.Client(timeout=30),
        )  # fmt: skip
        yield s
        s.client.close()
        started = [s.daprd, s.component, s.subscriber]
    except harness.HarnessError as exc:
        pytest.fail(str(exc), pytrace=False)
    finally:
        for proc in started:
            proc.stop()


@pytest.fixture(scope="module")
def rstack(
    daprd_path: str, e2e_redis: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RestartStack]:
    """Our component, subscribed through it (the layout a restart orphans)."""
    meta = harness.component_metadata(e2e_redis.port, redisDB="3", consumerID=APP_ID)
    with build_stack(
        daprd_path,
        e2e_redis,
        Path(tmp_path_factory.mktemp("e2e-restart")),
        {PUBSUB: harness.component_yaml(PUBSUB, meta)},
        [f"{PUBSUB}={TOPIC}"],
    ) as s:
        yield s


@pytest.fixture(scope="module")
def fast_stack(
    daprd_path: str, e2e_redis: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RestartStack]:
    """The fast-path layout: publish through our component, subscribe through daprd's built-in
    pubsub.redis on the same Redis database and consumer group."""
    ours = harness.component_metadata(e2e_redis.port, redisDB="4", consumerID=APP_ID)
    builtin = {"redisHost": f"127.0.0.1:{e2e_redis.port}", "redisDB": "4", "consumerID": APP_ID}
    with build_stack(
        daprd_path,
        e2e_redis,
        Path(tmp_path_factory.mktemp("e2e-fast-restart")),
        {
            PUBSUB: harness.component_yaml(PUBSUB, ours),
            FAST: harness.component_yaml(FAST, builtin, component_type="pubsub.redis"),
        },
        [f"{FAST}={TOPIC}"],
    ) as s:
        yield s


def test_after_sigkill_and_restart_publishes_succeed_and_the_orphaned_subscription_is_told(
    rstack: RestartStack,
) -> None:
    s = rstack
    r = s.publish({"id": "before-restart"})
    assert r.status_code == 204, r.text
    assert s.wait_arrival("before-restart", 15), "the subscription did not work before the restart"
    record = s.socket_dir / "delayed-pubsub.records" / f"{PUBSUB}.json"
    assert oct(record.stat().st_mode & 0o777) == "0o600"
    assert json.loads(record.read_bytes())["topics"] == [TOPIC]

    # An OOM kill: nothing is cleaned up, the socket stays behind, daprd keeps running.
    kill_and_restart_component(s)

    began = time.time()
    plain = s.publish({"id": "plain-after-restart"})
    assert plain.status_code == 204, f"{plain.status_code} {plain.text}\n{s.component.log_tail()}"
    delayed = s.publish({"id": "delayed-after-restart"}, {"scheduledSendDelay": "1s"})
    assert delayed.status_code == 204, f"{delayed.status_code} {delayed.text}"

    # The delayed one fires: it lands on its topic (the stream daprd would read) after a second.
    db = redis.Redis(port=s.redis.port, db=3)
    try:
        deadline = time.monotonic() + 10
        while not any(b"delayed-after-restart" in f[b"data"] for _, f in _entries(db)):
            assert time.monotonic() < deadline, "the delayed message never fired"
            time.sleep(0.05)
        assert time.time() - began >= 1.0
    finally:
        db.close()

    # The subscription is orphaned (daprd never re-opens a stream): told in all three places.
    harness.wait_until_blocking(
        lambda: s.health(SUBS_HEALTH) == health_pb2.HealthCheckResponse.NOT_SERVING,
        "orphan health",
        10,
    )
    assert s.health("") == health_pb2.HealthCheckResponse.SERVING
    assert s.orphan_gauge() == 1.0
    log = s.component.log_path.read_text()
    told = [line for line in log.splitlines() if " ERROR " in line and "daprd never re-opens" in line]
    assert len(told) == 1, log[-3000:]
    assert repr(TOPIC) in told[0]
    # Really orphaned: nothing published after the restart has reached the app.
    time.sleep(1.5)
    assert not s.arrivals("plain-after-restart")

    # The way out: restart daprd. It Inits, re-subscribes, and what waited in Redis arrives.
    s.daprd.stop()
    s.start_daprd()
    assert s.wait_arrival("plain-after-restart", 30)
    assert s.wait_arrival("delayed-after-restart", 30)
    harness.wait_until_blocking(
        lambda: s.health(SUBS_HEALTH) == health_pb2.HealthCheckResponse.SERVING,
        "health back",
        10,
    )
    assert s.orphan_gauge() == 0.0


def kill_and_restart_component(s: RestartStack) -> None:
    assert s.component.proc is not None
    os.killpg(s.component.proc.pid, signal.SIGKILL)
    s.component.proc.wait(10)
    s.component.proc = None
    s.start_component()


def test_fast_path_subscribers_keep_receiving_across_a_component_restart(fast_stack: RestartStack) -> None:
    s = fast_stack
    assert s.publish({"id": "fast-delayed-before"}, {"scheduledSendDelay": "1s"}).status_code == 204
    assert s.wait_arrival("fast-delayed-before", 15), (
        "a delayed message did not reach the pubsub.redis subscriber"
    )

    assert s.component.proc is not None
    os.killpg(s.component.proc.pid, signal.SIGKILL)
    s.component.proc.wait(10)
    s.component.proc = None
    # Our component is down: the built-in subscription does not care.
    assert s.publish({"id": "fast-while-down"}, pubsub=FAST).status_code == 204
    assert s.wait_arrival("fast-while-down", 15)
    s.start_component()

    r = s.publish({"id": "fast-delayed-after"}, {"scheduledSendDelay": "1s"})
    assert r.status_code == 204, r.text
    assert s.wait_arrival("fast-delayed-after", 15), s.component.log_tail()
    assert s.publish({"id": "fast-plain-after"}, pubsub=FAST).status_code == 204
    assert s.wait_arrival("fast-plain-after", 15)
    # Nothing of ours was subscribed: nothing is orphaned, nothing to restart.
    assert s.health(SUBS_HEALTH) == health_pb2.HealthCheckResponse.SERVING
    assert s.orphan_gauge() in (None, 0.0)
    assert "daprd never re-opens" not in s.component.log_path.read_text()


def test_a_record_left_by_another_user_is_refused_and_daprd_reports_why(rstack: RestartStack) -> None:
    s = rstack
    assert s.publish({"id": "before-foreign"}).status_code == 204
    record = s.socket_dir / "delayed-pubsub.records" / f"{PUBSUB}.json"
    # Someone else's file in our place (or ours, tampered with): never trusted.
    os.chown(record, 65534, 65534)
    kill_and_restart_component(s)
    r = s.publish({"id": "after-foreign"})
    assert r.status_code == 500
    assert "owned by uid 65534" in r.text, r.text
    assert "restart daprd" in r.text
    log = s.component.log_path.read_text()
    assert any(" ERROR " in line and "owned by uid 65534" in line for line in log.splitlines())

    # The way out works here too: daprd's Init writes a fresh record of our own.
    s.daprd.stop()
    s.start_daprd()
    assert s.publish({"id": "after-daprd-restart"}).status_code == 204
    assert s.wait_arrival("after-daprd-restart", 15)
    assert record.stat().st_uid == os.geteuid()
    assert oct(record.stat().st_mode & 0o777) == "0o600"
