"""The history's by-id index (lua/history.lua, HIST_WALK, HIST_SWEEP): the records of a scheduleId
are read along their chain, and give exactly what a scan of the whole history gives, against a
real Redis written by the real engine and by the other writers (Retention.append)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis

from delayed_middleware.clock import ManualClock
from delayed_middleware.engine import DelayEngine, EngineConfig
from delayed_middleware.envelope import RECURRING, Envelope
from delayed_middleware.history import HANDED_OFF, IndexSweep, Retention, decode_record
from delayed_middleware.inspector import HistoryPosition, Inspector
from delayed_middleware.keys import EngineKeys, delayed_topic
from tests.redis_server import stream_entries

T0 = 1_800_000_000_000
KEYS = EngineKeys.for_topic(delayed_topic("app"))


@pytest.fixture
async def client(redis_client: redis.Redis) -> AsyncIterator[aioredis.Redis]:
    port = redis_client.connection_pool.connection_kwargs["port"]
    c = aioredis.Redis(port=port)
    yield c
    await c.aclose()


def one_shot(sid: str, due_ms: int, n: int = 0) -> Envelope:
    return Envelope(
        id=sid,
        topic="orders",
        due_ms=due_ms,
        published_at_ms=T0,
        message=f'{{"n":{n}}}'.encode(),
        schedule_id=sid,
    )


def every_second(sid: str) -> Envelope:
    return Envelope(
        id=sid,
        topic="orders",
        due_ms=T0 + 1_000,
        published_at_ms=T0,
        message=b"{}",
        schedule_id=sid,
        kind=RECURRING,
        schedule="@every 1s",
        every_ms=1_000,
    )


def scanned(client: redis.Redis, id: str) -> list[str]:
    """The stream ids of `id`'s records, oldest first, by a scan of the whole history."""
    return [
        entry_id
        for entry_id, f in stream_entries(client, KEYS.history)
        if id.encode() in (f.get(b"id"), f.get(b"sid"))
    ]


def history_reads(client: redis.Redis) -> int:
    stats = client.info("commandstats")
    return sum(int(stats.get(f"cmdstat_{c}", {}).get("calls", 0)) for c in ("xrange", "xrevrange"))


def handed_off(id: str, at_ms: int) -> dict[str, str]:
    """A record as the forwarder writes it (its id, no sid)."""
    return {
        "event": HANDED_OFF,
        "at": str(at_ms),
        "id": id,
        "sid": "",
        "topic": "orders",
        "kind": "",
        "due": "",
        "late": "",
        "size": "2",
        "attempt": "1",
        "reason": "",
        "schedule": "",
    }


async def append(client: aioredis.Redis, records: list[dict[str, str]], retention: Retention) -> None:
    pipe = client.pipeline(transaction=True)
    # The age trim compares with the history's ids, which carry the Redis server's time.
    now = int(time.time() * 1000)
    for record in records:
        retention.append(pipe, KEYS.history, record, now)
    await pipe.execute()


async def mixed_history(client: aioredis.Redis, clock: ManualClock) -> list[str]:
    """Scheduled, replaced, cancelled, fired, recurring and handed-off records of 33 scheduleIds,
    among the records of 20 messages without one; returns the scheduleIds."""
    engine = DelayEngine(client, KEYS, clock)
    ids = [f"s{i}" for i in range(30)]
    await engine.schedule([one_shot(sid, T0 + 1_000 * (1 + i % 4), i) for i, sid in enumerate(ids)])
    await engine.schedule(
        [Envelope(id="", topic="orders", due_ms=T0 + 2_000, published_at_ms=T0) for _ in range(20)]
    )
    await engine.schedule([every_second(f"r{i}") for i in range(3)])
    await engine.schedule([one_shot(sid, T0 + 3_500) for sid in ids[:10]])  # replaced
    for sid in ids[10:15]:
        assert await engine.cancel(sid)
    for _ in range(6):
        clock.advance(1_000)
        while (await engine.fire_due())[0]:
            pass
        await append(client, [handed_off(sid, clock.now_ms()) for sid in ids[15:20]], Retention())
    return [*ids, "r0", "r1", "r2"]


async def test_the_records_of_every_schedule_id_are_those_a_scan_finds(
    client: aioredis.Redis, redis_client: redis.Redis
) -> None:
    ids = await mixed_history(client, ManualClock(T0))
    # A page of 3: the chain of a recurring schedule takes several script calls.
    inspector = Inspector(client, "app", page_size=3)
    for id in ids:
        want = scanned(redis_client, id)
        assert len(want) >= 2, (id, want)
        got = [r.stream_id for r in await inspector.history(id=id)]
        assert got == want, id
        newest = [p.ms for p, _ in await inspector.history_newest(2, id=id)]
        assert newest == [HistoryPosition.of(s).ms for s in want[-2:]], id
        after = HistoryPosition.of(want[0])
        assert [r.stream_id async for _, r in inspector.history_forward(id=id, after=after)] == want[1:], id
    assert [r.event for r in await inspector.history(id="r0")][:2] == ["scheduled", "fired"]
    assert [r.event for r in await inspector.history(id="s12")] == ["scheduled", "cancelled"]
    assert await inspector.history(id="nobody") == []


async def test_a_schedule_ids_records_are_read_without_scanning_the_history(
    client: aioredis.Redis, redis_client: redis.Redis
) -> None:
    # 20,000 records of other scheduleIds first, written as the retrier and forwarder write.
    retention = Retention()
    for start in range(0, 20_000, 2_000):
        await append(client, [handed_off(f"other{i}", T0) for i in range(start, start + 2_000)], retention)
    await mixed_history(client, ManualClock(T0))
    inspector = Inspector(client, "app", page_size=500)
    want = scanned(redis_client, "r1")
    before = history_reads(redis_client)
    assert [r.stream_id for r in await inspector.history(id="r1")] == want
    assert [p.ms for p, _ in await inspector.history_newest(3, id="r1")] == [
        HistoryPosition.of(s).ms for s in want[-3:]
    ]
    # One XRANGE per record of r1 and one for the history's head, per read: a scan is 40 pages.
    assert history_reads(redis_client) - before <= 2 * (len(want) + 1) + 2


async def test_records_written_before_the_index_are_found_by_a_scan_below_where_it_began(
    client: aioredis.Redis, redis_client: redis.Redis
) -> None:
    # A history from before the index: plain XADDs, no `prev`, no index.
    for n in range(3):
        legacy: dict[Any, Any] = {**handed_off("legacy", T0), "event": "retried", "attempt": str(n + 1)}
        await client.xadd(KEYS.history, legacy)
    gone_before: dict[Any, Any] = handed_off("gone-before", T0)
    await client.xadd(KEYS.history, gone_before)
    clock = ManualClock(T0)
    engine = DelayEngine(client, KEYS, clock)
    await engine.schedule([one_shot("legacy", T0 + 1_000)])
    clock.advance(1_000)
    await engine.fire_due()
    inspector = Inspector(client, "app")
    records = await inspector.history(id="legacy")
    assert [r.event for r in records] == ["retried", "retried", "retried", "scheduled", "fired"]
    assert [r.stream_id for r in records] == scanned(redis_client, "legacy")
    assert [r.event for r in await inspector.history(id="gone-before")] == [HANDED_OFF]


async def test_a_record_deleted_from_the_middle_of_a_chain_leaves_the_rest_found(
    client: aioredis.Redis, redis_client: redis.Redis
) -> None:
    await mixed_history(client, ManualClock(T0))
    chain = scanned(redis_client, "r2")
    assert len(chain) >= 5
    await client.xdel(KEYS.history, chain[2])
    inspector = Inspector(client, "app", page_size=2)
    assert [r.stream_id for r in await inspector.history(id="r2")] == chain[:2] + chain[3:]


async def test_the_sweep_keeps_the_index_as_long_as_the_trimmed_history(
    client: aioredis.Redis, redis_client: redis.Redis
) -> None:
    small = Retention(max_len=100, max_age_ms=0)
    for start in range(0, 3_000, 500):
        await append(client, [handed_off(f"id{i}", T0) for i in range(start, start + 500)], small)
    # MAXLEN ~ trims whole nodes: about 100 records stay, their ids' fields among 3,000.
    assert await client.hlen(KEYS.history_index) == 3_001
    sweep = IndexSweep(KEYS.history, KEYS.history_index, page=200)
    await sweep.step(client, T0)
    steps = 1
    while sweep._cursor is not None:
        await sweep.step(client, T0)
        steps += 1
    kept = {f.decode() if isinstance(f, bytes) else f for f in await client.hkeys(KEYS.history_index)} - {""}
    alive = {bytes(f[b"id"]).decode() for _, f in stream_entries(redis_client, KEYS.history)}
    assert kept == alive
    assert sweep.dropped == 3_000 - len(alive)
    assert steps > 1  # a page per step, not the whole hash in one script
    # Each one's records are still found through the index.
    inspector = Inspector(client, "app")
    some = sorted(alive)[0]
    assert [r.stream_id for r in await inspector.history(id=some)] == scanned(redis_client, some)
    # The next sweep waits out its interval.
    await sweep.step(client, T0 + 1_000)
    assert sweep._cursor is None


async def test_a_field_a_writer_moved_on_during_a_sweep_is_kept(
    client: aioredis.Redis, redis_client: redis.Redis
) -> None:
    small = Retention(max_len=10, max_age_ms=0)
    await append(client, [handed_off(f"id{i}", T0) for i in range(500)], small)
    # id0's newest record was trimmed; a writer adds a new one before the sweep reaches it.
    await append(client, [handed_off("id0", T0)], small)
    sweep = IndexSweep(KEYS.history, KEYS.history_index, page=50)
    await sweep.step(client, T0)
    while sweep._cursor is not None:
        await sweep.step(client, T0)
    assert await client.hexists(KEYS.history_index, "id0")
    assert [r.event for r in await Inspector(client, "app").history(id="id0")] == [HANDED_OFF]


async def test_with_the_history_off_nothing_is_indexed(client: aioredis.Redis) -> None:
    await append(client, [handed_off("x", T0)], Retention(max_len=0))
    clock = ManualClock(T0)
    engine = DelayEngine(client, KEYS, clock, config=EngineConfig(history_max_len=0))
    await engine.schedule([one_shot("y", T0 + 1_000), every_second("z")])
    clock.advance(2_000)
    await engine.fire_due()
    assert await engine.cancel("y") is False
    assert await client.exists(KEYS.history, KEYS.history_index) == 0


def test_a_decoded_record_ignores_the_prev_field() -> None:
    record = decode_record("1-0", {**handed_off("x", T0), "prev": "0-1"})
    assert record.id == "x"
