"""Broker and Subscription against a real Redis, below the gRPC layer."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis

from delayed_middleware.clock import SystemClock
from delayed_middleware.entry import StreamEntry, decode_entry, encode_entry
from delayed_middleware.errors import BackendUnavailableError, DelayedPubSubError
from delayed_middleware.retry import RetryPolicy, retry_key
from delayed_pubsub.broker import Broker, BulkEntry
from delayed_pubsub.calls import SubscriptionCalls
from delayed_pubsub.metrics import Metrics
from delayed_pubsub.redelivery import Retrier
from delayed_pubsub.settings import Settings, parse_settings
from delayed_pubsub.subscription import Subscription
from delayed_pubsub.window import Delivery
from tests.conftest import retrier
from tests.redis_server import RedisServer, free_port
from tests.waiting import wait_until


def settings(redis_server: RedisServer, **extra: str) -> Settings:
    return parse_settings(
        {
            "redisHost": f"127.0.0.1:{redis_server.port}",
            "consumerID": "app1",
            "processingTimeout": "400ms",
            "redeliverInterval": "100ms",
            **extra,
        }
    )


async def next_delivery(it: AsyncIterator[Delivery], within: float = 5.0) -> Delivery:
    return await asyncio.wait_for(anext(it), within)


Later = Callable[[AsyncIterator[Delivery]], "asyncio.Future[Delivery]"]


@contextlib.asynccontextmanager
async def two_streams(
    aclient: aioredis.Redis, redis_server: RedisServer, a: dict[str, str], b: dict[str, str]
) -> AsyncIterator[tuple[Subscription, Subscription, Later]]:
    """Streams "a" and "b" of group app1 on `orders`, each from its own Broker with its own
    settings (`a`, `b` over settings()): `a` started, `b` left for the test to start; and
    `later(it)`, the next delivery of `it` as a future, for one that must not come. Both
    streams are closed after, and the futures still waiting cancelled."""
    sub_a = Broker(aclient, settings(redis_server, **a), SystemClock()).subscription("orders", "a")
    sub_b = Broker(aclient, settings(redis_server, **b), SystemClock()).subscription("orders", "b")
    waiting: list[asyncio.Future[Delivery]] = []

    def later(it: AsyncIterator[Delivery]) -> asyncio.Future[Delivery]:
        waiting.append(asyncio.ensure_future(anext(it)))
        return waiting[-1]

    await sub_a.start()
    try:
        yield sub_a, sub_b, later
    finally:
        for future in waiting:
            future.cancel()
        await sub_a.close()
        await sub_b.close()


def backlog(redis_client: redis.Redis, n: int) -> None:
    """n entries m0..m{n-1} on `orders`, as a fire of n leaves them."""
    pipe = redis_client.pipeline(transaction=False)
    for i in range(n):
        pipe.xadd("orders", encode_entry(StreamEntry(f"m{i}".encode())))  # type: ignore[arg-type]
    pipe.execute()


async def take_and_ack(
    sub: Subscription, redis_client: redis.Redis, n: int, pace_s: float | None = None
) -> None:
    """Take n deliveries, acking each (after pace_s, like a subscriber at work), until none is
    pending; each must come exactly once."""
    seen: Counter[str] = Counter()
    it = sub.deliveries()
    while len(seen) < n:
        d = await next_delivery(it)
        seen[d.id] += 1
        if pace_s is not None:
            await asyncio.sleep(pace_s)
        sub.ack_nowait(d.id)
    await wait_until(lambda: redis_client.xpending("orders", "app1")["pending"] == 0)
    assert set(seen.values()) == {1}


async def test_publish_is_readable_as_pubsub_redis_reads_it(
    aclient: aioredis.Redis, redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    broker = Broker(aclient, settings(redis_server), SystemClock())
    entry_id = await broker.publish("orders", StreamEntry(b"{}", {"a": "1"}, "application/json"))
    rows: Any = redis_client.xrange("orders")
    assert rows == [
        (entry_id.encode(), {b"data": b"{}", b"metadata": b'{"a":"1"}', b"contentType": b"application/json"})
    ]


async def test_max_len_approx_trims_the_stream(
    aclient: aioredis.Redis, redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    broker = Broker(aclient, settings(redis_server, maxLenApprox="10"), SystemClock())
    await broker.bulk_publish("orders", [BulkEntry(str(i), StreamEntry(b"x")) for i in range(1000)])
    # Approximate trimming removes whole radix-tree nodes (100 entries each).
    assert 10 <= redis_client.xlen("orders") <= 200


async def test_stream_ttl_trims_entries_older_than_the_ttl(
    aclient: aioredis.Redis, redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    two_hours_ago = int(time.time() * 1000) - 7_200_000
    for i in range(500):
        redis_client.xadd("orders", encode_entry(StreamEntry(b"old")), id=f"{two_hours_ago}-{i}")  # type: ignore[arg-type]
    broker = Broker(aclient, settings(redis_server, streamTTL="1h"), SystemClock())
    await broker.publish("orders", StreamEntry(b"new"))
    rows: Any = redis_client.xrange("orders")
    assert len(rows) < 200  # approximate: whole 100-entry nodes go
    assert rows[-1][1][b"data"] == b"new"


async def test_bulk_publish_to_wrong_type_key_reports_every_entry(
    aclient: aioredis.Redis, redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    redis_client.set("orders", "a string")
    broker = Broker(aclient, settings(redis_server), SystemClock())
    failed = await broker.bulk_publish(
        "orders", [BulkEntry("a", StreamEntry(b"1")), BulkEntry("b", StreamEntry(b"2"))]
    )
    assert [f.entry_id for f in failed] == ["a", "b"]
    assert all("WRONGTYPE" in f.error for f in failed)


async def test_subscription_reclaims_entries_of_a_dead_consumer(
    aclient: aioredis.Redis, redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    s = settings(redis_server)
    redis_client.xgroup_create("orders", "app1", id="0", mkstream=True)
    kept = redis_client.xadd("orders", encode_entry(StreamEntry(b"kept", {"k": "v"})))  # type: ignore[arg-type]
    gone = redis_client.xadd("orders", encode_entry(StreamEntry(b"gone")))  # type: ignore[arg-type]
    # A consumer reads both and dies; one entry is then deleted while pending.
    redis_client.xreadgroup("app1", "dead", {"orders": ">"})
    redis_client.xdel("orders", gone)

    sub = Broker(aclient, s, SystemClock()).subscription("orders", "alive")
    await sub.start()
    try:
        it = sub.deliveries()
        d = await next_delivery(it)
        assert (d.id, d.entry.data, d.metadata) == (_s(kept), b"kept", {"k": "v", "deliveryAttempt": "2"})
        await sub.ack(d.id)
        pending: Any = redis_client.xpending("orders", "app1")
        assert pending["pending"] == 0  # the deleted one was dropped from the PEL too
    finally:
        await sub.close()


async def test_subscription_keeps_retrying_while_the_topic_key_is_unusable(
    aclient: aioredis.Redis, redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    redis_client.set("orders", "not a stream")
    sub = Broker(aclient, settings(redis_server), SystemClock()).subscription("orders", "c1")
    start = asyncio.create_task(sub.start())
    await asyncio.sleep(0.3)
    assert not start.done()  # still retrying XGROUP CREATE, not failed
    redis_client.delete("orders")
    await asyncio.wait_for(start, 5)
    redis_client.xadd("orders", encode_entry(StreamEntry(b"ok")))  # type: ignore[arg-type]
    try:
        assert (await next_delivery(sub.deliveries())).entry.data == b"ok"
    finally:
        await sub.close()


async def test_close_leaves_unacked_entries_pending_and_keeps_their_consumer(
    aclient: aioredis.Redis, redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    sub: Subscription = Broker(aclient, settings(redis_server), SystemClock()).subscription("orders", "c1")
    await sub.start()
    redis_client.xadd("orders", encode_entry(StreamEntry(b"x")))  # type: ignore[arg-type]
    await next_delivery(sub.deliveries())
    await sub.close()
    consumers: Any = redis_client.xinfo_consumers("orders", "app1")
    assert [(c["name"], c["pending"]) for c in consumers] == [(sub.consumer.encode(), 1)]


async def test_two_replicas_deliver_each_message_once_when_reading_ahead_is_possible(
    aclient: aioredis.Redis, redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    # queueDepth 100 but one slot: entries read ahead of a free slot would wait
    # in our PEL past processingTimeout, and the other replica would claim them.
    s = settings(redis_server, processingTimeout="500ms", concurrency="1", queueDepth="100")
    broker = Broker(aclient, s, SystemClock())
    for i in range(40):
        await broker.publish("orders", StreamEntry(f"m{i}".encode()))
    got: Counter[bytes] = Counter()

    async def replica(name: str) -> None:
        sub = broker.subscription("orders", name)
        await sub.start()
        try:
            async for d in sub.deliveries():
                got[d.entry.data] += 1
                await asyncio.sleep(0.05)  # the app takes 50 ms per message
                await sub.ack(d.id)
        finally:
            await sub.close()

    replicas = [asyncio.create_task(replica("a"))]
    await asyncio.sleep(0.05)
    replicas.append(asyncio.create_task(replica("b")))
    try:
        await wait_until(lambda: len(got) == 40, within_s=10)
        await asyncio.sleep(0.7)  # past processingTimeout: late duplicates show up too
    finally:
        for task in replicas:
            task.cancel()
        await asyncio.gather(*replicas, return_exceptions=True)
    assert got == Counter(f"m{i}".encode() for i in range(40))


async def test_an_entry_with_poison_metadata_is_delivered_and_the_rest_follow(
    aclient: aioredis.Redis, redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    sub = Broker(aclient, settings(redis_server), SystemClock()).subscription("orders", "c1")
    await sub.start()
    # Nested past the recursion limit: json.loads raises RecursionError.
    redis_client.xadd("orders", {"data": b"bad", "metadata": b"[" * 100_000})
    for i in range(3):
        redis_client.xadd("orders", encode_entry(StreamEntry(f"good{i}".encode(), {"k": "v"})))  # type: ignore[arg-type]
    got = []
    try:
        it = sub.deliveries()
        for _ in range(4):
            d = await next_delivery(it)
            got.append((d.entry.data, d.metadata))
            await sub.ack(d.id)
    finally:
        await sub.close()
    assert got == [
        (b"bad", {"deliveryAttempt": "1"}),
        *((f"good{i}".encode(), {"k": "v", "deliveryAttempt": "1"}) for i in range(3)),
    ]


async def test_the_fetch_loop_survives_an_unexpected_error(
    aclient: aioredis.Redis,
    redis_server: RedisServer,
    redis_client: redis.Redis,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    failures = [RuntimeError("a bug")]

    def decode_once_badly(fields: Any) -> StreamEntry:
        if failures:
            raise failures.pop()
        return decode_entry(fields)

    for i in range(3):
        redis_client.xadd("orders", encode_entry(StreamEntry(f"m{i}".encode())))  # type: ignore[arg-type]
    sub = Broker(aclient, settings(redis_server), SystemClock()).subscription("orders", "c1")
    monkeypatch.setattr(sub, "_decode", decode_once_badly)
    await sub.start()
    got = set()
    try:
        it = sub.deliveries()
        for _ in range(3):
            # The failed batch stays in our PEL, and comes back after processingTimeout.
            d = await next_delivery(it)
            got.add(d.entry.data)
            await sub.ack(d.id)
    finally:
        await sub.close()
    assert got == {b"m0", b"m1", b"m2"}


async def test_a_fetch_loop_cancelled_without_a_stop_is_restarted_and_delivers(
    aclient: aioredis.Redis,
    redis_server: RedisServer,
    redis_client: redis.Redis,
    caplog: pytest.LogCaptureFixture,
) -> None:
    sub = Broker(aclient, settings(redis_server), SystemClock()).subscription("orders", "c1")
    await sub.start()
    try:
        fetcher = sub._fetcher
        assert fetcher is not None
        # The supervisor starts its first run at its first step.
        await wait_until(lambda: fetcher.current_run is not None)
        first = fetcher.current_run
        assert first is not None
        # A stray cancellation (one a library left behind), not our stop, until one ends the run.
        # A library may swallow one, and the run then goes on delivering with nothing to restart:
        # this client has redis-py's default socket timeout, so it sends each command through
        # asyncio.wait_for, which on Python 3.11 returns the result of a send that completed as
        # the cancellation came and drops the cancellation (CPython gh-86296).
        async with asyncio.timeout(10):
            while not first.done():
                first.cancel()
                await asyncio.wait({first}, timeout=0.05)
        redis_client.xadd("orders", encode_entry(StreamEntry(b"after")))  # type: ignore[arg-type]
        # daprd never re-opens a stream: it must go on delivering, not end.
        d = await next_delivery(sub.deliveries(), within=10)
        assert d.entry.data == b"after"
        assert not sub.closed
        assert fetcher.restarts == 1
        assert any(
            "fetch loop of orders" in r.getMessage() and "cancelled without a stop" in r.getMessage()
            for r in caplog.records
            if r.levelno == logging.ERROR
        )
    finally:
        await sub.close()


@pytest.mark.parametrize("denied", ["xpending", "xclaim"])
async def test_a_reclaim_pass_failing_for_a_while_takes_nothing_and_delivers_once_it_works(
    redis_server: RedisServer, redis_client: redis.Redis, denied: str
) -> None:
    # A real failure of one step of the pass (listing the idle entries, or claiming
    # them): an ACL user that may not run that command, for a while.
    user = "denied"
    acl: Any = redis_client.execute_command  # untyped in redis-py
    acl("ACL", "SETUSER", user, "reset", "on", ">pw", "~*", "&*", "+@all", f"-{denied}")
    redis_client.acl_log_reset()
    client = aioredis.Redis(port=redis_server.port, username=user, password="pw")
    redis_client.xgroup_create("orders", "app1", id="0", mkstream=True)
    redis_client.xadd("orders", encode_entry(StreamEntry(b"m0")))  # type: ignore[arg-type]
    # A consumer read it and died long ago.
    read: Any = redis_client.xreadgroup("app1", "dead", {"orders": ">"})
    entry_id = read[0][1][0][0]
    redis_client.xclaim("orders", "app1", "dead", 0, [entry_id], idle=60_000, justid=True)

    def refused() -> int:
        log: Any = redis_client.acl_log()
        return sum(int(row["count"]) for row in log if _s(row["username"]) == user)

    def pending() -> tuple[str, int]:
        rows: Any = redis_client.xpending_range("orders", "app1", "-", "+", 1)
        return _s(rows[0]["consumer"]), rows[0]["times_delivered"]

    sub = Broker(client, settings(redis_server, processingTimeout="2s"), SystemClock()).subscription(
        "orders", "c1"
    )
    try:
        await sub.start()
        delivered = asyncio.ensure_future(next_delivery(sub.deliveries(), within=10))
        await wait_until(lambda: refused() >= 2)  # the pass failed, and was retried
        # Nothing was taken meanwhile: the dead consumer still holds it, delivered once.
        assert pending() == ("dead", 1)
        assert not delivered.done()
        acl("ACL", "SETUSER", user, f"+{denied}")
        allowed_at = time.monotonic()
        d = await delivered
        # As soon as the step works again, not after another processingTimeout (2 s).
        assert time.monotonic() - allowed_at < 1.2
        assert (d.entry.data, d.attempt) == (b"m0", 2)
        assert pending() == (sub.consumer, 2)
    finally:
        await sub.close()
        await client.aclose()
        acl("ACL", "DELUSER", user)


async def test_a_nacked_entry_is_not_reclaimed_by_another_replica_while_it_waits(
    aclient: aioredis.Redis, redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    # Handling (600 ms) + redeliverInterval (600 ms) > processingTimeout (1 s),
    # each alone less; the other replica looks every 50 ms.
    a = {"processingTimeout": "1s", "redeliverInterval": "600ms"}
    b = {"processingTimeout": "1s", "redeliverInterval": "50ms"}
    async with two_streams(aclient, redis_server, a, b) as (sub_a, sub_b, later):
        redis_client.xadd("orders", encode_entry(StreamEntry(b"m0")))  # type: ignore[arg-type]
        it = sub_a.deliveries()
        d = await next_delivery(it)
        await sub_b.start()
        stolen = later(sub_b.deliveries())
        await asyncio.sleep(0.6)
        sub_a.nack(d.id)
        again = await next_delivery(it)
        await sub_a.ack(again.id)
        assert (again.id, again.attempt) == (d.id, 2)
        assert not stolen.done()


async def test_delivery_attempts_count_nacks_not_reclaim_passes(
    aclient: aioredis.Redis, redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    sub = Broker(aclient, settings(redis_server), SystemClock()).subscription("orders", "c1")
    await sub.start()
    redis_client.xadd("orders", encode_entry(StreamEntry(b"m0")))  # type: ignore[arg-type]
    attempts = []
    try:
        it = sub.deliveries()
        for _ in range(3):
            d = await next_delivery(it)
            attempts.append(d.attempt)
            # Handled past processingTimeout (400 ms): our own reclaim passes
            # (every 100 ms) see it idle meanwhile.
            await asyncio.sleep(0.6)
            sub.nack(d.id)
    finally:
        await sub.close()
    assert attempts == [1, 2, 3]


async def test_stop_ends_a_subscription_that_is_retrying(
    aclient: aioredis.Redis, redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    redis_client.set("orders", "not a stream")
    sub = Broker(aclient, settings(redis_server), SystemClock()).subscription("orders", "c1")
    start = asyncio.create_task(sub.start())
    await asyncio.sleep(0.3)
    assert not start.done()
    # Not by cancelling the task: redis-py can swallow a CancelledError.
    sub.stop()
    await asyncio.wait({start}, timeout=5)
    try:
        assert start.cancelled()
    finally:
        start.cancel()
        await sub.close()


async def test_subscriptions_given_the_same_consumer_name_get_distinct_consumers(
    aclient: aioredis.Redis, redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    broker = Broker(aclient, settings(redis_server, concurrency="1"), SystemClock())
    subs = [broker.subscription("orders", "app1:host:42:1") for _ in range(2)]
    for sub in subs:
        await sub.start()
    for i in range(2):
        redis_client.xadd("orders", encode_entry(StreamEntry(f"m{i}".encode())))  # type: ignore[arg-type]

    def consumers() -> list[str]:
        rows: Any = redis_client.xinfo_consumers("orders", "app1")
        return sorted(_s(row["name"]) for row in rows)

    try:
        # One slot each: each reads one entry, as a consumer of its own.
        await wait_until(lambda: len(consumers()) == 2)
        assert consumers() == sorted(sub.consumer for sub in subs)
        assert all(name.startswith("app1:host:42:1:") for name in consumers())
    finally:
        for sub in subs:
            await sub.close()


async def _all(it: AsyncIterator[Delivery]) -> list[Delivery]:
    return [d async for d in it]


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


# --- expiry, acks this stream does not hold, batched acks (issues 12 and 13) ---


def expired_count(metrics: Metrics) -> float:
    value = metrics.registry.get_sample_value("delayed_pubsub_expired_messages_total", {"instance": "t"})
    return 0.0 if value is None else value


async def test_an_entry_past_its_expiry_is_acked_away_never_delivered_and_counted(
    aclient: aioredis.Redis, redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    now_ms = int(time.time() * 1000)
    redis_client.xadd("orders", encode_entry(StreamEntry(b"stale", expires_at_ms=now_ms - 1)))  # type: ignore[arg-type]
    redis_client.xadd("orders", encode_entry(StreamEntry(b"fresh", expires_at_ms=now_ms + 60_000)))  # type: ignore[arg-type]
    redis_client.xadd("orders", encode_entry(StreamEntry(b"forever")))  # type: ignore[arg-type]
    metrics = Metrics()
    sub = Broker(aclient, settings(redis_server), SystemClock(), metrics.for_instance("t")).subscription(
        "orders", "c1"
    )
    await sub.start()
    try:
        it = sub.deliveries()
        got = [await next_delivery(it), await next_delivery(it)]
        assert [d.entry.data for d in got] == [b"fresh", b"forever"]
        for d in got:
            await sub.ack(d.id)
        # The stale one was XACKed too: nothing waits for processingTimeout.
        await wait_until(lambda: redis_client.xpending("orders", "app1")["pending"] == 0)
        assert expired_count(metrics) == 1
        # And it is not claimed back later either (processingTimeout is 400 ms).
        with pytest.raises(TimeoutError):
            await next_delivery(it, within=0.8)
    finally:
        await sub.close()


async def test_an_entry_that_expires_while_waiting_for_redelivery_is_not_redelivered(
    aclient: aioredis.Redis, redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    expires = int(time.time() * 1000) + 1000
    redis_client.xadd("orders", encode_entry(StreamEntry(b"brief", expires_at_ms=expires)))  # type: ignore[arg-type]
    metrics = Metrics()
    s = settings(redis_server, redeliverInterval="1500ms", processingTimeout="10s")
    sub = Broker(aclient, s, SystemClock(), metrics.for_instance("t")).subscription("orders", "c1")
    await sub.start()
    try:
        it = sub.deliveries()
        d = await next_delivery(it)
        assert d.entry.data == b"brief"
        assert time.time() * 1000 < expires  # delivered in time, at first
        sub.nack(d.id)  # comes back after 1.5 s: past its expiry
        with pytest.raises(TimeoutError):
            await next_delivery(it, within=2.0)
        await wait_until(lambda: redis_client.xpending("orders", "app1")["pending"] == 0)
        assert expired_count(metrics) == 1
    finally:
        await sub.close()


async def test_acks_for_ids_this_stream_does_not_hold_are_ignored(
    aclient: aioredis.Redis, redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    broker = Broker(aclient, settings(redis_server, concurrency="1", processingTimeout="10s"), SystemClock())
    for i in range(2):
        redis_client.xadd("orders", encode_entry(StreamEntry(f"m{i}".encode())))  # type: ignore[arg-type]
    a, b = broker.subscription("orders", "a"), broker.subscription("orders", "b")
    await a.start()
    try:
        held_by_a = await next_delivery(a.deliveries())
        await b.start()
        held_by_b = await next_delivery(b.deliveries())
        # b acks what a holds, an id that does not exist, garbage, and its own twice.
        assert not b.ack_nowait(held_by_a.id)
        assert not b.ack_nowait("99999999999-0")
        assert not b.ack_nowait("not an id")
        await b.ack(held_by_b.id)
        assert not b.ack_nowait(held_by_b.id)
        await asyncio.sleep(0.1)
        rows: Any = redis_client.xpending_range("orders", "app1", "-", "+", 10)
        assert [(_s(r["message_id"]), _s(r["consumer"])) for r in rows] == [(held_by_a.id, a.consumer)]
        # a's own ack still works.
        await a.ack(held_by_a.id)
        assert redis_client.xpending("orders", "app1")["pending"] == 0
    finally:
        await a.close()
        await b.close()


async def test_acks_arriving_together_are_sent_as_few_xacks_and_all_land(
    aclient: aioredis.Redis, redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    n = 400
    backlog(redis_client, n)
    sub = Broker(aclient, settings(redis_server, concurrency="100"), SystemClock()).subscription(
        "orders", "c1"
    )
    await sub.start()
    redis_client.config_resetstat()
    try:
        await take_and_ack(sub, redis_client, n)
    finally:
        await sub.close()
    stats: Any = redis_client.info("commandstats")
    # One XACK per message would be 400 calls.
    assert stats["cmdstat_xack"]["calls"] <= n // 10


async def test_close_sends_the_acks_not_yet_xacked(
    aclient: aioredis.Redis, redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    for i in range(5):
        redis_client.xadd("orders", encode_entry(StreamEntry(f"m{i}".encode())))  # type: ignore[arg-type]
    sub = Broker(aclient, settings(redis_server), SystemClock()).subscription("orders", "c1")
    await sub.start()
    it = sub.deliveries()
    for _ in range(5):
        sub.ack_nowait((await next_delivery(it)).id)
    await sub.close()  # at once: the acks may still be queued
    assert redis_client.xpending("orders", "app1")["pending"] == 0


# --- coalesced publishes (issue 13) --------------------------------------------


async def test_concurrent_publishes_each_get_the_id_of_their_own_entry(
    aclient: aioredis.Redis, redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    broker = Broker(aclient, settings(redis_server), SystemClock())
    n = 500
    ids = await asyncio.gather(
        *(broker.publish(f"topic{i % 3}", StreamEntry(f"m{i}".encode(), {"i": str(i)})) for i in range(n))
    )
    assert len({(i % 3, entry_id) for i, entry_id in enumerate(ids)}) == n  # ids are per stream
    for i, entry_id in enumerate(ids):
        rows: Any = redis_client.xrange(f"topic{i % 3}", entry_id, entry_id)
        assert [decode_entry(f).data for _, f in rows] == [f"m{i}".encode()]
    assert sum(redis_client.xlen(f"topic{t}") for t in range(3)) == n


async def test_a_refused_publish_in_a_coalesced_batch_fails_only_its_caller(
    aclient: aioredis.Redis, redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    redis_client.set("not-a-stream", "x")
    broker = Broker(aclient, settings(redis_server), SystemClock())
    topics = ["orders" if i % 4 else "not-a-stream" for i in range(40)]
    results = await asyncio.gather(
        *(broker.publish(t, StreamEntry(f"m{i}".encode())) for i, t in enumerate(topics)),
        return_exceptions=True,
    )
    failed = [i for i, r in enumerate(results) if isinstance(r, BaseException)]
    assert failed == [i for i, t in enumerate(topics) if t == "not-a-stream"]
    assert all(isinstance(results[i], DelayedPubSubError) for i in failed)
    assert all("WRONGTYPE" in str(results[i]) for i in failed)
    rows: Any = redis_client.xrange("orders")
    stored = [decode_entry(f).data for _, f in rows]
    assert stored == [f"m{i}".encode() for i, t in enumerate(topics) if t == "orders"]


async def test_coalesced_publishes_fail_unavailable_when_redis_is_down(
    redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    port = free_port()
    client = aioredis.Redis(port=port)
    broker = Broker(client, settings(redis_server, redisHost=f"127.0.0.1:{port}"), SystemClock())
    try:
        results = await asyncio.gather(
            *(broker.publish("orders", StreamEntry(b"x")) for _ in range(10)), return_exceptions=True
        )
        assert all(isinstance(r, BackendUnavailableError) for r in results)
    finally:
        await client.aclose()


async def test_an_entry_that_expires_in_the_buffer_is_not_handed_out(
    aclient: aioredis.Redis, redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    expires = int(time.time() * 1000) + 500
    redis_client.xadd("orders", encode_entry(StreamEntry(b"brief", expires_at_ms=expires)))  # type: ignore[arg-type]
    metrics = Metrics()
    s = settings(redis_server, processingTimeout="10s")
    sub = Broker(aclient, s, SystemClock(), metrics.for_instance("t")).subscription("orders", "c1")
    await sub.start()
    try:
        # Fetched into the buffer (it is in our PEL) while nobody takes deliveries.
        await wait_until(lambda: redis_client.xpending("orders", "app1")["pending"] == 1)
        assert time.time() * 1000 < expires
        await asyncio.sleep(max(0.0, expires / 1000 - time.time()) + 0.05)
        with pytest.raises(TimeoutError):
            await next_delivery(sub.deliveries(), within=0.5)
        await wait_until(lambda: redis_client.xpending("orders", "app1")["pending"] == 0)
        assert expired_count(metrics) == 1
    finally:
        await sub.close()


async def test_publishes_arriving_one_per_loop_pass_share_round_trips(
    aclient: aioredis.Redis, redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    # grpc.aio hands the server one new call per event-loop pass: concurrent
    # publishes arrive staggered, not all at once as with gather().
    broker = Broker(aclient, settings(redis_server), SystemClock())
    round_trips = 0
    pipeline, xadd = aclient.pipeline, aclient.xadd

    def counted_pipeline(*args: Any, **kwargs: Any) -> Any:
        nonlocal round_trips
        round_trips += 1
        return pipeline(*args, **kwargs)

    async def counted_xadd(*args: Any, **kwargs: Any) -> Any:
        nonlocal round_trips
        round_trips += 1
        return await xadd(*args, **kwargs)

    aclient.pipeline = counted_pipeline  # type: ignore[method-assign]
    aclient.xadd = counted_xadd  # type: ignore[method-assign]

    async def arrive(i: int) -> str:
        for _ in range(i):
            await asyncio.sleep(0)
        return await broker.publish("orders", StreamEntry(f"m{i}".encode()))

    n = 400
    ids = await asyncio.gather(*(arrive(i) for i in range(n)))
    rows: Any = redis_client.xrange("orders")
    assert [decode_entry(f).data for _, f in rows] == [f"m{i}".encode() for i in range(n)]
    assert [r[0] if isinstance(r[0], str) else r[0].decode() for r in rows] == ids
    assert round_trips <= n // 10, f"{round_trips} round trips for {n} publishes"


async def test_an_entry_gone_idle_behind_the_reclaim_cursor_is_reclaimed_while_a_backlog_lasts(
    aclient: aioredis.Redis, redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    """300 entries of a dead consumer wait, and this stream takes one per pass (concurrency 1),
    so its reclaim round lasts ~30 s. An entry at the head of the PEL, held by a live consumer
    while the cursor went past it, goes idle: it is reclaimed within about two processingTimeouts."""
    timeout_s = 0.5
    s = settings(redis_server, processingTimeout="500ms", redeliverInterval="100ms", concurrency="1")
    redis_client.xgroup_create("orders", "app1", id="0", mkstream=True)
    behind = _s(redis_client.xadd("orders", encode_entry(StreamEntry(b"behind"))))  # type: ignore[arg-type]
    redis_client.xreadgroup("app1", "busy", {"orders": ">"}, count=1)
    pipe = redis_client.pipeline(transaction=False)
    for i in range(300):
        pipe.xadd("orders", encode_entry(StreamEntry(f"backlog {i}".encode())))  # type: ignore[arg-type]
    pipe.execute()
    redis_client.xreadgroup("app1", "dead", {"orders": ">"})

    async def keep_busy(until: float) -> None:
        # The live consumer working on it: its idle time keeps being reset.
        while time.monotonic() < until:
            await aclient.xclaim("orders", "app1", "busy", 0, [behind], justid=True)
            await asyncio.sleep(0.05)

    busy_until = time.monotonic() + 1.5
    busy = asyncio.create_task(keep_busy(busy_until))
    await asyncio.sleep(timeout_s + 0.1)  # the backlog is idle past processingTimeout
    sub = Broker(aclient, s, SystemClock()).subscription("orders", "alive")
    await sub.start()
    try:
        it = sub.deliveries()
        backlog = 0
        while True:
            assert time.monotonic() < busy_until + 10, "not reclaimed while the backlog lasts"
            d = await next_delivery(it)
            await sub.ack(d.id)
            if d.id == behind:
                break
            backlog += 1
        waited = time.monotonic() - busy_until
        await busy
        assert d.entry.data == b"behind"
        assert backlog < 100, "the backlog ran out: nothing shows the cursor went back"
        assert waited < 2 * timeout_s + 0.5, waited
    finally:
        busy.cancel()
        await sub.close()


@pytest.mark.parametrize("waiting", [10, 2000])
async def test_an_abandoned_entry_behind_entries_waiting_out_retry_backoffs_is_reclaimed(
    aclient: aioredis.Redis, redis_server: RedisServer, redis_client: redis.Redis, waiting: int
) -> None:
    """Entries at the PEL's head wait an hour for their retries; behind them an entry's
    consumer died. With two slots and four reclaim passes per processingTimeout, the entries
    that wait must not use up the passes: the abandoned one is delivered within about two
    processingTimeouts."""
    redis_client.xgroup_create("orders", "app1", id="0", mkstream=True)
    pipe = redis_client.pipeline(transaction=False)
    for _ in range(waiting):
        pipe.xadd("orders", encode_entry(StreamEntry(b"held")))  # type: ignore[arg-type]
    held = [_s(i) for i in pipe.execute()]
    redis_client.xreadgroup("app1", "other", {"orders": ">"})
    later = int(time.time() * 1000) + 3_600_000
    redis_client.zadd(retry_key("app1", "orders"), dict.fromkeys(held, later))
    dead = _s(redis_client.xadd("orders", encode_entry(StreamEntry(b"abandoned"))))  # type: ignore[arg-type]
    redis_client.xreadgroup("app1", "dead", {"orders": ">"})
    await asyncio.sleep(1.1)  # all idle past processingTimeout
    s = settings(redis_server, processingTimeout="1s", redeliverInterval="250ms", concurrency="2")
    sub = Broker(aclient, s, SystemClock()).subscription("orders", "alive")
    sub.retry = retrier(aclient, sub.consumer)
    started = time.monotonic()
    await sub.start()
    try:
        d = await next_delivery(sub.deliveries(), within=8.0)
        waited = time.monotonic() - started
        assert (d.id, d.entry.data, d.attempt) == (dead, b"abandoned", 2)
        assert waited < 2.5, waited
        # The entries waiting for their retries stay with their records.
        assert redis_client.zcard(retry_key("app1", "orders")) == waiting
        rows: Any = redis_client.xpending_range("orders", "app1", "-", "+", waiting + 10)
        assert {_s(r["message_id"]) for r in rows if r["consumer"] == b"other"} == set(held)
    finally:
        await sub.close()


def due_retries(redis_client: redis.Redis, n: int) -> list[str]:
    """n entries m0..m{n-1} on `orders`, delivered once to a consumer that is gone, their retries due now."""
    redis_client.xgroup_create("orders", "app1", id="0", mkstream=True)
    pipe = redis_client.pipeline(transaction=False)
    for i in range(n):
        pipe.xadd("orders", encode_entry(StreamEntry(f"m{i}".encode())))  # type: ignore[arg-type]
    ids = [_s(i) for i in pipe.execute()]
    redis_client.xreadgroup("app1", "gone", {"orders": ">"})
    redis_client.zadd(retry_key("app1", "orders"), dict.fromkeys(ids, int(time.time() * 1000) - 1))
    return ids


def retrying_stream(
    aclient: aioredis.Redis, redis_server: RedisServer, name: str, concurrency: str
) -> Subscription:
    """A stream of group app1 on `orders` with a retry policy, processingTimeout 500ms."""
    s = settings(redis_server, processingTimeout="500ms", redeliverInterval="100ms", concurrency=concurrency)
    sub = Broker(aclient, s, SystemClock()).subscription("orders", name)
    sub.retry = retrier(aclient, sub.consumer)
    return sub


async def until_all_acked(
    redis_client: redis.Redis,
    streams: list[Subscription],
    work: Callable[[Subscription], Coroutine[Any, Any, None]],
) -> None:
    """Start `streams` 0.1 s apart, in order, each consumed by `work`, until nothing is pending
    and then 1 s more (past processingTimeout: whatever would come again has come); close them."""
    tasks = []
    try:
        for sub in streams:
            await sub.start()
            tasks.append(asyncio.create_task(work(sub)))
            await asyncio.sleep(0.1)
        await wait_until(lambda: redis_client.xpending("orders", "app1")["pending"] == 0, within_s=15)
        await asyncio.sleep(1.0)
    finally:
        for t in tasks:
            t.cancel()
        for sub in streams:
            await sub.close()


async def test_due_retries_beyond_a_streams_window_are_left_to_other_streams_and_delivered_once(
    aclient: aioredis.Redis, redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    """Five retries are due and stream A, started first, has one slot. A claims one at a time;
    the others stay in Redis, and B (ten slots) delivers them: none waits in A's buffer going
    idle until B's reclaim pass delivers it a second time while A still hands out its copy."""
    ids = due_retries(redis_client, 5)
    seen: Counter[str] = Counter()
    copies: Counter[str] = Counter()
    twice: list[str] = []

    async def handle(sub: Subscription, d: Delivery) -> None:
        seen[d.id] += 1
        copies[d.id] += 1
        if copies[d.id] > 1:
            twice.append(d.id)
        await asyncio.sleep(0.3)  # the app's work, within processingTimeout
        copies[d.id] -= 1
        await sub.ack(d.id)

    async def work(sub: Subscription) -> None:
        # As daprd does: each message handled as it comes, up to the window.
        handling: set[asyncio.Task[None]] = set()
        async for d in sub.deliveries():
            task = asyncio.create_task(handle(sub, d))
            handling.add(task)
            task.add_done_callback(handling.discard)

    streams = [
        retrying_stream(aclient, redis_server, "A", "1"),
        retrying_stream(aclient, redis_server, "B", "10"),
    ]
    await until_all_acked(redis_client, streams, work)
    assert twice == []
    assert seen == dict.fromkeys(ids, 1)


async def test_a_streams_retry_poller_claims_no_more_due_retries_than_its_window_takes(
    aclient: aioredis.Redis, redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    """2,000 retries fall due at once for a stream with one slot whose app is busy: the poller
    claims one into the stream's buffer, not all of them (bounded memory); the rest wait in Redis."""
    ids = due_retries(redis_client, 2000)
    s = settings(redis_server, processingTimeout="60s", concurrency="1", queueDepth="1")
    sub = Broker(aclient, s, SystemClock()).subscription("orders", "A")
    sub.retry = retrier(aclient, sub.consumer)
    await sub.start()
    try:
        await wait_until(lambda: redis_client.zcard(retry_key("app1", "orders")) < 2000)
        await asyncio.sleep(1.5)  # past the poller's longest sleep: it had every chance to claim more
        rows: Any = redis_client.xpending_range("orders", "app1", "-", "+", 3000)
        assert Counter(r["consumer"] for r in rows) == {sub.consumer.encode(): 1, b"gone": 1999}
        assert redis_client.zcard(retry_key("app1", "orders")) == 1999
        d = await next_delivery(sub.deliveries())
        assert (d.id, d.attempt) == (ids[0], 2)
    finally:
        await sub.close()


async def test_a_buffered_entry_taken_over_while_it_waited_is_not_handed_out_as_well(
    aclient: aioredis.Redis, redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    """Five retries are due; A (one slot) and B (ten slots) share them, and each app works on one
    message at a time for 0.3 s, so B's claimed entries wait in its buffer past processingTimeout
    (0.5 s) and A's reclaim pass takes them over. B hands out none of those: no message is ever
    worked on by two streams at once, and every one is acked."""
    due_retries(redis_client, 5)
    working: Counter[str] = Counter()
    twice: list[str] = []

    async def work(sub: Subscription) -> None:
        async for d in sub.deliveries():  # one at a time
            working[d.id] += 1
            if working[d.id] > 1:
                twice.append(d.id)
            await asyncio.sleep(0.3)
            working[d.id] -= 1
            await sub.ack(d.id)

    streams = [
        retrying_stream(aclient, redis_server, "A", "1"),
        retrying_stream(aclient, redis_server, "B", "10"),
    ]
    await until_all_acked(redis_client, streams, work)
    assert twice == []


async def test_a_pending_entry_trimmed_away_leaves_the_pending_list_and_is_not_delivered(
    aclient: aioredis.Redis, redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    s = settings(redis_server)
    redis_client.xgroup_create("orders", "app1", id="0", mkstream=True)
    redis_client.xadd("orders", encode_entry(StreamEntry(b"trimmed")))  # type: ignore[arg-type]
    kept = redis_client.xadd("orders", encode_entry(StreamEntry(b"kept")))  # type: ignore[arg-type]
    redis_client.xreadgroup("app1", "dead", {"orders": ">"})
    # streamTTL / maxLenApprox trimming: the entry goes while it is pending.
    redis_client.xtrim("orders", minid=kept, approximate=False)
    assert redis_client.xpending("orders", "app1")["pending"] == 2
    sub = Broker(aclient, s, SystemClock()).subscription("orders", "alive")
    await sub.start()
    try:
        it = sub.deliveries()
        d = await next_delivery(it)
        assert (d.id, d.entry.data, d.attempt) == (_s(kept), b"kept", 2)
        await sub.ack(d.id)
        await wait_until(lambda: redis_client.xpending("orders", "app1")["pending"] == 0)
        with pytest.raises(TimeoutError):
            await next_delivery(it, within=1.0)
    finally:
        await sub.close()


async def test_a_nacked_entry_another_stream_delivered_while_it_waited_is_not_delivered_again(
    aclient: aioredis.Redis, redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    """No retry policy, and a redeliverInterval (2.5 s) longer than processingTimeout (2 s): while
    the nacked entry waits, another stream reclaims it (delivery 2). When the wait ends, the
    stream that got the nack does not deliver it a third time while delivery 2 is handled."""
    a = {"processingTimeout": "2s", "redeliverInterval": "2500ms"}
    b = {"processingTimeout": "2s", "redeliverInterval": "50ms"}
    async with two_streams(aclient, redis_server, a, b) as (sub_a, sub_b, later):
        redis_client.xadd("orders", encode_entry(StreamEntry(b"m0")))  # type: ignore[arg-type]
        it_a = sub_a.deliveries()
        d = await next_delivery(it_a)
        await sub_b.start()
        sub_a.nack(d.id)
        taken = await next_delivery(sub_b.deliveries())
        assert (taken.id, taken.attempt) == (d.id, 2)
        again = later(it_a)
        await asyncio.sleep(1.0)  # the app's work on delivery 2; a's wait ends meanwhile
        assert not again.done(), "delivered twice"
        await sub_b.ack(taken.id)
        await wait_until(lambda: redis_client.xpending("orders", "app1")["pending"] == 0)
        await asyncio.sleep(0.3)
        assert not again.done()


async def test_a_stopping_subscription_claims_no_due_retry_for_itself(
    aclient: aioredis.Redis,
    redis_server: RedisServer,
    redis_client: redis.Redis,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Between stop() and the end of close() the stream's retry poller claims nothing: an entry it
    claimed would be dropped with the stream's buffer, and come back only after processingTimeout,
    one delivery attempt higher. The due record stays for the other streams of the group."""
    redis_client.xgroup_create("orders", "app1", id="0", mkstream=True)
    entry = _s(redis_client.xadd("orders", encode_entry(StreamEntry(b"x"))))  # type: ignore[arg-type]
    redis_client.xreadgroup("app1", "other", {"orders": ">"})  # delivery 1, failed by another stream
    sub = Broker(aclient, settings(redis_server, processingTimeout="60s"), SystemClock()).subscription(
        "orders", "closing"
    )
    sub.retry = Retrier(
        aclient,
        RetryPolicy(initial_ms=1_000, max_ms=60_000, multiplier=2.0, jitter=0.0, active=True),
        topic="orders",
        group="app1",
        consumer=sub.consumer,
        clock=SystemClock(),
        metrics=Metrics().for_instance(""),
        call_timeout=5.0,
    )
    await sub.start()
    try:
        sub.stop()
        redis_client.zadd(retry_key("app1", "orders"), {entry: 0})  # due now
        await asyncio.sleep(1.5)  # past the poller's longest sleep
        rows: Any = redis_client.xpending_range("orders", "app1", min=entry, max=entry, count=1)
        assert [(r["consumer"], r["times_delivered"]) for r in rows] == [(b"other", 1)]
        assert redis_client.zcard(retry_key("app1", "orders")) == 1
        # Stopped by our own flag: no loop of it was taken for failed and restarted.
        assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
    finally:
        await sub.close()


async def test_an_entry_landing_while_the_buffer_is_handed_out_is_read_at_once(
    aclient: aioredis.Redis, redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    # A fire lands every few ms while PullMessages writes the previous one's messages, one
    # write at a time: the window (concurrency 100) has room, so the new entry must be read
    # then, not after the last of the earlier ones is written.
    backlog(redis_client, 10)
    sub = Broker(aclient, settings(redis_server, concurrency="100"), SystemClock()).subscription(
        "orders", "c1"
    )
    await sub.start()
    try:
        it = sub.deliveries()
        got = [await next_delivery(it)]  # one written, nine still in the buffer
        await wait_until(lambda: redis_client.xpending("orders", "app1")["pending"] == 10)
        late = redis_client.xadd("orders", encode_entry(StreamEntry(b"late")))  # type: ignore[arg-type]
        await wait_until(lambda: redis_client.xpending("orders", "app1")["pending"] == 11, within_s=2.0)
        while len(got) < 11:
            got.append(await next_delivery(it))
        assert [d.entry.data for d in got] == [*(f"m{i}".encode() for i in range(10)), b"late"]
        assert got[-1].id == (late.decode() if isinstance(late, bytes) else late)
        for d in got:
            sub.ack_nowait(d.id)
        await wait_until(lambda: redis_client.xpending("orders", "app1")["pending"] == 0)
    finally:
        await sub.close()


async def test_a_nack_of_a_delivery_another_stream_has_taken_over_redelivers_nothing(
    aclient: aioredis.Redis, redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    """No retry policy. The app holds a message past processingTimeout, another stream takes it
    over (delivery 2), and only then does the first delivery fail: that takeover is the
    redelivery, and the stream that got the nack does not deliver it a third time."""
    a = {"processingTimeout": "1s", "redeliverInterval": "200ms"}
    b = {"processingTimeout": "1s", "redeliverInterval": "50ms"}
    async with two_streams(aclient, redis_server, a, b) as (sub_a, sub_b, later):
        redis_client.xadd("orders", encode_entry(StreamEntry(b"m0")))  # type: ignore[arg-type]
        it_a = sub_a.deliveries()
        held = await next_delivery(it_a)
        await sub_b.start()
        taken = await next_delivery(sub_b.deliveries())
        assert (taken.id, taken.attempt) == (held.id, 2)
        sub_a.nack(held.id)
        again = later(it_a)
        await asyncio.sleep(0.6)  # past a's redeliverInterval, within delivery 2's processingTimeout
        assert not again.done(), "delivered twice"
        await sub_b.ack(taken.id)
        await wait_until(lambda: redis_client.xpending("orders", "app1")["pending"] == 0)
        await asyncio.sleep(0.3)
        assert not again.done()


async def test_under_a_backlog_acks_ride_on_the_reads_that_refill_their_slots(
    aclient: aioredis.Redis,
    redis_server: RedisServer,
    redis_client: redis.Redis,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # concurrency 10 (the default): a read refills half the window, and the acks that
    # freed those slots go in the same round trip, not in an XACK of their own.
    n = 600
    backlog(redis_client, n)
    sub = Broker(aclient, settings(redis_server), SystemClock()).subscription("orders", "c1")
    round_trips = Counter[str]()

    def counting(name: str) -> Callable[..., Any]:
        call = getattr(aclient, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            round_trips[name] += 1
            return call(*args, **kwargs)

        return counted

    for name in ("pipeline", "xack", "xreadgroup"):
        setattr(aclient, name, counting(name))
    # The delivery path's own pipeline (one round trip however many commands it sends).
    real_round_trip = SubscriptionCalls.round_trip

    def round_trip(calls: SubscriptionCalls, *commands: tuple[Any, ...]) -> Any:
        round_trips["round_trip"] += 1
        return real_round_trip(calls, *commands)

    monkeypatch.setattr(SubscriptionCalls, "round_trip", round_trip)
    await sub.start()
    try:
        # A subscriber that takes a moment per message, as daprd calling an app does.
        await take_and_ack(sub, redis_client, n, pace_s=0.0002)
    finally:
        await sub.close()
    # A read of half the window (0.2 per message) and an XACK every 2 ms of its own were
    # 0.45 round trips per message; carried acks make it one round trip per read.
    assert sum(round_trips.values()) <= 0.3 * n, dict(round_trips)


def xreadgroup_calls(redis_client: redis.Redis) -> int:
    stats: Any = redis_client.info("commandstats")
    return int(stats.get("cmdstat_xreadgroup", {}).get("calls", 0))


async def test_a_subscriber_that_keeps_pace_gets_a_window_read_ahead_and_a_slow_one_does_not(
    aclient: aioredis.Redis, redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    # concurrency 10: a subscriber acking at once turns its window in a few ms, so each read
    # brings two windows (read ahead of the slots in use): ~0.05 reads per message, not the
    # ~0.1 of reading one window at a time, nor the 0.2 of half a window. Never more than
    # four windows held, one with daprd.
    s = settings(redis_server, processingTimeout="10s")
    fast, n = Broker(aclient, s, SystemClock()).subscription("orders", "fast"), 1000
    backlog(redis_client, n)
    reads_before = xreadgroup_calls(redis_client)
    most_held = most_out = 0
    await fast.start()
    try:
        it = fast.deliveries()
        for _ in range(n):
            d = await next_delivery(it)
            most_held = max(most_held, fast.buffered + fast.in_flight)
            most_out = max(most_out, fast.in_flight)
            fast.ack_nowait(d.id)
        await wait_until(lambda: redis_client.xpending("orders", "app1")["pending"] == 0)
    finally:
        await fast.close()
    reads = xreadgroup_calls(redis_client) - reads_before
    assert reads <= 0.06 * n, reads
    assert most_out <= 10, (most_out, most_held)
    assert most_held <= 40, (most_out, most_held)

    # A subscriber that holds its one message reads nothing ahead: the next entry goes to
    # the other stream of the group.
    s = settings(redis_server, concurrency="1", processingTimeout="10s")
    for i in range(2):
        redis_client.xadd("orders", encode_entry(StreamEntry(f"slow{i}".encode())))  # type: ignore[arg-type]
    a, b = (
        Broker(aclient, s, SystemClock()).subscription("orders", "a"),
        Broker(aclient, s, SystemClock()).subscription("orders", "b"),
    )
    await a.start()
    try:
        first = await next_delivery(a.deliveries())
        await asyncio.sleep(0.2)  # a's fetch loop has had every chance to read ahead
        await b.start()
        second = await next_delivery(b.deliveries())
        assert {first.entry.data, second.entry.data} == {b"slow0", b"slow1"}
        assert a.buffered == 0
    finally:
        await a.close()
        await b.close()


async def test_a_wide_window_buffers_no_more_than_one_queue_depth_so_nothing_ages_into_a_second_delivery(
    aclient: aioredis.Redis, redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    # A stream with concurrency 2000 and an app taking 2 ms a message, another with 10.
    # Entries read ahead wait in the first stream's buffer, claimed in Redis: a buffer of
    # half the window (~1,000) outlasts a 1 s processingTimeout, the other stream's
    # reclaim pass delivers them as well, and the app sees them twice (465 of 2,500 before).
    n = 2500
    backlog(redis_client, n)
    wide = Broker(aclient, settings(redis_server, concurrency="2000", processingTimeout="1s"), SystemClock())
    narrow = Broker(aclient, settings(redis_server, concurrency="10", processingTimeout="1s"), SystemClock())
    a, b = wide.subscription("orders", "a"), narrow.subscription("orders", "b")
    seen: dict[str, list[tuple[str, int]]] = {}
    most_buffered = 0

    async def app(sub: Subscription, who: str) -> None:
        nonlocal most_buffered
        async for d in sub.deliveries():
            seen.setdefault(d.id, []).append((who, d.attempt))
            most_buffered = max(most_buffered, sub.buffered)
            await asyncio.sleep(0.002)  # daprd hands the app one message at a time
            sub.ack_nowait(d.id)

    await a.start()
    await asyncio.sleep(0.3)
    await b.start()
    apps = [asyncio.create_task(app(a, "a")), asyncio.create_task(app(b, "b"))]
    try:
        await wait_until(
            lambda: len(seen) == n and redis_client.xpending("orders", "app1")["pending"] == 0, within_s=60
        )
        await asyncio.sleep(1.5)  # past processingTimeout: a late second delivery would show
    finally:
        for task in apps:
            task.cancel()
        await asyncio.gather(*apps, return_exceptions=True)
        await a.close()
        await b.close()
    twice = {i: who for i, who in seen.items() if len(who) > 1}
    assert twice == {}, f"{len(twice)} delivered twice, e.g. {list(twice.items())[:3]}"
    assert most_buffered <= settings(redis_server).queue_depth


async def test_acks_whose_call_failed_are_sent_again_at_once_and_their_futures_resolve(
    aclient: aioredis.Redis,
    redis_server: RedisServer,
    redis_client: redis.Redis,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A reply redis-py cannot parse is not retried: the batch of acks that call carried
    # must go back to the queue, not wait on the wire list until close() while its
    # entries time out in our PEL (another stream would then deliver them again).
    n = 200
    backlog(redis_client, n)
    props = settings(redis_server, processingTimeout="1s", redeliverInterval="200ms")
    sub = Broker(aclient, props, SystemClock()).subscription("orders", "c1")
    real_pipeline = aclient.pipeline
    broken: list[int] = []

    class Garbled:
        def __init__(self, pipe: Any) -> None:
            self.pipe = pipe

        def __getattr__(self, name: str) -> Any:
            return getattr(self.pipe, name)

        async def execute(self, **kwargs: Any) -> Any:
            raise redis.exceptions.InvalidResponse("Protocol Error: injected")

    def pipeline(**kwargs: Any) -> Any:
        pipe = real_pipeline(**kwargs)
        if acks_given and not broken:
            broken.append(1)
            return Garbled(pipe)
        return pipe

    acks_given: list[asyncio.Future[None]] = []
    aclient.pipeline = pipeline  # type: ignore[method-assign,assignment]
    # The delivery path's own pipeline on a plain node: the same garbled reply, once.
    real_round_trip = SubscriptionCalls.round_trip

    async def round_trip(calls: SubscriptionCalls, *commands: tuple[Any, ...]) -> Any:
        if acks_given and not broken and any(c[0] == "XACK" for c in commands):
            broken.append(1)
            raise redis.exceptions.InvalidResponse("Protocol Error: injected")
        return await real_round_trip(calls, *commands)

    monkeypatch.setattr(SubscriptionCalls, "round_trip", round_trip)
    await sub.start()
    try:
        it = sub.deliveries()
        for _ in range(n):
            d = await next_delivery(it)
            await asyncio.sleep(0.0005)  # daprd's pace: acks ride on the reads of a backlog
            acks_given.append(asyncio.ensure_future(sub.ack(d.id)))
        await wait_until(lambda: all(f.done() for f in acks_given), within_s=3.0)
        await wait_until(lambda: redis_client.xpending("orders", "app1")["pending"] == 0, within_s=3.0)
    finally:
        await sub.close()
    assert broken, "the garbled reply was never injected"


async def test_a_retry_falling_due_during_a_fast_backlog_is_delivered_before_the_backlog_ends(
    aclient: aioredis.Redis, redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    # A subscriber acking at once reads ahead; a due retry must still get the slots acks
    # free (the stream stops reading ahead while one waits), not wait for the backlog to end.
    n = 4000
    sub = Broker(aclient, settings(redis_server, processingTimeout="10s"), SystemClock()).subscription(
        "orders", "c1"
    )
    sub.retry = retrier(
        aclient, sub.consumer, RetryPolicy(active=True, initial_ms=50, max_ms=50, multiplier=1.0, jitter=0.0)
    )
    backlog(redis_client, n)
    await sub.start()
    order: list[tuple[str, int]] = []
    try:
        it = sub.deliveries()
        first = await next_delivery(it)
        sub.nack(first.id)
        while not any(attempt == 2 for _, attempt in order) and len(order) < n:
            d = await next_delivery(it)
            order.append((d.id, d.attempt))
            sub.ack_nowait(d.id)
    finally:
        await sub.close()
    again = [i for i, (entry_id, attempt) in enumerate(order) if attempt == 2]
    assert again, "the nacked message came back only after the backlog"
    assert order[again[0]][0] == first.id
    assert again[0] < n - 500, again[0]


async def test_entries_left_unsent_in_the_buffers_of_closed_streams_are_not_dead_lettered(
    aclient: aioredis.Redis, redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    """maxDeliveryAttempts 2. Two streams in turn read a window of a 20-entry backlog into their
    buffers, hand one message to the app (which never answers) and close, as daprd ends a stream
    on a rolling restart. A third stream then gets every message: what waited unsent in the
    closed streams' buffers was never delivered, so it is delivered now, not dead-lettered; only
    a message the app was sent twice and never answered reaches the dead-letter topic."""
    backlog(redis_client, 20)
    backlog_data = [f"m{i}".encode() for i in range(20)]
    policy = RetryPolicy(
        active=True, initial_ms=3_600_000, max_ms=3_600_000, multiplier=2.0, jitter=0.0,
        max_attempts=2, dead_letter_topic="dlq",
    )  # fmt: skip
    s = settings(redis_server, concurrency="5", queueDepth="10")
    sent: Counter[bytes] = Counter()  # the app's deliveries, by payload

    def stream(name: str) -> Subscription:
        sub = Broker(aclient, s, SystemClock()).subscription("orders", name)
        sub.retry = retrier(aclient, sub.consumer, policy)
        return sub

    async def one_sent_then_closed(sub: Subscription) -> None:
        await sub.start()
        try:
            sent[(await next_delivery(sub.deliveries())).entry.data] += 1
            await wait_until(lambda: sub.buffered > 0)  # the rest of the window, never sent
        finally:
            await sub.close()
        # The restart takes longer than processingTimeout: the next stream's first reclaim
        # pass takes over what this one held.
        await asyncio.sleep(0.5)

    await one_sent_then_closed(stream("first"))
    await one_sent_then_closed(stream("second"))
    last = stream("third")

    async def ack_all() -> None:
        async for d in last.deliveries():
            sent[d.entry.data] += 1
            last.ack_nowait(d.id)

    await last.start()
    app = asyncio.create_task(ack_all())
    try:
        # Nothing pending: each message was acked or dead-lettered.
        await wait_until(lambda: redis_client.xpending("orders", "app1")["pending"] == 0, within_s=10)
    finally:
        app.cancel()
        await last.close()
    letters: Any = redis_client.xrange("dlq")
    dead = [decode_entry(fields).data for _, fields in letters]
    assert sorted(set(backlog_data) - set(sent)) == []  # never sent to the app
    assert {m: sent[m] for m in dead} == dict.fromkeys(dead, 2)


async def test_a_closing_stream_gives_back_unsent_entries_but_not_one_taken_over_meanwhile(
    aclient: aioredis.Redis, redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    """A stream reads five entries, sends one, and closes. The one sent stays pending at one
    delivery; of the four never sent, the one another consumer took over meanwhile stays with it
    at its count, and the other three go back to no delivery, idle past processingTimeout (400ms)
    so that any stream's next reclaim pass takes them at once."""
    backlog(redis_client, 5)
    sub = Broker(aclient, settings(redis_server, concurrency="5"), SystemClock()).subscription("orders", "c1")
    await sub.start()
    try:
        sent = (await next_delivery(sub.deliveries())).id
        await wait_until(lambda: sub.buffered == 4)
        unsent = sorted(_s(r["message_id"]) for r in redis_client.xpending_range("orders", "app1", "-", "+", 10))
        unsent.remove(sent)
        redis_client.xclaim("orders", "app1", "other", 0, [unsent[0]])  # a takeover: count 2
    finally:
        await sub.close()
    rows: Any = redis_client.xpending_range("orders", "app1", "-", "+", 10)
    pel = {_s(r["message_id"]): (_s(r["consumer"]), r["times_delivered"]) for r in rows}
    assert pel == {
        sent: (sub.consumer, 1),
        unsent[0]: ("other", 2),
        **dict.fromkeys(unsent[1:], (sub.consumer, 0)),
    }
    idle = {_s(r["message_id"]): r["time_since_delivered"] for r in rows}
    assert all(idle[i] >= 400 for i in unsent[1:])
