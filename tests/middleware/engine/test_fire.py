"""The fire step against a real Redis: never before the due time, then exactly once, in due
order, byte-exact, with racing replicas; what cannot be delivered (a vanished, undecodable,
expired or wrong-target envelope) is parked or dropped, never spun; targets are trimmed as their
publisher asked."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
from collections.abc import Callable

import pytest
import redis
import redis.asyncio as aioredis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from delayed_middleware import lua_scripts
from delayed_middleware.clock import ManualClock
from delayed_middleware.engine import DelayEngine, EngineConfig, FireReport
from delayed_middleware.entry import Trim, decode_entry
from delayed_middleware.envelope import BulkEntry, Envelope
from delayed_middleware.inspector import Inspector
from delayed_middleware.instants import format_instant
from tests.conftest import small_stream_nodes
from tests.middleware.engine.helpers import (
    KEYS,
    T0,
    drain,
    env,
    history,
    payloads,
    target,
)


@pytest.mark.both_fire_paths
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
    # The user's keys verbatim, plus what produced it, that nothing follows and the
    # occurrence it is (a one-shot's: its due time).
    assert entry.metadata == {
        "k": "v1",
        "cloudevent.id": "1",
        "scheduler": sid,
        "scheduleNext": "purge",
        "scheduleOccurrence": format_instant(T0 + 5_000),
    }
    # Fired once: the index and the delayed topic no longer hold it.
    assert await engine.fire_due() == (0, None)
    assert len(target(redis_client)) == 1
    assert redis_client.xlen(KEYS.stream) == 0
    assert await engine.pending() == 0
    assert redis_client.exists(KEYS.due) == 0  # the index is empty, no bucket left behind


@pytest.mark.both_fire_paths
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


@pytest.mark.both_fire_paths
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


@pytest.mark.both_fire_paths
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
        (
            f"ev{i}".encode(),
            "text/plain",
            {
                "i": str(i),
                "scheduler": sid,
                "scheduleNext": "purge",
                "scheduleOccurrence": format_instant(T0 + 100),
            },
        )
        for i in range(50)
    ]


@pytest.mark.both_fire_paths
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


_text = st.text(alphabet=st.characters(exclude_categories=["Cs"]), max_size=40)


@pytest.mark.both_fire_paths
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
    added = {"scheduler": "sid", "scheduleNext": "purge", "scheduleOccurrence": format_instant(T0)}
    if entries:
        expected = [(b.event, {**b.metadata, **added}, b.content_type) for b in entries]
    else:
        expected = [(message, {**metadata, **added}, content_type)]
    assert [(g.data, dict(g.metadata), g.content_type) for g in got] == expected
    assert redis_client.hlen(KEYS.ids) == 0


@pytest.mark.both_fire_paths
async def test_vanished_envelope_is_dropped_not_spun(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    engine = DelayEngine(aredis(), KEYS, ManualClock(T0))
    [a, _b] = await engine.schedule([env(1, T0), env(2, T0)])
    redis_client.xdel(KEYS.stream, a)
    assert (await engine.fire_due())[0] == 1
    assert await engine.pending() == 0
    assert [json.loads(decode_entry(f).data)["n"] for _, f in target(redis_client)] == [2]


@pytest.mark.both_fire_paths
async def test_envelopes_deleted_outside_the_engine_are_reported(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    """An XTRIM by an operator, or a MAXLEN publish by another client (the stock pubsub.redis
    on the same Redis), deletes envelopes from the delayed topic. Their index entries were
    dropped at the due time without a word."""
    engine = DelayEngine(aredis(), KEYS, ManualClock(T0))
    ids = await engine.schedule([env(i, T0) for i in range(3)])
    redis_client.xdel(KEYS.stream, ids[1])
    with caplog.at_level(logging.ERROR, logger="delayed_middleware.engine"):
        await drain(engine)
    assert sorted(payloads(redis_client)) == [0, 2]
    [record] = [r for r in caplog.records if "lost" in r.getMessage()]
    assert "1 pending message(s) on app-delayed were lost" in record.getMessage()


@pytest.mark.both_fire_paths
@pytest.mark.parametrize("route", ["its id", "the moved hash"])
async def test_an_index_entry_whose_envelope_no_route_finds_is_reported_once_and_never_listed_again(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis, route: str
) -> None:
    """An envelope deleted outside the engine (by its id, or its re-homed copy, which a release
    that does not know the moved hash never finds) leaves one `lost` history record, counts once
    in the fire report, and its index entry is removed: `pending` no longer lists it."""
    clock = ManualClock(T0)
    reports: list[FireReport] = []
    config = EngineConfig(compact_min_nodes=1)
    engine = DelayEngine(aredis(), KEYS, clock, config=config, on_batch=reports.append)
    if route == "its id":
        ids = await engine.schedule([env(i, T0 + 1_000) for i in range(3)])
        redis_client.xdel(KEYS.stream, ids[1])
    else:
        # Long waits among ones that fire now, a node each: compaction re-homes them.
        longs = [dataclasses.replace(env(i, T0 + 1_000), id="") for i in range(3)]
        fill = [dataclasses.replace(env(100, T0), topic="short", id="")] * 9
        with small_stream_nodes(redis_client, 10):
            ids = (await engine.schedule([x for e in longs for x in (e, *fill)]))[::10]
        await drain(engine)
        assert await engine.compact()
        copy = redis_client.hget(KEYS.moved, ids[1])
        assert copy is not None, "not re-homed"
        redis_client.xdel(KEYS.stream, copy)
    assert await engine.pending() == 3
    clock.set(T0 + 1_000)
    await drain(engine)
    await drain(engine)
    assert sorted(payloads(redis_client)) == [0, 2]
    [lost] = history(redis_client, "lost")
    assert (lost.id, lost.due_ms) == (ids[1], T0 + 1_000)
    assert sum(r.lost for r in reports) == 1
    assert await engine.pending() == 0
    assert not (await Inspector(aredis(), "app").pending()).messages
    assert redis_client.exists(KEYS.moved) == 0


@pytest.mark.both_fire_paths
async def test_undecodable_envelope_is_kept_for_inspection_not_fired(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    engine = DelayEngine(aredis(), KEYS, ManualClock(T0))
    # A truncated field, scheduled through the real script as any envelope is.
    redis_client.eval(
        lua_scripts.SCHEDULE,
        len(KEYS.script_keys),
        *KEYS.script_keys,
        *(KEYS.buckets, KEYS.wake, T0, 0, 1000, 1, "", 1),
        *(b"\x0a\xff\xff\xff", T0, "", 0, "orders", 4, "", "-", "-"),
    )
    [(bad_id, _)] = target(redis_client, KEYS.stream)
    await engine.schedule([env(1, T0)])
    assert (await engine.fire_due())[0] == 1
    assert [json.loads(decode_entry(f).data)["n"] for _, f in target(redis_client)] == [1]
    assert await engine.pending() == 0  # out of the index: it cannot spin the loop
    assert [i for i, _ in target(redis_client, KEYS.stream)] == [bad_id]  # still there to inspect
    assert "undecodable" in str(redis_client.hget(KEYS.parked, bad_id))  # and listed for operators


@pytest.mark.both_fire_paths
async def test_bad_targets_are_parked_and_the_rest_of_the_batch_fires(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    redis_client.hset("a-hash", "f", "v")
    redis_client.set("a-string", "x")
    engine = DelayEngine(aredis(), KEYS, ManualClock(T0))
    bad_topics = ["a-hash", "a-string", KEYS.due, "{other-delayed}:ids", "other-delayed"]
    envs = [env(0, T0)] + [env(i + 1, T0, topic=t) for i, t in enumerate(bad_topics)] + [env(9, T0)]
    await engine.schedule(envs)
    reports: list[FireReport] = []
    engine.state.on_batch = reports.append
    await drain(engine)
    assert payloads(redis_client) == [0, 9]
    assert sum(r.parked for r in reports) == len(bad_topics)
    assert redis_client.hgetall("a-hash") == {b"f": b"v"}
    assert redis_client.get("a-string") == b"x"
    assert redis_client.exists("other-delayed") == 0
    parked = {str(k): str(v) for k, v in redis_client.hgetall(KEYS.parked).items()}
    assert len(parked) == len(bad_topics)
    assert sum("WRONGTYPE" in why for why in parked.values()) == 2
    assert sum("reserved" in why for why in parked.values()) == 3
    # Kept on the delayed topic for an operator, out of the index.
    assert {repr(i.encode()) for i, _ in target(redis_client, KEYS.stream)} == set(parked)
    assert await engine.pending() == 0
    events = [(h.event, h.topic) for h in history(redis_client) if h.event == "parked"]
    assert sorted(t for _, t in events) == sorted(bad_topics)


@pytest.mark.both_fire_paths
async def test_expired_before_due_never_fires_and_ttl_rides_on_the_fired_entry(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    clock = ManualClock(T0)
    engine = DelayEngine(aredis(), KEYS, clock)
    await engine.schedule(
        [env(1, T0 + 100, expires_at_ms=T0 + 50), env(2, T0 + 100, expires_at_ms=T0 + 5_000)]
    )
    clock.set(T0 + 100)
    await drain(engine)
    [(_, fields)] = target(redis_client)
    assert decode_entry(fields).expires_at_ms == T0 + 5_000
    assert json.loads(decode_entry(fields).data)["n"] == 2
    [expired] = [h for h in history(redis_client) if h.event == "expired"]
    assert expired.reason == "MaxAge"
    assert target(redis_client, KEYS.stream) == []


@pytest.mark.both_fire_paths
async def test_target_pubsub_goes_to_the_outbox_not_the_topic(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    engine = DelayEngine(aredis(), KEYS, ManualClock(T0))
    bulk = Envelope(
        id="b",
        schedule_id="b",
        topic="orders",
        due_ms=T0,
        published_at_ms=T0,
        target_pubsub="kafka",
        bulk_entries=[BulkEntry("e1", b"one"), BulkEntry("e2", b"two", "text/plain")],
    )
    await engine.schedule([env(1, T0, target_pubsub="kafka", expires_at_ms=T0 + 9_000), bulk])
    await drain(engine)
    assert target(redis_client) == []
    rows = [{k.decode(): v.decode() for k, v in f.items()} for _, f in target(redis_client, KEYS.outbox)]
    assert [(r["pubsub"], r["topic"], r.get("bulk")) for r in rows] == [
        ("kafka", "orders", None),
        ("kafka", "orders", "b"),
        ("kafka", "orders", "b"),
    ]
    assert rows[0]["expiresAt"] == str(T0 + 9_000)
    assert (rows[2]["data"], rows[2]["contentType"]) == ("two", "text/plain")


@pytest.mark.both_fire_paths
async def test_fire_refused_for_memory_changes_nothing_then_fires_each_once(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    """With maxmemory reached (noeviction), FIRE's first write is refused and, the script
    having written nothing, nothing is half done; once memory is back, each fires once.
    (Redis lets a script that has written go on past the limit: no later write fails.)"""
    engine = DelayEngine(aredis(), KEYS, ManualClock(T0))
    await engine.schedule([env(i, T0) for i in range(50)])
    redis_client.config_set("maxmemory-policy", "noeviction")
    redis_client.config_set("maxmemory", 1)
    try:
        for _ in range(3):
            with contextlib.suppress(redis.exceptions.ResponseError):
                await engine.fire_due()
        assert redis_client.exists("orders", KEYS.parked) == 0
        assert {h.event for h in history(redis_client)} == {"scheduled"}
        assert await engine.pending() == 50
        assert redis_client.xlen(KEYS.stream) == 50
    finally:
        redis_client.config_set("maxmemory", 0)
    await drain(engine)
    assert sorted(payloads(redis_client)) == list(range(50))
    assert await engine.pending() == 0


@pytest.mark.two_phase_path
async def test_an_append_refused_for_memory_after_its_claim_loses_and_doubles_nothing(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    """Redis Cluster's path: memory runs out (noeviction) between CLAIM and APPEND, so every
    APPEND is refused at its first write (its marker) and the step raises with the batch in
    flight. Once memory is back, the claims are taken over when their lease ends and each
    message, on two targets, goes out once; nothing stays in flight."""
    full = [True]

    async def memory_runs_out(at: str) -> None:
        if at == "claimed" and full and full.pop():
            redis_client.config_set("maxmemory-policy", "noeviction")
            redis_client.config_set("maxmemory", 1)

    clock = ManualClock(T0)
    config = EngineConfig(two_phase=True, lease_ms=1_000)
    engine = DelayEngine(aredis(), KEYS, clock, config=config, fault=memory_runs_out)
    await engine.schedule([env(n, T0, topic=f"t{n % 2}") for n in range(6)])
    try:
        with pytest.raises(redis.exceptions.OutOfMemoryError):
            await engine.fire_due()
    finally:
        redis_client.config_set("maxmemory", 0)
    assert redis_client.zcard(KEYS.inflight) == 6
    assert redis_client.exists("t0", "t1") == 0
    await drain(engine)  # the lease runs: nothing to take over yet
    assert redis_client.zcard(KEYS.inflight) == 6
    clock.set(T0 + 1_000)
    await drain(engine)
    assert (sorted(payloads(redis_client, "t0")), sorted(payloads(redis_client, "t1"))) == ([0, 2, 4], [1, 3, 5])
    assert redis_client.exists(KEYS.inflight, KEYS.claims, KEYS.parked) == 0
    assert len(history(redis_client, "fired")) == 6
    assert await engine.pending() == 0


@pytest.mark.both_fire_paths
async def test_trim_maxlen_applies_to_target(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    engine = DelayEngine(aredis(), KEYS, ManualClock(T0), trim=Trim(mode="MAXLEN", max_len=10))
    for chunk in range(5):
        await engine.schedule([env(chunk * 200 + i, T0) for i in range(200)])
        await engine.fire_due()
    # Approximate trimming keeps at least max_len and far fewer than all 1000.
    assert 10 <= redis_client.xlen("orders") < 1000


@pytest.mark.both_fire_paths
async def test_another_components_max_len_does_not_trim_topics_it_did_not_publish_to(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    """Two components of one app (consumerID = app-id) share the delayed topic and fire each
    other's messages. Component b's maxLenApprox=10 trimmed the topics of messages published
    through a (no trimming): their unread messages were lost."""
    clock = ManualClock(T0)
    a = DelayEngine(aredis(), KEYS, clock, pubsub_name="a")
    b = DelayEngine(aredis(), KEYS, clock, trim=Trim(mode="MAXLEN", max_len=10), pubsub_name="b")
    await a.schedule([env(i, T0, pubsub_name="a") for i in range(300)])
    await drain(b)  # b's replica happens to fire them all
    assert redis_client.xlen("orders") == 300
    # Its own messages b does trim, as configured.
    await b.schedule([env(i, T0, topic="b-topic", pubsub_name="b") for i in range(300)])
    await drain(b)
    assert redis_client.xlen("b-topic") < 300


@pytest.mark.both_fire_paths
async def test_a_test_marked_for_both_fire_paths_fires_through_each(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis, fire_path: str
) -> None:
    """The mark's two runs really take two paths: CLAIM, APPEND and RELEASE happen on the
    two-phase run only, and the message is delivered once on both."""
    points: list[str] = []

    async def record(point: str) -> None:
        points.append(point)

    engine = DelayEngine(aredis(), KEYS, ManualClock(T0), fault=record)
    await engine.schedule([env(1, T0)])
    await drain(engine)
    assert payloads(redis_client) == [1]
    expected = ["claimed", "appended:1", "released"] if fire_path == "two-phase" else []
    assert points == expected


@pytest.mark.both_fire_paths
async def test_messages_of_one_batch_each_carry_their_own_occurrence_and_lateness(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    """One batch fires messages due at different instants, several at the same one: each carries
    the occurrence it is (its own due time), and its `fired` record its own lateness and size,
    however the batch reuses what it formatted for the message before."""
    clock = ManualClock(T0)
    engine = DelayEngine(aredis(), KEYS, clock)
    dues = [T0 + 10, T0 + 20, T0 + 20, T0 + 10, T0 + 30, T0 + 10]
    await engine.schedule([env(n, due) for n, due in enumerate(dues)])
    clock.set(T0 + 100)
    assert (await engine.fire_due())[0] == len(dues)
    got = {
        json.loads(e.data)["n"]: e.metadata["scheduleOccurrence"]
        for e in (decode_entry(f) for _, f in target(redis_client))
    }
    assert got == {n: format_instant(due) for n, due in enumerate(dues)}
    fired = history(redis_client, "fired")
    assert sorted((r.due_ms, r.lateness_ms, r.size_bytes, r.attempt) for r in fired) == sorted(
        (due, T0 + 100 - due, len(b'{"n":0}'), 1) for due in dues
    )
