"""Coalesced scheduling against a real Redis: concurrent schedule calls of one shard go out as
one SCHEDULE script call, and each caller still gets exactly what it would have got alone:
its own ids or error, its own token (a retry after a lost reply stores nothing twice, whatever
batch it joins), replace by scheduleId in arrival order, nothing stored for a caller that gave
up before its batch was sent. On Redis Cluster, one script call per shard."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import pytest
import redis
import redis.asyncio as aioredis
import redis.asyncio.cluster as acluster
import redis.cluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from delayed_middleware.aio import text
from delayed_middleware.clock import ManualClock
from delayed_middleware.engine import DelayEngine, EngineConfig, ShardedEngine
from delayed_middleware.entry import decode_entry
from delayed_middleware.envelope import Envelope, decode_envelope
from delayed_middleware.keys import EngineKeys, shard_topics
from tests.chaos.proxy import LosingProxy, SlowProxy
from tests.conftest import script_calls
from tests.middleware.engine.helpers import KEYS, T0, env, history, payloads, target
from tests.redis_server import RedisCluster, RedisServer

MARKER = b"lost-reply-marker"


def stored_messages(client: redis.Redis) -> list[bytes]:
    """The message of every envelope on the delayed topic, in stream order."""
    return [decode_envelope(decode_entry(f).data).message for _, f in target(client, KEYS.stream)]


async def test_concurrent_schedules_go_out_as_one_script_call_and_each_is_stored_once(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    engine = DelayEngine(aredis(), KEYS, ManualClock(T0))
    await engine.schedule([env(0, T0 + 10)])  # the script is loaded
    before = script_calls(redis_client)
    got = await asyncio.gather(*(engine.schedule([env(n, T0 + 10)]) for n in range(1, 51)))
    assert script_calls(redis_client) - before == 1
    ids = [i for one in got for i in one]
    assert len(ids) == len(set(ids)) == 50  # each caller its own id
    assert await engine.pending() == 51
    assert sorted(stored_messages(redis_client)) == sorted(f'{{"n":{n}}}'.encode() for n in range(51))
    assert len(history(redis_client, "scheduled")) == 51
    # And they fire, once each.
    engine_clock = ManualClock(T0 + 10)
    firing = DelayEngine(aredis(), KEYS, engine_clock)
    while (await firing.fire_due())[0]:
        pass
    assert sorted(payloads(redis_client)) == list(range(51))


async def test_a_call_the_script_refuses_fails_alone_and_the_others_of_its_batch_are_stored(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    engine = DelayEngine(aredis(), KEYS, ManualClock(T0))
    await engine.schedule([env(0, T0 + 10)])
    # A hand-damaged ids-hash ref: replacing `broken` makes the script's XDEL fail.
    redis_client.hset(KEYS.ids, "broken", "not-a-stream-id 5 - - i")
    calls = [[env(n, T0 + 10), env(100 + n, T0 + 10)] for n in range(1, 11)]
    calls[4] = [env(5, T0 + 10), env(105, T0 + 10, sid="broken")]
    before = script_calls(redis_client)
    got = await asyncio.gather(
        *(engine.schedule(c, token=f"call-{i}") for i, c in enumerate(calls)), return_exceptions=True
    )
    assert script_calls(redis_client) - before == 1
    assert isinstance(got[4], redis.exceptions.ResponseError)
    assert "Invalid stream ID" in str(got[4])
    assert all(isinstance(g, list) and len(g) == 2 for i, g in enumerate(got) if i != 4)
    # The nine good calls are stored, both envelopes each, and marked done; the
    # refused one's token is not (it is not taken for done).
    good = sorted(f'{{"n":{m}}}'.encode() for i in range(1, 11) if i != 5 for m in (i, 100 + i))
    assert sorted(stored_messages(redis_client)) == sorted([b'{"n":0}', b'{"n":5}', *good])
    tokens = {text(t) for t in redis_client.zrange(KEYS.calls, 0, -1)}
    assert {f"call-{i}" for i in range(10) if i != 4} <= tokens
    assert "call-4" not in tokens


async def test_two_calls_with_one_schedule_id_in_one_batch_keep_the_later(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    engine = DelayEngine(aredis(), KEYS, ManualClock(T0))
    await engine.schedule([env(0, T0 + 10)])
    before = script_calls(redis_client)
    first, second = await asyncio.gather(
        engine.schedule([env(1, T0 + 10, sid="order-66")]), engine.schedule([env(2, T0 + 20, sid="order-66")])
    )
    assert script_calls(redis_client) - before == 1
    assert first == second == ["order-66"]
    assert await engine.pending() == 2  # m0 and the later order-66
    assert sorted(stored_messages(redis_client)) == [b'{"n":0}', b'{"n":2}']
    assert [h.event for h in history(redis_client) if h.schedule_id == "order-66"] == [
        "scheduled",
        "replaced",
        "scheduled",
    ]
    firing = DelayEngine(aredis(), KEYS, ManualClock(T0 + 20))
    while (await firing.fire_due())[0]:
        pass
    assert sorted(payloads(redis_client)) == [0, 2]


async def test_a_caller_cancelled_before_its_batch_is_sent_stores_nothing_and_the_others_are_stored(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    engine = DelayEngine(aredis(), KEYS, ManualClock(T0))
    await engine.schedule([env(0, T0 + 10)])
    before = script_calls(redis_client)
    tasks = [
        asyncio.create_task(engine.schedule([env(n, T0 + 10), env(100 + n, T0 + 10)])) for n in range(1, 21)
    ]
    await asyncio.sleep(0)  # every caller has handed its call over; the batch is not sent yet
    tasks[6].cancel()  # as a client's deadline does to its RPC
    got = await asyncio.gather(*tasks, return_exceptions=True)
    assert isinstance(got[6], asyncio.CancelledError)
    assert all(isinstance(g, list) and len(g) == 2 for i, g in enumerate(got) if i != 6)
    assert script_calls(redis_client) - before == 1
    kept = [f'{{"n":{m}}}'.encode() for n in range(1, 21) if n != 7 for m in (n, 100 + n)]
    assert sorted(stored_messages(redis_client)) == sorted([b'{"n":0}', *kept])


async def test_a_caller_timing_out_while_its_batch_is_on_the_wire_leaves_its_call_whole_and_the_others_stored(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    engine = DelayEngine(aredis(), KEYS, ManualClock(T0))
    await engine.schedule([env(0, T0 + 10)])
    admin = aredis()
    before = script_calls(redis_client)
    await admin.client_pause(400, all=False)  # Redis holds the batch ~0.4 s
    patient = [asyncio.create_task(engine.schedule([env(n, T0 + 10)], timeout_s=10)) for n in range(1, 6)]
    hasty = asyncio.create_task(engine.schedule([env(7, T0 + 10), env(8, T0 + 10)], timeout_s=0.1))
    with pytest.raises(TimeoutError):
        await hasty
    got = await asyncio.gather(*patient)
    assert script_calls(redis_client) - before == 1
    assert all(len(g) == 1 for g in got)
    messages = stored_messages(redis_client)
    for n in range(6):
        assert messages.count(f'{{"n":{n}}}'.encode()) == 1
    # The hasty caller's call is stored whole or not at all, never half.
    assert {b'{"n":7}', b'{"n":8}'} & set(messages) in (set(), {b'{"n":7}', b'{"n":8}'})


async def test_a_caller_queued_behind_a_stalled_batch_times_out_at_its_own_deadline_and_stores_nothing(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    engine = DelayEngine(aredis(), KEYS, ManualClock(T0))
    await engine.schedule([env(0, T0 + 10)])
    admin = aredis()
    await admin.client_pause(3_000, all=False)  # Redis holds the batch on the wire ~3 s
    patient = [asyncio.create_task(engine.schedule([env(n, T0 + 10)], timeout_s=10)) for n in range(1, 4)]
    await asyncio.sleep(0.2)  # the patient batch is on the wire; the next caller queues behind it
    started = asyncio.get_running_loop().time()
    with pytest.raises(TimeoutError):
        await engine.schedule([env(7, T0 + 10)], timeout_s=0.2)
    # Answered at its own deadline, not when the batch ahead of it comes back.
    assert asyncio.get_running_loop().time() - started < 2.0
    got = await asyncio.gather(*patient)
    assert all(len(g) == 1 for g in got)
    messages = stored_messages(redis_client)
    assert sorted(messages) == sorted(f'{{"n":{n}}}'.encode() for n in range(4))


async def test_calls_that_keep_coming_while_batches_are_on_the_wire_go_out_a_linger_apart_not_each_round_trip(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis, redis_server: RedisServer
) -> None:
    proxy = SlowProxy(redis_server.port, delay_s=0.02)  # every round trip takes 20 ms
    await proxy.start()
    client = aioredis.Redis(port=proxy.port)
    try:
        engine = DelayEngine(client, KEYS, ManualClock(T0), config=EngineConfig(schedule_linger_ms=50))
        await engine.schedule([env(0, T0 + 10)])
        before = script_calls(redis_client)
        # A caller every 5 ms for ~0.5 s (daprd's concurrent publishes): a round trip gathers ~4.
        tasks = []
        for n in range(1, 101):
            tasks.append(asyncio.create_task(engine.schedule([env(n, T0 + 10)], timeout_s=10)))
            await asyncio.sleep(0.005)
        got = await asyncio.gather(*tasks)
        calls = script_calls(redis_client) - before
    finally:
        await client.aclose()
        await proxy.stop()
    assert all(len(g) == 1 for g in got)
    # One script call per linger and round trip (0.07 s), ~8; not one per round trip (~25).
    assert calls <= 15
    assert sorted(stored_messages(redis_client)) == sorted(f'{{"n":{n}}}'.encode() for n in range(101))


async def test_retries_after_a_lost_batch_reply_join_other_batches_and_each_call_is_stored_once(
    redis_client: redis.Redis,
) -> None:
    port = redis_client.connection_pool.connection_kwargs["port"]
    proxy = LosingProxy(port, marker=MARKER)
    await proxy.start()
    # No automatic resend (as the component's client): the callers retry, each with its token.
    client = aioredis.Redis(port=proxy.port, socket_timeout=5, retry=Retry(NoBackoff(), 0))
    try:
        engine = DelayEngine(client, KEYS, ManualClock(T0))
        await engine.schedule([env(0, T0 + 10)])  # loads the script: the cut hits EVALSHA
        marked = Envelope(id="", topic="orders", due_ms=T0 + 10, published_at_ms=T0, message=MARKER)
        proxy.armed = True
        lost = await asyncio.gather(
            engine.schedule([marked], token="call-a"),
            engine.schedule([env(1, T0 + 10), env(2, T0 + 10)], token="call-b"),
            return_exceptions=True,
        )
        assert proxy.cuts == 1  # one batch, written, its reply lost
        assert all(isinstance(e, redis.exceptions.ConnectionError) for e in lost)
        # Each retries with its own token, in batches of another make-up, beside a new call.
        before = script_calls(redis_client)
        a, c = await asyncio.gather(
            engine.schedule([marked], token="call-a"), engine.schedule([env(3, T0 + 10)], token="call-c")
        )
        b = await engine.schedule([env(1, T0 + 10), env(2, T0 + 10)], token="call-b")
        assert script_calls(redis_client) - before == 2
        assert a == b == []  # found done: nothing stored again
        assert len(c) == 1
    finally:
        await client.aclose()
        await proxy.stop()
    messages = stored_messages(redis_client)
    assert sorted(messages) == sorted([b'{"n":0}', MARKER, b'{"n":1}', b'{"n":2}', b'{"n":3}'])
    assert redis_client.get(KEYS.count) == b"5"


@pytest.fixture
async def aclient(cluster: RedisCluster) -> AsyncIterator[acluster.RedisCluster]:
    c = acluster.RedisCluster(host="127.0.0.1", port=cluster.nodes[0].port)
    yield c
    await c.aclose()


async def test_on_cluster_concurrent_schedules_go_to_their_own_shards_one_script_call_each(
    cluster: RedisCluster, admin: redis.cluster.RedisCluster, aclient: acluster.RedisCluster
) -> None:
    clock = ManualClock(T0)
    shards = ShardedEngine(
        [
            DelayEngine(aclient, EngineKeys.for_topic(t), clock, config=EngineConfig(two_phase=True))
            for t in shard_topics("coalesce", 6)
        ]
    )
    nodes = [n.client() for n in cluster.nodes]
    for i, e in enumerate(shards.engines):  # scripts loaded, connections open
        await e.schedule([env(0, T0 + 10, sid=f"warm-{i}")])
    before = script_calls(*nodes)
    got = await asyncio.gather(*(shards.schedule([env(n, T0 + 10, sid=f"s{n}")]) for n in range(60)))
    calls = script_calls(*nodes) - before
    assert got == [[f"s{n}"] for n in range(60)]
    assert calls <= len(shards.engines)  # one per shard, not one per publish
    # Each on its home shard, once.
    for n in range(60):
        home = shards.shard_of(f"s{n}")
        assert admin.hexists(home.keys.ids, f"s{n}")
        assert sum(admin.hexists(e.keys.ids, f"s{n}") for e in shards.engines) == 1
    assert await shards.pending() == 66
    assert len({shards.shard_of(f"s{n}").keys.stream for n in range(60)}) == 6
    for c in nodes:
        c.close()
