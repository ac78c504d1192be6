"""The same-Redis fast path under a real daprd, with the YAMLs of dapr/fastpath/ as shipped.

Delayed messages are published through our component (`delayed`); the app subscribes
through Dapr's built-in `pubsub.redis` (`pubsub`) on the same Redis, database and
consumerID. What a user checks: the message arrives on the built-in subscription when
due, not before, once, as the same CloudEvent (same id) with its metadata.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from tests.e2e import harness
from tests.e2e.harness import (
    LATENESS,
    LATENESS_TOLERANCE_MS,
    DaprdPorts,
    ManagedProcess,
    Stack,
    carries,
    now_ms,
    unique,
)
from tests.e2e.user import header
from tests.redis_server import RedisServer, free_port

pytestmark = pytest.mark.e2e

FASTPATH = harness.REPO / "dapr" / "fastpath"
APP_ID = "fastpath-app"
ROUTE = "/events/pubsub/orders"


@pytest.fixture(scope="module")
def fast_stack(daprd_path: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    workdir = Path(tmp_path_factory.mktemp("fastpath"))
    server = RedisServer(workdir / "redis")
    server.start()
    resources = workdir / "resources"
    resources.mkdir()
    address = f"127.0.0.1:{server.port}"
    # The shipped YAMLs, pointed at the test Redis; the subscription's route at the test app's.
    for name in ("delayed.yaml", "pubsub.yaml"):
        text = (FASTPATH / name).read_text()
        assert '"localhost:6379"' in text
        (resources / name).write_text(text.replace('"localhost:6379"', json.dumps(address)))
    subscription = (FASTPATH / "subscription.yaml").read_text()
    assert "default: /orders" in subscription
    (resources / "subscription.yaml").write_text(
        subscription.replace("default: /orders", f"default: {ROUTE}")
    )

    started: list[ManagedProcess] = []
    try:
        component = harness.start_component(workdir, workdir / "sockets")
        started.append(component)
        app_port = free_port()
        subscriber = harness.start_subscriber(workdir, app_port, ["pubsub=orders:declared"])
        started.append(subscriber)
        ports = DaprdPorts.free()
        daprd = harness.start_daprd(
            daprd_path, workdir, workdir / "sockets", APP_ID, app_port, resources, ports
        )
        started.append(daprd)
        s = Stack(workdir, server.port, app_port, ports, ("delayed", "pubsub"), daprd, component, subscriber)

        def loaded() -> bool:
            meta = s.client.get(f"{s.dapr_url}/v1.0/metadata").json()
            names = {c["name"] for c in meta.get("components", [])}
            subs = {(x["pubsubname"], x["topic"]) for x in meta.get("subscriptions", [])}
            return {"delayed", "pubsub"} <= names and ("pubsub", "orders") in subs

        harness.wait_until_blocking(
            loaded, "daprd to load both components and the subscription", 30, process=daprd
        )
        yield s
        s.client.close()
    except harness.HarnessError as exc:
        pytest.fail(str(exc), pytrace=False)
    finally:
        for proc in reversed(started):
            proc.stop()
        server.stop()


def only_arrival(stack: Stack, marker: str, due_ms: int, name: str) -> dict[str, Any]:
    """The one arrival of `marker`: not before due, within the tolerance after, and no second one."""
    early = (due_ms - now_ms()) / 1000 - 0.2
    if early > 0:
        assert stack.wait_arrivals(carries(marker), 1, timeout=early) == [], "arrived early"
    got = stack.wait_arrivals(carries(marker), 1, timeout=max(0.0, (due_ms - now_ms()) / 1000) + 10)
    assert len(got) == 1, f"expected one arrival of {marker}, got {got}"
    lateness = got[0]["received_ms"] - due_ms
    LATENESS.append((name, lateness))
    assert 0 <= lateness <= LATENESS_TOLERANCE_MS, f"lateness {lateness} ms"
    time.sleep(1.5)
    again = [a for a in stack.arrivals() if carries(marker)(a)]
    assert len(again) == 1, f"delivered {len(again)} times"
    assert again[0]["route"] == ROUTE, "not delivered through the built-in subscription"
    return again[0]


def test_own_cloudevent_published_delayed_through_ours_arrives_through_the_builtin_with_its_id(
    fast_stack: Stack,
) -> None:
    marker = unique("fast-ce")
    event_id = str(uuid.uuid4())
    t0 = now_ms()
    event = {
        "specversion": "1.0",
        "id": event_id,
        "source": "fastpath-test",
        "type": "com.example.order",
        "datacontenttype": "application/json",
        "data": {"id": marker, "due_ms": t0 + 2000},
    }
    response = fast_stack.publish(
        "delayed",
        "orders",
        json.dumps(event),
        metadata={"scheduledSendDelay": "2s", "customer": "acme-42"},
        content_type="application/cloudevents+json",
    )
    assert response.status_code == 204, response.text
    arrival = only_arrival(fast_stack, marker, t0 + 2000, "fast path: own CloudEvent, delay 2s")
    assert arrival["id"] == event_id
    assert arrival["data"] == event["data"]
    assert json.loads(arrival["body"])["source"] == "fastpath-test"
    assert header(arrival, "customer") == "acme-42"
    assert header(arrival, "scheduleNext") == "purge"
    assert header(arrival, "scheduler")


def test_daprd_built_cloudevent_keeps_its_id_from_publish_to_delivery(fast_stack: Stack) -> None:
    marker = unique("fast-plain")
    t0 = now_ms()
    payload = {"id": marker, "due_ms": t0 + 1000}
    response = fast_stack.publish("delayed", "orders", payload, metadata={"scheduledSendDelay": "1s"})
    assert response.status_code == 204, response.text
    arrival = only_arrival(fast_stack, marker, t0 + 1000, "fast path: daprd's CloudEvent, delay 1s")
    assert arrival["data"] == payload
    # The CloudEvent daprd built at publish time is the one on the stream and at the app.
    client: Any = redis.Redis(port=fast_stack.redis_port)
    try:
        stored = [
            json.loads(fields[b"data"])
            for _, fields in client.xrange("orders")
            if marker.encode() in fields[b"data"]
        ]
    finally:
        client.close()
    assert [e["id"] for e in stored] == [arrival["id"]]


def test_bulk_publish_delayed_through_ours_arrives_through_the_builtin(fast_stack: Stack) -> None:
    marker = unique("fast-bulk")
    due = now_ms() + 2000
    entries = [
        {"entryId": str(i), "event": {"id": f"{marker}-{i}", "n": i}, "contentType": "application/json"}
        for i in range(5)
    ]
    response = fast_stack.bulk_publish("delayed", "orders", entries, metadata={"scheduledSendDelay": "2s"})
    assert response.status_code == 204, response.text
    assert fast_stack.wait_arrivals(carries(marker), 1, timeout=(due - now_ms()) / 1000 - 0.2) == []
    got = fast_stack.wait_arrivals(carries(marker), 5, timeout=10)
    assert sorted(a["data"]["n"] for a in got) == [0, 1, 2, 3, 4]
    assert {a["route"] for a in got} == {ROUTE}
    for a in got:
        assert 0 <= a["received_ms"] - due <= LATENESS_TOLERANCE_MS
