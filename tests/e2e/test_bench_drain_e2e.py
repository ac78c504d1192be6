"""`bench drain`: its Go app counts what reaches each route, and a small backlog drains end to end
through a real daprd (built-in, ours over two streams, the fast path), each message once."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from bench import drain
from tests.e2e import harness
from tests.redis_server import free_port

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(shutil.which("go") is None, reason="bench drain's app is built with Go"),
]


@pytest.fixture
def app() -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen([str(drain.app_binary()), str(port), "pubsub=orders", "delayed=orders"])
    url = f"http://127.0.0.1:{port}"
    try:
        harness.wait_until_blocking(lambda: httpx.get(f"{url}/healthz").status_code == 200, "drain app", 30)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_the_app_subscribes_its_routes_and_counts_every_arrival_per_route(app: str) -> None:
    subs = httpx.get(f"{app}/dapr/subscribe").json()
    assert subs == [
        {"pubsubname": "pubsub", "topic": "orders", "route": "/events/pubsub/orders"},
        {"pubsubname": "delayed", "topic": "orders", "route": "/events/delayed/orders"},
    ]
    before = time.time() * 1000
    with httpx.Client() as http, ThreadPoolExecutor(8) as pool:
        codes = list(
            pool.map(
                lambda _: http.post(f"{app}/events/pubsub/orders", content=b"{}").status_code, range(200)
            )
        )
    assert codes == [200] * 200
    httpx.post(f"{app}/events/delayed/orders", content=b"{}")
    stats = httpx.get(f"{app}/stats").json()
    assert stats["/events/pubsub/orders"]["count"] == 200
    assert stats["/events/delayed/orders"]["count"] == 1
    route = stats["/events/pubsub/orders"]
    assert before - 1000 <= route["first_ms"] <= route["last_ms"] <= time.time() * 1000 + 1000
    assert 1 <= route["max_at_once"] <= 8


def test_a_backlog_drains_through_daprd_and_daprd_calls_the_app_one_at_a_time_per_stream_of_ours(
    daprd_path: str,
) -> None:
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench",
            "drain",
            "--messages",
            "300",
            "--fast-path",
            "--streams",
            "2",
            "--json",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=170,
        check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    figures = json.loads(run.stdout.strip().splitlines()[-1])
    # The bench waits until every backlog's count reached 300 on the app: each one drained.
    assert set(figures["seconds"]) == {"built-in", "ours", "fast path"}
    assert all(0 < s < 170 for s in figures["seconds"].values())
    assert figures["ratio"] == pytest.approx(figures["seconds"]["built-in"] / figures["seconds"]["ours"])
    # daprd's pluggable adapter handles one stream's messages one at a time: each stream's route
    # never held two at once, whatever our window (concurrency 10) had sent ahead.
    assert figures["app_at_once"]["ours"] == [1, 1]
    assert figures["ours_unacked_max"] <= 2 * 10
