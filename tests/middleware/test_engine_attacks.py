"""Engine v2 attacked: inputs, timings and faults that would lose, double or block a delayed
message, or make a script stop half way (Redis does not roll a script back). Real Redis."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable

import pytest
import redis
import redis.asyncio as aioredis

from delayed_middleware import scripts
from delayed_middleware.clock import ManualClock, SystemClock
from delayed_middleware.engine import DelayEngine, EngineConfig, FireReport
from delayed_middleware.entry import Trim, decode_entry
from delayed_middleware.envelope import RECURRING, Envelope, encode_envelope
from tests.conftest import SkewedClock, drain_and_compact, stored_bytes, wait_until
from tests.middleware.test_engine import KEYS, T0, env, target
from tests.middleware.test_engine_v2 import drain, every, history, payloads, recurring


def bare_fire(client: redis.Redis, now: int) -> list[object]:
    """The FIRE script alone: a replica that fires and dies before its REFILL step."""
    args = (KEYS.buckets, now, 500, 2000, 1 << 20, "", "", 100)
    return list(client.eval(scripts.FIRE, len(KEYS.script_keys), *KEYS.script_keys, *args))


def raw_schedule(client: redis.Redis, e: Envelope, now: int, nxt: int | str) -> None:
    """The SCHEDULE script alone, with the next due time a replica computed (or '-')."""
    client.eval(
        scripts.SCHEDULE, len(KEYS.script_keys), *KEYS.script_keys,
        *(KEYS.buckets, "nowake", now, f"tok-{e.schedule_id}", 100, 120_000, 1),
        *(encode_envelope(e), e.due_ms, e.schedule_id, e.kind, e.topic, e.size, e.schedule, nxt, "-"),
    )  # fmt: skip


def named_recurring(sid: str, due: int, published: int, interval: int, n: int) -> Envelope:
    return Envelope(
        id=sid,
        topic="orders",
        due_ms=due,
        published_at_ms=published,
        message=f'{{"n":{n}}}'.encode(),
        schedule_id=sid,
        kind=RECURRING,
        schedule=f"@test {interval}",
    )


# --- a script must never raise after its first write ----------------------------------------


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


# --- a replica that stops between FIRE and REFILL must not strand a schedule -----------------


async def test_a_refill_left_by_a_stopped_replica_is_completed_by_a_running_one(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    """Replica A fires occurrence 1 and stops before REFILL; replica B's FIRE at occurrence 2
    takes the envelope out of the index to wait for its refill, and B stops too (a rolling
    update). A replica that was already running refilled only at its own start or after a
    Redis error: the schedule never fired again."""
    clock = SystemClock()
    t0 = clock.now_ms()
    survivor = DelayEngine(aredis(), KEYS, clock, recurrence=every, config=EngineConfig(max_sleep_s=0.1))
    task = asyncio.create_task(survivor.run())
    try:
        await asyncio.sleep(0.3)  # past its start-up refill
        # Its next time is unknown ("-"), as after A fired it and stopped before REFILL.
        raw_schedule(redis_client, named_recurring("tick", t0 + 200, t0 - 99_800, 100_000, 1), t0, "-")
        # "B": its FIRE finds no next time, parks the occurrence for REFILL, then B stops.
        bare_fire(redis_client, t0 + 200)
        assert redis_client.zrange(KEYS.refill, 0, -1) == [b"tick"]
        for _ in range(60):
            if target(redis_client):
                break
            await asyncio.sleep(0.1)
        assert payloads(redis_client) == [1]
        assert await survivor.pending() == 1
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


# --- the engine loop must survive what a recurrence function raises ---------------------------


async def test_engine_loop_survives_a_recurrence_that_raises(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    """A recurrence (cron library) that raises something other than ValueError killed the
    engine task: no delayed message of the app fired any more."""

    def broken(e: Envelope, after: int) -> int | None:
        if e.schedule_id == "bad":
            raise TypeError("a bug in a cron library")
        return every(e, after)

    clock = SystemClock()
    t0 = clock.now_ms()
    engine = DelayEngine(aredis(), KEYS, clock, recurrence=broken, config=EngineConfig(max_sleep_s=0.1))
    # "bad" is stored with a next time, so schedule() itself does not call the recurrence.
    raw_schedule(redis_client, named_recurring("bad", t0 + 100, t0, 100, 0), t0, t0 + 200)
    task = asyncio.create_task(engine.run())
    try:
        await engine.schedule([env(5, t0 + 600)])
        for _ in range(60):
            if 5 in payloads(redis_client):
                break
            await asyncio.sleep(0.1)
        assert not task.done(), task.exception() if task.done() else None
        assert 5 in payloads(redis_client)
        # The schedule it cannot advance is withdrawn, visibly.
        [gone] = [h for h in history(redis_client) if h.event == "cancelled"]
        assert gone.id == "bad"
        assert "a bug in a cron library" in gone.reason
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, TypeError):
            await task


# --- a malformed id must not make CANCEL raise -------------------------------------------------


async def test_cancel_of_a_stream_id_out_of_range_is_a_clean_no(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    engine = DelayEngine(aredis(), KEYS, ManualClock(T0))
    await engine.schedule([env(1, T0 + 10)])
    assert await engine.cancel("99999999999999999999999-1") is False
    assert await engine.cancel("1-99999999999999999999999") is False
    assert await engine.pending() == 1


# --- one fire call's work is bounded whatever the envelopes carry -----------------------------


def heavy(n: int, *, keys: int = 0, value_bytes: int = 0) -> Envelope:
    """A message with a tiny payload and a lot of metadata: `keys` keys, or one key of `value_bytes`."""
    metadata = {f"k{i}": "v" for i in range(keys)} if keys else {"big": "v" * value_bytes}
    return Envelope(
        id="",
        topic="orders",
        due_ms=T0,
        published_at_ms=T0,
        message=f'{{"n":{n}}}'.encode(),
        metadata=metadata,
    )


async def test_metadata_pairs_count_against_the_fire_budget(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    """Metadata keys were free in the budget: 500 messages of 4,000 metadata keys each fired
    in one script call (2M pairs decoded and JSON-encoded: seconds of blocked Redis)."""
    reports: list[FireReport] = []
    engine = DelayEngine(aredis(), KEYS, ManualClock(T0), on_batch=reports.append)
    await engine.schedule([heavy(i, keys=4_000) for i in range(6)])
    await drain(engine)
    assert sorted(payloads(redis_client)) == list(range(6))
    # 4,000 pairs are 1,000 units of work of the 2,000 a call may do (with the entry).
    assert [r.fired for r in reports] == [1] * 6


async def test_metadata_bytes_count_against_the_fire_budget(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    """Only payload bytes were counted: messages with 1 MiB metadata values and a 7-byte
    payload all fired in one call, however many."""
    reports: list[FireReport] = []
    engine = DelayEngine(aredis(), KEYS, ManualClock(T0), on_batch=reports.append)
    await engine.schedule([heavy(i, value_bytes=1 << 20) for i in range(10)])
    await drain(engine)
    assert sorted(payloads(redis_client)) == list(range(10))
    assert max(r.fired for r in reports) <= 3  # 4 MiB per call, metadata included


async def test_costly_envelopes_read_the_clock_before_the_next(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    """The time budget was checked every 8 envelopes whatever they cost: 8 costly ones ran
    before the first look at the clock."""
    reports: list[FireReport] = []
    engine = DelayEngine(
        aredis(),
        KEYS,
        ManualClock(T0),
        config=EngineConfig(fire_budget_us=1, batch_entries=1 << 30, batch_bytes=1 << 30),
        on_batch=reports.append,
    )
    await engine.schedule([heavy(i, keys=200) for i in range(16)])
    await drain(engine)
    assert sorted(payloads(redis_client)) == list(range(16))
    assert max(r.fired for r in reports) == 1


# --- cancel by stream id of a recurring envelope that has a scheduleId --------------------------


async def test_cancel_by_stream_id_of_a_named_recurring_leaves_no_index_entry(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    """The stream-id path removed the index entry at the envelope's first due time; a
    recurring envelope that fired since waits at a later one. Its index entry stayed,
    counted as pending, until that time came."""
    clock = ManualClock(T0)
    engine = DelayEngine(aredis(), KEYS, clock, recurrence=every)
    await engine.schedule([recurring(1, 1_000, sid="job")])
    clock.set(T0 + 1_000)
    await drain(engine)
    assert payloads(redis_client) == [1]
    stream_id = redis_client.hget(KEYS.ids, "job").split()[0].decode()  # type: ignore[union-attr]
    assert await engine.cancel(stream_id)
    assert await engine.pending() == 0
    assert redis_client.exists(KEYS.due, KEYS.ids, KEYS.refill) == 0
    clock.set(T0 + 60_000)
    await drain(engine)
    assert payloads(redis_client) == [1]


# --- a caller's retry with its token stores nothing twice, however many chunks ------------------


async def test_a_retried_call_token_covers_every_chunk(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    """The caller's token named the first chunk only; the later chunks of a retried call
    got fresh tokens and were stored again."""
    engine = DelayEngine(aredis(), KEYS, ManualClock(T0), config=EngineConfig(schedule_chunk=2))
    envs = [env(i, T0 + 10) for i in range(5)]
    await engine.schedule(envs, token="call-9")
    await engine.schedule(envs, token="call-9")  # the caller's retry after a lost reply
    assert await engine.pending() == 5
    assert redis_client.xlen(KEYS.stream) == 5


# --- a replica that cannot compute recurrences must leave them to one that can ---------------


async def test_an_engine_without_recurrence_does_not_cancel_recurring_schedules(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    """The component builds its engine without a recurrence function (cron is another
    issue): during a rolling upgrade such a replica met a refill and cancelled the schedule
    ("needs the engine's recurrence function" treated as unschedulable)."""
    clock = ManualClock(T0)
    raw_schedule(redis_client, named_recurring("cron", T0 + 1_000, T0, 1_000, 1), T0, "-")
    clock.set(T0 + 1_000)
    plain = DelayEngine(aredis(), KEYS, clock)
    await drain(plain)
    await plain.refill_pending()
    assert redis_client.hexists(KEYS.ids, "cron")
    assert [h.event for h in history(redis_client)] == ["scheduled"]
    capable = DelayEngine(aredis(), KEYS, clock, recurrence=every)
    await drain(capable)
    assert payloads(redis_client) == [1]
    assert await capable.pending() == 1


# --- one SCHEDULE call is bounded by bytes too ------------------------------------------------


async def test_a_large_schedule_is_stored_in_calls_bounded_by_bytes(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    """Chunks counted envelopes only: a 64 MiB bulk publish (16 envelopes of 4 MiB) was one
    SCHEDULE call holding Redis ~200 ms."""

    def calls() -> int:
        stats = redis_client.info("commandstats")
        return sum(int(v["calls"]) for k, v in stats.items() if k in ("cmdstat_evalsha", "cmdstat_eval"))

    engine = DelayEngine(aredis(), KEYS, ManualClock(T0))
    big = [
        Envelope(
            id="",
            topic="orders",
            due_ms=T0,
            published_at_ms=T0,
            message=f'{{"n":{i}}}'.encode().ljust(1 << 20),
        )
        for i in range(8)
    ]
    before = calls()
    await engine.schedule(big)
    assert calls() - before >= 8
    assert await engine.pending() == 8
    await drain(engine)
    assert redis_client.xlen("orders") == 8


# --- out of memory mid-fire: nothing half done ------------------------------------------------


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


# --- a component's trim applies to its own messages only --------------------------------------


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


async def test_sampled_messages_count_against_the_fire_budget(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    """A scheduleSource's latest message is copied at each fire, whatever its size; it was
    not counted: 20 schedules sampling a 1 MiB message fired as 20 MiB in one call."""
    reports: list[FireReport] = []
    clock = ManualClock(T0)
    engine = DelayEngine(aredis(), KEYS, clock, recurrence=every, on_batch=reports.append)
    redis_client.xadd("sensor", {"data": b"x" * (1 << 20), "metadata": b"{}"})
    await engine.schedule([recurring(i, 1_000, schedule_source="sensor") for i in range(20)])
    clock.set(T0 + 1_000)
    await drain(engine)
    assert redis_client.xlen("orders") == 20
    assert max(r.fired for r in reports) <= 4  # 4 MiB per call


# --- idempotency must not depend on the replicas' clocks ----------------------------------------


async def test_a_replica_with_a_fast_clock_does_not_forget_other_replicas_call_tokens(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    """Call tokens were scored and pruned by the calling replica's clock: one running an hour
    ahead pruned every token of the others as 'older than the window', so another replica's
    retry after a lost reply stored its messages twice."""
    t0 = SystemClock().now_ms()
    honest = DelayEngine(aredis(), KEYS, ManualClock(t0))
    ahead = DelayEngine(aredis(), KEYS, ManualClock(t0 + 3_600_000))
    await honest.schedule([env(1, t0 + 60_000)], token="honest-call")
    await ahead.schedule([env(2, t0 + 60_000)])  # any call of the fast replica
    await honest.schedule([env(1, t0 + 60_000)], token="honest-call")  # the retry
    assert await honest.pending() == 2


# --- memory: fired envelopes must not pin their stream nodes -----------------------------------


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


# --- a message deleted behind the engine's back is lost loudly -----------------------------------


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


# --- clock skew ---------------------------------------------------------------------------------


async def test_a_replica_with_a_fast_clock_does_not_fire_early(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    """A message due in a minute by the publisher's clock (and Redis's) was delivered at once
    by a replica whose system clock runs ten minutes ahead: FIRE compared due times with the
    firing replica's clock. Due decisions are made on Redis TIME."""
    t0 = SystemClock().now_ms()
    publisher = DelayEngine(aredis(), KEYS, ManualClock(t0))
    fast = DelayEngine(aredis(), KEYS, SkewedClock(600_000))
    await publisher.schedule([env(1, t0 + 60_000)])
    fired, head = await fast.fire_due()
    assert (fired, payloads(redis_client)) == (0, [])
    # The head comes back in the fast replica's own frame, so its loop sleeps ~a minute.
    assert head is not None
    assert 59_000 < head - fast._clock.now_ms() <= 60_000


async def test_a_replica_with_a_slow_clock_fires_on_time_and_measures_lateness_on_redis_time(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    """A replica whose clock runs ten minutes behind held every message ten minutes (it found
    nothing due), and would have recorded a negative lateness."""
    slow = DelayEngine(aredis(), KEYS, SkewedClock(-600_000))
    due = redis_ms(redis_client) + 200
    await slow.schedule([env(1, due)])
    await wait_until(lambda: redis_ms(redis_client) >= due, "Redis TIME past the due time")
    await drain(slow)
    assert payloads(redis_client) == [1]
    [fired] = [r for r in history(redis_client) if r.event == "fired"]
    assert fired.lateness_ms is not None
    assert 0 <= fired.lateness_ms < 5_000
    assert 0 <= fired.at_ms - due < 5_000


async def test_a_fast_replica_sleeps_until_the_message_is_due_by_redis_time(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    """A replica ten minutes ahead must neither spin on a head that looks overdue by its own
    clock (one FIRE after another for ten minutes) nor fire before Redis says it is due."""
    engine = DelayEngine(aredis(), KEYS, SkewedClock(600_000))
    due = redis_ms(redis_client) + 1_500
    await engine.schedule([env(1, due)])
    redis_client.config_resetstat()
    runner = asyncio.create_task(engine.run())
    try:
        await wait_until(lambda: bool(payloads(redis_client)), "the delivery")
        arrived = redis_ms(redis_client)
    finally:
        runner.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await runner
    [entry_id, _] = target(redis_client)[0]
    assert int(entry_id.split("-")[0]) >= due
    assert arrived - due < 1_000
    # Woken by its own schedule's wake-up, then asleep until due: a handful of fire calls.
    calls = int(redis_client.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0))
    assert calls < 20


def redis_ms(client: redis.Redis) -> int:
    """The Redis server's clock (TIME) in ms."""
    sec, usec = client.time()
    return int(sec) * 1000 + int(usec) // 1000


async def test_a_replica_with_a_fast_clock_does_not_age_out_history_early(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    """History records carry stream ids from Redis's clock; a replica two days ahead trimmed
    by its own clock, so a one-day retention deleted records written a second ago. The age
    trim is taken on the shard's time, as FIRE's streamTTL trim is."""
    slow = DelayEngine(aredis(), KEYS, SystemClock())
    due = redis_ms(redis_client)
    await slow.schedule([env(1, due)])
    await drain(slow)
    assert [r.event for r in history(redis_client)] == ["scheduled", "fired"]
    fast = DelayEngine(aredis(), KEYS, SkewedClock(2 * 86_400_000))
    stop = asyncio.Event()
    passes = 0

    def beat() -> None:
        nonlocal passes
        passes += 1

    run = asyncio.create_task(fast.run(stop, beat=beat))
    await wait_until(lambda: passes >= 2, "two passes of the fast replica's loop")
    stop.set()
    await run
    assert [r.event for r in history(redis_client)] == ["scheduled", "fired"]


@pytest.mark.parametrize("two_phase", [False, True], ids=["fire", "two-phase"])
async def test_a_replica_with_a_fast_clock_does_not_trim_unread_messages_by_stream_ttl(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis, two_phase: bool
) -> None:
    """streamTTL trims a topic by MINID, and topic entry ids come from Redis's clock. A replica
    two days ahead that fires a message with a one-day streamTTL must not trim the messages
    published to that topic a moment ago (nobody has read them yet); those older than a day
    by Redis's clock still go (whole stream nodes: `~`)."""
    old = redis_ms(redis_client) - 2 * 86_400_000
    for n in range(300):
        redis_client.xadd(
            "orders", {"data": json.dumps({"n": n + 1000}), "metadata": "{}"}, id=f"{old}-{n + 1}"
        )
    for n in range(5):
        redis_client.xadd("orders", {"data": json.dumps({"n": n + 100}), "metadata": "{}"})
    trim = Trim(mode="MINID", max_age_ms=86_400_000)
    cfg = EngineConfig(two_phase=two_phase)
    fast = DelayEngine(aredis(), KEYS, SkewedClock(2 * 86_400_000), trim=trim, config=cfg)
    await fast.schedule([env(1, redis_ms(redis_client))])
    await drain(fast)
    got = sorted(payloads(redis_client))
    assert [n for n in got if n < 1000] == [1, 100, 101, 102, 103, 104]
    assert len(got) - 6 < 100
