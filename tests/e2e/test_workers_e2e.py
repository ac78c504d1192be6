"""Through a real daprd, with the firing in worker processes (`serve --workers 2`):
delayed messages arrive once each, also when a worker is killed with -9 on the way."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.components.serve import children_of
from tests.e2e import harness
from tests.e2e.harness import Stack, carries, now_ms, unique
from tests.redis_server import RedisServer

pytestmark = pytest.mark.e2e

APP_ID = "workers-app"
PUBSUB = "delayed-w"


@pytest.fixture(scope="module")
def workers_stack(
    daprd_path: str, e2e_redis: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    workdir = Path(tmp_path_factory.mktemp("e2e-workers"))
    resources = workdir / "resources"
    resources.mkdir()
    meta = harness.component_metadata(e2e_redis.port, redisDB="3", consumerID=APP_ID)
    (resources / f"{PUBSUB}.yaml").write_text(harness.component_yaml(PUBSUB, meta))
    with harness.started_stack(
        daprd_path,
        workdir,
        resources,
        redis_port=e2e_redis.port,
        pubsubs=(PUBSUB,),
        subscriptions=(f"{PUBSUB}=orders",),
        app_id=APP_ID,
        component_args=("--workers", "2"),
    ) as stack:
        yield stack


def test_delayed_messages_arrive_once_while_a_worker_is_killed(workers_stack: Stack) -> None:
    s = workers_stack
    assert s.component is not None
    assert s.component.proc is not None
    serve_pid = s.component.proc.pid
    harness.wait_until_blocking(
        lambda: len(children_of(serve_pid)) == 2, "two workers", 30, process=s.component
    )
    marker = unique("workers")
    n = 300
    due = now_ms() + 2000
    entries = [
        {
            "entryId": str(i),
            "event": {"id": f"{marker}-{i}", "n": i},
            "contentType": "application/json",
            "metadata": {"scheduledSendTime": harness.rfc3339(due + i * 10)},
        }
        for i in range(n)
    ]
    response = s.bulk_publish(PUBSUB, "orders", entries)
    assert response.status_code == 204, response.text
    # Firing is under way (due spreads over 3 s): kill one worker.
    first = s.wait_arrivals(carries(marker), 20, timeout=15)
    assert 20 <= len(first) < n, "the kill must land while messages are pending"
    os.kill(children_of(serve_pid)[0], signal.SIGKILL)
    s.wait_arrivals(carries(marker), n, timeout=30)
    time.sleep(1.0)  # a duplicate would arrive now, if ever
    got = [a for a in s.arrivals() if carries(marker)(a)]
    ids = sorted(a["data"]["n"] for a in got)
    assert ids == list(range(n)), f"{len(got)} arrivals, {len(set(ids))} distinct, of {n}"
    # The killed worker was replaced.
    harness.wait_until_blocking(
        lambda: len(children_of(serve_pid)) == 2, "the worker replaced", 30, process=s.component
    )
