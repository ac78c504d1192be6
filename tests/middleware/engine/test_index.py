"""The due index (buckets of a sorted set, lua/index.lua) against a real Redis: checked against
a plain-dict model through bursts that share one due time, splits, replaces, cancels and waves of
recurring reinserts."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from typing import cast

import pytest
import redis
import redis.asyncio as aioredis

from delayed_middleware.clock import ManualClock
from delayed_middleware.engine import DelayEngine, EngineConfig
from delayed_middleware.entry import decode_entry
from tests.middleware.engine.helpers import (
    KEYS,
    T0,
    drain,
    engine_libraries,
    env,
    every_env,
    index_buckets,
    payloads,
    target,
)


@pytest.mark.both_fire_paths
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


@pytest.mark.both_fire_paths
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


@pytest.mark.both_fire_paths
async def test_earlier_publishes_after_a_20k_same_instant_burst(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    clock = ManualClock(T0)
    engine = DelayEngine(aredis(), KEYS, clock)
    tomorrow = T0 + 86_400_000
    await engine.schedule([env(i, tomorrow) for i in range(20_000)])
    # Earlier than all, inside the burst bucket's range, and later than the burst.
    await engine.schedule([env(100_001, T0 + 2_000)])
    await engine.schedule([env(100_002, tomorrow - 1)])
    await engine.schedule([env(100_003, tomorrow + 1)])
    assert await engine.pending() == 20_003
    clock.set(T0 + 2_000)
    await drain(engine)
    assert payloads(redis_client) == [100_001]
    clock.set(tomorrow + 1)
    await drain(engine)
    got = payloads(redis_client)
    assert got[:2] == [100_001, 100_002]
    assert got[-1] == 100_003
    assert sorted(got[2:-1]) == list(range(20_000))
    assert await engine.pending() == 0
    assert redis_client.exists(KEYS.due) == 0


@pytest.mark.both_fire_paths
@pytest.mark.slow
# 100,000 schedules on each fire path: a minute of CPU on a shared machine, not a hang.
@pytest.mark.timeout(600)
async def test_index_model_with_100k_same_instant_mixed_with_earlier_later_replaced_cancelled(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    rng = random.Random(7)
    clock = ManualClock(T0)
    engine = DelayEngine(aredis(), KEYS, clock)
    burst = T0 + 50_000
    model: dict[int, tuple[int, str]] = {}
    # scheduleId -> the one message holding it: a replace or cancel finds its victim here
    # instead of scanning the 100k-entry model (that scan once took most of the test's time).
    holder: dict[str, int] = {}

    def forget(sid: str) -> None:
        old = holder.pop(sid, None)
        if old is not None:
            del model[old]

    envs = []
    for i in range(100_000):
        envs.append(env(i, burst))
        model[i] = (burst, "")
    # Interleave earlier, later and id'd ones with the burst's scheduling.
    extra = []
    for i in range(100_000, 102_000):
        due = burst + rng.choice([-40_000, -1, 1, 30_000]) + rng.randrange(0, 5)
        sid = f"s{rng.randrange(300)}" if rng.random() < 0.5 else ""
        extra.append(env(i, due, sid=sid))
    for chunk in range(0, 100_000, 10_000):
        await engine.schedule(envs[chunk : chunk + 10_000])
        part = extra[chunk // 50 : chunk // 50 + 200]
        await engine.schedule(part)
        for e in part:
            n = json.loads(e.message)["n"]
            if e.schedule_id:
                forget(e.schedule_id)
                holder[e.schedule_id] = n
            model[n] = (e.due_ms, e.schedule_id)
    for s in range(0, 300, 3):
        sid = f"s{s}"
        assert await engine.cancel(sid) is (sid in holder)
        forget(sid)
    assert await engine.pending() == len(model)
    seen = "0-0"  # the last target entry read: each step reads only what it fired
    for now in (burst - 1, burst, burst + 1, burst + 40_000):
        clock.set(now)
        await drain(engine)
        fresh = cast("list[tuple[bytes, dict[bytes, bytes]]]", redis_client.xrange("orders", f"({seen}"))
        if fresh:
            seen = fresh[-1][0].decode()
        got = [json.loads(decode_entry(f).data)["n"] for _, f in fresh]
        due_now = {k for k, (d, _) in model.items() if d <= now}
        assert sorted(got) == sorted(due_now)
        assert [model[k][0] for k in got] == sorted(model[k][0] for k in got)
        for k in got:
            del model[k]
        assert await engine.pending() == len(model)
    assert model == {}
    assert redis_client.exists(KEYS.due) == 0


def _lua_insert_many(client: redis.Redis, items: list[tuple[str, int]]) -> None:
    body = (
        "local items = {} for i = 2, #ARGV, 2 do items[#items + 1] = {ARGV[i], ARGV[i + 1]} end "
        "insert_many(items) return 1"
    )
    flat = [v for it in items for v in it]
    client.eval(engine_libraries("index.lua") + "\n" + body, len(KEYS.script_keys), *KEYS.script_keys,
                KEYS.buckets, *flat)  # fmt: skip


def _lua_insert(client: redis.Redis, items: list[tuple[str, int]]) -> None:
    body = "for i = 1, #ARGV - 1, 2 do insert(ARGV[i + 1], ARGV[i + 2]) end return 1"
    flat = [v for it in items for v in it]
    client.eval(engine_libraries("index.lua") + "\n" + body, len(KEYS.script_keys), *KEYS.script_keys,
                KEYS.buckets, *flat)  # fmt: skip


def test_insert_many_keeps_the_index_a_partition_whatever_the_dues(redis_client: redis.Redis) -> None:
    """insert_many against a model, over existing buckets: waves of equal dues (a bucket that
    cannot split), dues earlier than every bucket, later than all, on bucket starts, and
    waves far beyond CHUNK. Each id once at its due, each bucket inside its range, the
    pending count exact, and a bucket over BUCKET_MAX + 1 only when all its dues are equal."""
    rng = random.Random(5)
    model: dict[str, int] = {}
    n = 0
    for wave in range(12):
        items: list[tuple[str, int]] = []
        shape = wave % 4
        for _ in range(rng.choice([1, 50, 700, 1_300])):
            n += 1
            if shape == 0:
                due = T0 + 5_000  # all equal
            elif shape == 1:
                due = T0 - rng.randrange(1, 10_000_000)  # earlier than every bucket
            elif shape == 2:
                due = T0 + rng.randrange(0, 20) * 1_000  # few distinct dues, many equal
            else:
                due = T0 + rng.randrange(-(10**9), 10**9)
            items.append((f"e{n}", due))
        if wave % 3 == 2:
            _lua_insert(redis_client, items)  # one by one, mixed with the waves
        else:
            _lua_insert_many(redis_client, items)
        model.update(items)
    buckets = index_buckets(redis_client)
    seen: dict[str, int] = {}
    for i, (start, members) in enumerate(buckets):
        end = buckets[i + 1][0] if i + 1 < len(buckets) else float("inf")
        assert members, "empty bucket left in the top"
        for m, score in members:
            assert start <= score < end
            assert m.decode() not in seen
            seen[m.decode()] = int(score)
        if len(members) > 101:
            assert len({d for _, d in members}) == 1
    assert seen == model
    assert int(redis_client.get(KEYS.count) or 0) == len(model)


@pytest.mark.both_fire_paths
async def test_a_wave_of_recurring_reinserts_keeps_the_index_exact_and_compact(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    """5,000 @every schedules (phases spread over 0.4 s) fire as one wave and re-enter the index
    together (insert_many): afterwards every envelope is indexed once at its next grid point, the
    buckets still partition time, none holds more than 101 members, and every bucket stays
    listpack-encoded (the index's ~10 bytes per pending message)."""
    clock = ManualClock(T0)
    engine = DelayEngine(aredis(), KEYS, clock, recurrence=None)
    envs = [every_env(1_000, sid=f"w{i}", published=T0 + i * 2 // 25) for i in range(5_000)]
    for i in range(0, 5_000, 1_000):
        await engine.schedule(envs[i : i + 1_000])
    for wave in (1, 2, 3):
        clock.set(T0 + wave * 1_000 + 400)
        await drain(engine)
        assert len(target(redis_client)) == 5_000 * wave
        buckets = index_buckets(redis_client)
        members = [(m, due) for _, ms in buckets for m, due in ms]
        assert len(members) == len({m for m, _ in members}) == 5_000 == await engine.pending()
        ids = cast("dict[bytes, bytes]", redis_client.hgetall(KEYS.ids))
        refs = {k.decode(): v.decode().split() for k, v in ids.items()}
        expected = {
            refs[f"w{i}"][0].encode(): float(T0 + i * 2 // 25 + (wave + 1) * 1_000) for i in range(5_000)
        }
        assert dict(members) == expected
        for (start, ms), nxt in zip(buckets, [b[0] for b in buckets[1:]] + [float("inf")], strict=True):
            assert ms
            assert all(start <= due < nxt for _, due in ms)
            assert len(ms) <= 101
        for b in cast("list[bytes]", redis_client.zrange(KEYS.due, 0, -1)):
            assert redis_client.object("encoding", f"{KEYS.buckets}{b.decode()}") == b"listpack"
