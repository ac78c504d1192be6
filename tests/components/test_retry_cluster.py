"""Subscriber retries on a real 3-master Redis Cluster with delayed messaging and `delayShards: 6`.

The retry records (`{<consumerID>-delayed}:retry:<topic>`), the set of retrying
topics, the history and the dead-letter set live in the engine's slot; the
topic, its consumer group and the dead-letter topic each in their own. The
topics here are chosen so that all of these sit on different masters: any
command or script that touched two of them at once would fail with CROSSSLOT.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis.asyncio.cluster as acluster

from delayed_middleware.entry import decode_entry
from delayed_middleware.history import DEAD_LETTERED, RETRIED
from delayed_middleware.inspector import Inspector
from delayed_middleware.keys import EngineKeys, delayed_topic, shard_index, shard_topics
from delayed_middleware.retry import retry_key
from tests.components.driver import DELAY_SHARDS as SHARDS
from tests.components.driver import Component, Stream, cli, cluster_conn
from tests.components.test_retry import POISON_MAX, act_as_app, assert_dead_lettered_once_within_the_limit
from tests.redis_server import RedisCluster

pytestmark = pytest.mark.slow

Factory = Callable[[str], Component]
ENGINE = EngineKeys.for_topic(delayed_topic("app1"))


def on_other_masters(c: RedisCluster) -> tuple[str, str, str]:
    """(topic, dead-letter topic, scheduleId): the topic, the dead-letter topic and the shard the
    scheduleId hashes to are each on another master than the engine's retry keys."""
    engine = c.owner(ENGINE.retrying).port
    topic = next(t for t in (f"orders-{i}" for i in range(100)) if c.owner(t).port != engine)
    dlt = next(
        t for t in (f"dead-{i}" for i in range(100)) if c.owner(t).port not in (engine, c.owner(topic).port)
    )
    shards = shard_topics("app1", SHARDS)
    sid = next(
        s
        for s in (f"job-{i}" for i in range(1000))
        if shard_index(s, SHARDS) != 0 and c.owner(shards[shard_index(s, SHARDS)]).port != engine
    )
    return topic, dlt, sid


async def receive(stream: Stream, within: float = 8.0) -> tuple[Any, float]:
    msg = await stream.next(within)
    return msg, time.monotonic()


async def test_a_delayed_message_nacked_on_a_cluster_is_retried_with_backoff_then_dead_lettered(
    component: Factory, cluster: RedisCluster, admin: Any
) -> None:
    topic, dlt, sid = on_other_masters(cluster)
    c = component("delayed")
    await c.init(
        {
            "redisHost": cluster.nodes[0].address,
            "redisType": "cluster",
            "consumerID": "app1",
            "enableDelayedMessaging": "true",
            "delayShards": str(SHARDS),
            "maxDeliveryAttempts": "3",
            "retryInitialInterval": "1s",
            "retryMultiplier": "2",
            "deadLetterTopic": dlt,
        }
    )
    stream = await c.subscribe(topic)
    published = time.monotonic()
    await c.publish(topic, b"pay me", {"scheduledSendDelay": "1s", "scheduleId": sid, "k": "v"})

    client: Any = acluster.RedisCluster(host="127.0.0.1", port=cluster.nodes[1].port)
    inspector = Inspector(client, "app1", shards=SHARDS)
    try:
        arrivals: list[tuple[Any, float]] = []
        for i in range(3):
            msg, at = await receive(stream)
            arrivals.append((msg, at))
            await stream.nack(msg.id, f"boom {i + 1}")
            if i == 0:
                # While it waits out its backoff an operator sees it, kind "retry", on its topic.
                deadline = time.monotonic() + 0.8
                while admin.zcard(retry_key("app1", topic)) == 0:
                    assert time.monotonic() < deadline, "no retry record"
                    await asyncio.sleep(0.02)
                report = await inspector.pending()
                [waiting] = [m for m in report.messages if m.kind == "retry"]
                assert (waiting.topic, waiting.stream_id, waiting.attempts) == (topic, msg.id, 1)

        assert arrivals[0][1] - published >= 1.0, "delivered before its due time"
        assert [m.metadata["deliveryAttempt"] for m, _ in arrivals] == ["1", "2", "3"]
        assert len({m.id for m, _ in arrivals}) == 1, "the same entry comes back"
        gaps = [b - a for (_, a), (_, b) in itertools.pairwise(arrivals)]
        assert 1.0 <= gaps[0] < 3.0, gaps
        assert 2.0 <= gaps[1] < 4.0, gaps

        deadline = time.monotonic() + 5
        while admin.xlen(dlt) == 0:
            assert time.monotonic() < deadline, "not dead-lettered"
            await asyncio.sleep(0.05)
        [(_, fields)] = admin.xrange(dlt)
        dead = decode_entry(fields)
        assert dead.data == b"pay me"
        assert dead.metadata["k"] == "v"
        assert dead.metadata["deadLetterReason"] == "boom 3"
        assert dead.metadata["deadLetterAttempts"] == "3"
        assert dead.metadata["deadLetterSourceTopic"] == topic
        # Acked in the group: nothing pending for app1 on the topic, no retry record left.
        assert admin.xpending(topic, "app1")["pending"] == 0
        assert admin.zcard(retry_key("app1", topic)) == 0
        # The history names the delayed message (its scheduleId) for both steps.
        events = [r.event for r in await inspector.history(id=sid)]
        assert events.count(RETRIED) == 2
        assert events[-1] == DEAD_LETTERED
        assert await stream.nothing_for(0.5)

        # The operator CLI finds the dead letter and puts it back: delivered again.
        result = await cli("dead", *cluster_conn(cluster))
        assert result.code == 0, result.err
        assert "1 dead letters" in result.out
        assert dlt in result.out
        result = await cli("retry-dead", *cluster_conn(cluster))
        assert result.code == 0, result.err
        assert "1 dead letters moved back" in result.out
        again, _ = await receive(stream)
        assert again.data == b"pay me"
        assert again.metadata["deliveryAttempt"] == "1"
        await stream.ack(again.id)
        assert admin.xlen(dlt) == 0
    finally:
        await client.aclose()


async def test_on_a_cluster_an_app_failing_slower_than_processing_timeout_dead_letters_after_the_maximum(
    component: Factory, cluster: RedisCluster, admin: Any
) -> None:
    """Two streams, an app that nacks 1.6 s after receipt, processingTimeout 1 s, the topic and
    the dead-letter topic on different masters: each message is delivered at most 3 times and
    dead-lettered exactly once (before: taken over round the streams for ever)."""
    topic, dlt, _ = on_other_masters(cluster)
    c = component("delayed")
    await c.init(
        {
            "redisHost": cluster.nodes[0].address,
            "redisType": "cluster",
            "consumerID": "app1",
            "processingTimeout": "1s",
            "redeliverInterval": "200ms",
            "maxDeliveryAttempts": str(POISON_MAX),
            "retryInitialInterval": "100ms",
            "deadLetterTopic": dlt,
        }
    )
    streams = [await c.subscribe(topic) for _ in range(2)]
    n = 5
    for i in range(n):
        await c.publish(topic, str(i).encode())
    seen = await act_as_app(
        streams,
        nack_after_s=1.6,
        done=lambda: admin.xlen(dlt) >= n,
        quiet_s=3.0,
        within=30.0,
    )
    assert_dead_lettered_once_within_the_limit(admin, seen, n, topic=topic, dead_topic=dlt)
