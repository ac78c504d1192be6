"""The operator CLI's cancel on a real 3-master Redis Cluster stops an occurrence already in flight:
claimed by a replica's two-phase fire, not yet appended to its topic."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio.cluster as acluster

from delayed_middleware.clock import ManualClock
from delayed_middleware.engine import DelayEngine
from delayed_middleware.envelope import Envelope
from delayed_middleware.history import decode_record
from delayed_middleware.keys import EngineKeys, shard_index, shard_topics
from delayed_pubsub.connection import connect
from delayed_pubsub.engines import engine_config
from delayed_pubsub.operate import cancel_ids
from delayed_pubsub.settings import Settings, parse_settings
from tests.redis_server import RedisCluster

T0 = 1_800_000_000_000
APP = "app-op"


@pytest.fixture
async def aclient(cluster: RedisCluster) -> AsyncIterator[acluster.RedisCluster]:
    c = acluster.RedisCluster(host="127.0.0.1", port=cluster.nodes[0].port)
    yield c
    await c.aclose()


def settings_for(cluster: RedisCluster, shards: int) -> Settings:
    return parse_settings(
        {
            "redisHost": cluster.nodes[0].address,
            "redisType": "cluster",
            "consumerID": APP,
            "enableDelayedMessaging": "true",
            "delayShards": str(shards),
        }
    )


@pytest.mark.parametrize("shards", [1, 3])
async def test_an_operators_cancel_on_cluster_stops_an_occurrence_claimed_but_not_yet_appended(
    cluster: RedisCluster, admin: Any, aclient: acluster.RedisCluster, shards: int
) -> None:
    settings = settings_for(cluster, shards)
    connection = connect(settings)
    clock = ManualClock(T0)
    answers: list[tuple[list[str], list[str]]] = []

    async def operator_cancels_once_claimed(at: str) -> None:
        if at == "claimed":
            answers.append(await cancel_ids(connection, settings, ["s1"]))

    # The replica firing the shard that holds `s1`, with the instance's engine settings.
    home = shard_topics(APP, shards)[shard_index("s1", shards)]
    try:
        firer = DelayEngine(
            aclient,
            EngineKeys.for_topic(home),
            clock,
            config=engine_config(settings),
            fault=operator_cancels_once_claimed,
        )
        await firer.schedule(
            [
                Envelope(
                    id="s1",
                    topic="orders",
                    due_ms=T0 + 100,
                    published_at_ms=T0,
                    schedule_id="s1",
                    message=json.dumps({"n": 1}).encode(),
                )
            ]
        )
        clock.set(T0 + 100)
        while (await firer.fire_due())[0]:
            pass
    finally:
        await connection.aclose()

    # The operator was told it was cancelled, and it was: nothing reached the topic.
    assert answers == [(["s1"], [])]
    assert admin.xlen("orders") == 0
    events = [
        decode_record(i, f).event
        for i, f in admin.xrange(EngineKeys.for_topic(home).history)
        if decode_record(i, f).id == "s1"
    ]
    assert events == ["scheduled", "cancelled"]
    assert await firer.pending() == 0
