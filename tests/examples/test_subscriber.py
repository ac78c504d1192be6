"""examples/subscriber.py, the app of `make demo` and of the end-to-end tests, as daprd drives it."""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections.abc import Iterator

import pytest

from examples import subscriber


@pytest.fixture
def app() -> Iterator[tuple[int, subscriber.State]]:
    state = subscriber.State(
        subscriptions=[subscriber.Subscription.parse("delayed=orders")], arrivals_file=None, echo=False
    )
    server = subscriber.serve(0, state)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1], state
    finally:
        server.shutdown()
        server.server_close()


def test_events_on_one_keep_alive_connection_are_answered_without_a_delayed_ack_stall(
    app: tuple[int, subscriber.State],
) -> None:
    # daprd posts a pluggable subscription's messages one at a time on one kept-alive
    # connection. With Nagle on, each answer's body waited for the ACK of its headers, which
    # the client delays by ~40 ms: 100 events took over 4 s (20-odd a second at the demo's
    # 200 publishes/s). Without that stall they take a few milliseconds each.
    port, state = app
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    started = time.monotonic()
    for n in range(100):
        event = {"id": str(n), "topic": "orders", "pubsubname": "delayed", "data": {"n": n}}
        conn.request(
            "POST", "/events/delayed/orders", body=json.dumps(event), headers={"Content-Type": "application/json"}
        )
        reply = conn.getresponse()
        reply.read()
        assert reply.status == 200
    took = time.monotonic() - started
    conn.close()
    assert len(state.arrivals) == 100
    assert took < 2.0, f"100 events on one connection took {took:.2f} s"
