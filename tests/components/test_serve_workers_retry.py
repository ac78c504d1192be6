"""`serve --workers N` and the retry policy: a worker scans the retry schedules, serve's pollers
wait for its notices.

Real serve subprocesses driven over their unix socket as daprd drives them, one real Redis. A
record "from another replica" is written the way a replica's nack writes it (RETRY_RECORD on an
entry that replica holds pending), after serve's poller has read the schedule: only a notice (or
the long cap) brings it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import redis

from delayed_middleware.retry import retry_counts_key, retry_key, retry_topics_key
from delayed_pubsub import lua
from delayed_pubsub.retry_notices import retry_due_channel
from tests.components.driver import Component, Stream, cluster_props, now_ms
from tests.components.serve import Serve, instance, props_for
from tests.redis_server import RedisCluster, RedisServer
from tests.waiting import wait_until

pytestmark = pytest.mark.slow

POLICY = {"retryInitialInterval": "500ms", "retryMultiplier": "1"}


@asynccontextmanager
async def one_worker(folder: Path, redis_server: RedisServer) -> AsyncIterator[tuple[Serve, Component]]:
    """`serve --workers 1` with its worker running, and app1's instance on it with POLICY."""
    serve = Serve(folder, "a", "--workers", "1")
    try:
        await wait_until(lambda: len(serve.children()) == 1, "one worker running", 20, every_s=0.05)
        async with instance(serve, {**props_for(redis_server), **POLICY}) as c:
            yield serve, c
    finally:
        serve.stop()


def polls_of_retry_schedules(client: redis.Redis) -> int:
    """ZRANGEBYSCORE calls Redis served since the last CONFIG RESETSTAT: a retry poller's look."""
    stats = client.info("commandstats")
    return int(stats.get("cmdstat_zrangebyscore", {}).get("calls", 0))


def retry_schedule_reads(server: RedisServer, seconds: float) -> list[str]:
    """The retry pollers' reads of app1's retry schedules that Redis served in the next
    `seconds`, seen through MONITOR. INFO commandstats cannot tell them apart: the delay
    engine's own index script reads its due index with the same command."""
    prefix = retry_key("app1", "")
    # MONITOR is read without a timeout (redis-py drops a connection whose read timed out)
    # and ended by a marker command of our own, which it sees like any other.
    marker = f"end-of-watch-{time.monotonic_ns()}"
    watcher = redis.Redis(host="127.0.0.1", port=server.port)
    poker = redis.Redis(host="127.0.0.1", port=server.port)
    timer = threading.Timer(seconds, lambda: poker.echo(marker))
    seen: list[str] = []
    with watcher.monitor() as monitor:  # type: ignore[no-untyped-call]
        timer.start()
        while True:
            command = str(monitor.next_command()["command"])
            if marker in command:
                break
            if command.upper().startswith("ZRANGEBYSCORE ") and prefix in command:
                seen.append(command)
    timer.join()
    watcher.close()
    poker.close()
    return seen


def notice_listeners(client: redis.Redis) -> int:
    """Subscribers of app1's retry notice channel: serve's listener, once it has subscribed."""
    channel = retry_due_channel("app1")
    ((_, count),) = client.pubsub_numsub(channel)
    return int(count)


async def polls_quiet_for(client: redis.Redis, quiet_s: float, within_s: float) -> None:
    """Returns once no retry poller has looked for `quiet_s`; fails after `within_s`. Pollers
    that look every second (no workers) are never quiet that long."""
    deadline = time.monotonic() + within_s
    last, since = polls_of_retry_schedules(client), time.monotonic()
    while time.monotonic() - since < quiet_s:
        assert time.monotonic() < deadline, f"retry pollers still looking after {within_s}s"
        await asyncio.sleep(0.1)
        now = polls_of_retry_schedules(client)
        if now != last:
            last, since = now, time.monotonic()


async def held_by_another_replica(
    c: Component, client: Any, topic: str, streams: int = 1
) -> tuple[str, list[Stream]]:
    """An entry of `topic` that a replica now gone read (delivery count 1) and still holds, and
    `streams` streams of serve on `topic` whose pollers have looked once and now wait."""
    client.xgroup_create(topic, "app1", id="$", mkstream=True)
    await c.publish(topic, b"retried")
    rows: Any = client.xreadgroup("app1", "app1:gone:1:1", {topic: ">"}, count=1)
    entry_id: str = rows[0][1][0][0].decode()
    opened = [await c.subscribe(topic) for _ in range(streams)]
    await asyncio.sleep(1.5)
    return entry_id, opened


def record_retry(client: Any, topic: str, entry_id: str, due_ms: int) -> None:
    """What that replica's nack left: a retry record of delivery 1, due at `due_ms`."""
    client.eval(
        lua.RETRY_RECORD,
        2,
        retry_key("app1", topic),
        retry_counts_key("app1", topic),
        entry_id,
        due_ms,
        1,
    )
    client.sadd(retry_topics_key("app1"), topic)


async def no_more(stream: Stream, seconds: float) -> None:
    assert await stream.nothing_for(seconds), f"delivered twice: {stream.received.get_nowait()}"


class NoticesHeard:
    """The worker's notices on app1's retry channel as the test hears them, each with the time
    (ms) it was heard: when the worker's due scan saw a record due."""

    def __init__(self, client: Any) -> None:
        self.heard: list[tuple[int, str]] = []
        self._pubsub: Any = client.pubsub(ignore_subscribe_messages=True)
        self._pubsub.subscribe(retry_due_channel("app1"))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._listen, daemon=True)
        self._thread.start()

    def _listen(self) -> None:
        while not self._stop.is_set():
            msg = self._pubsub.get_message(timeout=0.05)
            if msg is not None:
                self.heard.append((now_ms(), msg["data"].decode()))

    def of(self, topic: str) -> list[int]:
        return [at for at, t in list(self.heard) if t == topic]

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._pubsub.close()


async def due_scan_running(client: Any, notices: NoticesHeard) -> None:
    """Returns once the worker's due scan has looked at the retry schedules (and our ear hears its
    notices): it announces a record of a topic nobody reads, due at once, which is then removed.
    A worker starts its scan only once it has set up the app, seconds after `serve` answered Init
    on a loaded machine; a record written before that waits for that first look, not the scan's
    one-second cap that the lateness bound stands on."""
    topic = f"scan-probe-{time.monotonic_ns()}"
    client.zadd(retry_key("app1", topic), {"0-1": 0})
    client.sadd(retry_topics_key("app1"), topic)
    await wait_until(lambda: notices.of(topic), "the worker's due scan announcing a due record", 30)
    client.srem(retry_topics_key("app1"), topic)
    client.delete(retry_key("app1", topic))


async def announced_and_delivered_once(c: Component, client: Any, topic: str) -> None:
    """Another replica's retry record of `topic`, written after serve's poller looked, comes back
    once, as delivery 2, within 1.5 s of its due time: the worker's scan looks at least once a
    second, and without its notice the poller would wait for its 30 s cap."""
    entry_id, (stream,) = await held_by_another_replica(c, client, topic)
    notices = NoticesHeard(client)
    try:
        await due_scan_running(client, notices)
        due = now_ms() + 300
        record_retry(client, topic, entry_id, due)
        msg = await stream.next(5)
        late_ms = now_ms() - due
    finally:
        notices.close()
    # The notices' times tell a late scan (the worker's turn on the CPU) from a late poller.
    announced = [at - due for at in notices.of(topic)]
    assert (msg.id, msg.data, msg.metadata["deliveryAttempt"]) == (entry_id, b"retried", "2")
    assert 0 <= late_ms <= 1500, (
        f"{topic}: delivered {late_ms} ms after its due time, announced at {announced}"
    )
    await stream.ack(msg.id)
    await no_more(stream, 1.5)


async def test_with_workers_idle_retry_streams_leave_redis_alone(
    folder: Path, redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    async with one_worker(folder, redis_server) as (_, c):
        streams = [await c.subscribe(f"idle-{i}") for i in range(5)]
        # Past the streams' start-up, known from events rather than a fixed sleep: each poller
        # looks once when it starts, and again when the notice listener has subscribed (a
        # notice may have been missed meanwhile); on a loaded machine that comes seconds late.
        await wait_until(
            lambda: notice_listeners(redis_client) >= 1, "the notice listener subscribed", 20, every_s=0.05
        )
        await polls_quiet_for(redis_client, 1.0, within_s=20)
        # Without workers each poller looks every second (15 looks here); with them the
        # worker's scan looks, and serve's pollers wait for its notice.
        looks = await asyncio.to_thread(retry_schedule_reads, redis_server, 3.0)
        assert looks == [], f"serve's pollers looked while idle: {looks[:3]}"
        for s in streams:
            await s.cancel()


async def test_with_workers_a_nacked_message_comes_back_at_its_backoff(
    folder: Path, redis_server: RedisServer
) -> None:
    async with one_worker(folder, redis_server) as (_, c):
        stream = await c.subscribe("orders")
        await asyncio.sleep(1.5)  # the poller past its first look, waiting
        await c.publish("orders", b"x")
        first = await stream.next(5)
        nacked = time.monotonic()
        await stream.nack(first.id)
        again = await stream.next(5)
        after_ms = (time.monotonic() - nacked) * 1000
        assert again.data == b"x"
        assert again.metadata["deliveryAttempt"] == "2"
        assert 450 <= after_ms <= 500 + 300, f"redelivered {after_ms:.0f} ms after the nack"
        await stream.ack(again.id)
        await no_more(stream, 1.5)


async def test_with_workers_a_retry_recorded_by_another_replica_is_announced_and_delivered_once(
    folder: Path, redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    async with one_worker(folder, redis_server) as (_, c):
        await announced_and_delivered_once(c, redis_client, "orders")


async def test_with_workers_a_retry_due_while_the_worker_is_killed_is_delivered_once(
    folder: Path, redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    async with one_worker(folder, redis_server) as (serve, c):
        entry_id, (stream,) = await held_by_another_replica(c, redis_client, "orders")
        (victim,) = serve.children()
        os.kill(victim, signal.SIGKILL)
        record_retry(redis_client, "orders", entry_id, now_ms() + 100)
        killed = time.monotonic()
        # Due while no worker runs: the restarted worker's first scan announces it (the
        # pollers' 30 s cap would bring it too, later).
        msg = await stream.next(20)
        assert victim not in serve.children()
        assert len(serve.children()) == 1, "the worker was restarted"
        assert time.monotonic() - killed < 15, "delivered by the restarted worker's notice, not the cap"
        assert (msg.id, msg.metadata["deliveryAttempt"]) == (entry_id, "2")
        await stream.ack(msg.id)
        await no_more(stream, 2.0)
        assert redis_client.zcard(retry_key("app1", "orders")) == 0
        assert redis_client.xpending("orders", "app1")["pending"] == 0


async def test_with_workers_a_flood_of_notices_delivers_a_due_retry_once_to_one_of_two_streams(
    folder: Path, redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    async with one_worker(folder, redis_server) as (_, c):
        entry_id, streams = await held_by_another_replica(c, redis_client, "orders", streams=2)
        due = now_ms() + 300
        record_retry(redis_client, "orders", entry_id, due)
        # Anyone who can PUBLISH may repeat the worker's notice: every poller of the topic
        # wakes on each, and the take still lets one of them deliver.
        channel = retry_due_channel("app1")
        while now_ms() < due + 500:
            redis_client.publish(channel, "orders")
            await asyncio.sleep(0.005)
        await wait_until(
            lambda: any(not s.received.empty() for s in streams), "the retry delivered", 5, every_s=0.05
        )
        await asyncio.sleep(1.0)  # a second delivery would land now, if ever
        got = [s.received.get_nowait() for s in streams for _ in range(s.received.qsize())]
        assert [(m.id, m.metadata["deliveryAttempt"]) for m in got] == [(entry_id, "2")]


async def test_with_the_worker_stopped_nacks_landing_while_the_poller_looks_come_back_at_once(
    folder: Path, redis_server: RedisServer
) -> None:
    n = 200
    async with one_worker(folder, redis_server) as (serve, c):
        # No notices while the worker is stopped (the supervisor kills a hung one only after
        # 15 s): a nack's own wake-up is all that brings its retry back before the 30 s cap.
        (worker,) = serve.children()
        stream = await c.subscribe("orders", {"retryInitialInterval": "0"})
        await asyncio.sleep(1.5)
        os.kill(worker, signal.SIGSTOP)
        try:
            for i in range(n):
                await c.publish("orders", str(i).encode())
            attempts: dict[bytes, list[str]] = {}
            deadline = time.monotonic() + 8
            while sum(len(a) for a in attempts.values()) < 2 * n:
                msg = await stream.next(max(0.1, deadline - time.monotonic()))
                attempts.setdefault(msg.data, []).append(msg.metadata["deliveryAttempt"])
                if msg.metadata["deliveryAttempt"] == "1":
                    await stream.nack(msg.id)
                else:
                    await stream.ack(msg.id)
            assert attempts == {str(i).encode(): ["1", "2"] for i in range(n)}
        finally:
            os.kill(worker, signal.SIGCONT)


async def test_on_redis_cluster_a_retry_recorded_by_another_replica_is_announced_and_delivered_once(
    folder: Path, cluster: RedisCluster, admin: Any
) -> None:
    # The notice travels on Redis pub/sub, which a Cluster broadcasts to every node: the
    # worker publishes through one node, serve listens through another (or the same).
    serve = Serve(folder, "a", "--workers", "1")
    try:
        await wait_until(lambda: len(serve.children()) == 1, "one worker running", 20, every_s=0.05)
        async with instance(serve, {**cluster_props(cluster), **POLICY}) as c:
            for topic in ("orders", "payments", "a{b}c"):
                await announced_and_delivered_once(c, admin, topic)
    finally:
        serve.stop()
