"""Hostile review of the @every fire step, the shared batch decision, insert_many and the
cheaper CANCEL: inputs, timings and faults that would lose, double, fire early, block or
leak. Real Redis."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis

from delayed_middleware import scripts
from delayed_middleware.clock import ManualClock
from delayed_middleware.engine import DelayEngine, EngineConfig
from delayed_middleware.entry import decode_entry
from delayed_middleware.envelope import encode_envelope
from tests.middleware.test_engine import KEYS, T0, env, target
from tests.middleware.test_engine_attacks import named_recurring, raw_schedule
from tests.middleware.test_engine_v2 import drain, every, every_env, history

# publishedAtMs (field 8, varint) as a 150-byte varint: 148 continuation bytes of 0x80.
# Lua's decoder multiplied its way to inf, and 0 * inf is NaN: the value read was NaN.
_NAN_PUBLISHED = b"\x40" + b"\x80" * 148 + b"\x01"


def store_raw(client: redis.Redis, raw: bytes, due: int, sid: str, now: int) -> None:
    """SCHEDULE with envelope bytes as written by hand (someone with access to Redis)."""
    client.eval(
        scripts.SCHEDULE, len(KEYS.script_keys), *KEYS.script_keys,
        *(KEYS.buckets, "nowake", now, "", 100, 120_000, 1),
        *(raw, due, sid, 1, "orders", 1, "@every 1s", "-", "-"),
    )  # fmt: skip


async def test_an_over_long_varint_in_a_hand_written_every_envelope_loses_no_other_schedule(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    """An @every envelope written by hand on the delayed topic whose publishedAtMs is a
    150-byte varint: Lua's decoder read it as NaN, the successor became 'nan', and
    insert_many's bucket lookup raised after the batch's appends and index removals. Every
    other @every schedule fired in that batch was left out of the index for ever (its
    message out, its ids ref pointing at a next due time nothing would fire).
    Protobuf refuses varints longer than 10 bytes: so must the decoder."""
    clock = ManualClock(T0)
    engine = DelayEngine(aredis(), KEYS, clock, recurrence=None)
    await engine.schedule([every_env(1_000, sid=f"ok{i}") for i in range(3)])
    hostile = encode_envelope(every_env(1_000, sid="bad")) + _NAN_PUBLISHED
    store_raw(redis_client, hostile, T0 + 1_000, "bad", T0)
    for k in (1, 2):
        clock.set(T0 + k * 1_000)
        await drain(engine)
    fired = sorted(decode_entry(f).metadata["scheduler"] for _, f in target(redis_client))
    assert fired == ["ok0", "ok0", "ok1", "ok1", "ok2", "ok2"]
    assert await engine.pending() == 3
    # The hostile envelope did not fire as garbage: it is parked, listed with why.
    assert redis_client.hlen(KEYS.parked) == 1


@pytest.mark.xfail(
    strict=True,
    reason="two-phase fire: a cancel landing after APPEND wrote the message (before RELEASE) "
    "answers False, but its CANCEL already wrote 'cancelled' and withdrew the envelope, so "
    "RELEASE writes no 'fired': the history says cancelled for a message the subscriber got. "
    "Needs RELEASE to record 'fired' from the claim record when the envelope is gone and the "
    "outcome was ok/dup (or CANCEL to defer its record to the marker's answer).",
)
async def test_a_cancel_after_the_append_leaves_a_fired_record_not_a_cancelled_one(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    """Two-phase fire on one node: the cancel lands between APPEND and RELEASE. It is too
    late and says so (False); the history must then say the message fired."""
    clock = ManualClock(T0)
    canceller = DelayEngine(aredis(), KEYS, clock, config=EngineConfig(two_phase=True))
    await canceller.schedule([env(1, T0 + 100, sid="s1")])
    answers: list[bool] = []

    async def cancel_after_append(at: str) -> None:
        if at == "appended:1":
            answers.append(await canceller.cancel("s1"))

    firer = DelayEngine(aredis(), KEYS, clock, config=EngineConfig(two_phase=True), fault=cancel_after_append)
    clock.set(T0 + 100)
    await drain(firer)
    assert answers == [False]
    assert len(target(redis_client)) == 1  # it went out, once
    events = [r.event for r in history(redis_client) if r.id == "s1"]
    assert events == ["scheduled", "fired"]


@pytest.mark.xfail(
    strict=True,
    reason="refill_pending reads a waiting cron envelope's ref, then its envelope; a replace "
    "landing between the two deletes the old envelope, the read finds it gone, and "
    "_refill_batch calls cancel(key): an unconditional cancel by scheduleId that withdraws "
    "the NEW schedule the replace just stored. Needs a compare-and-set cancel (on the ref "
    "read), e.g. REFILL with an 'end' outcome, instead of cancel().",
)
async def test_a_replace_racing_refill_pending_is_not_cancelled(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cron schedule waits for its refill (its replica stopped between FIRE and REFILL,
    or an outage passed its successor). The publisher replaces it (same scheduleId) while a
    replica's refill_pending sweep is between its two reads."""
    clock = ManualClock(T0)
    engine = DelayEngine(aredis(), KEYS, clock, recurrence=every)
    publisher = DelayEngine(aredis(), KEYS, clock, recurrence=every)
    # Stored with its successor unknown, as a replica that fired it and stopped left it.
    raw_schedule(redis_client, named_recurring("c", T0 + 1_000, T0, 1_000, 1), T0, "-")
    clock.set(T0 + 1_000)
    redis_client.zadd(KEYS.refill, {"c": T0 + 1_000})
    real_pipeline = engine._redis.pipeline
    calls = 0

    def pipeline(transaction: bool = True) -> Any:
        pipe = real_pipeline(transaction=transaction)
        real_execute = pipe.execute

        async def execute(raise_on_error: bool = True) -> Any:
            nonlocal calls
            out = await real_execute(raise_on_error)
            calls += 1
            if calls == 1:  # the refs were read; the replace lands now
                await publisher.schedule([named_recurring("c", T0 + 5_000, T0, 5_000, 2)])
            return out

        monkeypatch.setattr(pipe, "execute", execute)
        return pipe

    monkeypatch.setattr(engine._redis, "pipeline", pipeline)
    await engine.refill_pending()
    monkeypatch.undo()
    assert redis_client.hexists(KEYS.ids, "c")  # the replacement stands
    clock.set(T0 + 5_000)
    await drain(engine)
    assert [decode_entry(f).data for _, f in target(redis_client)] == [b'{"n":2}']
