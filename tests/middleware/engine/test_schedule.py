"""Storing delayed messages against a real Redis: the envelope on the delayed topic, replace by
scheduleId, call tokens that make a retried call store nothing twice, calls bounded by bytes."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
import redis
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from delayed_middleware.clock import ManualClock
from delayed_middleware.engine import DelayEngine, EngineConfig
from delayed_middleware.entry import decode_entry
from delayed_middleware.envelope import Envelope, decode_envelope
from tests.chaos.proxy import LosingProxy
from tests.middleware.engine.helpers import (
    KEYS,
    T0,
    drain,
    env,
    history,
    payloads,
    target,
)


@pytest.mark.both_fire_paths
async def test_envelope_on_delayed_topic_decodes(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    engine = DelayEngine(aredis(), KEYS, ManualClock(T0))
    e = env(7, T0 + 60_000, content_type="application/json", pubsub_name="delayed")
    [sid] = await engine.schedule([e])
    [(stream_id, fields)] = target(redis_client, KEYS.stream)
    assert stream_id == sid
    decoded = decode_envelope(decode_entry(fields).data)
    assert decoded == e
    assert await engine.pending() == 1


@pytest.mark.both_fire_paths
async def test_schedule_id_replaces_and_cancel(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    clock = ManualClock(T0)
    engine = DelayEngine(aredis(), KEYS, clock)
    await engine.schedule([env(1, T0 + 1000, sid="order-66")])
    await engine.schedule([env(2, T0 + 2000, sid="order-66")])
    assert await engine.pending() == 1
    assert redis_client.xlen(KEYS.stream) == 1
    clock.set(T0 + 5000)
    await engine.fire_due()
    assert [json.loads(decode_entry(f).data)["n"] for _, f in target(redis_client)] == [2]
    assert redis_client.hlen(KEYS.ids) == 0

    await engine.schedule([env(3, T0 + 9000, sid="later")])
    assert await engine.cancel("later") is True
    assert await engine.cancel("later") is False
    clock.set(T0 + 10_000)
    assert await engine.fire_due() == (0, None)
    assert len(target(redis_client)) == 1


@pytest.mark.both_fire_paths
async def test_same_call_token_twice_stores_once(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    clock = ManualClock(T0)
    engine = DelayEngine(aredis(), KEYS, clock)
    assert len(await engine.schedule([env(1, T0 + 10)], token="call-1")) == 1
    assert await engine.schedule([env(1, T0 + 10)], token="call-1") == []
    assert await engine.pending() == 1
    clock.set(T0 + 10)
    await drain(engine)
    assert payloads(redis_client) == [1]


@pytest.mark.both_fire_paths
async def test_a_call_retried_with_its_token_after_a_lost_reply_is_stored_once(
    redis_client: redis.Redis,
) -> None:
    port = redis_client.connection_pool.connection_kwargs["port"]
    proxy = LosingProxy(port, marker=b"lost-reply-marker")
    await proxy.start()
    # No automatic resend (as the component's client): the caller retries, with its token.
    client = aioredis.Redis(port=proxy.port, socket_timeout=5, retry=Retry(NoBackoff(), 0))
    try:
        engine = DelayEngine(client, KEYS, ManualClock(T0))
        await engine.schedule([env(0, T0 + 10)])  # loads the script: the cut hits EVALSHA
        marked = Envelope(
            id="", topic="orders", due_ms=T0 + 10, published_at_ms=T0, message=b"lost-reply-marker"
        )
        proxy.armed = True
        with pytest.raises(redis.exceptions.ConnectionError):
            await engine.schedule([marked], token="call-7")
        assert proxy.cuts == 1  # the write landed, the reply was lost
        assert await engine.schedule([marked], token="call-7") == []  # the retry is a no-op
    finally:
        await client.aclose()
        await proxy.stop()
    assert len(target(redis_client, KEYS.stream)) == 2
    assert redis_client.get(KEYS.count) == b"2"
    assert [h.event for h in history(redis_client)] == ["scheduled", "scheduled"]


@pytest.mark.both_fire_paths
async def test_a_retried_call_token_covers_every_chunk(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    """The caller's token named the first chunk only; the later chunks of a retried call
    got fresh tokens and were stored again."""
    engine = DelayEngine(aredis(), KEYS, ManualClock(T0), config=EngineConfig(schedule_chunk=2))
    envs = [env(i, T0 + 10) for i in range(5)]
    await engine.schedule(envs, token="call-9")
    await engine.schedule(envs, token="call-9")  # the caller's retry after a lost reply
    assert await engine.pending() == 5
    assert redis_client.xlen(KEYS.stream) == 5


@pytest.mark.both_fire_paths
async def test_a_large_schedule_is_stored_in_calls_bounded_by_bytes(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    """Chunks counted envelopes only: a 64 MiB bulk publish (16 envelopes of 4 MiB) was one
    SCHEDULE call holding Redis ~200 ms."""

    def calls() -> int:
        stats = redis_client.info("commandstats")
        return sum(int(v["calls"]) for k, v in stats.items() if k in ("cmdstat_evalsha", "cmdstat_eval"))

    engine = DelayEngine(aredis(), KEYS, ManualClock(T0))
    big = [
        Envelope(
            id="",
            topic="orders",
            due_ms=T0,
            published_at_ms=T0,
            message=f'{{"n":{i}}}'.encode().ljust(1 << 20),
        )
        for i in range(8)
    ]
    before = calls()
    await engine.schedule(big)
    assert calls() - before >= 8
    assert await engine.pending() == 8
    await drain(engine)
    assert redis_client.xlen("orders") == 8
