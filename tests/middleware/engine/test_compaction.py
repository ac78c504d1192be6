"""Compaction (lua/compact.lua): envelopes that wait long among ones that fired are re-homed
to the delayed topic's tail, so the stream nodes they pinned are freed. Attacked as a race
with every other step (fire, cancel, replace, a crash mid-pass, a parked envelope, a claim in
flight on Cluster): nothing is lost, doubled, or renamed. Real Redis, real Redis Cluster."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Awaitable, Callable
from typing import cast

import pytest
import redis
import redis.asyncio as aioredis
import redis.asyncio.cluster as acluster
import redis.cluster

from delayed_middleware.clock import ManualClock
from delayed_middleware.engine import DelayEngine, EngineConfig
from delayed_middleware.entry import decode_entry
from delayed_middleware.envelope import Envelope
from delayed_middleware.inspector import Inspector
from delayed_middleware.keys import EngineKeys, shard_topics
from tests.conftest import drain_and_compact, freed_by_deleting, stored_bytes
from tests.middleware.engine.helpers import KEYS, T0, drain, env, every, payloads, recurring, target
from tests.redis_server import RedisCluster, stream_entries

HOUR = 3_600_000
# Small steps, so a pass spans many fire steps and other calls land between its chunks.
STEPWISE = EngineConfig(history_max_len=0, compact_check_every=1, compact_chunk=3, compact_slice_s=0.0)


def filler(n: int) -> list[Envelope]:
    """Messages due at T0 on topic `short` (300-byte bodies): what fires around the long ones."""
    return [Envelope(id="", topic="short", due_ms=T0, published_at_ms=T0, message=b"x" * 300)] * n


def interleaved(longs: list[Envelope], per_long: int = 9) -> list[Envelope]:
    out: list[Envelope] = []
    for e in longs:
        out += [e, *filler(per_long)]
    return out


async def compacted(engine: DelayEngine, client: redis.Redis) -> None:
    """Fire what is due (its own pass may run), then a whole pass if the stream is still
    sparse; something must have moved."""
    await drain_and_compact(engine)
    await engine.compact()
    assert client.hlen(KEYS.moved) > 0


def delivered(client: redis.Redis, topic: str = "orders") -> list[tuple[int, dict[str, str]]]:
    out = []
    for _, fields in target(client, topic):
        entry = decode_entry(fields)
        out.append((json.loads(entry.data)["n"], dict(entry.metadata)))
    return out


async def test_a_re_homed_message_keeps_its_id_in_pending_inspect_and_cancel(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    """The id a user got from the publish (a stream id without scheduleId, the scheduleId
    otherwise) still lists, inspects and cancels after its envelope moved."""
    clock = ManualClock(T0)
    engine = DelayEngine(aredis(), KEYS, clock, config=EngineConfig(history_max_len=0))
    longs = [env(i, T0 + HOUR, sid=f"s{i}" if i % 2 else "") for i in range(40)]
    longs = [e if e.schedule_id else dataclasses.replace(e, id="") for e in longs]
    ids = (await engine.schedule(interleaved(longs)))[::10]
    assert len(set(ids)) == 40
    assert any(i.startswith("s") for i in ids)
    assert any("-" in i for i in ids)
    await compacted(engine, redis_client)
    assert redis_client.hlen(KEYS.moved) == 40
    inspector = Inspector(aredis(), "app")
    listed = (await inspector.pending()).messages
    assert sorted(m.id for m in listed) == sorted(ids)
    for i in ids[:4]:
        info = await inspector.get(i)
        assert info is not None
        assert info.message.id == i
        assert info.state == "pending"
    assert await engine.cancel_many(ids[:20]) == [(True, "orders")] * 20
    assert await engine.cancel_many(ids[:20]) == [(False, "")] * 20
    clock.advance(HOUR)
    await drain(engine)
    assert sorted(n for n, _ in delivered(redis_client)) == list(range(20, 40))
    # Nothing left behind: no envelope, no move record.
    assert redis_client.xlen(KEYS.stream) == 0
    assert redis_client.exists(KEYS.moved) == 0


async def test_a_recurring_message_without_schedule_id_keeps_its_scheduler_header_after_moving(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    """A schedule without scheduleId is named by its first stream id: the `scheduler` header
    of every message it produces, and the id that cancels it."""
    clock = ManualClock(T0)
    engine = DelayEngine(aredis(), KEYS, clock, config=EngineConfig(history_max_len=0), recurrence=every)
    scheds = (await engine.schedule(interleaved([recurring(i, HOUR) for i in range(20)], per_long=100)))[
        ::101
    ]
    await compacted(engine, redis_client)
    assert redis_client.hlen(KEYS.moved) == 20
    for _ in range(3):
        clock.advance(HOUR)
        await drain(engine)
    got = delivered(redis_client)
    assert sorted(n for n, _ in got) == sorted(list(range(20)) * 3)
    assert {(n, md["scheduler"]) for n, md in got} == set(enumerate(scheds))
    assert await engine.cancel_many(scheds) == [(True, "orders")] * 20
    clock.advance(HOUR)
    await drain(engine)
    assert len(delivered(redis_client)) == 60
    assert redis_client.xlen(KEYS.stream) == 0
    assert redis_client.exists(KEYS.moved) == 0


async def test_a_pass_racing_fires_cancels_and_replaces_loses_and_doubles_nothing(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    """Between every chunk of a pass: a message fires, one is cancelled, one replaced. Each
    lands on the envelope wherever it is at that moment (moved or not yet)."""
    clock = ManualClock(T0)
    engine = DelayEngine(aredis(), KEYS, clock, config=STEPWISE)
    # 60 long ones (due at T0 + 1 h + i s), every third with a scheduleId.
    longs = [env(i, T0 + HOUR + i * 1_000, sid=f"s{i}" if i % 3 == 0 else "") for i in range(60)]
    longs = [e if e.schedule_id else dataclasses.replace(e, id="") for e in longs]
    ids = (await engine.schedule(interleaved(longs, per_long=30)))[::31]
    await drain(engine)  # the filler fires; the pass starts at the first idle step
    assert engine.compacting
    cancelled: set[int] = set()
    replaced: set[int] = set()
    steps = 0
    clock.set(T0 + HOUR)
    while engine.compacting:
        steps += 1
        i = steps % 60
        if steps % 3 == 0 and i not in cancelled | replaced:
            assert await engine.cancel(ids[i])
            cancelled.add(i)
        elif steps % 3 == 1 and longs[i].schedule_id and i not in cancelled | replaced:
            await engine.schedule([env(1_000 + i, T0 + HOUR + i * 1_000, sid=longs[i].schedule_id)])
            replaced.add(i)
        clock.advance(1_000)  # one more long one is due at each step
        await engine.fire_due()
    assert steps > 5
    clock.advance(2 * HOUR)
    await drain(engine)
    want = sorted([i for i in range(60) if i not in cancelled | replaced] + [1_000 + i for i in replaced])
    assert sorted(n for n, _ in delivered(redis_client)) == want
    assert await engine.pending() == 0
    assert redis_client.xlen(KEYS.stream) == 0
    assert redis_client.exists(KEYS.moved) == 0


async def test_a_pass_cut_short_by_a_crash_is_started_again_without_loss_or_duplicates(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    """The replica dies half way through a pass; another one starts its own pass from the
    stream's head, moving some envelopes a second time: each keeps its first id."""
    clock = ManualClock(T0)
    longs = [Envelope(id="", topic="orders", due_ms=T0 + HOUR, published_at_ms=T0, message=b'{"n":%d}' % i)
             for i in range(50)]  # fmt: skip
    first = DelayEngine(aredis(), KEYS, clock, config=STEPWISE)
    ids = (await first.schedule(interleaved(longs, per_long=20)))[::21]
    await drain(first)
    await first.fire_due()
    await first.fire_due()
    assert first.compacting
    assert 0 < redis_client.hlen(KEYS.moved) < 50
    # `first` is gone (its pass with it); a new replica finds the stream still sparse.
    second = DelayEngine(aredis(), KEYS, clock, config=STEPWISE)
    assert await second.compact()
    origins = {f[b"origin"].decode() for _, f in stream_entries(redis_client, KEYS.stream)}
    assert origins == set(ids)
    listed = (await Inspector(aredis(), "app").pending()).messages
    assert sorted(m.id for m in listed) == sorted(ids)
    clock.advance(HOUR)
    await drain(second)
    assert sorted(payloads(redis_client)) == list(range(50))


async def test_five_replicas_compacting_at_once_keep_one_copy_of_each_envelope(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every replica runs its own passes over the same stream: each move is atomic, so
    whichever replica gets to an envelope first moves it and the others skip it."""
    clock = ManualClock(T0)
    # Passes only when asked (compact()), all five at once.
    config = EngineConfig(history_max_len=0, compact_chunk=7, compact_check_every=0)
    engines = [DelayEngine(aredis(), KEYS, clock, config=config) for _ in range(5)]
    longs = [
        Envelope(id="", topic="orders", due_ms=T0 + HOUR, published_at_ms=T0, message=b'{"n":%d}' % i)
        for i in range(200)
    ]
    ids = (await engines[0].schedule(interleaved(longs, per_long=12)))[::13]
    await drain(engines[0])
    # All five find the stream sparse before any moves, so the five passes overlap: on a busy
    # machine a replica's density check could otherwise land after another's whole pass.
    everyone_checked = asyncio.Barrier(len(engines))
    for e in engines:
        compactor = e.parts.compactor

        async def sparse_until(
            check: Callable[[], Awaitable[str | None]] = compactor.sparse_until,
        ) -> str | None:
            end = await check()
            await everyone_checked.wait()
            return end

        monkeypatch.setattr(compactor, "sparse_until", sparse_until)
    assert all(await asyncio.gather(*(e.compact() for e in engines)))
    entries = stream_entries(redis_client, KEYS.stream)
    assert len(entries) == 200
    raw = cast("dict[bytes, bytes]", redis_client.hgetall(KEYS.moved))
    moved = {k.decode(): v.decode() for k, v in raw.items()}
    assert sorted(moved) == sorted(ids)
    assert {entry_id: f[b"origin"].decode() for entry_id, f in entries} == {v: k for k, v in moved.items()}
    clock.advance(HOUR)
    await asyncio.gather(*(drain(e) for e in engines))
    assert sorted(payloads(redis_client)) == list(range(200))
    assert redis_client.xlen(KEYS.stream) == 0
    assert redis_client.exists(KEYS.moved) == 0


async def test_a_parked_envelope_stays_parked_and_listed_after_moving(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    """An envelope parked for an operator (its target is not a stream) moves like any other
    and is still found as parked, under its id."""
    clock = ManualClock(T0)
    redis_client.set("not-a-stream", "x")
    engine = DelayEngine(aredis(), KEYS, clock, config=EngineConfig(history_max_len=0))
    bad = Envelope(id="", topic="not-a-stream", due_ms=T0, published_at_ms=T0, message=b"{}")
    [parked_id, *_] = await engine.schedule(
        [bad, *interleaved([env(i, T0 + HOUR, sid=f"s{i}") for i in range(30)], per_long=10)]
    )
    await compacted(engine, redis_client)
    assert redis_client.hget(KEYS.moved, parked_id) is not None
    info = await Inspector(aredis(), "app").get(parked_id)
    assert info is not None
    assert info.state == "parked"
    assert info.message.id == parked_id
    assert await engine.holds(parked_id)


async def test_compaction_frees_the_memory_one_long_delay_in_a_hundred_pinned(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    """40,000 messages due in 1-3 s, one in every 100 delayed by an hour, 300-byte payloads,
    history off. After the short ones fire and 40 s pass, Redis held 4,904 B per remaining
    pending message; at most 1 KB now, by MEMORY USAGE and by the used_memory they free."""
    clock = ManualClock(T0)
    engine = DelayEngine(aredis(), KEYS, clock, config=EngineConfig(history_max_len=0))
    envs = []
    for i in range(40_000):
        if i % 100 == 0:
            envs.append(Envelope(id="", topic="orders", due_ms=T0 + HOUR + i, published_at_ms=T0,
                                 message=b'{"n":%d}' % i + b" " * 290))  # fmt: skip
        else:
            envs.append(Envelope(id="", topic="short", due_ms=T0 + 1_000 + i % 2_000, published_at_ms=T0,
                                 message=b"x" * 300))  # fmt: skip
    for start in range(0, len(envs), 500):
        await engine.schedule(envs[start : start + 500])
    clock.advance(3_000)
    await drain(engine)
    # The subscriber consumed the short ones: their topic is gone, as after acks and trimming.
    redis_client.delete("short")
    clock.advance(40_000)
    await drain_and_compact(engine)
    assert await engine.pending() == 400
    assert stored_bytes(redis_client, KEYS) / 400 <= 1_024
    assert freed_by_deleting(redis_client, KEYS) / 400 <= 1_024


# --- Redis Cluster: a claim in flight while its envelope moves ----------------------------------


async def test_a_claim_in_flight_while_its_envelope_moves_is_appended_once(cluster: RedisCluster) -> None:
    """Two-phase fire: CLAIM took an envelope, compaction moved it before APPEND and RELEASE.
    RELEASE finds it where it is now: one delivery, nothing left behind."""
    shard = EngineKeys.for_topic(shard_topics("app", 3)[0])
    client = acluster.RedisCluster(host="127.0.0.1", port=cluster.nodes[0].port)
    admin = redis.cluster.RedisCluster(host="127.0.0.1", port=cluster.nodes[0].port)
    try:
        cluster.flushall()
        clock = ManualClock(T0)
        moved_during_claim: list[int] = []

        async def fault(point: str) -> None:
            if point == "claimed":
                helper = DelayEngine(client, shard, clock, config=cfg)
                await helper.compact()
                moved_during_claim.append(int(admin.hlen(shard.moved)))

        cfg = EngineConfig(two_phase=True, history_max_len=0, batch_size=500, fire_budget_us=0)
        engine = DelayEngine(client, shard, clock, config=cfg, fault=fault)
        longs = [Envelope(id="", topic="orders", due_ms=T0 + HOUR, published_at_ms=T0,
                          message=b'{"n":%d}' % i) for i in range(30)]  # fmt: skip
        await engine.schedule(interleaved(longs, per_long=20))
        clock.advance(1)
        # Fire the filler without compaction (the fault hook would run it mid-claim).
        quiet = DelayEngine(client, shard, clock, config=EngineConfig(
            two_phase=True, history_max_len=0, compact_check_every=0))  # fmt: skip
        await drain(quiet)
        clock.advance(HOUR)
        await drain(engine)
        assert moved_during_claim
        assert moved_during_claim[0] == 30
        got = sorted(json.loads(decode_entry(f).data)["n"] for _, f in stream_entries(admin, "orders"))
        assert got == list(range(30))
        assert admin.xlen(shard.stream) == 0
        assert admin.exists(shard.moved) == 0
    finally:
        await client.aclose()
        admin.close()


async def test_a_hand_written_entry_claiming_a_pending_message_origin_cannot_take_its_place(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    """Anyone with Redis access can XADD to the delayed topic. An entry that carries an
    `origin` field naming a pending message (here: a copy of message 5's fields claiming to be
    message 3) must not become message 3: compaction trusts `origin` only on the copy the
    moved hash points at. Each of the 40 messages fires once, with its own body, and the
    readers list each id once."""
    clock = ManualClock(T0)
    engine = DelayEngine(aredis(), KEYS, clock, config=EngineConfig(history_max_len=0))
    longs = [dataclasses.replace(env(i, T0 + HOUR), id="") for i in range(40)]
    ids = (await engine.schedule(interleaved(longs)))[::10]
    [fields] = [f for i, f in stream_entries(redis_client, KEYS.stream) if i == ids[5]]
    redis_client.xadd(KEYS.stream, {**fields, b"origin": ids[3].encode()})  # type: ignore[dict-item]
    await compacted(engine, redis_client)
    # And one written after the pass: the listing shows it under its own id, not as message 3.
    redis_client.xadd(KEYS.stream, {**fields, b"origin": ids[3].encode()})  # type: ignore[dict-item]
    inspector = Inspector(aredis(), "app")
    listed = [m.id for m in (await inspector.pending()).messages]
    counts, _ = await inspector.counts_by_topic()
    clock.advance(HOUR)
    await drain(engine)
    assert sorted(n for n, _ in delivered(redis_client)) == list(range(40))
    # Every message's envelope left the stream; only the hand-written entries remain.
    assert redis_client.xlen(KEYS.stream) == 2
    assert listed.count(ids[3]) == 1
    assert len(listed) == len(set(listed)) == 42
    assert counts == {"orders": 42}


@pytest.mark.parametrize("when", ["before-due", "in-flight"])
async def test_a_moved_envelope_deleted_by_someone_else_leaves_no_move_record_behind(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis, when: str
) -> None:
    """An operator's XDEL/XTRIM of the delayed topic loses the messages it deletes (logged as
    lost when they come due); their move records must go with them, or the moved hash grows
    with every such loss for good. Deleted before they come due (FIRE, CLAIM), or while the
    two-phase fire holds them claimed (RELEASE)."""
    clock = ManualClock(T0)
    deleted: list[str] = []
    armed = False

    async def delete_claimed(step: str) -> None:
        if armed and step == "claimed" and not deleted:
            deleted.extend(i for i, _ in stream_entries(redis_client, KEYS.stream)[:10])
            redis_client.xdel(KEYS.stream, *deleted)

    cfg = EngineConfig(history_max_len=0, two_phase=when == "in-flight")
    engine = DelayEngine(aredis(), KEYS, clock, config=cfg, fault=delete_claimed)
    longs = [dataclasses.replace(env(i, T0 + HOUR), id="") for i in range(40)]
    await engine.schedule(interleaved(longs))
    await compacted(engine, redis_client)
    copies = [i for i, _ in stream_entries(redis_client, KEYS.stream)]
    assert len(copies) == 40
    if when == "before-due":
        redis_client.xdel(KEYS.stream, *copies[:10])
    armed = True
    clock.advance(HOUR)
    await drain(engine)
    # Claimed ones carry their messages in the claim: those still go out, once.
    assert sorted(n for n, _ in delivered(redis_client)) == list(range(10 if when == "before-due" else 0, 40))
    assert redis_client.xlen(KEYS.stream) == 0
    assert redis_client.hlen(KEYS.moved) == 0


async def test_a_listing_that_pages_through_a_pass_lists_each_message_once(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    """`pending` pages through the stream while fire steps compact it: an envelope read at its
    first place and moved to the tail before the listing reaches the tail is still one message,
    and one moved from ahead of the listing is still listed."""
    clock = ManualClock(T0)
    engine = DelayEngine(aredis(), KEYS, clock, config=STEPWISE)
    longs = [dataclasses.replace(env(i, T0 + HOUR), id="") for i in range(60)]
    ids = (await engine.schedule(interleaved(longs, per_long=30)))[::31]
    await drain(engine)
    assert engine.compacting
    listed: list[str] = []
    async for m in Inspector(aredis(), "app", page_size=7).scan():
        listed.append(m.id)
        # The pass goes on between the listing's pages.
        await engine.fire_due()
    assert not engine.compacting
    assert sorted(listed) == sorted(ids)


@pytest.mark.parametrize("parked_besides", [0, 10_001])
async def test_the_pending_gauge_does_not_count_a_parked_envelope_after_it_moved(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis, parked_besides: int
) -> None:
    """The gauge's counts skip parked envelopes, whether the parked hash is read whole (small)
    or looked up page by page (over 10,000 parked): by the envelope's id, not its copy's."""
    clock = ManualClock(T0)
    redis_client.set("not-a-stream", "x")
    engine = DelayEngine(aredis(), KEYS, clock, config=EngineConfig(history_max_len=0))
    bad = Envelope(id="", topic="not-a-stream", due_ms=T0, published_at_ms=T0, message=b"{}")
    await engine.schedule(
        [bad, *interleaved([env(i, T0 + HOUR, sid=f"s{i}") for i in range(30)], per_long=10)]
    )
    await compacted(engine, redis_client)
    for start in range(0, parked_besides, 1000):
        redis_client.hset(KEYS.parked, mapping={f"0-{i}": "elsewhere" for i in range(start, start + 1000)})
    counts, complete = await Inspector(aredis(), "app").counts_by_topic()
    assert complete
    assert counts == {"orders": 30}


async def test_a_cancel_by_the_id_a_moved_envelope_is_stored_at_cancels_that_message(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    """A subscriber of the delayed topic sees a moved envelope at its copy's stream id; a
    cancel by that id cancels the message as a cancel by its first id does: nothing fires,
    nothing waits in the index, no move record is left. One-shot and recurring messages,
    with and without scheduleId."""
    clock = ManualClock(T0)
    engine = DelayEngine(aredis(), KEYS, clock, config=EngineConfig(history_max_len=0), recurrence=every)
    longs = [
        env(i, T0 + HOUR, sid=f"s{i}") if i % 4 == 1 else dataclasses.replace(env(i, T0 + HOUR), id="")
        for i in range(0, 40, 2)
    ]
    longs += [recurring(i, HOUR, sid=f"r{i}" if i % 4 == 3 else "") for i in range(1, 40, 2)]
    await engine.schedule(interleaved(longs))
    await compacted(engine, redis_client)
    copies = [i for i, _ in stream_entries(redis_client, KEYS.stream)]
    assert len(copies) == 40
    assert await engine.cancel_many(copies[:10] + copies[20:30]) == [(True, "orders")] * 20
    assert await engine.pending() == 20
    assert redis_client.hlen(KEYS.moved) == 20
    for _ in range(2):
        clock.advance(HOUR)
        await drain(engine)
    # The first ten one-shots and the first ten schedules were cancelled; the other
    # schedules fired twice.
    got = sorted(n for n, _ in delivered(redis_client))
    assert got == sorted([*range(20, 40, 2), *range(21, 40, 2), *range(21, 40, 2)])
    assert await engine.cancel_many(copies[30:]) == [(True, "orders")] * 10
    assert redis_client.xlen(KEYS.stream) == 0
    assert redis_client.exists(KEYS.moved) == 0
    assert redis_client.hlen(KEYS.ids) == 0


async def test_replace_and_cancel_find_a_message_whose_envelope_moved_twice(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    """Two passes move the first messages twice (the second copies the first's copies). A
    publish with the same scheduleId replaces such a message, a cancel by its first id
    cancels it; the replaced and cancelled envelopes leave the stream with their move
    records, and what fires is each message once, in its latest version."""
    clock = ManualClock(T0)
    engine = DelayEngine(aredis(), KEYS, clock, config=EngineConfig(history_max_len=0))
    first = [
        env(i, T0 + HOUR, sid=f"s{i}") if i % 2 else dataclasses.replace(env(i, T0 + HOUR), id="")
        for i in range(20)
    ]
    ids = (await engine.schedule(interleaved(first)))[::10]
    await compacted(engine, redis_client)
    once = {k: redis_client.hget(KEYS.moved, k) for k in ids if not k.startswith("s")}
    await engine.schedule(interleaved([env(i, T0 + HOUR) for i in range(20, 40)]))
    await compacted(engine, redis_client)
    twice = {k: redis_client.hget(KEYS.moved, k) for k in once}
    assert all(twice[k] not in (None, once[k]) for k in once)
    # Replace the scheduleId ones with new bodies (n + 100), cancel the others by their first id.
    await engine.schedule([env(i + 100, T0 + HOUR, sid=f"s{i}") for i in range(1, 20, 2)])
    assert await engine.cancel_many(list(once)) == [(True, "orders")] * 10
    assert await engine.pending() == 30
    clock.advance(HOUR)
    await drain(engine)
    assert sorted(n for n, _ in delivered(redis_client)) == [*range(20, 40), *range(101, 120, 2)]
    assert redis_client.xlen(KEYS.stream) == 0
    assert redis_client.exists(KEYS.moved) == 0
    assert redis_client.hlen(KEYS.ids) == 0


async def test_moved_messages_that_expire_or_park_then_cancel_leave_no_move_record(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    """The moved hash shrinks back to nothing when the moved envelopes are gone, whatever
    took them: a TTL that ran out before the due time, a park then a cancel, a fire."""
    clock = ManualClock(T0)
    redis_client.set("not-a-stream", "x")
    engine = DelayEngine(aredis(), KEYS, clock, config=EngineConfig(history_max_len=0))
    expiring = [
        dataclasses.replace(env(i, T0 + HOUR), id="", expires_at_ms=T0 + HOUR // 2) for i in range(10)
    ]
    parking = [dataclasses.replace(env(i, T0 + HOUR, topic="not-a-stream"), id="") for i in range(10, 20)]
    firing = [dataclasses.replace(env(i, T0 + HOUR), id="") for i in range(20, 30)]
    ids = (await engine.schedule(interleaved([*expiring, *parking, *firing])))[::10]
    await compacted(engine, redis_client)
    assert redis_client.hlen(KEYS.moved) == 30
    clock.advance(HOUR)
    await drain(engine)
    assert sorted(n for n, _ in delivered(redis_client)) == list(range(20, 30))
    assert redis_client.hlen(KEYS.parked) == 10
    assert redis_client.hlen(KEYS.moved) == 10
    assert await engine.cancel_many(ids[10:20]) == [(True, "not-a-stream")] * 10
    assert redis_client.xlen(KEYS.stream) == 0
    assert redis_client.exists(KEYS.moved) == 0
    assert redis_client.exists(KEYS.parked) == 0


@pytest.mark.both_fire_paths
async def test_long_delays_interleaved_with_short_ones_do_not_multiply_memory(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    """One message delayed by an hour among nine due at once (retries beside reminders):
    after the nine fire, each pending 300-byte envelope pinned a whole ~4 KB stream node,
    ten times what the same messages cost when scheduled alone (measured 4,053 vs 405 B).
    Compaction re-homes them; each still fires once, at its time."""
    clock = ManualClock(T0)
    engine = DelayEngine(aredis(), KEYS, clock, config=EngineConfig(history_max_len=0))
    envs = []
    for i in range(1_000):
        body = b'{"n":%d}' % i
        envs.append(
            Envelope(
                id="", topic="orders", due_ms=T0 + 3_600_000, published_at_ms=T0, message=body.ljust(300)
            )
        )
        envs += [Envelope(id="", topic="short", due_ms=T0, published_at_ms=T0, message=b"x" * 300)] * 9
    ids = await engine.schedule(envs)
    await drain_and_compact(engine)
    assert await engine.pending() == 1_000
    assert stored_bytes(redis_client, KEYS) / 1_000 < 1_000
    # Each long one is still held under its own id, and fires once, at its time.
    long_ids = ids[::10]
    assert all([await engine.holds(i) for i in long_ids])
    clock.advance(3_600_000)
    await drain(engine)
    assert sorted(payloads(redis_client)) == list(range(1_000))
    assert await engine.pending() == 0
    assert redis_client.exists(KEYS.moved) == 0
    assert redis_client.xlen(KEYS.stream) == 0
