"""Hand-offs to another Dapr pub/sub (`targetPubsub`) through a real daprd that is stopped and
started again, with the firing and the forwarders in worker processes (`serve --workers 2`).

The target is Dapr's built-in `pubsub.redis` (component `target`, database 1 of the test Redis;
ours keeps its outbox in database 0); the subscriber app listens on `target/orders`. What a user
checks: every message due while daprd was away arrives once it is back, and none twice (nothing
died, so "at least once" leaves no room for a second copy here).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from delayed_middleware.keys import EngineKeys, delayed_topic
from delayed_middleware.outbox import OUTBOX_GROUP
from tests.components.serve import children_of
from tests.e2e import harness
from tests.e2e.harness import DaprdPorts, ManagedProcess, carries, now_ms, unique
from tests.redis_server import RedisServer, free_port

pytestmark = pytest.mark.e2e

APP_ID = "handoff-app"
OUTBOX = EngineKeys.for_topic(delayed_topic(APP_ID)).outbox
# processingTimeout 5s: another forwarder takes over a pending hand-off after 15 s idle (the floor).
CLAIM_IDLE_S = 15
# Once daprd answers, every forwarder holding a hand-off gets through within its reconnect backoff
# plus its retry backoff (both capped at 5 s): a second copy would come within this, if ever.
SECOND_COPY_WINDOW_S = 12


@dataclass
class HandOffStack:
    daprd_path: str
    workdir: Path
    redis: RedisServer
    app_port: int
    ports: DaprdPorts
    resources: Path
    component: ManagedProcess
    subscriber: ManagedProcess
    daprd: ManagedProcess | None = None

    def start_daprd(self) -> None:
        self.daprd = harness.start_daprd(
            self.daprd_path,
            self.workdir,
            self.workdir / "sockets",
            APP_ID,
            self.app_port,
            self.resources,
            self.ports,
        )
        url = f"http://127.0.0.1:{self.ports.http}/v1.0/metadata"

        def loaded() -> bool:
            meta = httpx.get(url, timeout=2).json()
            names = {c["name"] for c in meta.get("components", [])}
            subs = {(x["pubsubname"], x["topic"]) for x in meta.get("subscriptions", [])}
            return {"delayed", "target"} <= names and ("target", "orders") in subs

        harness.wait_until_blocking(
            loaded, "daprd to load both components and the subscription", 30, process=self.daprd
        )

    def stop_daprd(self) -> None:
        """SIGTERM: an ordinary stop (an upgrade, a rescheduled pod), not a crash."""
        assert self.daprd is not None
        self.daprd.stop()
        self.daprd = None

    def arrivals(self, marker: str) -> list[dict[str, Any]]:
        got: list[dict[str, Any]] = httpx.get(f"http://127.0.0.1:{self.app_port}/arrivals").json()
        return [a for a in got if carries(marker)(a)]


@pytest.fixture(scope="module")
def handoff_stack(daprd_path: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[HandOffStack]:
    workdir = Path(tmp_path_factory.mktemp("e2e-handoff"))
    server = RedisServer(workdir / "redis")
    server.start()
    resources = workdir / "resources"
    resources.mkdir()
    ports = DaprdPorts.free()
    meta = harness.component_metadata(
        server.port, processingTimeout="5s", daprGrpcAddress=f"127.0.0.1:{ports.grpc}"
    )
    (resources / "delayed.yaml").write_text(harness.component_yaml("delayed", meta))
    (resources / "target.yaml").write_text(
        harness.component_yaml(
            "target", {"redisHost": f"127.0.0.1:{server.port}", "redisDB": "1"}, "pubsub.redis"
        )
    )
    started: list[ManagedProcess] = []
    s: HandOffStack | None = None
    try:
        component = harness.start_component(workdir, workdir / "sockets", "--workers", "2")
        started.append(component)
        app_port = free_port()
        subscriber = harness.start_subscriber(workdir, app_port, ["target=orders"])
        started.append(subscriber)
        s = HandOffStack(daprd_path, workdir, server, app_port, ports, resources, component, subscriber)
        s.start_daprd()
        assert component.proc is not None
        pid = component.proc.pid
        harness.wait_until_blocking(lambda: len(children_of(pid)) == 2, "two workers", 30, process=component)
        yield s
    except harness.HarnessError as exc:
        pytest.fail(str(exc), pytrace=False)
    finally:
        if s is not None and s.daprd is not None:
            s.daprd.stop()
        for proc in reversed(started):
            proc.stop()
        server.stop()


@pytest.mark.slow
def test_hand_offs_waiting_out_a_daprd_restart_arrive_once_each(handoff_stack: HandOffStack) -> None:
    """60 hand-offs fall due while daprd is stopped for longer than the takeover time; both
    forwarders stay alive and retry. Once daprd is back each message arrives, once."""
    s = handoff_stack
    marker = unique("outage")
    n = 60
    due = now_ms() + 2000
    entries = [
        {
            "entryId": str(i),
            "event": {"id": f"{marker}-{i}", "n": i},
            "contentType": "application/json",
            "metadata": {"scheduledSendTime": harness.rfc3339(due), "targetPubsub": "target"},
        }
        for i in range(n)
    ]
    url = f"http://127.0.0.1:{s.ports.http}/v1.0-alpha1/publish/bulk/delayed/orders"
    response = httpx.post(url, json=entries, timeout=30)
    assert response.status_code == 204, response.text
    s.stop_daprd()
    db: Any = s.redis.client(db=0)
    try:

        def all_held() -> bool:
            # Fired while daprd is away: every message read by a forwarder, none handed off.
            return int(db.xpending(OUTBOX, OUTBOX_GROUP)["pending"]) == n

        harness.wait_until_blocking(all_held, f"the {n} due hand-offs to be read by the forwarders", 20)
        # Past the takeover idle time, with both forwarders alive and retrying.
        time.sleep(CLAIM_IDLE_S + 5)
        assert s.arrivals(marker) == []
        s.start_daprd()
        deadline = time.monotonic() + 30
        while len(s.arrivals(marker)) < n and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(SECOND_COPY_WINDOW_S)
        got = [a["data"]["n"] for a in s.arrivals(marker)]
        assert sorted(set(got)) == list(range(n)), f"{len(set(got))} of {n} arrived"
        doubled = sorted({k for k in got if got.count(k) > 1})
        assert len(got) == n, f"{len(got)} arrivals for {n} messages; twice: {doubled}"
        harness.wait_until_blocking(lambda: int(db.xlen(OUTBOX)) == 0, "the outbox to empty", 10)
    finally:
        db.close()
