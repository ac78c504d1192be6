"""The engine attacked with what anyone with access to Redis can write: malformed or hostile
envelopes, hand-written ids entries, topics and cron expressions that are not UTF-8, sources that
are not streams or hold undecodable entries. None may lose, double or block another message, or
make a script stop half way (Redis does not roll a script back). Real Redis."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable
from typing import Any, cast

import pytest
import redis
import redis.asyncio as aioredis

from delayed_middleware import lua_scripts
from delayed_middleware.clock import ManualClock
from delayed_middleware.engine import DelayEngine, EngineConfig
from delayed_middleware.entry import decode_entry
from delayed_middleware.envelope import encode_envelope
from delayed_middleware.instants import format_instant
from tests.middleware.engine.helpers import (
    KEYS,
    T0,
    drain,
    env,
    every,
    every_env,
    history,
    index_buckets,
    named_recurring,
    payloads,
    recurring,
    target,
)


@pytest.mark.both_fire_paths
async def test_sampled_metadata_json_can_not_break_the_fire_batch(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    """A scheduleSource topic is written by anyone: its latest entry's metadata is JSON that
    Lua's cjson decodes (1e400 -> inf) but cannot encode again. That raised in FIRE after
    the batch's earlier messages were appended: they stayed in the index and were appended
    again by every retry, for ever."""
    clock = ManualClock(T0)
    engine = DelayEngine(aredis(), KEYS, clock, recurrence=every)
    redis_client.xadd("sensor", {"data": b"21C", "metadata": b'{"unit":"C","x":1e400}'})
    await engine.schedule([env(1, T0 + 1_000)])
    await engine.schedule([recurring(2, 1_000, schedule_source="sensor")])
    await engine.schedule([env(3, T0 + 1_000)])
    clock.set(T0 + 1_000)
    for _ in range(3):  # the engine loop retries a failed batch
        with contextlib.suppress(redis.exceptions.ResponseError):
            await drain(engine)
    rows = [decode_entry(f) for _, f in target(redis_client)]
    assert sorted(e.data for e in rows) == [b"21C", b'{"n":1}', b'{"n":3}']
    [sampled] = [e for e in rows if e.data == b"21C"]
    assert sampled.metadata["scheduler"]  # delivered, with what could be kept
    assert await engine.pending() == 1  # the recurring one, at its next time


_NAN_PUBLISHED = b"\x40" + b"\x80" * 148 + b"\x01"


def store_raw(client: redis.Redis, raw: bytes, due: int, sid: str, now: int) -> None:
    """SCHEDULE with envelope bytes as written by hand (someone with access to Redis)."""
    client.eval(
        lua_scripts.SCHEDULE, len(KEYS.script_keys), *KEYS.script_keys,
        *(KEYS.buckets, "nowake", now, 100, 120_000, 1, "", 1),
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
        lua_scripts.SCHEDULE, len(KEYS.script_keys), *KEYS.script_keys,
        *(KEYS.buckets, "nowake", T0, 100, 120_000, 1, "", 1),
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
            lua_scripts.SCHEDULE, len(KEYS.script_keys), *KEYS.script_keys,
            *(KEYS.buckets, "nowake", T0, 100, 120_000, 1, "", 1),
            *(raw, T0 + 1_000, sid, i % 3 % 2, "orders", 1, "@every 1s", T0 + 2_000, "-"),
        )  # fmt: skip
        ids.append(out[2].decode())  # (status, count, id)
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


async def test_a_cron_envelope_whose_expression_is_not_utf8_does_not_stop_the_batchs_refills(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    """FIRE hands back (key, ref, expression, published) for each cron envelope it fired;
    the refill step decoded them outside its per-envelope guard, so one hand-written expression
    that is not UTF-8 raised out of fire_due after FIRE had committed: the successors of
    every other cron schedule of the batch were not stored, and each waited for the sweep."""
    clock = ManualClock(T0)
    engine = DelayEngine(aredis(), KEYS, clock, recurrence=every)
    await engine.schedule([named_recurring(f"c{i}", T0 + 1_000, T0, 1_000, i) for i in range(5)])
    bad = encode_envelope(named_recurring("bad", T0 + 1_000, T0, 1_000, 9)) + b"\x62\x02\xff\xfe"
    redis_client.eval(
        lua_scripts.SCHEDULE, len(KEYS.script_keys), *KEYS.script_keys,
        *(KEYS.buckets, "nowake", T0, 100, 120_000, 1, "", 1),
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


@pytest.mark.both_fire_paths
@pytest.mark.parametrize(
    "ref",
    ["{due} nan - i", "{due} inf - i", "{due} 1e999 - i", "nan - - i", "-inf - - i", "{due} {nxt} - i nan -"],
    ids=["next-nan", "next-inf", "next-1e999", "due-nan-waiting", "due-minus-inf-waiting", "nominal-nan"],
)
async def test_a_cron_ref_whose_times_are_no_instants_neither_blocks_the_shard_nor_stops_the_schedule(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis, ref: str
) -> None:
    """An ids ref written by hand whose due or next time Lua's tonumber reads as NaN or infinity:
    Redis refuses it as a score (ZADD) after the batch's appends (Redis keeps them). A next of
    them raised in advance(): the occurrence went out, its schedule left the index for good
    (no `fired` record, nothing to fire it again); `inf` was re-indexed at infinity and every
    step raised after its script. A due of them raised before any append, at the same
    candidate in every step: nothing on the shard fired any more. Such a time is unknown: the
    occurrence waits for REFILL, which gives the schedule its next time, and it goes on. A NaN
    nominal time was stamped as scheduleOccurrence `-9223372036854775808-...`."""
    clock = ManualClock(T0)
    engine = DelayEngine(aredis(), KEYS, clock, recurrence=every, config=EngineConfig(lease_ms=1_000))
    await engine.schedule([named_recurring("cron", T0 + 1_000, T0, 1_000, 0)])
    await engine.schedule([env(n, T0 + 1_000) for n in range(1, 4)])
    stream_id = cast("bytes", redis_client.hget(KEYS.ids, "cron")).decode().split()[0]
    redis_client.hset(KEYS.ids, "cron", f"{stream_id} {ref.format(due=T0 + 1_000, nxt=T0 + 2_000)}")
    for step in range(4):
        clock.set(T0 + 1_000 + step * 1_000)
        await drain(engine)
    got = [decode_entry(f) for _, f in target(redis_client)]
    assert sorted(e.data for e in got)[-3:] == [b'{"n":1}', b'{"n":2}', b'{"n":3}']
    assert len(got) - 3 >= 3  # the schedule fires on, once per step at most
    assert len(history(redis_client, "fired")) == len(got)
    assert await engine.pending() == 1
    assert cast("bytes", redis_client.hget(KEYS.ids, "cron")).split()[1] == str(T0 + 5_000).encode()
    stamped = [e.metadata["scheduleOccurrence"] for e in got if "scheduleOccurrence" in e.metadata]
    assert all(o.startswith("2027-") for o in stamped), stamped


@pytest.mark.both_fire_paths
@pytest.mark.parametrize(
    "written",
    [
        "member:garbage", "member:99999999999999999999-0", "member:1-x", "move:garbage", "move:1-1-1",
        "move:18446744073709551616-0", f"member:{'0' * 126}1-0",
    ],
)
async def test_an_index_member_or_move_naming_no_stream_id_does_not_block_the_shard(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis, written: str
) -> None:
    """An index member, or a moved-hash entry, written by hand that is no stream id (XRANGE
    refuses it: `Invalid stream ID`). FIRE and CLAIM read it before writing anything for it and
    raised, at the same candidate in every step: nothing on the shard fired any more. Such a
    member names no envelope (it leaves the index with a `lost` record); such a move is
    forgotten and the envelope read where it was stored, and fired once."""
    clock = ManualClock(T0)
    engine = DelayEngine(aredis(), KEYS, clock, config=EngineConfig(lease_ms=1_000))
    ids = await engine.schedule([env(n, T0 + 1_000) for n in range(4)])
    kind, value = written.split(":", 1)
    if kind == "member":
        bucket = cast("bytes", redis_client.zrange(KEYS.due, 0, 0)[0]).decode()
        redis_client.zadd(f"{KEYS.buckets}{bucket}", {value: T0})
    else:
        redis_client.hset(KEYS.moved, ids[0], value)
    for step in range(3):
        clock.set(T0 + 1_000 + step * 2_000)
        await drain(engine)
    assert sorted(decode_entry(f).data for _, f in target(redis_client)) == [
        f'{{"n":{n}}}'.encode() for n in range(4)
    ]
    assert index_buckets(redis_client) == []
    assert redis_client.exists(KEYS.moved, KEYS.inflight, KEYS.claims) == 0
    assert target(redis_client, KEYS.stream) == []
    assert [r.id for r in history(redis_client, "lost")] == ([value] if kind == "member" else [])


class _Crash(Exception):
    """Stands for the replica dying at a fault point."""


@pytest.mark.two_phase_path
@pytest.mark.parametrize("torn", ["", "x", "1 2", "1 2 3", "{due} inf - {k}", "{due} -inf - {k}", "{due} nan - {k}"])
async def test_a_torn_claim_record_parks_its_envelope_and_the_shard_fires_on(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis, torn: str
) -> None:
    """Redis Cluster's path: a replica dies after CLAIM, and a claim record is then torn (written
    by hand: no due time, or no scheduler). The takeover read it with nil fields, which reached a
    command: every CLAIM raised before claiming anything due, and nothing on the shard fired any
    more. A next time of `inf` or `-inf` went into the index, and each step failed reading it
    (`cannot convert float infinity to integer`): nothing on the shard fired any more either. Which occurrence was claimed is unknown and nothing was appended: the envelope parks
    (kept, listed, recorded), its lease ends once, and the rest goes out once each."""
    armed = [True]

    async def replica_dies_and_the_record_tears(at: str) -> None:
        if at == "claimed" and armed and armed.pop():
            first = cast("list[bytes]", redis_client.zrange(KEYS.inflight, 0, 0))[0]
            redis_client.hset(KEYS.claims, first, torn.format(due=T0, k=first.decode()))
            raise _Crash(at)

    clock = ManualClock(T0)
    config = EngineConfig(two_phase=True, lease_ms=1_000)
    engine = DelayEngine(aredis(), KEYS, clock, config=config, fault=replica_dies_and_the_record_tears)
    ids = await engine.schedule([env(n, T0) for n in range(4)])
    with pytest.raises(_Crash):
        await engine.fire_due()
    clock.set(T0 + 1_000)
    await drain(engine)
    clock.set(T0 + 3_000)
    await drain(engine)
    got = cast("dict[bytes, bytes]", redis_client.hgetall(KEYS.parked))
    parked = {k.decode(): v.decode() for k, v in got.items()}
    [(torn_id, reason)] = parked.items()
    assert reason == "torn claim record"
    n = ids.index(torn_id)
    assert sorted(payloads(redis_client)) == [m for m in range(4) if m != n]
    assert [r.id for r in history(redis_client, "parked")] == [torn_id]
    assert redis_client.exists(KEYS.inflight, KEYS.claims) == 0
    assert [i for i, _ in target(redis_client, KEYS.stream)] == [torn_id]


@pytest.mark.both_fire_paths
@pytest.mark.parametrize("at", ["18446744073709551615-0", "10000000000000000000-7", "padded"])
async def test_an_envelope_moved_to_a_stream_id_past_19_digits_fires_once_and_is_not_lost(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis, at: str
) -> None:
    """A stream id's parts go up to 2^64-1 (20 digits), and Redis reads them with leading zeros
    too. Once the delayed topic holds an id past 10^19 ms (an entry added by hand), every id Redis
    makes there after it is one too, compaction's copies among them. The check that a move names
    a stream id took 19 digits for the limit: such a move was forgotten, the envelope looked for
    where it no longer is and dropped with a `lost` record, its copy left on the topic."""
    clock = ManualClock(T0)
    engine = DelayEngine(aredis(), KEYS, clock, config=EngineConfig(lease_ms=1_000))
    ids = await engine.schedule([env(n, T0 + 1_000) for n in range(3)])
    if at == "padded":
        top = int(ids[-1].split("-")[0]) + 1
        copy, at = f"{top}-0", f"{top:030d}-0"
    else:
        copy = at
    # Compaction's move of the first one (a copy at the tail naming its origin, the original deleted), by hand.
    [(_, fields)] = cast("list[tuple[bytes, dict[Any, bytes]]]", redis_client.xrange(KEYS.stream, ids[0], ids[0]))
    redis_client.xadd(KEYS.stream, {**fields, b"origin": ids[0].encode()}, id=copy)
    redis_client.xdel(KEYS.stream, ids[0])
    redis_client.hset(KEYS.moved, ids[0], at)
    for step in range(2):
        clock.set(T0 + 1_000 + step * 2_000)
        await drain(engine)
    assert sorted(payloads(redis_client)) == [0, 1, 2]
    assert history(redis_client, "lost") == []
    assert target(redis_client, KEYS.stream) == []
    assert redis_client.exists(KEYS.moved, KEYS.inflight, KEYS.claims) == 0


@pytest.mark.both_fire_paths
@pytest.mark.parametrize("score", ["inf", "-inf"])
async def test_an_index_entry_written_at_an_infinite_time_does_not_block_the_shard(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis, score: str
) -> None:
    """An index entry whose score is set by hand to `inf` (Redis takes it, as it takes `-inf`).
    Each fire step reported it as the earliest time left, and the engine failed to read that time
    after the step's script (`cannot convert float infinity to integer`): on Redis Cluster's path
    CLAIM's batch was never appended, and nothing on the shard fired any more. `inf` is a time
    that never comes: that message waits (listed, cancellable) and the others go out once each;
    `-inf` is due: it goes out once too."""
    clock = ManualClock(T0)
    engine = DelayEngine(aredis(), KEYS, clock, config=EngineConfig(lease_ms=1_000))
    ids = await engine.schedule([env(n, T0 + 1_000) for n in range(4)])
    bucket = cast("bytes", redis_client.zrange(KEYS.due, 0, 0)[0]).decode()
    redis_client.zadd(f"{KEYS.buckets}{bucket}", {ids[0]: score})
    for step in range(3):
        clock.set(T0 + 1_000 + step * 2_000)
        await drain(engine)
    waits = 1 if score == "inf" else 0
    assert sorted(payloads(redis_client)) == list(range(waits, 4))
    assert await engine.pending() == waits
    assert await engine.cancel(ids[0]) == bool(waits)
    assert target(redis_client, KEYS.stream) == []
    assert index_buckets(redis_client) == []
