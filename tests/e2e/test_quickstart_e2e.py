"""The README's quickstart, run as written: the repository's component YAML, `delayed-pubsub
serve`, daprd started as `dapr run --app-id quickstart --app-port ...` starts it,
examples/quickstart/subscriber.py (a Dapr Python SDK app, which subscribes in code) as the app
and examples/quickstart/publisher.py (the Python SDK) publishing through that sidecar. What it
checks is what the subscriber prints.

Only two things differ from the README: Redis runs on a private port (the YAML's
``localhost:6379`` is rewritten to it) and daprd's ports are free ones instead of 3500/50001.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import httpx
import pytest

from tests.e2e import harness
from tests.e2e.harness import REPO, ManagedProcess
from tests.redis_server import RedisServer, free_port

pytestmark = pytest.mark.e2e

APP_ID = "quickstart"
# The component's redeliverInterval in dapr/components/delayed-pubsub.yaml: a failed delivery
# comes back after it.
REDELIVER_S = 15
EVERY_MS = 3000


@dataclass
class Quickstart:
    subscriber: ManagedProcess
    daprd: ManagedProcess
    ports: harness.DaprdPorts
    workdir: Path

    def deliveries(self) -> list[dict[str, str]]:
        """The subscriber's printed lines (`orders key=value ...`), parsed."""
        lines = self.subscriber.log_path.read_text(errors="replace").splitlines()
        return [
            dict(pair.split("=", 1) for pair in line.split()[1:])
            for line in lines
            if line.startswith("orders ")
        ]

    def wait(
        self, check: Callable[[list[dict[str, str]]], bool], timeout: float, what: str
    ) -> list[dict[str, str]]:
        def done() -> bool:
            return check(self.deliveries())

        harness.wait_until_blocking(done, what, timeout, process=self.daprd)
        return self.deliveries()


def on_private_redis(component_yaml: str, port: int) -> str:
    """The README's component YAML with its one `localhost:6379` (outside comments) moved to `port`."""
    lines = component_yaml.splitlines(keepends=True)
    live = [i for i, line in enumerate(lines) if "localhost:6379" in line.split("#", 1)[0]]
    assert len(live) == 1, f"the quickstart's YAML should name localhost:6379 once, not on lines {live}"
    lines[live[0]] = lines[live[0]].replace("localhost:6379", f"127.0.0.1:{port}", 1)
    return "".join(lines)


@contextmanager
def running_quickstart(daprd_path: str, workdir: Path, *, subscription_yaml: bool) -> Iterator[Quickstart]:
    """Redis, `delayed-pubsub serve`, the subscriber and its daprd, as the README starts them.

    With ``subscription_yaml`` daprd also loads dapr/subscriptions/orders.yaml (the README's
    alternative for apps that do not subscribe in code), beside the app's own subscription.
    """
    redis = RedisServer(workdir / "redis")
    redis.start()
    started: list[ManagedProcess] = []
    try:
        resources = workdir / "resources"
        resources.mkdir()
        (resources / "delayed-pubsub.yaml").write_text(
            on_private_redis((REPO / "dapr" / "components" / "delayed-pubsub.yaml").read_text(), redis.port)
        )
        if subscription_yaml:
            (resources / "orders.yaml").write_text(
                (REPO / "dapr" / "subscriptions" / "orders.yaml").read_text()
            )

        socket_dir = workdir / "sockets"
        started.append(harness.start_component(workdir, socket_dir))
        app_port = free_port()
        subscriber = ManagedProcess(
            "quickstart subscriber",
            [
                sys.executable,
                str(REPO / "examples" / "quickstart" / "subscriber.py"),
                "--port",
                str(app_port),
            ],
            workdir / "subscriber.log",
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        ).start()
        started.append(subscriber)
        harness.wait_until_blocking(
            lambda: httpx.get(f"http://127.0.0.1:{app_port}/dapr/subscribe", timeout=1).status_code == 200,
            "the quickstart subscriber",
            15,
            process=subscriber,
        )
        ports = harness.DaprdPorts.free()
        daprd = harness.start_daprd(daprd_path, workdir, socket_dir, APP_ID, app_port, resources, ports)
        started.append(daprd)

        def subscribed() -> bool:
            meta = httpx.get(f"http://127.0.0.1:{ports.http}/v1.0/metadata", timeout=2).json()
            # Exactly one subscription, and the app's (GET /dapr/subscribe), not a YAML one.
            subs = [(s["pubsubname"], s["topic"], s.get("type")) for s in meta.get("subscriptions", [])]
            return subs == [("delayed", "orders", "PROGRAMMATIC")]

        harness.wait_until_blocking(
            subscribed, "daprd to load the subscriber's own subscription", 30, process=daprd
        )
        yield Quickstart(subscriber, daprd, ports, workdir)
    except harness.HarnessError as exc:
        pytest.fail(str(exc), pytrace=False)
    finally:
        for proc in reversed(started):
            proc.stop()
        redis.stop()


@pytest.fixture(scope="module")
def quickstart(daprd_path: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Quickstart]:
    """The README's quickstart: no subscription YAML, the subscriber subscribes in code."""
    with running_quickstart(
        daprd_path, Path(tmp_path_factory.mktemp("quickstart")), subscription_yaml=False
    ) as q:
        yield q


def run_publisher(q: Quickstart) -> int:
    """`python examples/quickstart/publisher.py` with the env `dapr run` gives its app."""
    env = {**os.environ, "DAPR_GRPC_PORT": str(q.ports.grpc), "DAPR_HTTP_PORT": str(q.ports.http)}
    result = subprocess.run(
        [sys.executable, str(REPO / "examples" / "quickstart" / "publisher.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, f"publisher failed:\n{result.stdout}\n{result.stderr}"
    assert result.stdout.count("published ") == 3, result.stdout
    return harness.now_ms()


def by_label(deliveries: list[dict[str, str]], label: str) -> list[dict[str, str]]:
    return [d for d in deliveries if d.get("label") == label]


def test_quickstart_delivers_delayed_scheduled_and_retried_messages_with_their_headers(
    quickstart: Quickstart,
) -> None:
    published_ms = run_publisher(quickstart)

    # order-2 is due 8 s after publishing, fails once, and comes back after redeliverInterval.
    got = quickstart.wait(
        lambda ds: any(d["deliveryAttempt"] == "2" for d in by_label(ds, "order-2")),
        8 + REDELIVER_S + 20,
        "order-2's second delivery",
    )

    # A one-shot delayed by 5 s: once, never early, with the component's headers.
    (order1,) = by_label(got, "order-1")
    assert order1["deliveryAttempt"] == "1"
    assert order1["scheduler"] == "order-1"
    assert order1["scheduleNext"] == "purge"
    assert 0 <= int(order1["lateness_ms"]) <= harness.LATENESS_TOLERANCE_MS, order1

    # scheduledSendTime, failed on purpose the first time: delivered again with deliveryAttempt 2.
    order2 = by_label(got, "order-2")
    assert [(d["deliveryAttempt"], d["status"]) for d in order2] == [("1", "500"), ("2", "200")]
    assert all(d["scheduler"] == "order-2" and d["scheduleNext"] == "purge" for d in order2)
    assert 0 <= int(order2[0]["lateness_ms"]) <= harness.LATENESS_TOLERANCE_MS, order2
    # The retry waited for redeliverInterval after the failure.
    assert int(order2[1]["lateness_ms"]) >= REDELIVER_S * 1000, order2

    # @every 3s with a 10 s TTL: fires due 3, 6 (and 9) s after acceptance, then the schedule ends.
    ticks = by_label(got, "tick")
    assert all(d["scheduler"] == "tick" and d["deliveryAttempt"] == "1" for d in ticks), ticks
    nexts = [int(datetime.fromisoformat(d["scheduleNext"]).timestamp() * 1000) for d in ticks]
    assert 2 <= len(ticks) <= 3, ticks
    assert all(b - a == EVERY_MS for a, b in itertools.pairwise(nexts)), nexts
    assert all(0 <= int(d["lateness_ms"]) <= harness.LATENESS_TOLERANCE_MS for d in ticks), ticks
    # By now (over 20 s after the publish) a schedule that had not ended would have fired ~7 times.
    assert harness.now_ms() - published_ms >= 20_000


def test_quickstart_subscriber_with_the_subscription_yaml_too_gets_each_message_once(
    daprd_path: str, tmp_path: Path
) -> None:
    """The README: an app that subscribes in code and a YAML for the same topic: daprd keeps the app's."""
    with running_quickstart(daprd_path, tmp_path, subscription_yaml=True) as q:
        # (running_quickstart already checked daprd lists one subscription, the app's.)
        labels = [f"plain-{i}" for i in range(10)]
        with httpx.Client(timeout=10) as client:
            for label in labels:
                reply = client.post(
                    f"http://127.0.0.1:{q.ports.http}/v1.0/publish/delayed/orders", json={"label": label}
                )
                assert reply.status_code == 204, reply.text
            got = q.wait(lambda ds: {d["label"] for d in ds} >= set(labels), 30, "the ten plain messages")
            # A second subscription would deliver again (or split the messages between two
            # consumers): publish a last one and wait for it, so anything queued behind got its turn.
            reply = client.post(
                f"http://127.0.0.1:{q.ports.http}/v1.0/publish/delayed/orders", json={"label": "last"}
            )
            assert reply.status_code == 204, reply.text
            got = q.wait(lambda ds: any(d["label"] == "last" for d in ds), 30, "the last message")
    assert sorted(d["label"] for d in got) == sorted([*labels, "last"]), got
    assert all(d["deliveryAttempt"] == "1" and d["status"] == "200" for d in got), got
