"""The lifecycle history against a real Redis: a record for every transition, off when asked,
trimmed to its length and aged out by its age."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis

from delayed_middleware.clock import ManualClock, SystemClock
from delayed_middleware.engine import DelayEngine, EngineConfig
from delayed_middleware.entry import decode_entry
from delayed_middleware.instants import format_instant
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
    target,
)


async def test_history_records_every_transition(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    redis_client.hset("a-hash", "f", "v")
    clock = ManualClock(T0)
    engine = DelayEngine(aredis(), KEYS, clock)
    await engine.schedule([env(1, T0 + 100, sid="x")])
    await engine.schedule([env(2, T0 + 200, sid="x")])  # replaces x
    await engine.schedule([env(3, T0 + 100, sid="y"), env(4, T0 + 100, topic="a-hash")])
    await engine.schedule([env(5, T0 + 100, expires_at_ms=T0 + 1)])
    assert await engine.cancel("y")
    assert not await engine.cancel("nope")
    clock.set(T0 + 250)
    await drain(engine)
    h = history(redis_client)
    assert [r.event for r in h] == [
        "scheduled",
        "replaced",
        "scheduled",
        "scheduled",
        "scheduled",
        "scheduled",
        "cancelled",
        *sorted(["fired", "parked", "expired"], key=lambda ev: {"parked": 0, "expired": 1, "fired": 2}[ev]),
    ]
    fired = h[-1]
    assert (fired.event, fired.id, fired.schedule_id, fired.topic, fired.kind) == (
        "fired",
        "x",
        "x",
        "orders",
        "oneshot",
    )
    assert (fired.due_ms, fired.lateness_ms, fired.size_bytes, fired.attempt) == (
        T0 + 200,
        50,
        len(b'{"n":2}'),
        1,
    )
    assert fired.at_ms == T0 + 250
    assert (h[6].id, h[6].reason) == ("y", "Remove")
    assert h[1].due_ms == T0 + 100  # the replaced one's due time


@pytest.mark.both_fire_paths
async def test_history_can_be_turned_off(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    engine = DelayEngine(aredis(), KEYS, ManualClock(T0), config=EngineConfig(history_max_len=0))
    await engine.schedule([env(1, T0)])
    await drain(engine)
    assert payloads(redis_client) == [1]
    assert redis_client.exists(KEYS.history) == 0


@pytest.mark.both_fire_paths
async def test_history_is_trimmed_to_its_length(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    engine = DelayEngine(aredis(), KEYS, ManualClock(T0), config=EngineConfig(history_max_len=100))
    for i in range(20):
        await engine.schedule([env(i * 100 + j, T0) for j in range(100)])
    # Approximate trimming (whole stream nodes): bounded, never far above the setting.
    assert redis_client.xlen(KEYS.history) <= 300


@pytest.mark.both_fire_paths
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


@pytest.mark.both_fire_paths
async def test_the_history_stays_trimmed_to_its_length_while_batches_fire(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    """A fire batch writes a `fired` record per message and trims the history once, at its end:
    after each batch the history is as short as trimming each record would have left it."""
    with small_stream_nodes(redis_client, 10):
        config = EngineConfig(history_max_len=100, batch_size=300)
        engine = DelayEngine(aredis(), KEYS, ManualClock(T0), config=config)
        await engine.schedule([env(n, T0) for n in range(1000)])
        batches = 0
        while (await engine.fire_due())[0]:
            batches += 1
            # Approximate trimming frees whole nodes (10 records): never a node above the setting.
            assert 100 <= redis_client.xlen(KEYS.history) < 110
    assert batches >= 3
    assert sorted(payloads(redis_client)) == list(range(1000))
    # The newest records are the last batch's, and the history is still linked and readable.
    assert history(redis_client)[-1].event == "fired"


def test_numbers_in_records_read_as_redis_would_have_printed_them(redis_client: redis.Redis) -> None:
    """history.lua prints a record's numbers itself (once per call): each is the text Redis makes
    of the same Lua number, integral or not, small or past what '%d' could print alike."""
    libs = engine_libraries("index.lua", "decode.lua", "history.lua", "common.lua")
    body = """
local out = {}
for i, v in ipairs(ARGV) do
  local n = tonumber(v)
  redis.call('SET', KEYS[1], n)
  local theirs = redis.call('GET', KEYS[1])
  redis.call('SET', KEYS[1], hist_text(n))
  local mine = redis.call('GET', KEYS[1])
  redis.call('SET', KEYS[1], hist_text(n))
  out[#out + 1] = {mine, theirs, redis.call('GET', KEYS[1])}
end
return out
"""
    values = ["0", "1", "-5", "90", "1800000001000", "99999999999999", "1e14", "999999999999999", "1e15", "-1e15",
              "9007199254740993", "1.5", "-0.25", "1e300"]  # fmt: skip
    got = redis_client.eval(libs + "\n" + body, 1, "{test}:n", *values)
    assert [(mine, theirs) for mine, theirs, _ in got] == [(theirs, theirs) for _, theirs, _ in got]
    assert [again for _, _, again in got] == [mine for mine, _, _ in got]  # the kept text, the same


@pytest.mark.both_fire_paths
async def test_the_history_stays_at_its_length_when_a_batch_outgrows_one_trims_reach(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    """One approximate trim evicts at most 100 nodes' worth of records (Redis's default LIMIT): a
    batch that writes more records than that (here nodes of 2, a limit of 200, batches of 300)
    must still leave the history at its length, not one batch's excess longer after each."""
    with small_stream_nodes(redis_client, 2):
        config = EngineConfig(history_max_len=100, batch_size=300)
        engine = DelayEngine(aredis(), KEYS, ManualClock(T0), config=config)
        await engine.schedule([env(n, T0) for n in range(1500)])
        while (await engine.fire_due())[0]:
            assert redis_client.xlen(KEYS.history) <= 102
    assert sorted(payloads(redis_client)) == list(range(1500))


@pytest.mark.both_fire_paths
async def test_a_lowered_history_length_is_reached_by_the_next_batch(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    """historyMaxLen lowered while the history is full: the next batch trims it to the new length,
    as far as each of its records' own trims would reach (here 20 records, each up to 200)."""
    with small_stream_nodes(redis_client, 2):
        full = DelayEngine(aredis(), KEYS, ManualClock(T0), config=EngineConfig(history_max_len=100_000))
        await full.schedule([env(n, T0 if n < 1500 else T0 + 1000) for n in range(1520)])
        await drain(full)
        assert redis_client.xlen(KEYS.history) >= 3000  # a `scheduled` and a `fired` record each
        config = EngineConfig(history_max_len=100)
        lowered = DelayEngine(aredis(), KEYS, ManualClock(T0 + 1000), config=config)
        assert (await lowered.fire_due())[0] == 20
        assert redis_client.xlen(KEYS.history) <= 102
    assert sorted(payloads(redis_client)) == list(range(1520))


async def _fire_failing_at_the_first_record(engine: DelayEngine, redis_client: redis.Redis) -> None:
    """Three messages due now, fired by a step that raises at its first history record (the key is
    not a stream: Redis keeps what the script wrote before the error); the key is then repaired."""
    await engine.schedule([env(n, T0) for n in range(3)])
    redis_client.delete(KEYS.history)
    redis_client.set(KEYS.history, "not a stream")
    with pytest.raises(Exception, match="WRONGTYPE"):
        await engine.fire_due()
    redis_client.delete(KEYS.history)


@pytest.mark.two_phase_path
async def test_a_release_that_fails_midway_leaves_nothing_it_released_to_fire_again(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    """RELEASE raises after it released a message (here: the history key is not a stream, so the
    first record fails; Redis keeps what the script wrote before it). The released message's
    envelope goes with it: no orphan sweep finds it later, once its fire marker has expired,
    and delivers it a second time."""
    clock = ManualClock(T0)
    engine = DelayEngine(aredis(), KEYS, clock, config=EngineConfig(fire_marker_ttl_ms=1_000))
    await _fire_failing_at_the_first_record(engine, redis_client)
    assert sorted(payloads(redis_client)) == [0, 1, 2]  # appended before RELEASE
    clock.set(T0 + 60_000)  # past every lease: the two not released are, by the next step
    await drain(engine)
    await asyncio.sleep(1.1)  # then the fire markers expire
    await engine.recover_orphans()
    await drain(engine)
    assert sorted(payloads(redis_client)) == [0, 1, 2]
    assert history(redis_client, "recovered") == []



async def test_a_fire_step_that_fails_midway_delivers_nothing_twice(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    """FIRE raises after it appended a message (here: the history key is not a stream, so the
    first record fails; Redis keeps what the script wrote before it): the next steps and the
    orphan sweep do not deliver that message again."""
    clock = ManualClock(T0)
    engine = DelayEngine(aredis(), KEYS, clock)
    await _fire_failing_at_the_first_record(engine, redis_client)
    await engine.recover_orphans()
    await drain(engine)
    assert sorted(payloads(redis_client)) == [0, 1, 2]


@pytest.mark.both_fire_paths
async def test_a_claim_or_fire_that_fails_behind_taken_messages_doubles_and_leaks_nothing(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    """The history key is not a stream, so a step raises at the first record it writes: here an
    expired message due behind four others of the batch and a recurring schedule (Redis keeps
    what the script wrote before). FIRE has delivered the first by then and finishes it (a
    recurring one is advanced and re-indexed); CLAIM has put them in flight (still indexed,
    no APPEND follows) and raises at every step, lease ends included. Once the key is repaired
    each message goes out once, each occurrence of the schedule at most once, the expired one
    never, and nothing stays in flight, claimed or stored but the schedule, which goes on."""
    clock = ManualClock(T0)
    engine = DelayEngine(aredis(), KEYS, clock, recurrence=every, config=EngineConfig(lease_ms=1_000))
    await engine.schedule([env(n, T0 + 1_000 + n) for n in range(4)])
    await engine.schedule([recurring(7, 1_000, sid="rec")])
    await engine.schedule([env(9, T0 + 1_500, sid="late", expires_at_ms=T0 + 1_200)])
    redis_client.delete(KEYS.history)
    redis_client.set(KEYS.history, "not a stream")

    def delivered() -> tuple[list[int], list[str]]:
        got = [decode_entry(f) for _, f in target(redis_client)]
        occurrences = [e.metadata["scheduleOccurrence"] for e in got if e.metadata.get("scheduler") == "rec"]
        return sorted(json.loads(e.data)["n"] for e in got if e.metadata.get("scheduler") != "rec"), occurrences

    for step in range(3):
        clock.set(T0 + 2_000 + step * 2_000)
        with pytest.raises(redis.exceptions.ResponseError, match="WRONGTYPE"):
            await engine.fire_due()
        once, occurrences = delivered()
        assert sorted(set(once)) == once
        assert sorted(set(occurrences)) == sorted(occurrences)
    redis_client.delete(KEYS.history)
    clock.set(T0 + 8_000)
    await drain(engine)
    once, occurrences = delivered()
    assert once == [0, 1, 2, 3]
    # Its first occurrence, overdue, once; the ones missed meanwhile skipped (catch-up `one`).
    assert occurrences == [format_instant(T0 + 1_000)]
    assert [r.id for r in history(redis_client, "expired")] == ["late"]
    assert await engine.pending() == 1  # the schedule, at its next occurrence
    assert redis_client.exists(KEYS.inflight, KEYS.claims) == 0
    assert redis_client.xlen(KEYS.stream) == 1
    clock.set(T0 + 9_000)
    await drain(engine)
    assert delivered()[1] == [format_instant(T0 + 1_000), format_instant(T0 + 9_000)]
