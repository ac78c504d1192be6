"""Orphan recovery against a real Redis: envelopes left on the delayed topic with no due-index
entry (release 0.1.0 run on data whose envelopes compaction re-homed drops their index entries)
are put back at their due time once each, on both fire paths; what was fired, cancelled, replaced
or paused is never brought back."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections import Counter
from collections.abc import Callable
from typing import cast

import pytest
import redis
import redis.asyncio as aioredis

from delayed_middleware import lua_scripts
from delayed_middleware.aio import text
from delayed_middleware.clock import ManualClock
from delayed_middleware.engine import DelayEngine, EngineConfig
from delayed_middleware.inspector import Inspector
from tests.conftest import small_stream_nodes
from tests.middleware.engine.helpers import (
    KEYS,
    T0,
    drain,
    engine_libraries,
    env,
    every,
    history,
    payloads,
    recurring,
)
from tests.waiting import wait_until

DUE = T0 + 1_000
LATER = T0 + 5_000


def drop_index_entry(client: redis.Redis, id: str, due: int) -> None:
    """What release 0.1.0 does to a due entry whose envelope it cannot find at its id (or to the
    entry of a message it cancels): the index entry goes, the re-homed copy stays."""
    script = engine_libraries("index.lua") + "\nreturn remove(ARGV[2], ARGV[3])"
    assert client.eval(script, len(KEYS.script_keys), *KEYS.script_keys, KEYS.buckets, id, due) == 1


def stored_id(client: redis.Redis, id: str) -> str:
    ref = client.hget(KEYS.ids, id)
    return id if ref is None else text(ref).split()[0]


async def listed(aredis: Callable[[], aioredis.Redis]) -> set[str]:
    return {m.id for m in (await Inspector(aredis(), "app").pending()).messages}


@pytest.mark.both_fire_paths
async def test_envelopes_no_index_entry_refers_to_fire_once_and_nothing_settled_comes_back(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    clock = ManualClock(T0)
    config = EngineConfig(compact_min_nodes=1, recover_chunk=3)
    engine = DelayEngine(aredis(), KEYS, clock, config=config, recurrence=every)
    longs = [
        env(0, DUE),  # orphan, its move record kept
        env(1, DUE, sid="b"),  # orphan, its move record gone too
        env(2, DUE, sid="c"),  # cancelled by the old release
        env(3, DUE, sid="d"),  # replaced by the old release
        recurring(4, 1_000, sid="r"),  # a recurring orphan (due T0 + 1000)
        env(5, DUE, sid="p"),  # paused: held on purpose
        env(6, LATER),  # orphan due later: not before its due
        env(7, DUE),  # never orphaned
        env(8, DUE, sid="e"),  # orphan, its move record gone, then re-homed again: its id lost
    ]
    longs = [e if e.schedule_id else dataclasses.replace(e, id="") for e in longs]
    # Parked at once (a target in the engine's namespace): kept on the delayed topic, never indexed.
    longs.append(dataclasses.replace(env(9, T0, topic="bad-delayed"), id=""))
    fill = [dataclasses.replace(env(100, T0), topic="short", id="")] * 9
    with small_stream_nodes(redis_client, 10):
        ids = (await engine.schedule([x for e in longs for x in (e, *fill)]))[::10]
    # Stream ids (a scheduleId names its envelope through the ids hash).
    at = [stored_id(redis_client, i) for i in ids]
    await drain(engine)
    assert redis_client.hexists(KEYS.parked, at[9])
    assert await engine.compact()
    assert all(redis_client.hget(KEYS.moved, i) for i in at), "not all re-homed"
    await engine.set_paused("p", pause=True)

    # The state the old release leaves: index entries of the re-homed ones dropped (as lost, or
    # with a cancel or a replace), their copies still on the delayed topic.
    for i in (0, 1, 2, 3, 4, 6, 8):
        drop_index_entry(redis_client, at[i], longs[i].due_ms)
    redis_client.hdel(KEYS.moved, at[8])
    # A whole compaction pass now: the copy of 8 is re-homed under its own stream id.
    [(last, _)] = cast("list[tuple[bytes, object]]", redis_client.xrevrange(KEYS.stream, count=1))
    redis_client.eval(lua_scripts.COMPACT, len(KEYS.script_keys), *KEYS.script_keys, "-", last, 1_000, 0)
    redis_client.hdel(KEYS.moved, at[1])
    redis_client.hdel(KEYS.ids, "c")
    redis_client.hdel(KEYS.ids, "d")
    await engine.schedule([env(30, T0 + 2_000, sid="d")])
    assert {ids[0], "b", "r", ids[6]} <= await listed(aredis)
    assert redis_client.hget(KEYS.moved, at[8]) is None, "8's id not lost"

    clock.set(DUE)
    await drain(engine)
    assert payloads(redis_client) == [7], "only the indexed one fires without recovery"

    # Upgrading again: a fresh engine's sweep.
    upgraded = DelayEngine(aredis(), KEYS, clock, config=config, recurrence=every)
    assert await upgraded.recover_orphans() == (5, 2)
    assert await upgraded.recover_orphans() == (0, 0), "recovered twice"
    recovered = history(redis_client, "recovered")
    assert sorted((r.id, r.due_ms) for r in recovered) == sorted(
        [(ids[0], DUE), ("b", DUE), ("r", DUE), (ids[6], LATER), ("e", DUE)]
    )
    await drain(upgraded)
    assert sorted(payloads(redis_client)) == [0, 1, 4, 7, 8], "overdue orphans fire at once"
    # The copies of the cancelled and replaced messages are gone; the paused one stays held.
    assert await listed(aredis) == {"r", ids[6], "d", "p"}

    clock.set(LATER - 1)
    await drain(upgraded)
    assert 6 not in payloads(redis_client), "fired before its due"
    clock.set(LATER)
    await drain(upgraded)
    count = Counter(payloads(redis_client))
    # Each orphan and the replacement once; the cancelled, the replaced and the paused never.
    assert [count[n] for n in (0, 1, 6, 7, 8, 30, 2, 3, 5)] == [1, 1, 1, 1, 1, 1, 0, 0, 0]
    assert redis_client.hexists(KEYS.parked, at[9]), "the parked envelope was touched"
    assert redis_client.xlen("bad-delayed") == 0
    fired_r = [r for r in history(redis_client, "fired") if r.id == "r" and r.due_ms == DUE]
    assert len(fired_r) == 1
    assert ids[6] not in await listed(aredis)


@pytest.mark.both_fire_paths
async def test_the_run_loop_recovers_orphans_at_start_and_a_pinned_engine_does_not(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """The sweep runs beside the fire loop when it starts (off in the rollback window, where
    nothing was ever moved): an overdue orphan is delivered without any call of its own."""
    clock = ManualClock(T0)
    config = EngineConfig(compact_min_nodes=1, max_sleep_s=0.05)
    engine = DelayEngine(aredis(), KEYS, clock, config=config)
    fill = [dataclasses.replace(env(100, T0), topic="short", id="")] * 9
    with small_stream_nodes(redis_client, 10):
        ids = (await engine.schedule([dataclasses.replace(env(0, DUE), id=""), *fill]))[::10]
    await drain(engine)
    assert await engine.compact()
    drop_index_entry(redis_client, ids[0], DUE)
    clock.set(DUE)

    async def run_for(e: DelayEngine, seconds: float) -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(e.run(stop))
        await asyncio.sleep(seconds)
        stop.set()
        await task

    await run_for(
        DelayEngine(aredis(), KEYS, clock, config=dataclasses.replace(config, recover_orphans=False)), 0.3
    )
    assert payloads(redis_client) == []
    stop = asyncio.Event()
    with caplog.at_level(logging.WARNING, logger="delayed_middleware.engine"):
        task = asyncio.create_task(DelayEngine(aredis(), KEYS, clock, config=config).run(stop))
        try:
            await wait_until(lambda: payloads(redis_client) == [0], "the orphan delivered", within_s=10)
        finally:
            stop.set()
            await task
    [line] = [r.getMessage() for r in caplog.records if "not in its due index" in r.getMessage()]
    assert line.startswith("1 pending message(s) on app-delayed")
    assert payloads(redis_client) == [0]
