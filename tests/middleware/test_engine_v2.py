"""Engine v2 against a real Redis: bounded index work, failure-atomic fires, idempotent
schedules, budgeted batches, the recurring fire path and the lifecycle history."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Callable
from typing import cast

import pytest
import redis
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from delayed_middleware import scripts
from delayed_middleware.clock import ManualClock
from delayed_middleware.engine import DelayEngine, EngineConfig, FireReport
from delayed_middleware.entry import decode_entry
from delayed_middleware.envelope import RECURRING, BulkEntry, Envelope
from delayed_middleware.history import HistoryRecord, decode_record
from delayed_middleware.instants import format_instant
from tests.chaos.proxy import LosingProxy
from tests.middleware.test_engine import KEYS, T0, env, target
from tests.redis_server import stream_entries


def every(e: Envelope, after: int) -> int | None:
    """Test-only recurrence: `@test <ms>` fires at published_at + k * interval."""
    interval = int(e.schedule.split()[1])
    return e.published_at_ms + ((after - e.published_at_ms) // interval + 1) * interval


def recurring(n: int, interval: int, sid: str = "", topic: str = "orders", **kw: object) -> Envelope:
    return Envelope(
        id=sid,
        topic=topic,
        due_ms=T0 + interval,
        published_at_ms=T0,
        message=f'{{"n":{n}}}'.encode(),
        metadata={"k": f"v{n}"},
        schedule_id=sid,
        kind=RECURRING,
        schedule=f"@test {interval}",
        **kw,  # type: ignore[arg-type]
    )


def history(client: redis.Redis) -> list[HistoryRecord]:
    return [decode_record(i, f) for i, f in stream_entries(client, KEYS.history)]


def payloads(client: redis.Redis, topic: str = "orders") -> list[int]:
    return [json.loads(decode_entry(f).data)["n"] for _, f in target(client, topic)]


async def drain(engine: DelayEngine) -> None:
    while (await engine.fire_due())[0]:
        pass


# --- defect 1: a large same-instant bucket must not break earlier publishes ---------------


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


@pytest.mark.slow
async def test_index_model_with_100k_same_instant_mixed_with_earlier_later_replaced_cancelled(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    rng = random.Random(7)
    clock = ManualClock(T0)
    engine = DelayEngine(aredis(), KEYS, clock)
    burst = T0 + 50_000
    model: dict[int, tuple[int, str]] = {}
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
                model = {k: v for k, v in model.items() if v[1] != e.schedule_id}
            model[n] = (e.due_ms, e.schedule_id)
    for s in range(0, 300, 3):
        sid = f"s{s}"
        assert await engine.cancel(sid) is any(v[1] == sid for v in model.values())
        model = {k: v for k, v in model.items() if v[1] != sid}
    assert await engine.pending() == len(model)
    for now in (burst - 1, burst, burst + 1, burst + 40_000):
        clock.set(now)
        before = len(target(redis_client))
        await drain(engine)
        got = payloads(redis_client)[before:]
        due_now = {k for k, (d, _) in model.items() if d <= now}
        assert sorted(got) == sorted(due_now)
        assert [model[k][0] for k in got] == sorted(model[k][0] for k in got)
        for k in got:
            del model[k]
        assert await engine.pending() == len(model)
    assert model == {}
    assert redis_client.exists(KEYS.due) == 0


# --- defect 2: a bad target parks that envelope, the rest fire ------------------------------


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
    engine._on_batch = reports.append
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


# --- defect 4: a retried schedule call is stored once ---------------------------------------


async def test_same_call_token_twice_stores_once(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    clock = ManualClock(T0)
    engine = DelayEngine(aredis(), KEYS, clock)
    assert len(await engine.schedule([env(1, T0 + 10)], token="call-1")) == 1
    assert await engine.schedule([env(1, T0 + 10)], token="call-1") == []
    assert await engine.pending() == 1
    clock.set(T0 + 10)
    await drain(engine)
    assert payloads(redis_client) == [1]


async def test_a_call_retried_with_its_token_after_a_lost_reply_is_stored_once(
    redis_client: redis.Redis,
) -> None:
    port = redis_client.connection_pool.connection_kwargs["port"]
    proxy = LosingProxy(port, marker=b"lost-reply-marker")
    await proxy.start()
    # No automatic resend (as the component's client): the caller retries, with its token.
    client = aioredis.Redis(port=proxy.port, socket_timeout=5, retry=Retry(NoBackoff(), 0))
    try:
        engine = DelayEngine(client, KEYS, ManualClock(T0))
        await engine.schedule([env(0, T0 + 10)])  # loads the script: the cut hits EVALSHA
        marked = Envelope(
            id="", topic="orders", due_ms=T0 + 10, published_at_ms=T0, message=b"lost-reply-marker"
        )
        proxy.armed = True
        with pytest.raises(redis.exceptions.ConnectionError):
            await engine.schedule([marked], token="call-7")
        assert proxy.cuts == 1  # the write landed, the reply was lost
        assert await engine.schedule([marked], token="call-7") == []  # the retry is a no-op
    finally:
        await client.aclose()
        await proxy.stop()
    assert len(target(redis_client, KEYS.stream)) == 2
    assert redis_client.get(KEYS.count) == b"2"
    assert [h.event for h in history(redis_client)] == ["scheduled", "scheduled"]


# --- defect 5: one fire call has a bounded amount of work -----------------------------------


async def test_fire_batches_are_budgeted_by_entries(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    reports: list[FireReport] = []
    # No time budget: on a busy machine it may cut a call after one 1,000-entry
    # envelope (the clock is read after every costly one), and this is about entries.
    engine = DelayEngine(
        aredis(),
        KEYS,
        ManualClock(T0),
        config=EngineConfig(batch_entries=2_000, fire_budget_us=0),
        on_batch=reports.append,
    )
    bulk = [
        Envelope(
            id="",
            topic="orders",
            due_ms=T0,
            published_at_ms=T0,
            bulk_entries=[BulkEntry(f"{b}-{i}", f'{{"n":{b * 1000 + i}}}'.encode()) for i in range(1000)],
        )
        for b in range(12)
    ]
    await engine.schedule(bulk)
    await drain(engine)
    assert len(target(redis_client)) == 12_000
    assert max(r.entries for r in reports) == 2_000
    assert [r.fired for r in reports if r.fired] == [2] * 6


async def test_one_envelope_above_the_budget_still_fires_alone(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    engine = DelayEngine(aredis(), KEYS, ManualClock(T0), config=EngineConfig(batch_bytes=10))
    await engine.schedule([env(1, T0), env(2, T0)])
    assert await engine.fire_due() == (1, T0)
    assert await engine.fire_due() == (1, None)
    assert payloads(redis_client) == [1, 2]


# --- recurring-ready firing -----------------------------------------------------------------


async def test_recurring_fires_every_occurrence_once_with_schedule_next(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    clock = ManualClock(T0)
    engine = DelayEngine(aredis(), KEYS, clock, recurrence=every)
    [rid] = await engine.schedule([recurring(1, 1_000)])
    for k in range(1, 6):
        clock.set(T0 + k * 1_000 - 1)
        await drain(engine)
        assert len(target(redis_client)) == k - 1
        clock.set(T0 + k * 1_000)
        await drain(engine)
        entries = [decode_entry(f) for _, f in target(redis_client)]
        assert len(entries) == k
        assert entries[-1].metadata == {
            "k": "v1",
            "scheduler": rid,
            "scheduleNext": format_instant(T0 + (k + 1) * 1_000),
        }
        assert await engine.pending() == 1
        assert redis_client.zcard(KEYS.refill) == 0
    assert await engine.cancel(rid)
    clock.set(T0 + 60_000)
    await drain(engine)
    assert len(target(redis_client)) == 5
    assert await engine.pending() == 0
    for key in (KEYS.ids, KEYS.refill, KEYS.due):
        assert redis_client.exists(key) == 0
    assert target(redis_client, KEYS.stream) == []


async def test_crash_between_fire_and_refill_loses_and_doubles_nothing(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    clock = ManualClock(T0)
    engine = DelayEngine(aredis(), KEYS, clock, recurrence=every)
    await engine.schedule([recurring(1, 1_000, sid="tick")])
    # A replica fires occurrence 1 and dies before computing the one after next:
    # the bare FIRE script, without the engine's refill step.
    redis_client.eval(
        scripts.FIRE, len(KEYS.script_keys), *KEYS.script_keys,
        *(KEYS.buckets, T0 + 1_000, 500, 2000, 1 << 20, "", "", 100),
    )  # fmt: skip
    assert redis_client.zrange(KEYS.refill, 0, -1) == [b"tick"]
    # Occurrence 2 comes: another replica completes the refill first, then fires it once.
    clock.set(T0 + 2_000)
    await drain(engine)
    clock.set(T0 + 3_000)
    await drain(engine)
    nexts = [decode_entry(f).metadata["scheduleNext"] for _, f in target(redis_client)]
    assert nexts == [format_instant(T0 + t) for t in (2_000, 3_000, 4_000)]


@pytest.mark.parametrize("successor", ["refilled by the replica", "computed by the fire step"])
async def test_missed_fires_fire_once_on_recovery_then_continue(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis, successor: str
) -> None:
    """Both ways a successor is found (a replica's recurrence and REFILL, or @every's grid
    in the fire script) follow the same missed-fires policy."""
    clock = ManualClock(T0)
    if successor == "refilled by the replica":
        engine = DelayEngine(aredis(), KEYS, clock, recurrence=every)
        await engine.schedule([recurring(1, 1_000, sid="tick")])
    else:
        engine = DelayEngine(aredis(), KEYS, clock, recurrence=None)
        await engine.schedule([every_env(1_000, sid="tick")])
    clock.set(T0 + 1_000)
    await drain(engine)
    clock.set(T0 + 10_500)  # down across eight fire times
    await drain(engine)
    await drain(engine)
    entries = [decode_entry(f) for _, f in target(redis_client)]
    assert len(entries) == 2
    assert entries[-1].metadata["scheduleNext"] == format_instant(T0 + 11_000)
    clock.set(T0 + 10_999)
    await drain(engine)
    assert len(target(redis_client)) == 2
    clock.set(T0 + 11_000)
    await drain(engine)
    assert len(target(redis_client)) == 3


async def test_racing_replicas_fire_each_recurring_occurrence_exactly_once(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    clock = ManualClock(T0)
    engines = [DelayEngine(aredis(), KEYS, clock, recurrence=every) for _ in range(5)]
    await engines[0].schedule([recurring(i, 1_000 + 10 * (i % 3)) for i in range(60)])
    for step in range(1, 13):
        clock.set(T0 + step * 1_000 + 25)
        await asyncio.gather(*(drain(e) for e in engines))
    got = payloads(redis_client)
    expected = {
        i: sum(1 for s in range(1, 13) if s * 1_000 + 25 >= (1_000 + 10 * (i % 3))) for i in range(60)
    }
    # occurrences of interval d up to t: floor(t / d)
    expected = {i: (12 * 1_000 + 25) // (1_000 + 10 * (i % 3)) for i in range(60)}
    assert {i: got.count(i) for i in range(60)} == expected
    assert await engines[0].pending() == 60


async def test_recurring_replaced_by_id_fires_only_the_new_one(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    clock = ManualClock(T0)
    engine = DelayEngine(aredis(), KEYS, clock, recurrence=every)
    await engine.schedule([recurring(1, 1_000, sid="job")])
    await engine.schedule([recurring(2, 500, sid="job")])
    clock.set(T0 + 1_000)
    await drain(engine)
    assert payloads(redis_client) == [2]
    assert await engine.pending() == 1
    assert len(target(redis_client, KEYS.stream)) == 1


# --- TTL, sampling and hand-off in the fire path ------------------------------------------------


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


async def test_schedule_source_delivers_the_latest_message_or_nothing(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    clock = ManualClock(T0)
    engine = DelayEngine(aredis(), KEYS, clock, recurrence=every)
    [rid] = await engine.schedule([recurring(1, 1_000, schedule_source="sensor", schedule_ttl_ms=30_000)])
    clock.set(T0 + 1_000)
    await drain(engine)
    assert target(redis_client) == []  # the source is empty: nothing
    redis_client.xadd("sensor", {"data": b"21C", "metadata": b'{"unit":"C"}'})
    redis_client.xadd("sensor", {"data": b"22C", "metadata": b'{"unit":"C"}', "contentType": b"text/plain"})
    clock.set(T0 + 2_000)
    await drain(engine)
    [(_, fields)] = target(redis_client)
    e = decode_entry(fields)
    assert (e.data, e.content_type, e.expires_at_ms) == (b"22C", "text/plain", T0 + 2_000 + 30_000)
    assert e.metadata == {"unit": "C", "scheduler": rid, "scheduleNext": format_instant(T0 + 3_000)}


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


# --- the lifecycle history ------------------------------------------------------------------


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


async def test_history_can_be_turned_off(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    engine = DelayEngine(aredis(), KEYS, ManualClock(T0), config=EngineConfig(history_max_len=0))
    await engine.schedule([env(1, T0)])
    await drain(engine)
    assert payloads(redis_client) == [1]
    assert redis_client.exists(KEYS.history) == 0


async def test_history_is_trimmed_to_its_length(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    engine = DelayEngine(aredis(), KEYS, ManualClock(T0), config=EngineConfig(history_max_len=100))
    for i in range(20):
        await engine.schedule([env(i * 100 + j, T0) for j in range(100)])
    # Approximate trimming (whole stream nodes): bounded, never far above the setting.
    assert redis_client.xlen(KEYS.history) <= 300


async def test_fire_batches_stop_at_their_time_budget(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    reports: list[FireReport] = []
    engine = DelayEngine(
        aredis(), KEYS, ManualClock(T0), config=EngineConfig(fire_budget_us=1), on_batch=reports.append
    )
    await engine.schedule([env(i, T0) for i in range(100)])
    await drain(engine)
    assert sorted(payloads(redis_client)) == list(range(100))
    # Time is checked every eight envelopes: a 1 us budget stops each call there.
    assert max(r.fired for r in reports) == 8
    assert await engine.pending() == 0


# --- batched cancels and markers (deleteMarkerTTL) ------------------------------------------


async def test_cancel_many_in_one_call_reports_each_id(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    engine = DelayEngine(aredis(), KEYS, ManualClock(T0))
    await engine.schedule([env(i, T0 + 100, sid=f"s{i}") for i in range(1_200)])
    [anon] = await engine.schedule([env(9_999, T0 + 100, topic="billing")])
    ids = [f"s{i}" for i in range(0, 1_200, 2)] + ["nope", anon, "s0"]
    results = await engine.cancel_many(ids)
    assert results[:600] == [(True, "orders")] * 600
    assert results[600:] == [(False, ""), (True, "billing"), (False, "")]  # s0 once only
    assert await engine.pending() == 600
    assert sum(1 for h in history(redis_client) if h.event == "cancelled") == 601
    assert redis_client.exists("orders") == 0  # no markers unless asked for


async def test_markers_go_on_the_topic_when_a_cancel_or_an_expiry_removes_a_message(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    clock = ManualClock(T0)
    engine = DelayEngine(aredis(), KEYS, clock, config=EngineConfig(marker_ttl_ms=60_000))
    await engine.schedule(
        [env(1, T0 + 100, sid="c"), env(2, T0 + 100, topic="billing", expires_at_ms=T0 + 10)]
    )
    assert await engine.cancel("c")
    clock.set(T0 + 100)
    await drain(engine)
    [(_, removed)] = target(redis_client, "orders")
    [(_, aged)] = target(redis_client, "billing")
    for fields, reason in ((removed, "Remove"), (aged, "MaxAge")):
        marker = decode_entry(fields)
        assert marker.data == b""
        assert marker.metadata["markerReason"] == reason
        assert marker.expires_at_ms in (T0 + 60_000, T0 + 100 + 60_000)
    assert decode_entry(removed).metadata["scheduler"] == "c"


# --- @every successors computed in the fire step (no REFILL round trip) ---------------------


def every_env(interval: int, sid: str = "", published: int = T0, **kw: object) -> Envelope:
    """A real @every envelope, as plan.py builds it: the interval rides in every_ms."""
    return Envelope(
        id=sid,
        topic="orders",
        due_ms=published + interval,
        published_at_ms=published,
        message=b'{"n":1}',
        schedule_id=sid,
        kind=RECURRING,
        schedule=f"@every {interval}ms",
        every_ms=interval,
        **kw,  # type: ignore[arg-type]
    )


def _lua_iso(client: redis.Redis, values: list[int]) -> list[str]:
    libs = "\n".join(scripts.load(f) for f in ("index.lua", "decode.lua", "history.lua", "common.lua"))
    body = "local out = {} for i, v in ipairs(ARGV) do out[i] = iso_ms(tonumber(v)) end return out"
    return [v.decode() for v in client.eval(libs + "\n" + body, 0, *values)]


def test_the_fire_step_formats_schedule_next_exactly_as_python(redis_client: redis.Redis) -> None:
    """The Lua formatter behind an @every message's scheduleNext equals format_instant:
    edges of the calendar (year 1, leap days, centuries, 9999's last ms) and 20,000 random ms."""
    from delayed_middleware.instants import MAX_INSTANT_MS, MIN_INSTANT_MS, parse_instant

    edges = [MIN_INSTANT_MS, MAX_INSTANT_MS, 0, -1, 1, T0, 951_782_400_000, 951_868_799_999]
    for text in ("2000-02-29T23:59:59.999Z", "1900-03-01T00:00:00.000Z", "2024-12-31T12:00:00.500Z",
                 "1600-02-29T00:00:00.001Z", "0004-02-29T00:00:00.000Z", "9999-12-31T00:00:00.000Z"):  # fmt: skip
        edges.append(parse_instant(text))
    rng = random.Random(11)
    values = edges + [rng.randint(MIN_INSTANT_MS, MAX_INSTANT_MS) for _ in range(20_000)]
    for i in range(0, len(values), 2_000):
        part = values[i : i + 2_000]
        assert _lua_iso(redis_client, part) == [format_instant(v) for v in part]


async def test_every_fires_on_its_grid_without_refills_for_1000_occurrences(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    """No replica computes an @every successor (no recurrence function at all): the fire
    step does, from the acceptance instant, so 1,000 fires fired late by a varying amount
    still fall on T0 + k * 1 s, and each message names the next grid point."""
    clock = ManualClock(T0)
    engine = DelayEngine(aredis(), KEYS, clock, recurrence=None)
    await engine.schedule([every_env(1_000, sid="tick")])
    rng = random.Random(3)
    for k in range(1, 1_001):
        clock.set(T0 + k * 1_000 + rng.randrange(0, 900))  # late, never a whole interval
        await drain(engine)
        assert redis_client.zcard(KEYS.refill) == 0
    nexts = [decode_entry(f).metadata["scheduleNext"] for _, f in target(redis_client)]
    assert nexts == [format_instant(T0 + (k + 1) * 1_000) for k in range(1, 1_001)]
    fired = [r for r in history(redis_client) if r.event == "fired"]
    assert [r.due_ms for r in fired] == [T0 + k * 1_000 for k in range(1, 1_001)]


async def test_every_replaced_or_cancelled_stops_and_the_end_of_time_purges(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    from delayed_middleware.instants import MAX_INSTANT_MS

    clock = ManualClock(T0)
    engine = DelayEngine(aredis(), KEYS, clock, recurrence=None)
    await engine.schedule([every_env(1_000, sid="a"), every_env(1_000, sid="b")])
    clock.set(T0 + 1_000)
    await drain(engine)
    assert await engine.cancel("a")
    await engine.schedule([every_env(5_000, sid="b", published=T0 + 1_000)])  # replaces b
    clock.set(T0 + 5_000)
    await drain(engine)
    assert len(target(redis_client)) == 2  # a and b once each, then nothing until b's new grid
    clock.set(T0 + 6_000)
    await drain(engine)
    assert [decode_entry(f).metadata["scheduler"] for _, f in target(redis_client)][-1] == "b"
    assert await engine.cancel("b")
    # A grid whose next point falls after year 9999: the last occurrence says purge and goes.
    last = MAX_INSTANT_MS - 500
    clock.set(last - 1_000)
    await engine.schedule([every_env(1_000, sid="end", published=last - 1_000)])
    clock.set(last)
    await drain(engine)
    assert decode_entry(target(redis_client)[-1][1]).metadata["scheduleNext"] == "purge"
    assert await engine.pending() == 0
    assert redis_client.exists(KEYS.ids) == 0


async def test_a_fire_batch_refills_its_cron_envelopes_itself(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fire step hands back what the recurrence needs (expression, acceptance time), so
    the firing replica stores 1,000 successors in the same fire_due, without the refill-set
    sweep (which would read every ref and envelope back first)."""
    clock = ManualClock(T0)
    engine = DelayEngine(aredis(), KEYS, clock, recurrence=every)
    await engine.schedule([recurring(i, 1_000, sid=f"c{i}") for i in range(1_000)])

    async def no_sweep(limit: int = 0) -> int:
        raise AssertionError("the sweep ran: the fire step's refills were not applied directly")

    monkeypatch.setattr(engine, "refill_pending", no_sweep)
    for k in (1, 2, 3):
        clock.set(T0 + k * 1_000)
        await drain(engine)
        assert redis_client.zcard(KEYS.refill) == 0
        assert len(target(redis_client)) == 1_000 * k
    nexts = {decode_entry(f).metadata["scheduleNext"] for _, f in target(redis_client)[-1_000:]}
    assert nexts == {format_instant(T0 + 4_000)}


def index_buckets(client: redis.Redis) -> list[tuple[float, list[tuple[bytes, float]]]]:
    """The due index as (bucket start, its members with their due), in bucket order."""
    out = []
    tops = cast("list[tuple[bytes, float]]", client.zrange(KEYS.due, 0, -1, withscores=True))
    for b, start in tops:
        key = f"{KEYS.buckets}{b.decode()}"
        out.append((start, cast("list[tuple[bytes, float]]", client.zrange(key, 0, -1, withscores=True))))
    return out


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
