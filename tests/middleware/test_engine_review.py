"""Hostile review of the @every fire step, the shared batch decision, insert_many and the
cheaper CANCEL: inputs, timings and faults that would lose, double, fire early, block or
leak. Real Redis."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from typing import Any, cast

import pytest
import redis
import redis.asyncio as aioredis

from delayed_middleware import scripts
from delayed_middleware.clock import ManualClock
from delayed_middleware.engine import DelayEngine, EngineConfig
from delayed_middleware.entry import decode_entry
from delayed_middleware.envelope import encode_envelope
from delayed_middleware.instants import format_instant
from tests.middleware.test_engine import KEYS, T0, env, target
from tests.middleware.test_engine_attacks import named_recurring, raw_schedule
from tests.middleware.test_engine_v2 import drain, every, every_env, history, index_buckets, recurring

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


def _raw_topic(e_bytes: bytes, topic: bytes) -> bytes:
    """The envelope with its topic (field 1) set to `topic` (the last occurrence wins)."""
    return e_bytes + b"\x0a" + bytes([len(topic)]) + topic


async def test_a_topic_that_is_not_utf8_neither_blocks_the_two_phase_fire_nor_breaks_cancel(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    """A hand-written envelope whose topic is not UTF-8 (Redis keys are bytes; daprd's are
    always text). CLAIM claimed it and the replica's reply parsing raised after CLAIM had
    committed: the claim stayed in flight, was taken over first when its lease ended, and
    raised again, for ever, while everything claimed with it waited: that shard's firing
    stopped. It must park; a cancel of such an envelope must answer, not raise."""
    clock = ManualClock(T0)
    engine = DelayEngine(aredis(), KEYS, clock, config=EngineConfig(two_phase=True, lease_ms=1_000))
    poison = _raw_topic(encode_envelope(env(0, T0 + 100)), b"\xff\xfeorders")
    redis_client.eval(
        scripts.SCHEDULE, len(KEYS.script_keys), *KEYS.script_keys,
        *(KEYS.buckets, "nowake", T0, "", 100, 120_000, 1),
        *(poison, T0 + 100, "", 0, "orders", 1, "", "-", "-"),
    )  # fmt: skip
    await engine.schedule([env(n, T0 + 100, sid=f"g{n}") for n in range(1, 6)])
    for step in range(1, 5):
        clock.set(T0 + 100 + step * 2_000)  # past each lease
        try:
            await drain(engine)
        except UnicodeDecodeError:
            continue
    assert sorted(decode_entry(f).metadata["scheduler"] for _, f in target(redis_client)) == [
        f"g{n}" for n in range(1, 6)
    ]
    assert redis_client.hlen(KEYS.parked) == 1
    assert redis_client.zcard(KEYS.inflight) == 0
    # Cancelling it (by its stream id): found, its topic not text, so none is named.
    [parked_id] = cast("list[bytes]", redis_client.hkeys(KEYS.parked))
    assert await engine.cancel_many([parked_id.decode()]) == [(True, "")]


def _hostile(rng: random.Random, base: bytes) -> bytes:
    """One malformed or odd DelayedMessage: truncated, flipped, or with fields appended
    that repeat known ones with the wrong wire type, over-long varints, bad lengths."""
    roll = rng.randrange(6)
    if roll == 0:
        return base[: rng.randrange(1, len(base))]
    if roll == 1:
        b = bytearray(base)
        for _ in range(rng.randrange(1, 4)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        return bytes(b)
    fno = rng.choice([1, 2, 3, 4, 5, 6, 7, 8, 10, 11, 12, 13, 14, 15, 16, 17, 18, 99])
    wt = rng.choice([0, 1, 2, 3, 5, 6, 7])
    tag = bytes([(fno << 3 | wt) & 0x7F | 0x80, (fno << 3 | wt) >> 7]) if fno > 15 else bytes([fno << 3 | wt])
    if roll == 2:
        tail = b"\xff" * rng.randrange(9, 40) + b"\x01"  # over-long varint
    elif roll == 3:
        tail = bytes([rng.randrange(128, 256), 0x7F]) + b"x" * rng.randrange(0, 5)  # length past the end
    elif roll == 4:
        tail = b"\x00" * 8
    else:
        tail = bytes([3]) + b"abc"
    return base + tag + tail


async def test_hostile_envelopes_never_make_cancel_or_fire_raise(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    """600 malformed envelopes written by hand on the delayed topic, among good ones: CANCEL
    (the lean peek decoder, by scheduleId and by stream id, in bulks) and FIRE never raise
    (Redis keeps a script's writes before an error), everything cancelled is gone, the
    rest fires, parks or counts as undecodable, and the index ends empty."""
    rng = random.Random(7)
    clock = ManualClock(T0)
    engine = DelayEngine(aredis(), KEYS, clock, recurrence=every)
    bases = [
        encode_envelope(env(1, T0 + 1_000, sid="x")),
        encode_envelope(env(2, T0 + 1_000, sid="y", expires_at_ms=T0 + 10)),
        encode_envelope(every_env(1_000, sid="z")),
    ]
    ids = []
    for i in range(600):
        raw = _hostile(rng, rng.choice(bases))
        sid = f"h{i}" if i % 2 else ""
        out = redis_client.eval(
            scripts.SCHEDULE, len(KEYS.script_keys), *KEYS.script_keys,
            *(KEYS.buckets, "nowake", T0, "", 100, 120_000, 1),
            *(raw, T0 + 1_000, sid, i % 3 % 2, "orders", 1, "@every 1s", T0 + 2_000, "-"),
        )  # fmt: skip
        ids.append(out[0].decode())
    await engine.schedule([env(n, T0 + 1_000, sid=f"good{n}") for n in range(50)])
    # Stream ids (cancel_stream_id, the full decoder) and scheduleIds (the lean peek).
    victims = ids[::2] + ids[1::4]
    stream_ids = ids[::2] + [
        cast("bytes", redis_client.hget(KEYS.ids, k)).decode().split()[0] for k in ids[1::4]
    ]
    assert all(found for found, _ in await engine.cancel_many(victims))
    assert all(not redis_client.xrange(KEYS.stream, i, i) for i in stream_ids)
    clock.set(T0 + 1_000)
    await drain(engine)
    assert await engine.cancel_many(victims) == [(False, "")] * len(victims)
    schedulers = [decode_entry(f).metadata.get("scheduler", "") for _, f in target(redis_client)]
    assert sorted(x for x in schedulers if x.startswith("good")) == sorted(f"good{n}" for n in range(50))
    fired = {r.id for r in history(redis_client) if r.event == "fired"}
    assert not fired & set(victims)  # nothing cancelled went out
    # Nothing left due in the index: each envelope fired, parked, expired or was dropped.
    left = [m for _, members in index_buckets(redis_client) for m, due in members if due <= T0 + 1_000]
    assert left == []


def _lua_insert_many(client: redis.Redis, items: list[tuple[str, int]]) -> None:
    body = (
        "local items = {} for i = 2, #ARGV, 2 do items[#items + 1] = {ARGV[i], ARGV[i + 1]} end "
        "insert_many(items) return 1"
    )
    flat = [v for it in items for v in it]
    client.eval(scripts.load("index.lua") + "\n" + body, len(KEYS.script_keys), *KEYS.script_keys,
                KEYS.buckets, *flat)  # fmt: skip


def _lua_insert(client: redis.Redis, items: list[tuple[str, int]]) -> None:
    body = "for i = 1, #ARGV - 1, 2 do insert(ARGV[i + 1], ARGV[i + 2]) end return 1"
    flat = [v for it in items for v in it]
    client.eval(scripts.load("index.lua") + "\n" + body, len(KEYS.script_keys), *KEYS.script_keys,
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


async def test_a_cron_envelope_whose_expression_is_not_utf8_does_not_stop_the_batchs_refills(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    """FIRE hands back (key, ref, expression, published) for each cron envelope it fired;
    _advance decoded them outside its per-envelope guard, so one hand-written expression
    that is not UTF-8 raised out of fire_due after FIRE had committed: the successors of
    every other cron schedule of the batch were not stored, and each waited for the sweep."""
    clock = ManualClock(T0)
    engine = DelayEngine(aredis(), KEYS, clock, recurrence=every)
    await engine.schedule([named_recurring(f"c{i}", T0 + 1_000, T0, 1_000, i) for i in range(5)])
    bad = encode_envelope(named_recurring("bad", T0 + 1_000, T0, 1_000, 9)) + b"\x62\x02\xff\xfe"
    redis_client.eval(
        scripts.SCHEDULE, len(KEYS.script_keys), *KEYS.script_keys,
        *(KEYS.buckets, "nowake", T0, "", 100, 120_000, 1),
        *(bad, T0 + 1_000, "bad", 1, "orders", 1, "@test 1000", T0 + 2_000, "-"),
    )  # fmt: skip
    clock.set(T0 + 1_000)
    await engine.fire_due()
    assert len(target(redis_client)) == 6
    waiting = {m.decode() for m in redis_client.zrange(KEYS.refill, 0, -1)}  # type: ignore[union-attr]
    assert waiting == {"bad"}


@pytest.mark.parametrize(
    ("every_ms", "published"),
    [(-1_000, T0), (2**63 - 1, T0), (1, 0), (1_000, 2**63 - 1), (1_000, -(2**62)), (7, T0 - 10**12)],
)
async def test_hand_written_every_intervals_and_starts_neither_raise_nor_disturb_others(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis, every_ms: int, published: int
) -> None:
    """everyMs and publishedAtMs as anyone with Redis access could write them (negative,
    2^63 - 1, 1 ms from the epoch, a start far away): the fire step computes a successor
    on the grid or ends the schedule ('purge'), never raises, never fires it early, and a
    real schedule beside it keeps its grid."""
    clock = ManualClock(T0)
    engine = DelayEngine(aredis(), KEYS, clock, recurrence=None)
    await engine.schedule([every_env(1_000, sid="ok")])
    hostile = every_env(1_000, sid="odd", published=T0)
    raw = encode_envelope(hostile)
    # Fields 8 and 18 again, as int64 varints (the last occurrence wins).
    for field, value in ((8, published), (18, every_ms)):
        v = value & (2**64 - 1)
        out = bytearray([field << 3 if field < 16 else (field << 3) & 0x7F | 0x80])
        if field >= 16:
            out.append((field << 3) >> 7)
        while True:
            byte, v = v & 0x7F, v >> 7
            out.append(byte | (0x80 if v else 0))
            if not v:
                break
        raw += bytes(out)
    store_raw(redis_client, raw, T0 + 1_000, "odd", T0)
    seen = 0
    for k in (1, 2, 3):
        clock.set(T0 + k * 1_000)
        await drain(engine)
        entries = [decode_entry(f) for _, f in target(redis_client)]
        assert [e.metadata["scheduler"] for e in entries].count("ok") == k
        for e in entries[seen:]:  # this round's: each names a next time after now, or purge
            nxt = e.metadata["scheduleNext"]
            assert nxt == "purge" or nxt > format_instant(T0 + k * 1_000)
        seen = len(entries)
    assert await engine.pending() in (1, 2)


async def test_an_ids_entry_without_a_due_time_does_not_abort_a_bulk_cancel(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    """An ids-hash value written by hand as just a stream id (no due time): cancel_ref cached
    its bucket under a nil key, which raises in Lua, after the history records of the
    bulk's earlier ids were written and before any queued removal: the bulk failed, the
    history said 'cancelled' for messages still pending, and they fired."""
    clock = ManualClock(T0)
    engine = DelayEngine(aredis(), KEYS, clock)
    await engine.schedule([env(1, T0 + 1_000, sid="a")])
    redis_client.hset(KEYS.ids, "weird", "1-1")
    assert await engine.cancel_many(["a", "weird"]) == [(True, "orders"), (True, "")]
    assert await engine.pending() == 0
    assert not redis_client.exists(KEYS.ids)
    clock.set(T0 + 1_000)
    await drain(engine)
    assert target(redis_client) == []


async def test_ids_entries_written_by_hand_break_neither_replace_nor_fire(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    """As above, for SCHEDULE (a replace of such an id located a nil due and wrote a nil
    history field, raising after its call token and earlier envelopes were stored: a
    retried publish then doubled them) and FIRE (a cron ref naming its envelope but
    without due or next concatenated a nil, raising after the batch's appends: every
    retry appended them again)."""
    clock = ManualClock(T0)
    engine = DelayEngine(aredis(), KEYS, clock, recurrence=every)
    redis_client.hset(KEYS.ids, "weird", "1-1")
    await engine.schedule([env(1, T0 + 1_000), env(2, T0 + 1_000, sid="weird")])
    assert await engine.pending() == 2
    [cron_id] = await engine.schedule([named_recurring("", T0 + 1_000, T0, 1_000, 3)])
    redis_client.hset(KEYS.ids, cron_id, cron_id)  # its ref: the stream id alone
    await engine.schedule([env(4, T0 + 1_000)])
    clock.set(T0 + 1_000)
    await drain(engine)
    await drain(engine)
    got = sorted(decode_entry(f).data for _, f in target(redis_client))
    assert got == [b'{"n":1}', b'{"n":2}', b'{"n":3}', b'{"n":4}']


async def test_a_schedule_source_that_is_not_a_stream_does_not_block_the_two_phase_fire(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    """scheduleSource is publisher input: a topic name whose key holds a hash (another
    app's, or recreated as one). FIRE delivers nothing for such a source and goes on; the
    two-phase path read the source with XREVRANGE, which raised WRONGTYPE out of the fire
    step after CLAIM: the claim was taken over at each lease end (first, with the batch
    claimed beside it) and raised again, so nothing on that shard fired any more."""
    redis_client.hset("a-hash", "f", "v")
    clock = ManualClock(T0)
    engine = DelayEngine(
        aredis(), KEYS, clock, recurrence=every, config=EngineConfig(two_phase=True, lease_ms=1_000)
    )
    await engine.schedule([recurring(0, 1_000, sid="sampler", schedule_source="a-hash")])
    await engine.schedule([env(n, T0 + 1_000, sid=f"g{n}") for n in range(1, 6)])
    for step in range(4):
        clock.set(T0 + 1_000 + step * 2_000)  # claimed together, then past each lease
        try:
            await drain(engine)
        except redis.exceptions.ResponseError:
            continue
    got = [decode_entry(f).metadata["scheduler"] for _, f in target(redis_client)]
    assert sorted(g for g in got if g.startswith("g")) == [f"g{n}" for n in range(1, 6)]
    assert redis_client.zcard(KEYS.inflight) == 0


@pytest.mark.parametrize(
    "fields",
    [
        {b"\xff\xfe": b"x", b"data": b"21C"},  # a field name that is not UTF-8
        {b"data": b"21C", b"metadata": b"[" * 100_000 + b"]" * 100_000},  # JSON nested past recursion
    ],
)
async def test_a_source_entry_anyone_wrote_does_not_block_the_two_phase_fire(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis, fields: dict[bytes, bytes]
) -> None:
    """The source topic's latest entry is anyone's: FIRE reads it in Lua and keeps what it
    can. The two-phase path decoded its field names as UTF-8 and its metadata with
    json.loads, whose RecursionError is no ValueError: either raised after CLAIM, for
    ever (see above). The sample goes out with its data, as FIRE sends it."""
    redis_client.xadd("sensor", fields)  # type: ignore[arg-type]
    clock = ManualClock(T0)
    engine = DelayEngine(
        aredis(), KEYS, clock, recurrence=every, config=EngineConfig(two_phase=True, lease_ms=1_000)
    )
    await engine.schedule([recurring(0, 1_000, sid="sampler", schedule_source="sensor")])
    await engine.schedule([env(n, T0 + 1_000, sid=f"g{n}") for n in range(1, 4)])
    for step in range(3):
        clock.set(T0 + 1_000 + step * 2_000)
        try:
            await drain(engine)
        except (UnicodeDecodeError, RecursionError):
            continue
    rows = [decode_entry(f) for _, f in target(redis_client)]
    assert sorted(e.metadata.get("scheduler", "") for e in rows if e.data != b"21C") == ["g1", "g2", "g3"]
    assert any(e.data == b"21C" for e in rows)
    assert redis_client.zcard(KEYS.inflight) == 0


@pytest.mark.parametrize("two_phase", [False, True])
async def test_old_format_every_envelopes_keep_their_grid_beside_new_ones(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis, two_phase: bool
) -> None:
    """Envelopes stored before everyMs existed (an '@every' expression, no interval) go the
    cron way (successor from the replica's recurrence, REFILLed by the fire step's own
    reply); new ones advance in Lua. Side by side, through an outage, both stay on
    published + k * 1 s, fire once after the outage, and name the same next time."""
    from delayed_middleware.schedules import EnvelopeRecurrence

    clock = ManualClock(T0)
    config = EngineConfig(two_phase=two_phase)
    engine = DelayEngine(aredis(), KEYS, clock, recurrence=EnvelopeRecurrence(), config=config)
    old = dataclasses.replace(every_env(1_000, sid="old"), every_ms=0, schedule="@every 1s")
    new = dataclasses.replace(every_env(1_000, sid="new"), schedule="@every 1s")
    await engine.schedule([old, new])
    for now in (T0 + 1_000, T0 + 2_300, T0 + 9_500, T0 + 10_000):
        clock.set(now)
        await drain(engine)
    rows = [decode_entry(f).metadata for _, f in target(redis_client)]
    by = {s: [m["scheduleNext"] for m in rows if m["scheduler"] == s] for s in ("old", "new")}
    expected = [format_instant(T0 + k) for k in (2_000, 3_000, 10_000, 11_000)]
    assert by == {"old": expected, "new": expected}
    assert redis_client.zcard(KEYS.refill) == 0


async def test_a_replace_or_cancel_between_fire_and_its_refill_wins(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """FIRE hands back the cron envelopes it advanced; before the replica's REFILL lands,
    one schedule is replaced and another cancelled. The compare-and-set leaves both alone:
    the replacement keeps its own next time, the cancelled one stays gone, nothing waits
    in the refill set, and a third is refilled as usual."""
    clock = ManualClock(T0)
    engine = DelayEngine(aredis(), KEYS, clock, recurrence=every)
    await engine.schedule([named_recurring(s, T0 + 1_000, T0, 1_000, n) for n, s in enumerate("abc")])
    real_advance = engine._advance

    async def racing_advance(quads: Any) -> None:
        if quads:
            await engine.schedule([named_recurring("a", T0 + 5_000, T0, 5_000, 9)])
            assert await engine.cancel("b")
        await real_advance(quads)

    monkeypatch.setattr(engine, "_advance", racing_advance)
    clock.set(T0 + 1_000)
    await drain(engine)
    monkeypatch.undo()
    assert redis_client.zcard(KEYS.refill) == 0
    assert not redis_client.hexists(KEYS.ids, "b")
    for now in (T0 + 2_000, T0 + 3_000, T0 + 5_000):
        clock.set(now)
        await drain(engine)
    got = [(decode_entry(f).metadata["scheduler"], decode_entry(f).data) for _, f in target(redis_client)]
    assert [d for s, d in got if s == "a"] == [b'{"n":0}', b'{"n":9}']
    assert [d for s, d in got if s == "b"] == [b'{"n":1}']
    assert [d for s, d in got if s == "c"] == [b'{"n":2}'] * 4
