"""What one fire batch reads once and reuses for every message in it: a target's verdict (a
topic that cannot take our XADD), and whether the history's by-id index says where it began.
Every message of the batch is still decided on its own: a bad target met twice parks both,
and the history's index marker lands where it would had each record checked it."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import redis
import redis.asyncio as aioredis

from delayed_middleware.aio import text
from delayed_middleware.clock import ManualClock
from delayed_middleware.engine import DelayEngine, FireReport
from tests.middleware.engine.helpers import KEYS, T0, env, history, payloads, target


async def test_a_bad_target_met_again_in_the_same_batch_parks_that_message_too(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    redis_client.hset("a-hash", "f", "v")
    reports: list[FireReport] = []
    engine = DelayEngine(aredis(), KEYS, ManualClock(T0), on_batch=reports.append)
    # Interleaved, all due at once: one batch. "fresh" does not exist before its first message.
    topics = ["a-hash", "fresh", "other-delayed", "orders", "a-hash", "fresh", "other-delayed", "orders"]
    await engine.schedule([env(i, T0, topic=t) for i, t in enumerate(topics)])
    assert (await engine.fire_due())[0] == 4
    assert [r.fired for r in reports] == [4]
    assert [r.parked for r in reports] == [4]
    assert payloads(redis_client) == [3, 7]
    assert payloads(redis_client, "fresh") == [1, 5]
    parked = {str(v) for v in redis_client.hgetall(KEYS.parked).values()}
    assert len(redis_client.hgetall(KEYS.parked)) == 4
    assert sum("WRONGTYPE" in why for why in parked) == 1  # the same reason for both
    assert redis_client.exists("other-delayed") == 0
    assert sorted(h.topic for h in history(redis_client, "parked")) == ["a-hash"] * 2 + ["other-delayed"] * 2


@pytest.mark.both_fire_paths
async def test_a_batch_over_a_history_from_before_the_index_marks_where_indexing_began_at_its_first_indexed_record(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    clock = ManualClock(T0)
    engine = DelayEngine(aredis(), KEYS, clock)
    # Unindexed records (no scheduleId) first, then one of a scheduleId, in one batch.
    await engine.schedule([env(1, T0 + 1), env(2, T0 + 2), env(3, T0 + 3, sid="s3"), env(4, T0 + 4)])
    # As code from before the index left it: records, no index.
    redis_client.delete(KEYS.history_index)
    clock.advance(10)
    assert (await engine.fire_due())[0] == 4
    fired_s3 = [h for h in history(redis_client, "fired") if h.id == "s3"]
    assert len(fired_s3) == 1
    index = {text(k): text(v) for k, v in redis_client.hgetall(KEYS.history_index).items()}
    entry = next(i for i, f in target(redis_client, KEYS.history) if f[b"id"] == b"s3" and f[b"event"] == b"fired")
    assert index == {"s3": entry, "": entry}


@pytest.mark.both_fire_paths
async def test_a_batch_that_writes_the_histories_first_record_marks_it_indexed_from_the_start(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    clock = ManualClock(T0)
    engine = DelayEngine(aredis(), KEYS, clock)
    await engine.schedule([env(1, T0 + 1), env(2, T0 + 2), env(3, T0 + 3, sid="s3"), env(4, T0 + 4)])
    # A history emptied (an operator's DEL): the batch's first record is its first.
    redis_client.delete(KEYS.history, KEYS.history_index)
    clock.advance(10)
    assert (await engine.fire_due())[0] == 4
    index = {text(k): text(v) for k, v in redis_client.hgetall(KEYS.history_index).items()}
    entry = next(i for i, f in target(redis_client, KEYS.history) if f[b"id"] == b"s3")
    assert index == {"": "0-0", "s3": entry}
    assert [h.event for h in history(redis_client)] == ["fired"] * 4
