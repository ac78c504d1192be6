"""Retry policy over the real gRPC socket and a real Redis: backoff, attempts, dead letters."""

from __future__ import annotations

import asyncio
import itertools
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import prometheus_client
import pytest
import redis
import redis.asyncio as aioredis

from delayed_middleware.deadletters import dead_letter_topics_key
from delayed_middleware.entry import StreamEntry, decode_entry, encode_entry
from delayed_middleware.retry import retry_counts_key, retry_key
from delayed_pubsub import lua
from delayed_pubsub.claims import claim_unchanged
from delayed_pubsub.server import ComponentServer
from tests.chaos.proxy import DelayingProxy, LosingProxy
from tests.components.driver import Component, Stream
from tests.components.serve import Serve, instance
from tests.conftest import retrier, small_stream_nodes
from tests.redis_server import free_port
from tests.waiting import wait_until

Factory = Callable[[str], Component]

# 300 ms, then 600 ms: the backoff is visible without slowing the suite.
POLICY = {
    "maxDeliveryAttempts": "3",
    "retryInitialInterval": "300ms",
    "retryMultiplier": "2",
    "retryMaxInterval": "10s",
    "deadLetterTopic": "orders-dead",
}


async def receive(stream: Stream, within: float = 5.0) -> tuple[Any, float]:
    msg = await stream.next(within)
    return msg, time.monotonic()


def dead_letters(redis_client: redis.Redis, topic: str = "orders-dead") -> list[Any]:
    rows: Any = redis_client.xrange(topic)
    return [decode_entry(f) for _, f in rows]


async def work_until_quiet(
    streams: list[Stream],
    *,
    expect: int,
    quiet_s: float,
    work_s: float,
    fail_first: bool,
    within: float = 20.0,
) -> list[tuple[bytes, str]]:
    """Act as the app on `streams` until `expect` deliveries came and then none for `quiet_s`.

    A first delivery is failed at once when `fail_first`; every other one is acked after `work_s`
    of work. One write at a time on each gRPC stream, as daprd writes its acks. Returns
    (data, deliveryAttempt) of every delivery, in arrival order.
    """
    seen: list[tuple[bytes, str]] = []
    work: set[asyncio.Task[None]] = set()
    writing = {id(s): asyncio.Lock() for s in streams}

    async def handle(s: Stream, msg_id: str) -> None:
        await asyncio.sleep(work_s)
        async with writing[id(s)]:
            await s.ack(msg_id)

    last = time.monotonic()
    deadline = last + within
    while len(seen) < expect or time.monotonic() - last < quiet_s:
        assert time.monotonic() < deadline, seen
        for s in streams:
            while not s.received.empty():
                msg = s.received.get_nowait()
                attempt = msg.metadata["deliveryAttempt"]
                seen.append((msg.data, attempt))
                last = time.monotonic()
                if fail_first and attempt == "1":
                    async with writing[id(s)]:
                        await s.nack(msg.id, "later")
                    continue
                task = asyncio.create_task(handle(s, msg.id))
                work.add(task)
                task.add_done_callback(work.discard)
        await asyncio.sleep(0.01)
    await asyncio.gather(*work)
    return seen


async def test_three_nacks_follow_the_backoff_then_dead_letter_with_the_error(
    component: Factory, props: dict[str, str], redis_client: redis.Redis
) -> None:
    c = component("delayed")
    await c.init({**props, **POLICY})
    stream = await c.subscribe("orders")
    await c.publish("orders", b"payload", {"k": "v"})

    arrivals: list[tuple[Any, float]] = []
    for i in range(3):
        msg, at = await receive(stream)
        arrivals.append((msg, at))
        await stream.nack(msg.id, f"boom {i + 1}")

    assert [m.metadata["deliveryAttempt"] for m, _ in arrivals] == ["1", "2", "3"]
    assert len({m.id for m, _ in arrivals}) == 1, "the same entry comes back"
    gaps = [b - a for (_, a), (_, b) in itertools.pairwise(arrivals)]
    # 0.3 s then 0.6 s: never early (the upper bound is loose: a shared machine).
    assert 0.3 <= gaps[0] < 1.5, gaps
    assert 0.6 <= gaps[1] < 1.8, gaps

    await wait_until(lambda: len(dead_letters(redis_client)) == 1)
    [dead] = dead_letters(redis_client)
    assert dead.data == b"payload"
    assert dead.metadata["k"] == "v"
    assert dead.metadata["deadLetterReason"] == "boom 3"
    assert dead.metadata["deadLetterAttempts"] == "3"
    assert dead.metadata["deadLetterSourceTopic"] == "orders"
    assert dead.metadata["deadLetterConsumer"] == "app1"
    assert redis_client.smembers(dead_letters_key := dead_letter_topics_key("app1")) == {b"orders-dead"}, (
        dead_letters_key
    )
    # Acked on the source: it never comes back, and nothing waits in the PEL.
    assert await stream.nothing_for(1.0)
    assert redis_client.xpending("orders", "app1")["pending"] == 0
    assert redis_client.zcard(retry_key("app1", "orders")) == 0
    # Two retried, one dead-lettered, in the history the CLI reads.
    rows: Any = redis_client.xrange("{app1-delayed}:history")
    events = [f[b"event"] for _, f in rows]
    assert events == [b"retried", b"retried", b"deadlettered"]
    # The planned waits, exactly: the backoff, not the machine's load.
    assert [int(f[b"due"]) - int(f[b"at"]) for _, f in rows[:2]] == [300, 600]
    assert [f[b"attempt"] for _, f in rows] == [b"1", b"2", b"3"]
    assert rows[2][1][b"reason"] == b"boom 3"


async def test_without_dead_letter_topic_the_last_failure_drops(
    component: Factory, props: dict[str, str], redis_client: redis.Redis
) -> None:
    c = component("delayed")
    await c.init({**props, "maxDeliveryAttempts": "2", "retryInitialInterval": "50ms"})
    stream = await c.subscribe("orders")
    await c.publish("orders", b"x")
    for _ in range(2):
        await stream.nack((await stream.next()).id, "nope")
    assert await stream.nothing_for(1.0)
    await wait_until(lambda: redis_client.xpending("orders", "app1")["pending"] == 0)
    assert not redis_client.exists(dead_letter_topics_key("app1"))


async def test_subscription_metadata_overrides_the_component_policy(
    component: Factory, props: dict[str, str], redis_client: redis.Redis
) -> None:
    c = component("delayed")
    await c.init({**props, **POLICY})
    # This subscription gives up at once, to its own dead-letter topic.
    stream = await c.subscribe("orders", {"maxDeliveryAttempts": "1", "deadLetterTopic": "mine-dead"})
    await c.publish("orders", b"x")
    msg = await stream.next()
    await stream.nack(msg.id, "first and last")
    await wait_until(lambda: len(dead_letters(redis_client, "mine-dead")) == 1)
    assert dead_letters(redis_client, "mine-dead")[0].metadata["deadLetterReason"] == "first and last"
    assert dead_letters(redis_client, "orders-dead") == []


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("maxDeliveryAttempts", "0"),
        ("maxDeliveryAttempts", "three"),
        ("retryInitialInterval", "soon"),
        ("retryMultiplier", "0.5"),
        ("retryJitter", "1.5"),
        ("retryMaxInterval", "10ms"),
        ("deadLetterTopic", "other-delayed"),
        ("deadLetterTopic", "orders"),
    ],
)
async def test_bad_subscription_policy_is_invalid_argument(
    component: Factory, props: dict[str, str], key: str, value: str
) -> None:
    c = component("delayed")
    await c.init({**props, "retryInitialInterval": "1s"})
    code, details = await (await c.subscribe("orders", {key: value})).status()
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert key in details
    assert value in details


async def test_bad_component_policy_refuses_init(component: Factory, props: dict[str, str]) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await component("delayed").init({**props, "retryJitter": "-0.1"})
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "retryJitter" in (err.value.details() or "")


async def test_backoff_survives_a_restart_and_other_streams_do_not_redeliver_early(
    component: Factory, props: dict[str, str], redis_client: redis.Redis
) -> None:
    # processingTimeout is 500 ms in `props`: far below the 3 s backoff, so a
    # plain XAUTOCLAIM would hand the entry to the other stream long before.
    c = component("delayed")
    await c.init({**props, "retryInitialInterval": "3s"})
    first = await c.subscribe("orders")
    await c.publish("orders", b"x")
    msg = await first.next()
    other = await c.subscribe("orders")
    nacked_at = time.monotonic()
    await first.nack(msg.id, "later please")
    await wait_until(lambda: redis_client.zcard(retry_key("app1", "orders")) == 1)
    # The stream that got the nack goes away (daprd restarted, say): no timer
    # of it survives, only the record in Redis.
    await first.cancel()
    assert await other.nothing_for(2.0), "redelivered before its backoff"
    again = await other.next(within=5)
    waited = time.monotonic() - nacked_at
    assert again.id == msg.id
    assert again.metadata["deliveryAttempt"] == "2"
    assert 3.0 <= waited < 4.5, waited
    await other.ack(again.id)
    await wait_until(lambda: redis_client.xpending("orders", "app1")["pending"] == 0)
    assert redis_client.zcard(retry_key("app1", "orders")) == 0


async def test_inactive_policy_keeps_the_redeliver_interval_behaviour(
    component: Factory, props: dict[str, str], redis_client: redis.Redis
) -> None:
    c = component("delayed")
    await c.init(props)  # no retry keys: redeliverInterval (200 ms), forever
    stream = await c.subscribe("orders")
    await c.publish("orders", b"x")
    for attempt in range(1, 6):
        msg = await stream.next()
        assert msg.metadata["deliveryAttempt"] == str(attempt)
        await stream.nack(msg.id)
    assert not redis_client.exists(retry_key("app1", "orders"))


async def test_metrics_over_http_show_retries_and_dead_letters(
    server: ComponentServer, component: Factory, props: dict[str, str]
) -> None:
    c = component("delayed")
    await c.init({**props, **POLICY, "retryInitialInterval": "50ms"})
    stream = await c.subscribe("orders")
    await c.publish("orders", b"x")
    for _ in range(3):
        await stream.nack((await stream.next()).id, "bad")

    port = free_port()
    httpd, thread = prometheus_client.start_http_server(
        port, addr="127.0.0.1", registry=server.metrics.registry
    )
    try:

        def scrape() -> dict[str, float]:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
                body = r.read().decode()
            values: dict[str, float] = {}
            for line in body.splitlines():
                if line.startswith("delayed_pubsub_") and 'instance="delayed"' in line:
                    name, _, value = line.rpartition(" ")
                    values[name] = float(value)
            return values

        deadline = time.monotonic() + 5
        while True:
            m = scrape()
            done = m.get(
                'delayed_pubsub_dead_lettered_messages_total{instance="delayed",outcome="published"}'
            )
            if done == 1 or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
        assert m['delayed_pubsub_retried_messages_total{instance="delayed"}'] == 2
        assert m['delayed_pubsub_dead_lettered_messages_total{instance="delayed",outcome="published"}'] == 1
        assert m['delayed_pubsub_dead_lettered_messages_total{instance="delayed",outcome="dropped"}'] == 0
        assert m['delayed_pubsub_nacked_messages_total{instance="delayed"}'] == 3
        assert m['delayed_pubsub_delivered_messages_total{instance="delayed"}'] == 3
        assert m['delayed_pubsub_open_subscriptions{instance="delayed"}'] == 1
        await stream.close()
        await wait_until(lambda: scrape()['delayed_pubsub_open_subscriptions{instance="delayed"}'] == 0)
    finally:
        httpd.shutdown()
        thread.join(5)


async def test_streams_of_one_group_redeliver_each_retry_exactly_once(
    component: Factory, props: dict[str, str], redis_client: redis.Redis
) -> None:
    # Three streams of one group race for the same retry records (each runs a
    # poller on the same key): every message comes back once per nack, never twice.
    c = component("delayed")
    await c.init({**props, "retryInitialInterval": "100ms"})
    streams = [await c.subscribe("orders") for _ in range(3)]
    n = 60
    for i in range(n):
        await c.publish("orders", f"m{i}".encode())
    seen: dict[str, list[str]] = {}

    async def work(stream: Stream) -> None:
        while True:
            try:
                msg = await stream.next(within=2.0)
            except AssertionError:
                return  # quiet for 2 s: done
            seen.setdefault(msg.data.decode(), []).append(msg.metadata["deliveryAttempt"])
            if msg.metadata["deliveryAttempt"] == "1":
                await stream.nack(msg.id, "once")
            else:
                await stream.ack(msg.id)

    await asyncio.gather(*(work(s) for s in streams))
    assert len(seen) == n
    assert all(attempts == ["1", "2"] for attempts in seen.values()), {
        k: v for k, v in seen.items() if v != ["1", "2"]
    }
    await wait_until(lambda: redis_client.xpending("orders", "app1")["pending"] == 0)
    assert redis_client.zcard(retry_key("app1", "orders")) == 0


async def test_an_entry_deleted_while_it_waits_is_not_redelivered_and_its_record_goes(
    component: Factory, props: dict[str, str], redis_client: redis.Redis
) -> None:
    c = component("delayed")
    await c.init({**props, "retryInitialInterval": "300ms"})
    stream = await c.subscribe("orders")
    await c.publish("orders", b"x")
    msg = await stream.next()
    await stream.nack(msg.id, "e")
    await wait_until(lambda: redis_client.zcard(retry_key("app1", "orders")) == 1)
    redis_client.xdel("orders", msg.id)  # trimmed (maxLenApprox) or deleted by an operator
    assert await stream.nothing_for(1.0)
    assert redis_client.zcard(retry_key("app1", "orders")) == 0


async def test_an_unwritable_dead_letter_topic_loses_nothing_and_blocks_nothing(
    component: Factory, props: dict[str, str], redis_client: redis.Redis
) -> None:
    # The dead-letter topic's key holds a hash (a mistake, or a hostile app):
    # XADD fails with WRONGTYPE. The failed message must stay pending, other
    # messages keep flowing, and once the key is fixed the dead letter lands.
    redis_client.hset("dlq", "not", "a stream")
    c = component("delayed")
    await c.init({**props, "maxDeliveryAttempts": "1", "deadLetterTopic": "dlq"})
    stream = await c.subscribe("orders")
    await c.publish("orders", b"poison")
    await c.publish("orders", b"fine")
    first = await stream.next()
    await stream.nack(first.id, "bad")
    second = await stream.next()
    assert second.data == b"fine"
    await stream.ack(second.id)
    await asyncio.sleep(1.0)
    assert redis_client.xpending("orders", "app1")["pending"] == 1  # the poison one, kept
    redis_client.delete("dlq")
    await wait_until(lambda: bool(redis_client.exists("dlq")) and redis_client.xlen("dlq") == 1, within_s=10)
    await wait_until(lambda: redis_client.xpending("orders", "app1")["pending"] == 0)
    assert dead_letters(redis_client, "dlq")[0].data == b"poison"


async def test_a_retry_comes_back_to_the_failing_app_only(
    component: Factory, props: dict[str, str], redis_client: redis.Redis
) -> None:
    # Two apps (consumer groups) read one topic; app1 fails the message three
    # times, app2 handles it at once: app2 must see it once, never the retries.
    failing, handling = component("app1"), component("app2")
    await failing.init({**props, "retryInitialInterval": "100ms"})
    await handling.init({**props, "consumerID": "app2"})
    a = await failing.subscribe("orders")
    b = await handling.subscribe("orders")
    await failing.publish("orders", b"shared")
    got_b = await b.next()
    await b.ack(got_b.id)
    for attempt in range(1, 4):
        msg = await a.next()
        assert msg.metadata["deliveryAttempt"] == str(attempt)
        await a.nack(msg.id, "not yet")
    await a.ack((await a.next()).id)
    assert await b.nothing_for(1.0)
    assert redis_client.xlen("orders") == 1  # nothing was re-published


async def test_dead_letter_topic_alone_on_the_component_keeps_the_plain_redelivery(
    component: Factory, props: dict[str, str], redis_client: redis.Redis
) -> None:
    # deadLetterTopic is also the forwarder's key (failed hand-offs): set alone on
    # the component it must not turn subscriber retries on. A nack then comes back
    # after redeliverInterval (200 ms here) without a retry record, forever.
    c = component("delayed")
    await c.init({**props, "deadLetterTopic": "orders-dead"})
    stream = await c.subscribe("orders")
    await c.publish("orders", b"x")
    for attempt in range(1, 4):
        msg, _ = await receive(stream)
        assert msg.metadata["deliveryAttempt"] == str(attempt)
        await stream.nack(msg.id, "again")
    msg, _ = await receive(stream)
    await stream.ack(msg.id)
    assert not redis_client.exists(retry_key("app1", "orders"))
    assert not redis_client.exists("orders-dead")
    # On a subscription, the same key alone does turn the policy on.
    sub = await c.subscribe("billing", {"deadLetterTopic": "billing-dead"})
    await c.publish("billing", b"y")
    msg, _ = await receive(sub)
    await sub.nack(msg.id, "e")
    await wait_until(lambda: redis_client.zcard(retry_key("app1", "billing")) == 1)


async def test_the_component_dead_letter_topic_can_be_subscribed_and_keeps_what_its_subscriber_fails(
    component: Factory, props: dict[str, str], redis_client: redis.Redis
) -> None:
    # The app reads its own dead letters: a subscription to the component's deadLetterTopic
    # is accepted; what it fails there comes back with the backoff past maxDeliveryAttempts,
    # never appended to the dead-letter topic again and never dropped.
    c = component("delayed")
    await c.init({**props, **POLICY, "retryInitialInterval": "100ms", "retryMaxInterval": "200ms"})
    orders = await c.subscribe("orders")
    dead = await c.subscribe("orders-dead")
    await c.publish("orders", b"payload", {"k": "v"})
    for _ in range(3):
        await orders.nack((await orders.next()).id, "boom")

    attempts = []
    for _ in range(6):
        msg = await dead.next(within=5.0)
        assert msg.data == b"payload"
        assert msg.metadata["deadLetterSourceTopic"] == "orders"
        attempts.append(msg.metadata["deliveryAttempt"])
        if len(attempts) < 6:
            await dead.nack(msg.id, "still failing")
    assert attempts == ["1", "2", "3", "4", "5", "6"]
    assert len(dead_letters(redis_client)) == 1, "dead-lettered into itself"
    await dead.ack(msg.id)
    assert await dead.nothing_for(1.0)
    assert redis_client.xpending("orders-dead", "app1")["pending"] == 0
    assert len(dead_letters(redis_client)) == 1


async def test_the_dead_letter_topic_subscribed_without_a_retry_policy_redelivers_after_redeliver_interval(
    component: Factory, props: dict[str, str], redis_client: redis.Redis
) -> None:
    # deadLetterTopic alone on the component (the forwarder's) leaves subscriber retries off:
    # the dead-letter topic's subscriber still opens, and a nack comes back (redeliverInterval).
    c = component("delayed")
    await c.init({**props, "deadLetterTopic": "orders-dead"})
    dead = await c.subscribe("orders-dead")
    redis_client.xadd("orders-dead", {"data": b"old letter", "metadata": b"{}"})
    for attempt in ("1", "2", "3"):
        msg = await dead.next()
        assert (msg.data, msg.metadata["deliveryAttempt"]) == (b"old letter", attempt)
        if attempt != "3":
            await dead.nack(msg.id, "not yet")
    await dead.ack(msg.id)
    assert int(redis_client.xlen("orders-dead")) == 1


async def test_history_off_writes_no_record_for_retries_and_dead_letters(
    component: Factory, props: dict[str, str], redis_client: redis.Redis
) -> None:
    c = component("delayed")
    await c.init({**props, **POLICY, "retryInitialInterval": "50ms", "historyMaxLen": "0"})
    stream = await c.subscribe("orders")
    for i in range(4):
        await c.publish("orders", f"m{i}".encode())
    for _ in range(12):  # 4 messages, 3 failed deliveries each: 8 retries, 4 dead letters
        await stream.nack((await stream.next()).id, "boom")
    await wait_until(lambda: len(dead_letters(redis_client)) == 4)
    await wait_until(lambda: redis_client.xpending("orders", "app1")["pending"] == 0)
    assert redis_client.exists("{app1-delayed}:history") == 0


async def test_a_small_history_max_len_bounds_the_retry_records(
    component: Factory, props: dict[str, str], redis_client: redis.Redis
) -> None:
    c = component("delayed")
    await c.init(
        {
            **props,
            "maxDeliveryAttempts": "1000",
            "retryInitialInterval": "1ms",
            "retryMultiplier": "1",
            "historyMaxLen": "20",
        }
    )
    stream = await c.subscribe("orders")
    # Approximate trimming frees whole stream nodes: small nodes make the bound show.
    with small_stream_nodes(redis_client, 10):
        await c.publish("orders", b"x")
        for _ in range(100):
            await stream.nack((await stream.next()).id, "again")
        # The 101st delivery comes after the 100th retry record was written.
        await stream.ack((await stream.next()).id)
    rows: Any = redis_client.xrange("{app1-delayed}:history")
    assert 20 <= len(rows) <= 30, len(rows)
    assert rows[-1][1][b"attempt"] == b"100"


async def test_a_due_retry_whose_claim_is_slow_on_the_wire_is_delivered_once(
    component: Factory, props: dict[str, str], redis_client: redis.Redis, slow_claims: DelayingProxy
) -> None:
    """A retry poller takes a due record, and its claim is held up on the way to Redis; meanwhile
    the entry passes processingTimeout and the other streams' reclaim passes find it idle and
    without a record. Each message still comes back once, as delivery 2, to an app that takes
    a moment over it."""
    c = component("delayed")
    # Due 950 ms after the nack, idle enough for a reclaim pass 50-250 ms later: while the
    # poller's claim (600 ms on the wire) is still on its way.
    await c.init(
        {
            **props,
            "redisHost": f"127.0.0.1:{slow_claims.port}",
            "processingTimeout": "1s",
            "retryInitialInterval": "950ms",
        }
    )
    streams = [await c.subscribe("orders") for _ in range(3)]
    n = 12
    failed: set[bytes] = set()

    async def fail_first_deliveries() -> None:
        while len(failed) < n:
            for s in streams:
                while not s.received.empty():
                    msg = s.received.get_nowait()
                    assert msg.metadata["deliveryAttempt"] == "1"
                    failed.add(msg.data)
                    await s.nack(msg.id, "later")
            await asyncio.sleep(0.005)

    failing = asyncio.create_task(fail_first_deliveries())
    # Spread over a reclaim period, so the messages meet the passes at different moments.
    for i in range(n):
        await c.publish("orders", str(i).encode())
        await asyncio.sleep(0.02)
    await asyncio.wait_for(failing, 5)
    await wait_until(lambda: redis_client.zcard(retry_key("app1", "orders")) == n)
    slow_claims.delay_s = 0.6
    slow_claims.armed = True

    # Until every message came back and then nothing for longer than a second claim would
    # take to show (the wire's delay + processingTimeout + a pass); the app's work (0.35 s)
    # is well within processingTimeout.
    again = await work_until_quiet(streams, expect=n, quiet_s=2.5, work_s=0.35, fail_first=False)
    assert slow_claims.delayed > 0, "no claim went through the slow path"
    assert sorted(again) == sorted((data, "2") for data in failed)
    await wait_until(lambda: redis_client.xpending("orders", "app1")["pending"] == 0)
    assert redis_client.zcard(retry_key("app1", "orders")) == 0


async def test_a_nack_of_a_delivery_another_stream_has_taken_over_schedules_no_second_retry(
    component: Factory, props: dict[str, str], redis_client: redis.Redis
) -> None:
    """The app holds a message past processingTimeout, another stream takes it over (delivery 2),
    and only then does the first delivery fail. The takeover is the retry: the message is not
    delivered a third time while delivery 2 is still being handled."""
    c = component("delayed")
    await c.init({**props, "processingTimeout": "1500ms", "retryInitialInterval": "300ms"})
    first = await c.subscribe("orders")
    await c.publish("orders", b"x")
    held = await first.next()
    assert held.metadata["deliveryAttempt"] == "1"
    other = await c.subscribe("orders")
    taken = await other.next(within=5)
    assert (taken.id, taken.metadata["deliveryAttempt"]) == (held.id, "2")
    await first.nack(held.id, "too late")
    # Well past the backoff, well within delivery 2's processingTimeout.
    assert await other.nothing_for(0.8)
    assert first.received.empty()
    await other.ack(taken.id)
    await wait_until(lambda: redis_client.xpending("orders", "app1")["pending"] == 0)
    assert await other.nothing_for(1.0)
    assert first.received.empty()
    assert redis_client.zcard(retry_key("app1", "orders")) == 0


async def test_streams_of_one_group_redeliver_each_retry_once_when_the_backoff_outlasts_processing_timeout(
    component: Factory, props: dict[str, str], redis_client: redis.Redis
) -> None:
    """150 nacked messages over 3 streams, a 1 s backoff against a 500 ms processingTimeout: the
    entries are idle long before they are due, so every reclaim pass meets them while the
    pollers redeliver. No delivery attempt of any message is delivered twice."""
    c = component("delayed")
    await c.init({**props, "retryInitialInterval": "1s"})
    streams = [await c.subscribe("orders") for _ in range(3)]
    n = 150
    for i in range(n):
        await c.publish("orders", str(i).encode())
    seen: Counter[tuple[bytes, str]] = Counter()
    last = time.monotonic()
    deadline = last + 30
    # Until every message came back and then nothing for longer than a reclaim would take.
    while len(seen) < 2 * n or time.monotonic() - last < 2.0:
        assert time.monotonic() < deadline, len(seen)
        for s in streams:
            while not s.received.empty():
                msg = s.received.get_nowait()
                attempt = msg.metadata["deliveryAttempt"]
                seen[msg.data, attempt] += 1
                last = time.monotonic()
                if attempt == "1":
                    await s.nack(msg.id, "later")
                else:
                    await s.ack(msg.id)
        await asyncio.sleep(0.01)
    twice = {k: v for k, v in seen.items() if v > 1}
    assert not twice
    assert sorted(seen) == sorted((str(i).encode(), a) for i in range(n) for a in ("1", "2"))
    await wait_until(lambda: redis_client.xpending("orders", "app1")["pending"] == 0)
    assert redis_client.zcard(retry_key("app1", "orders")) == 0


async def test_a_retry_record_held_up_past_processing_timeout_does_not_deliver_a_second_time(
    component: Factory, props: dict[str, str], redis_client: redis.Redis, slow_retry_records: DelayingProxy
) -> None:
    """A nack's retry record reaches Redis 1.5 s late, past processingTimeout (1 s): meanwhile a
    reclaim pass finds the entry idle and without a record, and delivers it again (delivery 2).
    The record lands already due, and is stale: the message is not delivered a third time
    while delivery 2 is still being handled."""
    c = component("delayed")
    await c.init(
        {
            **props,
            "redisHost": f"127.0.0.1:{slow_retry_records.port}",
            "processingTimeout": "1s",
            "retryInitialInterval": "1200ms",
        }
    )
    streams = [await c.subscribe("orders") for _ in range(2)]
    await c.publish("orders", b"x")
    slow_retry_records.delay_s = 1.5
    slow_retry_records.armed = True
    # Until the retry came and then nothing for longer than the stale record would take to
    # show; the app's work (0.7 s) is within processingTimeout.
    seen = await work_until_quiet(streams, expect=2, quiet_s=2.5, work_s=0.7, fail_first=True)
    assert slow_retry_records.delayed == 1
    assert [attempt for _, attempt in seen] == ["1", "2"]
    await wait_until(lambda: redis_client.xpending("orders", "app1")["pending"] == 0)
    assert redis_client.zcard(retry_key("app1", "orders")) == 0
    assert redis_client.hlen(retry_counts_key("app1", "orders")) == 0


async def test_a_retry_whose_claim_reply_is_lost_is_delivered_as_the_next_attempt_at_once(
    component: Factory, props: dict[str, str], redis_client: redis.Redis, lost_claim_reply: LosingProxy
) -> None:
    """The poller's claim lands, and its reply is lost on the way back. The claim is sent again
    and hands back what the first one claimed: the message comes back as delivery 2 after its
    backoff, not as delivery 3 after processingTimeout (which would dead-letter it one real
    delivery early)."""
    c = component("delayed")
    await c.init(
        {
            **props,
            **POLICY,
            "redisHost": f"127.0.0.1:{lost_claim_reply.port}",
            "processingTimeout": "3s",
            "retryInitialInterval": "200ms",
        }
    )
    stream = await c.subscribe("orders")
    await c.publish("orders", b"x")
    first = await stream.next()
    lost_claim_reply.armed = True
    nacked = time.monotonic()
    await stream.nack(first.id, "once")
    again = await stream.next(within=10)
    waited = time.monotonic() - nacked
    assert lost_claim_reply.cuts == 1
    assert (again.id, again.metadata["deliveryAttempt"]) == (first.id, "2")
    assert waited < 3.0, waited  # before processingTimeout: the claim that landed delivered it
    await stream.nack(again.id, "twice")
    third = await stream.next(within=5)
    assert third.metadata["deliveryAttempt"] == "3"
    await stream.nack(third.id, "thrice")
    await wait_until(lambda: len(dead_letters(redis_client)) == 1)
    assert dead_letters(redis_client)[0].metadata["deadLetterAttempts"] == "3"
    assert await stream.nothing_for(0.5)


async def test_a_retry_record_written_without_a_delivery_count_still_fires(
    component: Factory, props: dict[str, str], redis_client: redis.Redis
) -> None:
    """Records stored by the previous version hold no delivery count beside them: they fire as before."""
    c = component("delayed")
    await c.init({**props, "retryInitialInterval": "1s"})
    stream = await c.subscribe("orders")
    await c.publish("orders", b"x")
    msg = await stream.next()
    await stream.nack(msg.id, "e")
    counts = retry_counts_key("app1", "orders")
    await wait_until(lambda: redis_client.hlen(counts) == 1)
    redis_client.hdel(counts, msg.id)  # the record alone, as the previous version wrote it
    again = await stream.next(within=5)
    assert (again.id, again.metadata["deliveryAttempt"]) == (msg.id, "2")
    await stream.ack(again.id)
    await wait_until(lambda: redis_client.xpending("orders", "app1")["pending"] == 0)
    assert redis_client.zcard(retry_key("app1", "orders")) == 0


def test_a_slow_taker_does_not_remove_a_retry_record_written_since_it_looked(
    redis_client: redis.Redis,
) -> None:
    """A poller (or reclaim pass) read a due record; before its take lands, the entry was delivered,
    failed again and got a newer record, due later. The take removes nothing: the newer record
    stays, with its own delivery count, until its time."""
    key, counts = retry_key("app1", "orders"), retry_counts_key("app1", "orders")
    redis_client.eval(lua.RETRY_RECORD, 2, key, counts, "1-0", 1_000, 1)  # what the taker read
    redis_client.eval(lua.RETRY_RECORD, 2, key, counts, "1-0", 5_000, 2)  # written since
    assert redis_client.eval(lua.RETRY_TAKE, 2, key, counts, 2_000, "1-0") == [-1]
    assert (redis_client.zscore(key, "1-0"), redis_client.hget(counts, "1-0")) == (5_000, b"2:5000")
    assert redis_client.eval(lua.RETRY_TAKE, 2, key, counts, 5_000, "1-0", "2-0") == [2, -1]
    assert not redis_client.exists(key, counts)


def _str(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _pel(redis_client: redis.Redis) -> list[tuple[str, str, int]]:
    rows: Any = redis_client.xpending_range("orders", "app1", "-", "+", 100)
    return [(r["message_id"].decode(), r["consumer"].decode(), r["times_delivered"]) for r in rows]


async def test_a_late_retry_record_leaves_the_newer_one_of_a_later_delivery_in_place(
    aclient: aioredis.Redis, redis_client: redis.Redis
) -> None:
    """Stream A nacks delivery 1, and its record is held up on the wire past processingTimeout.
    Meanwhile B reclaims the entry (delivery 2), fails it, and records a retry an hour away.
    A's record then lands, due at once: the hour's wait for delivery 2's failure stays, and
    no poller delivers the entry before it."""
    key, counts = retry_key("app1", "orders"), retry_counts_key("app1", "orders")
    redis_client.xgroup_create("orders", "app1", id="0", mkstream=True)
    e = _str(redis_client.xadd("orders", encode_entry(StreamEntry(b"m"))))  # type: ignore[arg-type]
    redis_client.xreadgroup("app1", "A", {"orders": ">"})  # delivery 1
    assert redis_client.eval(lua.NACK_HOLD, 1, "orders", "app1", "A", e, 1)[0] == 1
    got = await claim_unchanged(aclient, "orders", "app1", "B", {e: 1}, 0, nonce="n1")  # delivery 2
    assert [(c.id, c.attempt, c.given_up) for c in got] == [(e, 2, False)]
    now = int(time.time() * 1000)
    assert redis_client.eval(lua.RETRY_RECORD, 2, key, counts, e, now + 3_600_000, 2) == 1
    assert redis_client.eval(lua.RETRY_RECORD, 2, key, counts, e, now - 1, 1) == 0  # A's, late
    assert redis_client.zscore(key, e) == now + 3_600_000
    pushed: list[tuple[str, int]] = []
    await retrier(aclient, "C")._redeliver_due(lambda i, f, n: pushed.append((i, n)), lambda c: None)
    assert pushed == []
    assert _pel(redis_client) == [(e, "B", 2)]
    assert redis_client.zscore(key, e) == now + 3_600_000


async def test_a_retry_record_rewritten_by_an_older_replica_is_delivered_as_the_next_attempt(
    aclient: aioredis.Redis, redis_client: redis.Redis
) -> None:
    """A rolling upgrade: a new replica nacks delivery 1 (record and count 1). An older replica
    takes the record (leaving the count), delivers it (2), its app fails, and it writes a record
    of its own, without a count. The new poller delivers that retry as delivery 3: the count
    left over from delivery 1 is not trusted, and the retry is not dropped as stale."""
    key, counts = retry_key("app1", "orders"), retry_counts_key("app1", "orders")
    redis_client.xgroup_create("orders", "app1", id="0", mkstream=True)
    e = _str(redis_client.xadd("orders", encode_entry(StreamEntry(b"m"))))  # type: ignore[arg-type]
    redis_client.xreadgroup("app1", "new1", {"orders": ">"})
    now = int(time.time() * 1000)
    redis_client.eval(lua.RETRY_RECORD, 2, key, counts, e, now - 10, 1)
    # The older replica: ZREM as its token (no HDEL), XCLAIM (delivery 2), then its nack: ZADD alone.
    redis_client.zrem(key, e)
    redis_client.xclaim("orders", "app1", "old1", 0, [e])
    redis_client.zadd(key, {e: now - 5})
    pushed: list[tuple[str, int]] = []
    await retrier(aclient, "new2")._redeliver_due(lambda i, f, n: pushed.append((i, n)), lambda c: None)
    assert pushed == [(e, 3)]
    assert _pel(redis_client) == [(e, "new2", 3)]
    assert not redis_client.exists(key, counts)


async def test_counts_an_older_replica_left_without_their_records_are_swept_away(
    aclient: aioredis.Redis, redis_client: redis.Redis
) -> None:
    """An older replica takes records without removing their counts: 250 are left behind. The new
    poller removes them a few at a time, and keeps the count of the one record still waiting."""
    key, counts = retry_key("app1", "orders"), retry_counts_key("app1", "orders")
    redis_client.hset(counts, mapping={f"{i}-0": f"1:{i}" for i in range(1, 251)})
    later = int(time.time() * 1000) + 3_600_000
    redis_client.eval(lua.RETRY_RECORD, 2, key, counts, "999-0", later, 1)
    poller = retrier(aclient, "new")
    for _ in range(10):
        await poller._redeliver_due(lambda i, f, n: None, lambda c: None)
        if redis_client.hlen(counts) == 1:
            break
    assert redis_client.hgetall(counts) == {b"999-0": f"1:{later}".encode()}
    assert redis_client.zscore(key, "999-0") == later


def test_taking_a_record_that_is_gone_removes_a_count_left_behind(redis_client: redis.Redis) -> None:
    key, counts = retry_key("app1", "orders"), retry_counts_key("app1", "orders")
    redis_client.hset(counts, "1-0", "1:1000")  # its record was taken by an older version
    assert redis_client.eval(lua.RETRY_TAKE, 2, key, counts, 2_000, "1-0") == [-1]
    assert not redis_client.exists(counts)


# --- poison messages: an app that fails slower than processingTimeout, or never answers ---

# Every delivery outlasts processingTimeout (1 s): each is taken over by the other stream
# before its nack comes. maxDeliveryAttempts 3, so a message is delivered at most 3 times.
POISON = {**POLICY, "processingTimeout": "1s", "retryInitialInterval": "100ms"}
POISON_MAX = 3


async def act_as_app(
    streams: list[Stream],
    *,
    nack_after_s: float | None,
    done: Callable[[], bool],
    quiet_s: float,
    within: float,
    seen: list[tuple[bytes, str, int]] | None = None,
) -> list[tuple[bytes, str, int]]:
    """Act as an app on `streams`: nack every delivery `nack_after_s` after it came (None: never
    answer), until `done()` and then no delivery for `quiet_s`. Returns (data, deliveryAttempt,
    epoch ms it came) of every delivery, in arrival order (appended to `seen` if given)."""
    seen = [] if seen is None else seen
    writing = {id(s): asyncio.Lock() for s in streams}
    work: set[asyncio.Task[None]] = set()

    async def fail(s: Stream, msg_id: str) -> None:
        assert nack_after_s is not None
        await asyncio.sleep(nack_after_s)
        async with writing[id(s)]:
            await s.nack(msg_id, "still broken")

    last = time.monotonic()
    deadline = last + within
    while not done() or time.monotonic() - last < quiet_s:
        assert time.monotonic() < deadline, f"{len(seen)} deliveries, the last: {seen[-3:]}"
        for s in streams:
            while not s.received.empty():
                msg = s.received.get_nowait()
                seen.append((msg.data, msg.metadata["deliveryAttempt"], int(time.time() * 1000)))
                last = time.monotonic()
                if nack_after_s is not None:
                    task = asyncio.create_task(fail(s, msg.id))
                    work.add(task)
                    task.add_done_callback(work.discard)
        await asyncio.sleep(0.01)
    for task in work:
        task.cancel()
    return seen


def assert_dead_lettered_once_within_the_limit(
    redis_client: Any,
    seen: list[tuple[bytes, str, int]],
    n: int,
    topic: str = "orders",
    dead_topic: str = "orders-dead",
) -> None:
    """Each of the `n` messages (data "0", "1", ...) of `topic` is in `dead_topic` exactly once,
    after at most maxDeliveryAttempts deliveries (none of them twice), and none was delivered
    after it; nothing is left pending."""
    rows: Any = redis_client.xrange(dead_topic)
    dead = {decode_entry(f).data: (decode_entry(f), int(_str(i).split("-")[0])) for i, f in rows}
    assert len(rows) == n, Counter(decode_entry(f).data for _, f in rows)
    assert sorted(dead) == sorted(str(i).encode() for i in range(n))
    for data, (letter, at_ms) in dead.items():
        deliveries = [(attempt, came) for d, attempt, came in seen if d == data]
        attempts = [attempt for attempt, _ in deliveries]
        assert 1 <= len(deliveries) <= POISON_MAX, (data, attempts)
        assert len(set(attempts)) == len(attempts), (data, attempts)
        assert letter.metadata["deadLetterAttempts"] == str(POISON_MAX), (data, letter.metadata)
        assert letter.metadata["deadLetterSourceTopic"] == topic
        assert all(came < at_ms for _, came in deliveries), (data, deliveries, at_ms)
    assert redis_client.xpending(topic, "app1")["pending"] == 0


async def test_an_app_failing_slower_than_processing_timeout_dead_letters_each_message_after_the_maximum(
    component: Factory, props: dict[str, str], redis_client: redis.Redis
) -> None:
    """Two streams, an app that nacks 1.6 s after receipt, processingTimeout 1 s: every delivery
    is taken over before its nack comes, and the nack is about a delivery that is over. Each
    takeover is an attempt: each of 10 messages is delivered at most 3 times and then
    dead-lettered exactly once (before: 27 deliveries in 30 s each, no dead letter)."""
    c = component("delayed")
    await c.init({**props, **POISON})
    streams = [await c.subscribe("orders") for _ in range(2)]
    n = 10
    for i in range(n):
        await c.publish("orders", str(i).encode())
    seen = await act_as_app(
        streams,
        nack_after_s=1.6,
        done=lambda: redis_client.xlen("orders-dead") >= n,
        quiet_s=3.0,
        within=30.0,
    )
    assert_dead_lettered_once_within_the_limit(redis_client, seen, n)


async def test_an_app_that_never_answers_on_any_stream_still_dead_letters_each_message_after_the_maximum(
    component: Factory, props: dict[str, str], redis_client: redis.Redis
) -> None:
    """Two streams whose app holds every message and never answers: each stream goes on
    holding its earlier copies, and each takeover by the other stream counts. After 3
    deliveries each of 10 messages is dead-lettered exactly once, and nothing comes after
    (before: two deliveries each, then held by both streams for good, no dead letter)."""
    c = component("delayed")
    # Room in each window beside the copies the app holds for ever.
    await c.init({**props, **POISON, "concurrency": "30"})
    streams = [await c.subscribe("orders") for _ in range(2)]
    n = 10
    for i in range(n):
        await c.publish("orders", str(i).encode())
    seen = await act_as_app(
        streams,
        nack_after_s=None,
        done=lambda: redis_client.xlen("orders-dead") >= n,
        quiet_s=3.0,
        within=30.0,
    )
    assert_dead_lettered_once_within_the_limit(redis_client, seen, n)
    assert all(len([1 for d, _, _ in seen if d == str(i).encode()]) == POISON_MAX for i in range(n))


async def test_a_delivery_whose_process_is_killed_counts_toward_the_maximum(
    folder: Path, component: Factory, props: dict[str, str], redis_client: redis.Redis
) -> None:
    """A `serve` process holding the first delivery of 10 messages is killed with -9; two
    streams of another process take them over, their app failing each 1.6 s after receipt
    (processingTimeout 1 s). The killed delivery counts: each message is delivered at most
    3 times in all and dead-lettered exactly once."""
    n = 10
    seen: list[tuple[bytes, str, int]] = []
    first = Serve(folder, "killed")
    try:
        async with instance(first, {**props, **POISON}) as killed:
            doomed = await killed.subscribe("orders")
            for i in range(n):
                await killed.publish("orders", str(i).encode())
            for _ in range(n):
                msg = await doomed.next(within=10)
                seen.append((msg.data, msg.metadata["deliveryAttempt"], int(time.time() * 1000)))
            first.kill9()
    finally:
        first.stop()
    assert sorted(d for d, _, _ in seen) == sorted(str(i).encode() for i in range(n))
    c = component("delayed")
    await c.init({**props, **POISON})
    streams = [await c.subscribe("orders") for _ in range(2)]
    await act_as_app(
        streams,
        nack_after_s=1.6,
        done=lambda: redis_client.xlen("orders-dead") >= n,
        quiet_s=3.0,
        within=30.0,
        seen=seen,
    )
    assert_dead_lettered_once_within_the_limit(redis_client, seen, n)


async def test_entries_a_killed_serve_read_ahead_and_never_sent_come_back_one_attempt_higher(
    folder: Path, component: Factory, props: dict[str, str], redis_client: redis.Redis
) -> None:
    """The stated bound of RELIABILITY.md D16: a `serve` process killed with -9 while entries it
    read ahead wait unsent in its buffer leaves them one attempt higher (their read bumped the
    delivery count, and nothing gives them back): the next stream delivers them as attempt 2,
    though the app never saw attempt 1. Held by the app or never read, the attempt is right."""
    window = 5
    for i in range(300):
        redis_client.xadd("orders", encode_entry(StreamEntry(f"m{i}".encode())))  # type: ignore[arg-type]
    seen: set[str] = set()
    held: set[str] = set()
    unsent: set[str] = set()
    first = Serve(folder, "killed")
    try:
        async with instance(first, {**props, "concurrency": str(window)}) as killed:
            stream = await killed.subscribe("orders")
            # The app acks two windows as they come (the stream then reads ahead of its window), then
            # holds the next window: what the stream read beyond it waits unsent in its buffer.
            # Again until the read-ahead came (a slow turn, on a loaded machine, reads none).
            for _ in range(20):
                for _ in range(2 * window):
                    msg = await stream.next(within=10)
                    seen.add(msg.id)
                    await stream.ack(msg.id)
                held = set()
                for _ in range(window):
                    held.add((await stream.next(within=10)).id)
                seen |= held
                assert await stream.nothing_for(0.3)  # the window is full: nothing more is sent
                rows: Any = redis_client.xpending_range("orders", "app1", "-", "+", 1000)
                unsent = {r["message_id"].decode() for r in rows} - seen
                if unsent:
                    break
                for msg_id in held:
                    await stream.ack(msg_id)
            assert unsent, "the stream never read ahead of its window"
            first.kill9()
    finally:
        first.stop()
    c = component("delayed")
    await c.init(props)
    stream = await c.subscribe("orders")
    attempts: dict[str, str] = {}
    while not unsent | held <= attempts.keys():
        msg = await stream.next(within=10)
        attempts[msg.id] = msg.metadata["deliveryAttempt"]
        await stream.ack(msg.id)
    # Sent once and held: its second delivery. Never sent: a second delivery too, by the count.
    assert {attempts[i] for i in held} == {"2"}
    assert {attempts[i] for i in unsent} == {"2"}
    assert {a for i, a in attempts.items() if i not in seen} - {"2"} <= {"1"}


async def test_a_dead_letter_that_cannot_be_written_for_a_while_is_written_once_by_the_streams_racing_for_it(
    component: Factory, props: dict[str, str], redis_client: redis.Redis
) -> None:
    """The dead-letter topic refuses writes (WRONGTYPE) for 4 s while the writer retries with a
    backoff longer than processingTimeout (500 ms): the other stream takes the used-up entry over
    to give it up, and the two take turns. Only the one holding it writes: once the topic is
    fixed there is one dead letter, and the message was never delivered again."""
    redis_client.hset("dlq", "not", "a stream")
    c = component("delayed")
    await c.init({**props, "maxDeliveryAttempts": "1", "deadLetterTopic": "dlq"})
    streams = [await c.subscribe("orders") for _ in range(2)]
    await c.publish("orders", b"poison")
    await wait_until(lambda: any(not s.received.empty() for s in streams))
    holder = next(s for s in streams if not s.received.empty())
    msg = holder.received.get_nowait()
    await holder.nack(msg.id, "bad")
    # Long enough for the writer's backoff to pass processingTimeout more than once.
    await asyncio.sleep(4.0)
    assert redis_client.xpending("orders", "app1")["pending"] == 1  # kept while it cannot be written
    redis_client.delete("dlq")
    await wait_until(lambda: bool(redis_client.exists("dlq")) and redis_client.xlen("dlq") == 1, within_s=10)
    await wait_until(lambda: redis_client.xpending("orders", "app1")["pending"] == 0)
    # Every stream that took it over to give it up has had time to write (backoff cap 2 s).
    await asyncio.sleep(3.0)
    assert [d.data for d in dead_letters(redis_client, "dlq")] == [b"poison"]
    assert all(s.received.empty() for s in streams)


async def test_without_a_dead_letter_topic_a_used_up_message_is_dropped_once_by_three_streams(
    component: Factory, props: dict[str, str], redis_client: redis.Redis
) -> None:
    """maxDeliveryAttempts 1, no deadLetterTopic, three streams, an app that never answers:
    each message is delivered once; the takeover past the maximum drops it (acked away,
    whichever of the three streams raced for it) and nothing is delivered again."""
    c = component("delayed")
    policy = {k: v for k, v in POISON.items() if k != "deadLetterTopic"}
    await c.init({**props, **policy, "maxDeliveryAttempts": "1", "concurrency": "30"})
    streams = [await c.subscribe("orders") for _ in range(3)]
    n = 10
    for i in range(n):
        await c.publish("orders", str(i).encode())

    def dropped() -> bool:
        return (
            int(redis_client.xpending("orders", "app1")["pending"]) == 0
            and int(redis_client.xlen("orders")) == n
        )

    seen = await act_as_app(streams, nack_after_s=None, done=dropped, quiet_s=3.0, within=30.0)
    assert sorted(d for d, _, _ in seen) == sorted(str(i).encode() for i in range(n)), seen
    assert {a for _, a, _ in seen} == {"1"}
    assert not redis_client.exists("orders-dead")
