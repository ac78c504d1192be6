"""`delayed-pubsub serve --workers N`: firing in supervised worker processes.

Real serve subprocesses driven over their unix socket as daprd drives them, one real Redis;
deliveries are counted by message id on the target stream.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import redis

from delayed_middleware.clock import SystemClock
from delayed_middleware.entry import decode_entry
from delayed_middleware.instants import format_instant
from delayed_pubsub.health_http import HealthHttpServer
from delayed_pubsub.server import ComponentServer
from delayed_pubsub.workers import WorkerPool
from tests.components.driver import cluster_props, delayed_entries, engine_left, now_ms
from tests.components.serve import Serve, alive, instance, props_for
from tests.redis_server import RedisCluster, RedisServer, free_port, stream_entries
from tests.waiting import wait_until

pytestmark = pytest.mark.slow


def delivered(client: redis.Redis, topic: str) -> list[int]:
    return [json.loads(decode_entry(f).data)["n"] for _, f in stream_entries(client, topic)]


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return str(r.read().decode())


def sample(text: str, name: str, labels: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(f"{name}{{{labels}}} "):
            return float(line.rsplit(" ", 1)[1])
    return None


async def test_two_workers_fire_every_message_once_and_metrics_count_them(
    folder: Path, redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    port = free_port()
    serve = Serve(folder, "a", "--workers", "2", "--metrics-port", str(port))
    try:
        await wait_until(lambda: len(serve.children()) == 2, "two workers running", 20, every_s=0.05)
        async with instance(serve, props_for(redis_server)) as c:
            reply = await c.bulk_publish("orders", delayed_entries(2000, now_ms() + 1500, 1000))
            assert list(reply.failed_entries) == []
            await wait_until(lambda: redis_client.xlen("orders") >= 2000, "2000 fired", 30, every_s=0.05)
            await asyncio.sleep(1.0)  # a duplicate would land now, if ever
            assert sorted(delivered(redis_client, "orders")) == list(range(2000))
            # The workers' counters reach the one endpoint (merged at most 1 s late).
            await wait_until(
                lambda: (
                    sample(scrape(port), "delayed_pubsub_fired_messages_total", 'instance="delayed"')
                    == 2000.0
                ),
                "the fired counter at 2000 on the metrics endpoint",
                10,
                every_s=0.05,
            )
            # The fire loops run in the workers, and their liveness gauge says so.
            text = scrape(port)
            assert sample(text, "delayed_pubsub_fire_loop_up", 'instance="delayed",shard="0"') == 1.0
    finally:
        serve.stop()


async def test_kill_9_of_a_worker_loses_nothing_fires_nothing_twice_and_it_is_restarted(
    folder: Path, redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    n = 5000
    serve = Serve(folder, "a", "--workers", "2")
    try:
        await wait_until(lambda: len(serve.children()) == 2, "two workers running", 20, every_s=0.05)
        async with instance(serve, props_for(redis_server)) as c:
            reply = await c.bulk_publish("orders", delayed_entries(n, now_ms() + 1000, 4000))
            assert list(reply.failed_entries) == []
            await wait_until(lambda: redis_client.xlen("orders") >= 300, "firing under way", 15, every_s=0.05)
            victim = serve.children()[0]
            os.kill(victim, signal.SIGKILL)
            assert redis_client.xlen("orders") < n, "the kill must land while messages are pending"
            await wait_until(lambda: redis_client.xlen("orders") >= n, f"all {n} fired", 30, every_s=0.05)
            await asyncio.sleep(1.0)
            assert sorted(delivered(redis_client, "orders")) == list(range(n))
            assert int(redis_client.get("{app1-delayed}:pending") or 0) == 0
            # The supervisor put a new worker in its place.
            await wait_until(
                lambda: len(serve.children()) == 2 and victim not in serve.children(),
                "the killed worker replaced",
                20,
                every_s=0.05,
            )
            # ... and the new one fires too: kill the other original, publish more.
            survivor = next(p for p in serve.children() if p != victim)
            os.kill(survivor, signal.SIGKILL)
            more = delayed_entries(100, now_ms() + 500, 100)
            for e in more:
                e.entry_id = str(n + int(e.entry_id))
                e.event = json.dumps({"n": n + json.loads(e.event)["n"]}).encode()
            reply = await c.bulk_publish("orders", more)
            assert list(reply.failed_entries) == []
            await wait_until(
                lambda: redis_client.xlen("orders") >= n + 100, "the second batch fired", 30, every_s=0.05
            )
            await asyncio.sleep(1.0)
            assert sorted(delivered(redis_client, "orders")) == list(range(n + 100))
    finally:
        serve.stop()


async def test_sigterm_stops_serve_and_every_worker(folder: Path, redis_server: RedisServer) -> None:
    serve = Serve(folder, "a", "--workers", "2")
    await wait_until(lambda: len(serve.children()) == 2, "two workers running", 20, every_s=0.05)
    async with instance(serve, props_for(redis_server)):
        pass
    workers = serve.children()
    serve.proc.send_signal(signal.SIGTERM)
    assert serve.proc.wait(timeout=20) == 0
    await wait_until(lambda: not any(alive(p) for p in workers), "no worker left", 5, every_s=0.05)
    assert not serve.socket.exists()


async def test_kill_9_of_serve_takes_its_workers_with_it(folder: Path, redis_server: RedisServer) -> None:
    serve = Serve(folder, "a", "--workers", "1")
    await wait_until(lambda: len(serve.children()) == 1, "one worker running", 20, every_s=0.05)
    workers = serve.children()
    serve.kill9()
    await wait_until(lambda: not any(alive(p) for p in workers), "no orphaned worker", 5, every_s=0.05)


def worker_folders(folder: Path, name: str) -> list[Path]:
    return sorted(folder.glob(f"{name}.workers-*"))


async def test_the_workers_folder_is_private_beside_the_socket_and_a_dead_serves_is_removed(
    folder: Path, redis_server: RedisServer
) -> None:
    # Beside the socket, because that is the one folder serve may write in a container with a
    # read-only root file system (the temp dir is not writable there).
    other = Serve(folder, "b", "--workers", "1")
    serve = Serve(folder, "a", "--workers", "1")
    try:
        await wait_until(lambda: len(serve.children()) == 1, "one worker running", 20, every_s=0.05)
        (first,) = worker_folders(folder, "a")
        assert first.stat().st_mode & 0o777 == 0o700
        async with instance(serve, props_for(redis_server)):
            assert (first / "instances.json").stat().st_mode & 0o777 == 0o600
        serve.kill9()
        assert first.exists()  # Init metadata (secrets among it) left by a kill -9...
        serve = Serve(folder, "a", "--workers", "1")
        await wait_until(lambda: len(serve.children()) == 1, "one worker running", 20, every_s=0.05)
        # ...is removed by the next serve of that socket; another socket's folder stays.
        (second,) = worker_folders(folder, "a")
        assert second != first
        assert not first.exists()
        assert len(worker_folders(folder, "b")) == 1
    finally:
        serve.stop()
        other.stop()
    assert worker_folders(folder, "a") == []
    assert worker_folders(folder, "b") == []


async def test_workers_0_fires_in_the_serve_process_alone(
    folder: Path, redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    serve = Serve(folder, "a", "--workers", "0")
    try:
        async with instance(serve, props_for(redis_server)) as c:
            reply = await c.bulk_publish("orders", delayed_entries(500, now_ms() + 500, 500))
            assert list(reply.failed_entries) == []
            await wait_until(lambda: redis_client.xlen("orders") >= 500, "500 fired", 20, every_s=0.05)
            await asyncio.sleep(0.5)
            assert sorted(delivered(redis_client, "orders")) == list(range(500))
        assert serve.children() == []
    finally:
        serve.stop()


async def test_a_publish_due_soon_wakes_a_sleeping_worker(
    folder: Path, redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    serve = Serve(folder, "a", "--workers", "1")
    try:
        await wait_until(lambda: len(serve.children()) == 1, "one worker running", 20, every_s=0.05)
        async with instance(serve, props_for(redis_server)) as c:
            # The worker's loop now sleeps its longest (5 s) before a message due in a minute.
            await c.publish("orders", b'{"n": 0}', {"scheduledSendDelay": "60s"})
            await asyncio.sleep(1.5)
            due = now_ms() + 300
            await c.publish("orders", b'{"n": 1}', {"scheduledSendTime": format_instant(due)})
            await wait_until(
                lambda: redis_client.xlen("orders") >= 1, "the early message fired", 5, every_s=0.05
            )
            late_ms = now_ms() - due
            # Woken across processes (the schedule script's PUBLISH), not at the 5 s sleep's end.
            assert late_ms < 1500, f"fired {late_ms} ms after its due time"
    finally:
        serve.stop()


async def test_re_init_with_new_metadata_reaches_the_workers(
    folder: Path, redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    serve = Serve(folder, "a", "--workers", "1")
    try:
        props = props_for(redis_server)
        async with instance(serve, props) as c:
            await c.init({**props, "consumerID": "app2"})
            reply = await c.bulk_publish("orders", delayed_entries(50, now_ms() + 300, 100))
            assert list(reply.failed_entries) == []
            await wait_until(
                lambda: redis_client.xlen("orders") >= 50, "app2's messages fired", 15, every_s=0.05
            )
            assert sorted(delivered(redis_client, "orders")) == list(range(50))
    finally:
        serve.stop()


async def test_liveness_fails_when_workers_do_not_come_back(socket_path: Path) -> None:
    # Workers that die at once, every time: the supervisor restarts them in vain.
    pool = WorkerPool(
        1, socket_path, command=[sys.executable, "-c", "import sys; sys.exit(3)"], dead_after_s=1.0
    )
    server = ComponentServer(socket_path, SystemClock(), health_interval=0.2, workers=pool)
    await server.start()
    http = HealthHttpServer(socket_path, 0, "127.0.0.1")
    http.start()
    try:

        def status() -> int:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{http.port}/healthz", timeout=5) as r:
                    return int(r.status)
            except urllib.error.HTTPError as e:
                return int(e.code)

        statuses: list[int] = []

        def unhealthy() -> bool:
            statuses.append(status())
            return statuses[-1] == 503

        # asyncio.to_thread: the probe asks this very process's gRPC server.
        deadline = time.monotonic() + 10
        while not await asyncio.to_thread(unhealthy):
            assert time.monotonic() < deadline, f"/healthz stayed {statuses[-1]}"
            await asyncio.sleep(0.1)
        assert [f.split(" down for ")[0] for f in pool.failed()] == ["worker 0"]
    finally:
        http.stop()
        await server.stop(1.0)
    assert not pool.folder.exists()


async def test_on_redis_cluster_kill_9_of_a_worker_loses_and_doubles_nothing(
    folder: Path, cluster: RedisCluster, admin: Any
) -> None:
    # Two-phase firing: the killed worker's claims wait for their lease, then another takes them.
    topics = [f"topic-{i}" for i in range(12)]
    assert len({cluster.owner(t).port for t in topics}) == 3, "the topics must spread over every master"
    n = 6000
    per = n // len(topics)
    serve = Serve(folder, "a", "--workers", "2")
    try:
        await wait_until(lambda: len(serve.children()) == 2, "two workers running", 20, every_s=0.05)
        async with instance(serve, cluster_props(cluster)) as c:
            want: dict[str, list[int]] = {}
            for k, t in enumerate(topics):
                entries = delayed_entries(per, now_ms() + 2000, 4000)
                for i, e in enumerate(entries):
                    e.event = json.dumps({"n": k * per + i}).encode()
                reply = await c.bulk_publish(t, entries)
                assert list(reply.failed_entries) == []
                want[t] = [k * per + i for i in range(per)]

            def fired() -> int:
                return sum(int(admin.xlen(t)) for t in topics)

            await wait_until(lambda: fired() >= 1000, "firing under way", 20, every_s=0.05)
            os.kill(serve.children()[0], signal.SIGKILL)
            assert fired() < n, "the kill must land while messages are pending"
            # Lease 5 s + takeover + the rest of the spread.
            await wait_until(lambda: fired() >= n, f"all {n} fired", 30, every_s=0.05)
            await wait_until(
                lambda: engine_left(admin) == {"pending": 0, "inflight": 0, "envelopes": 0},
                "the engine left empty (the dead worker's claims released)",
                15,
                every_s=0.05,
            )
            got = {
                t: sorted(json.loads(decode_entry(f).data)["n"] for _, f in admin.xrange(t)) for t in topics
            }
            assert got == want
    finally:
        serve.stop()
