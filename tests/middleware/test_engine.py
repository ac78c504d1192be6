"""The delay engine against a real Redis: on time, once, durable, racing replicas."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from delayed_middleware import scripts
from delayed_middleware.clock import ManualClock, SystemClock
from delayed_middleware.engine import DelayEngine, EngineConfig
from delayed_middleware.entry import Trim, decode_entry
from delayed_middleware.envelope import BulkEntry, Envelope, decode_envelope
from delayed_middleware.keys import EngineKeys, delayed_topic
from tests.conftest import small_stream_nodes
from tests.redis_server import RedisServer, stream_entries

T0 = 1_800_000_000_000
KEYS = EngineKeys.for_topic(delayed_topic("app"))


def env(n: int, due: int, topic: str = "orders", sid: str = "", **kw: object) -> Envelope:
    return Envelope(
        id=sid or f"m{n}",
        topic=topic,
        due_ms=due,
        published_at_ms=T0,
        message=f'{{"n":{n}}}'.encode(),
        metadata={"k": f"v{n}", "cloudevent.id": str(n)},
        schedule_id=sid,
        **kw,  # type: ignore[arg-type]
    )


def target(redis_client: redis.Redis, topic: str = "orders") -> list[tuple[str, dict[bytes, bytes]]]:
    return stream_entries(redis_client, topic)


async def test_not_before_due_then_exactly_once(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    clock = ManualClock(T0)
    engine = DelayEngine(aredis(), KEYS, clock)
    [sid] = await engine.schedule([env(1, T0 + 5_000)])

    clock.set(T0 + 4_999)
    assert await engine.fire_due() == (0, T0 + 5_000)
    assert target(redis_client) == []

    clock.set(T0 + 5_000)
    fired, head = await engine.fire_due()
    assert (fired, head) == (1, None)
    [(_, fields)] = target(redis_client)
    entry = decode_entry(fields)
    assert entry.data == b'{"n":1}'
    # The user's keys verbatim, plus what produced it and that nothing follows.
    assert entry.metadata == {"k": "v1", "cloudevent.id": "1", "scheduler": sid, "scheduleNext": "purge"}
    # Fired once: the index and the delayed topic no longer hold it.
    assert await engine.fire_due() == (0, None)
    assert len(target(redis_client)) == 1
    assert redis_client.xlen(KEYS.stream) == 0
    assert await engine.pending() == 0
    assert redis_client.exists(KEYS.due) == 0  # the index is empty, no bucket left behind


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


async def test_content_type_and_raw_bytes_survive(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    engine = DelayEngine(aredis(), KEYS, ManualClock(T0))
    raw = bytes(range(256))
    await engine.schedule(
        [
            Envelope(
                id="x",
                topic="raw",
                due_ms=T0,
                published_at_ms=T0,
                message=raw,
                content_type="application/octet-stream",
            )
        ]
    )
    await engine.fire_due()
    [(_, fields)] = target(redis_client, "raw")
    entry = decode_entry(fields)
    assert entry.data == raw
    assert entry.content_type == "application/octet-stream"


async def test_overdue_fire_at_once_in_due_order(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    clock = ManualClock(T0)
    engine = DelayEngine(aredis(), KEYS, clock, config=EngineConfig(batch_size=500))
    # Scheduled out of order, all overdue by the time the engine looks.
    await engine.schedule([env(n, T0 + 1000 - n) for n in range(1200)])
    clock.set(T0 + 10_000)
    total = 0
    while True:
        fired, _ = await engine.fire_due()
        if not fired:
            break
        total += fired
    assert total == 1200
    ns = [json.loads(decode_entry(f).data)["n"] for _, f in target(redis_client)]
    assert ns == list(range(1199, -1, -1))  # earliest due first


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


async def test_bulk_fires_as_one_batch(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    clock = ManualClock(T0)
    engine = DelayEngine(aredis(), KEYS, clock)
    entries = tuple(BulkEntry(f"e{i}", f"ev{i}".encode(), "text/plain", {"i": str(i)}) for i in range(50))
    [sid] = await engine.schedule(
        [Envelope(id="b", topic="bulk", due_ms=T0 + 100, published_at_ms=T0, bulk_entries=entries)]
    )
    assert redis_client.xlen(KEYS.stream) == 1  # one envelope for the whole bulk
    clock.set(T0 + 100)
    assert (await engine.fire_due())[0] == 1
    got = [decode_entry(f) for _, f in target(redis_client, "bulk")]
    assert [(e.data, e.content_type, e.metadata) for e in got] == [
        (f"ev{i}".encode(), "text/plain", {"i": str(i), "scheduler": sid, "scheduleNext": "purge"})
        for i in range(50)
    ]


async def test_racing_replicas_fire_each_exactly_once(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    clock = ManualClock(T0)
    engines = [DelayEngine(aredis(), KEYS, clock, config=EngineConfig(batch_size=100)) for _ in range(5)]
    n = 3000
    await engines[0].schedule([env(i, T0 + i % 7) for i in range(n)])
    clock.set(T0 + 10)

    async def drain(e: DelayEngine) -> int:
        total = 0
        while True:
            fired, _ = await e.fire_due()
            total += fired
            if not fired and await e.pending() == 0:
                return total

    counts = await asyncio.gather(*(drain(e) for e in engines))
    assert sum(counts) == n
    ns = [json.loads(decode_entry(f).data)["n"] for _, f in target(redis_client)]
    assert sorted(ns) == list(range(n))  # each once: no loss, no duplicate


async def test_vanished_envelope_is_dropped_not_spun(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    engine = DelayEngine(aredis(), KEYS, ManualClock(T0))
    [a, _b] = await engine.schedule([env(1, T0), env(2, T0)])
    redis_client.xdel(KEYS.stream, a)
    assert (await engine.fire_due())[0] == 1
    assert await engine.pending() == 0
    assert [json.loads(decode_entry(f).data)["n"] for _, f in target(redis_client)] == [2]


async def test_trim_maxlen_applies_to_target(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    engine = DelayEngine(aredis(), KEYS, ManualClock(T0), trim=Trim(mode="MAXLEN", max_len=10))
    for chunk in range(5):
        await engine.schedule([env(chunk * 200 + i, T0) for i in range(200)])
        await engine.fire_due()
    # Approximate trimming keeps at least max_len and far fewer than all 1000.
    assert 10 <= redis_client.xlen("orders") < 1000


async def test_run_loop_wakes_exactly_on_time(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    clock = SystemClock()
    engine = DelayEngine(aredis(), KEYS, clock)
    other = DelayEngine(aredis(), KEYS, clock)  # another replica publishing
    await engine.schedule([env(0, clock.now_ms() + 60_000)])  # a far head: the loop sleeps long
    task = asyncio.create_task(engine.run())
    try:
        await asyncio.sleep(0.2)
        due = clock.now_ms() + 300
        await other.schedule([env(1, due)])
        arrived = await _wait_for_entries(redis_client, "orders", 1, within_s=3)
        assert arrived[0] >= due, "delivered early"
        assert arrived[0] - due < 100, f"late by {arrived[0] - due} ms"
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def test_run_loop_survives_redis_restart(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis, redis_server: RedisServer
) -> None:
    clock = SystemClock()
    engine = DelayEngine(aredis(), KEYS, clock, config=EngineConfig(max_sleep_s=0.5))
    task = asyncio.create_task(engine.run())
    try:
        await engine.schedule([env(1, clock.now_ms() + 1500)])
        await asyncio.sleep(0.2)
        await asyncio.to_thread(redis_server.restart)  # AOF keeps the pending message
        await _wait_for_entries(redis_server.client(), "orders", 1, within_s=8)
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def _wait_for_entries(client: redis.Redis, topic: str, n: int, within_s: float) -> list[int]:
    """Arrival times (ms, from the entry ids Redis assigned) of the first n entries."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            entries = stream_entries(client, topic)
        except redis.ConnectionError:
            entries = []
        if len(entries) >= n:
            return [int(i.split("-")[0]) for i, _ in entries]
        await asyncio.sleep(0.005)
    raise AssertionError(f"{topic}: fewer than {n} entries after {within_s}s")


_text = st.text(alphabet=st.characters(exclude_categories=["Cs"]), max_size=40)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    message=st.binary(max_size=3000),
    metadata=st.dictionaries(_text, _text, max_size=6),
    content_type=_text,
    bulk=st.lists(
        st.tuples(_text, st.binary(max_size=300), _text, st.dictionaries(_text, _text, max_size=3)),
        max_size=4,
    ),
)
async def test_lua_decoder_agrees_with_protobuf(
    aredis: Callable[[], aioredis.Redis],
    redis_client: redis.Redis,
    message: bytes,
    metadata: dict[str, str],
    content_type: str,
    bulk: list[tuple[str, bytes, str, dict[str, str]]],
) -> None:
    """Whatever the envelope holds, the fired entries carry it exactly (the Lua decoder is ours)."""
    redis_client.flushall()
    engine = DelayEngine(aredis(), KEYS, ManualClock(T0))
    entries = tuple(BulkEntry(*b) for b in bulk)
    e = Envelope(
        id="x",
        topic="t",
        due_ms=T0,
        published_at_ms=T0,
        message=message,
        content_type=content_type,
        metadata=metadata,
        schedule_id="sid",
        bulk_entries=entries,
    )
    await engine.schedule([e])
    assert (await engine.fire_due())[0] == 1
    got = [decode_entry(f) for _, f in target(redis_client, "t")]
    added = {"scheduler": "sid", "scheduleNext": "purge"}
    if entries:
        expected = [(b.event, {**b.metadata, **added}, b.content_type) for b in entries]
    else:
        expected = [(message, {**metadata, **added}, content_type)]
    assert [(g.data, dict(g.metadata), g.content_type) for g in got] == expected
    assert redis_client.hlen(KEYS.ids) == 0


async def test_undecodable_envelope_is_kept_for_inspection_not_fired(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    engine = DelayEngine(aredis(), KEYS, ManualClock(T0))
    # A truncated field, scheduled through the real script as any envelope is.
    redis_client.eval(
        scripts.SCHEDULE,
        len(KEYS.script_keys),
        *KEYS.script_keys,
        *(KEYS.buckets, KEYS.wake, T0, "", 0, 1000, 1),
        *(b"\x0a\xff\xff\xff", T0, "", 0, "orders", 4, "", "-", "-"),
    )
    [(bad_id, _)] = target(redis_client, KEYS.stream)
    await engine.schedule([env(1, T0)])
    assert (await engine.fire_due())[0] == 1
    assert [json.loads(decode_entry(f).data)["n"] for _, f in target(redis_client)] == [1]
    assert await engine.pending() == 0  # out of the index: it cannot spin the loop
    assert [i for i, _ in target(redis_client, KEYS.stream)] == [bad_id]  # still there to inspect
    assert "undecodable" in str(redis_client.hget(KEYS.parked, bad_id))  # and listed for operators


@pytest.mark.parametrize("seed", range(4))
async def test_index_agrees_with_a_model_through_splits_replaces_and_cancels(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis, seed: int
) -> None:
    """Random schedules (bursts sharing a due time, sparse ones, replaced and canceled ids) and fires,
    checked after every step against a plain dict: the bucketed index loses nothing and fires in order."""
    rng = random.Random(seed)
    clock = ManualClock(T0)
    engine = DelayEngine(aredis(), KEYS, clock, config=EngineConfig(batch_size=rng.choice([7, 50, 500])))
    model: dict[str, tuple[int, str]] = {}  # payload -> (due, scheduleId)
    fired_order: list[str] = []
    n = 0
    for _step in range(60):
        op = rng.random()
        if op < 0.55:
            batch = []
            burst_due = clock.now_ms() + rng.choice([0, 5, 300, 5_000, 86_400_000])
            for _ in range(rng.choice([1, 20, 150, 400])):
                n += 1
                due = burst_due if rng.random() < 0.5 else clock.now_ms() + rng.randrange(0, 20_000)
                sid = f"s{rng.randrange(40)}" if rng.random() < 0.2 else ""
                batch.append(env(n, due, sid=sid))
            await engine.schedule(batch)
            for e in batch:
                if e.schedule_id:
                    model = {k: v for k, v in model.items() if v[1] != e.schedule_id}
                model[e.message.decode()] = (e.due_ms, e.schedule_id)
        elif op < 0.65:
            sid = f"s{rng.randrange(40)}"
            was = any(v[1] == sid for v in model.values())
            assert await engine.cancel(sid) is was
            model = {k: v for k, v in model.items() if v[1] != sid}
        else:
            clock.advance(rng.choice([1, 50, 1_000, 10_000]))
            before = len(target(redis_client))
            while (await engine.fire_due())[0]:
                pass
            got = [decode_entry(f).data.decode() for _, f in target(redis_client)[before:]]
            due_now = {k for k, (due, _) in model.items() if due <= clock.now_ms()}
            assert set(got) == due_now
            assert len(got) == len(due_now)
            assert [model[k][0] for k in got] == sorted(model[k][0] for k in got)  # earliest first
            fired_order += got
            for k in got:
                del model[k]
        assert await engine.pending() == len(model)
    clock.advance(100_000_000)
    while (await engine.fire_due())[0]:
        pass
    delivered = [decode_entry(f).data.decode() for _, f in target(redis_client)]
    assert len(delivered) == len(set(delivered))  # nothing twice
    assert set(delivered) == set(fired_order) | set(model)  # nothing lost
    assert await engine.pending() == 0
    assert redis_client.exists(KEYS.due) == 0


async def test_a_burst_sharing_one_due_time_outgrows_a_bucket_and_fires_whole(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    clock = ManualClock(T0)
    engine = DelayEngine(aredis(), KEYS, clock, config=EngineConfig(batch_size=64))
    # Interleaved: a bucket fills with one due time, then with the next, and
    # must split between them, never inside a run of equal due times.
    await engine.schedule([env(i, T0 + 10 + i % 2) for i in range(600)])
    assert await engine.pending() == 600

    async def fire_at(now: int) -> list[int]:
        clock.set(now)
        before = len(target(redis_client))
        while (await engine.fire_due())[0]:
            pass
        return [json.loads(decode_entry(f).data)["n"] for _, f in target(redis_client)[before:]]

    assert sorted(await fire_at(T0 + 10)) == list(range(0, 600, 2))
    assert await engine.pending() == 300
    await engine.schedule([env(1000 + i, T0 + 5) for i in range(250)])  # earlier than every bucket
    assert sorted(await fire_at(T0 + 10)) == list(range(1000, 1250))
    assert sorted(await fire_at(T0 + 11)) == list(range(1, 600, 2))
    assert await engine.pending() == 0
    assert redis_client.exists(KEYS.due) == 0


async def test_history_records_written_before_the_history_was_turned_off_still_age_out(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    # Written while the history was on: one old enough to go, one recent enough to stay, in
    # stream nodes of their own (the age trim is approximate: it frees whole nodes).
    now = int(time.time() * 1000)
    with small_stream_nodes(redis_client, 1):
        redis_client.xadd(KEYS.history, {"event": "fired"}, id=f"{now - 7_200_000}-0")
        redis_client.xadd(KEYS.history, {"event": "fired"}, id=f"{now - 60_000}-0")
    config = EngineConfig(history_max_len=0, history_max_age_ms=3_600_000, max_sleep_s=0.2)
    engine = DelayEngine(aredis(), KEYS, SystemClock(), config=config)
    task = asyncio.create_task(engine.run())
    try:
        deadline = time.monotonic() + 10
        while redis_client.xlen(KEYS.history) != 1:
            assert time.monotonic() < deadline, "the old record was not trimmed"
            await asyncio.sleep(0.05)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    rows: Any = redis_client.xrange(KEYS.history)
    assert [kept for kept, _ in rows] == [f"{now - 60_000}-0".encode()]
