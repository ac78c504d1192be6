"""Trigger now and reschedule against a real Redis, on both fire paths: a triggered one-shot is
delivered once and gone, even racing its own fire or a cancel; a triggered schedule delivers one
extra occurrence (stamped scheduler / scheduleNext / scheduleOccurrence) and keeps its grid and its
pause; a reschedule moves a one-shot later or earlier, and racing its fire either fires once at the
new time or answers `fired` after the old one; a recurring schedule cannot be rescheduled."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis

from delayed_middleware.clock import ManualClock
from delayed_middleware.engine import DelayEngine, EngineConfig
from delayed_middleware.engine.timecontrol import (
    FIRED,
    OCCURRENCE_KEY,
    RECURRING,
    RESCHEDULED,
    TRIGGERED,
    UNKNOWN,
    TimeResult,
)
from delayed_middleware.entry import decode_entry
from delayed_middleware.instants import format_instant, parse_instant
from tests.middleware.engine.helpers import KEYS, T0, drain, env, every, history, payloads, recurring, target

pytestmark = pytest.mark.both_fire_paths


def make(
    aredis: Callable[[], aioredis.Redis], clock: ManualClock, config: EngineConfig | None = None
) -> DelayEngine:
    if config is None:
        return DelayEngine(aredis(), KEYS, clock, recurrence=every)
    return DelayEngine(aredis(), KEYS, clock, recurrence=every, config=config)


def metadata(client: redis.Redis, topic: str = "orders") -> list[Mapping[str, str]]:
    return [decode_entry(f).metadata for _, f in target(client, topic)]


async def test_a_triggered_one_shot_is_delivered_once_now_and_gone(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    clock = ManualClock(T0)
    engine = make(aredis, clock)
    await engine.schedule([env(1, T0 + 3_600_000, sid="a")])
    clock.set(T0 + 5)
    got = await engine.trigger("a", reason="test")
    assert (got.status, got.topic, got.at_ms) == (TRIGGERED, "orders", T0 + 5)
    await drain(engine)
    assert payloads(redis_client) == [1]
    assert metadata(redis_client)[0]["scheduler"] == "a"
    # The fire stamps its occurrence's time: the trigger's.
    assert metadata(redis_client)[0][OCCURRENCE_KEY] == format_instant(T0 + 5)
    # Gone: nothing fires at its old time, and a second trigger finds it fired.
    clock.set(T0 + 3_600_000)
    await drain(engine)
    assert payloads(redis_client) == [1]
    assert (await engine.trigger("a")).status == FIRED
    assert await engine.pending() == 0
    [rec] = history(redis_client, "triggered")
    assert (rec.id, rec.at_ms, rec.reason) == ("a", T0 + 5, "test")
    [fired] = history(redis_client, "fired")
    assert fired.due_ms == T0 + 5


async def test_a_trigger_racing_the_fire_step_delivers_once(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    for round in range(20):
        redis_client.flushall()
        clock = ManualClock(T0 + 1_000)
        engines = [make(aredis, clock) for _ in range(3)]
        await engines[0].schedule([env(round, T0 + 1_000, sid="r")])

        async def fire(e: DelayEngine) -> None:
            await drain(e)

        results = await asyncio.gather(
            engines[0].trigger("r"), engines[1].trigger("r"), fire(engines[1]), fire(engines[2])
        )
        await drain(engines[0])
        assert payloads(redis_client) == [round]
        statuses = {r.status for r in results[:2]}
        assert statuses <= {TRIGGERED, FIRED}


async def test_a_trigger_racing_a_cancel_leaves_it_delivered_or_cancelled_never_both(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    for round in range(20):
        redis_client.flushall()
        clock = ManualClock(T0)
        a, b = make(aredis, clock), make(aredis, clock)
        await a.schedule([env(round, T0 + 60_000, sid="c")])
        triggered, cancelled = await asyncio.gather(a.trigger("c"), b.cancel("c"))
        await drain(a)
        delivered = payloads(redis_client)
        if cancelled:
            # The cancel answered OK: nothing may go out, whatever the trigger said.
            assert delivered == []
        else:
            assert triggered.status == TRIGGERED
            assert delivered == [round]


async def test_a_triggered_schedule_delivers_one_extra_occurrence_and_keeps_its_grid(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    clock = ManualClock(T0)
    engine = make(aredis, clock)
    await engine.schedule([recurring(7, 10_000, sid="tick")])
    clock.set(T0 + 10_000)
    await drain(engine)
    clock.set(T0 + 12_345)
    got = await engine.trigger("tick")
    assert got.status == TRIGGERED
    md = metadata(redis_client)
    assert len(md) == 2
    assert md[1]["scheduler"] == "tick"
    assert md[1]["scheduleNext"] == format_instant(T0 + 20_000)
    assert md[1][OCCURRENCE_KEY] == format_instant(T0 + 12_345) == "2027-01-15T08:00:12.345Z"
    # The grid stands: the next occurrence is at 20 s, then 30 s.
    clock.set(T0 + 19_999)
    await drain(engine)
    assert len(payloads(redis_client)) == 2
    clock.set(T0 + 20_000)
    await drain(engine)
    assert payloads(redis_client) == [7, 7, 7]
    assert [r.event for r in history(redis_client) if r.event in ("triggered", "fired")] == [
        "fired",
        "triggered",
        "fired",
    ]


async def test_a_triggered_paused_schedule_delivers_once_and_stays_paused(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    clock = ManualClock(T0)
    engine = make(aredis, clock)
    await engine.schedule([recurring(3, 10_000, sid="p")])
    assert (await engine.set_paused("p", pause=True)).status == "paused"
    clock.set(T0 + 1_000)
    assert (await engine.trigger("p")).status == TRIGGERED
    assert payloads(redis_client) == [3]
    assert metadata(redis_client)[0]["scheduleNext"] == "-"
    for t in (10_000, 20_000, 30_000):
        clock.set(T0 + t)
        await drain(engine)
    assert payloads(redis_client) == [3]
    assert (await engine.set_paused("p", pause=True)).status == "already"


async def test_a_triggered_paused_one_shot_is_delivered_once(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    clock = ManualClock(T0)
    engine = make(aredis, clock)
    await engine.schedule([env(4, T0 + 60_000, sid="q")])
    await engine.set_paused("q", pause=True)
    assert (await engine.trigger("q")).status == TRIGGERED
    await drain(engine)
    assert payloads(redis_client) == [4]
    assert (await engine.set_paused("q", pause=False)).status == UNKNOWN


async def test_reschedule_moves_a_one_shot_later_and_earlier(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    clock = ManualClock(T0)
    engine = make(aredis, clock)
    await engine.schedule([env(1, T0 + 10_000, sid="l"), env(2, T0 + 50_000, sid="e")])
    assert (await engine.reschedule("l", T0 + 90_000, reason="op")).status == RESCHEDULED
    got = await engine.reschedule("e", T0 + 5_000)
    assert (got.status, got.at_ms) == (RESCHEDULED, T0 + 5_000)
    clock.set(T0 + 5_000)
    await drain(engine)
    assert payloads(redis_client) == [2]
    clock.set(T0 + 50_000)
    await drain(engine)
    assert payloads(redis_client) == [2]
    clock.set(T0 + 90_000)
    await drain(engine)
    assert payloads(redis_client) == [2, 1]
    moved = [r for r in history(redis_client, "rescheduled") if r.id == "l"]
    assert moved[0].due_ms == T0 + 90_000
    assert moved[0].reason == f"op from {format_instant(T0 + 10_000)}"


@pytest.mark.parametrize("past", ["1900-01-01T00:00:00Z", "2026-01-01T00:00:00Z"])
async def test_a_reschedule_into_the_past_fires_now_and_names_now_its_occurrence(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis, past: str
) -> None:
    # As a past scheduledSendTime: delivered at once. The CLI's --at and any caller of the engine
    # pass the instant as given; one before 1970 fired without scheduleOccurrence, its history
    # naming a due time in 1900.
    clock = ManualClock(T0)
    engine = make(aredis, clock)
    await engine.schedule([env(1, T0 + 60_000, sid="p")])
    got = await engine.reschedule("p", parse_instant(past))
    assert (got.status, got.at_ms) == (RESCHEDULED, T0)
    await drain(engine)
    assert payloads(redis_client) == [1]
    assert metadata(redis_client)[0][OCCURRENCE_KEY] == format_instant(T0)
    [moved] = history(redis_client, "rescheduled")
    assert moved.due_ms == T0
    [fired] = history(redis_client, "fired")
    assert fired.due_ms == T0


async def test_a_reschedule_racing_the_fire_fires_once_and_answers_what_happened(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    for round in range(25):
        redis_client.flushall()
        clock = ManualClock(T0 + 1_000)
        a, b = make(aredis, clock), make(aredis, clock)
        await a.schedule([env(round, T0 + 1_000, sid="x")])
        moved, _ = await asyncio.gather(a.reschedule("x", T0 + 500_000), drain(b))
        if moved.status == RESCHEDULED:
            # Moved first: nothing went out at the old time; it fires once at the new one.
            assert payloads(redis_client) == []
            clock.set(T0 + 500_000)
            await drain(b)
        else:
            assert moved.status == FIRED
        assert payloads(redis_client) == [round]


async def test_a_reschedule_racing_a_cancel_never_revives_it(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    for _ in range(20):
        redis_client.flushall()
        clock = ManualClock(T0)
        a, b = make(aredis, clock), make(aredis, clock)
        await a.schedule([env(1, T0 + 60_000, sid="y")])
        moved, cancelled = await asyncio.gather(a.reschedule("y", T0 + 1_000), b.cancel("y"))
        assert cancelled
        assert moved.status in (RESCHEDULED, UNKNOWN)
        clock.set(T0 + 120_000)
        await drain(a)
        assert payloads(redis_client) == []
        assert await a.pending() == 0


async def test_a_recurring_schedule_cannot_be_rescheduled(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    clock = ManualClock(T0)
    engine = make(aredis, clock)
    await engine.schedule([recurring(1, 10_000, sid="r")])
    before = redis_client.hget(KEYS.ids, "r")
    assert (await engine.reschedule("r", T0 + 1)).status == RECURRING
    assert redis_client.hget(KEYS.ids, "r") == before
    assert history(redis_client, "rescheduled") == []


async def test_unknown_ids_change_nothing(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    clock = ManualClock(T0)
    engine = make(aredis, clock)
    await engine.schedule([env(1, T0 + 10_000, sid="k")])
    assert (await engine.trigger("nope")).status == UNKNOWN
    assert (await engine.reschedule("nope", T0)).status == UNKNOWN
    assert [r.event for r in history(redis_client)] == ["scheduled"]
    assert await engine.pending() == 1


async def test_a_triggered_schedule_with_a_source_delivers_the_sources_latest_message(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    clock = ManualClock(T0)
    engine = make(aredis, clock)
    await engine.schedule([recurring(1, 10_000, sid="s", schedule_source="sensor")])
    # An empty source: nothing, as at a fire.
    assert (await engine.trigger("s")).status == TRIGGERED
    assert target(redis_client) == []
    redis_client.xadd("sensor", {"data": b'{"n":41}', "metadata": '{"unit":"C"}'})
    redis_client.xadd("sensor", {"data": b'{"n":42}', "metadata": '{"unit":"F"}'})
    clock.set(T0 + 7)
    assert (await engine.trigger("s")).status == TRIGGERED
    assert payloads(redis_client) == [42]
    [md] = metadata(redis_client)
    assert md["unit"] == "F"
    assert md["scheduler"] == "s"
    assert md[OCCURRENCE_KEY] == format_instant(T0 + 7)


async def test_a_triggered_schedule_bound_for_another_pubsub_goes_to_the_outbox(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    clock = ManualClock(T0)
    engine = make(aredis, clock)
    await engine.schedule([recurring(5, 10_000, sid="h", target_pubsub="kafka")])
    assert (await engine.trigger("h")).status == TRIGGERED
    assert target(redis_client) == []
    [(_, fields)] = target(redis_client, KEYS.outbox)
    assert fields[b"pubsub"] == b"kafka"
    assert fields[b"topic"] == b"orders"
    assert fields[b"id"] == b"h"


# Redis Cluster's engine (EngineConfig.two_phase): its scripts get the in-flight keys, so a cancel
# finds what a trigger registered (a `both_fire_paths` engine on one node takes the two-phase fire
# path with the single node's key layout).
CLUSTER = EngineConfig(two_phase=True)
# Cluster's path with a lease short enough for a test to outlast it.
SHORT_LEASE = EngineConfig(two_phase=True, lease_ms=200)


async def a_schedule(aredis: Callable[[], aioredis.Redis], config: EngineConfig | None = None) -> DelayEngine:
    """An engine with the schedule `tick` (every 10 s, payload 7), nothing fired yet."""
    engine = make(aredis, ManualClock(T0), config)
    await engine.schedule([recurring(7, 10_000, sid="tick")])
    return engine


async def test_nothing_of_a_triggered_occurrence_goes_out_after_a_cancel_was_answered(
    aredis: Callable[[], aioredis.Redis],
    redis_client: redis.Redis,
    monkeypatch: pytest.MonkeyPatch,
    fire_path: str,
) -> None:
    # Cluster: the target is in another slot, so the APPEND stays a second step after the script,
    # and the cancel stops the occurrence the script registered (keys.EngineKeys.triggers).
    engine = await a_schedule(aredis, CLUSTER if fire_path == "two-phase" else None)
    scripts = engine.state.scripts
    timecontrol = scripts.timecontrol
    seen: list[list[int]] = []

    async def cancel_after_the_script(*args: Any, **kwargs: Any) -> Any:
        got = await timecontrol(*args, **kwargs)
        if not seen:
            # The trigger's script answered; the trigger's call has not: a cancel lands here.
            assert await engine.cancel("tick")
            seen.append(payloads(redis_client))
        return got

    monkeypatch.setattr(scripts, "timecontrol", cancel_after_the_script)
    got = await engine.trigger("tick")
    # Once the cancel was answered OK, nothing more may go out (single node: the trigger's script
    # already appended it, atomically with its decision).
    assert payloads(redis_client) == seen[0]
    if fire_path == "two-phase":
        # Answered as a trigger after the cancel: nothing pending under that id, nothing went out.
        assert (seen[0], got.status) == ([], UNKNOWN)
        assert history(redis_client, "triggered") == []
        assert redis_client.exists(KEYS.triggers) == 0
    else:
        assert (seen[0], got.status) == ([7], TRIGGERED)


def append_fails(monkeypatch: pytest.MonkeyPatch, engine: DelayEngine, *, landed: bool, times: int) -> None:
    """The engine's next `times` APPENDs fail with a dropped connection: before the write, or after it
    `landed` (the reply lost)."""
    scripts = engine.state.scripts
    append = scripts.append
    left = [times]

    async def failing(*args: Any, **kwargs: Any) -> Any:
        got = await append(*args, **kwargs) if landed or not left[0] else None
        if left[0]:
            left[0] -= 1
            raise redis.exceptions.ConnectionError(f"Redis went away (landed: {landed})")
        return got

    monkeypatch.setattr(scripts, "append", failing)


# Cluster's path only: a single node appends in the trigger's own script (no second step to fail).
@pytest.mark.two_phase_path
async def test_a_trigger_lost_before_its_append_leaves_no_triggered_record_and_a_retry_delivers_once(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = await a_schedule(aredis, CLUSTER)
    append_fails(monkeypatch, engine, landed=False, times=2)  # the first try and its one resend
    with pytest.raises(redis.exceptions.ConnectionError):
        await engine.trigger("tick")
    assert payloads(redis_client) == []
    assert (await engine.trigger("tick")).status == TRIGGERED  # the caller, unanswered, retries
    assert payloads(redis_client) == [7]
    assert len(history(redis_client, "triggered")) == 1, "a triggered record without a delivery"


# Cluster's path only: a single node appends in the trigger's own script (no second step to fail).
@pytest.mark.two_phase_path
async def test_a_triggered_occurrences_append_whose_reply_was_lost_is_delivered_once_and_answered(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = await a_schedule(aredis, CLUSTER)
    append_fails(monkeypatch, engine, landed=True, times=1)
    # Answered (an error would have the publisher trigger again: a second delivery).
    assert (await engine.trigger("tick")).status == TRIGGERED
    assert payloads(redis_client) == [7]
    assert len(history(redis_client, "triggered")) == 1
    assert redis_client.exists(KEYS.triggers) == 0, "its registration outlived its APPEND"


@pytest.mark.two_phase_path
async def test_a_trigger_whose_process_died_before_its_append_blocks_nothing_and_is_swept(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = await a_schedule(aredis, CLUSTER)
    scripts = engine.state.scripts
    append = scripts.append

    async def gone(*args: Any, **kwargs: Any) -> Any:
        raise asyncio.CancelledError  # the trigger's process stops after its script answered

    monkeypatch.setattr(scripts, "append", gone)
    with pytest.raises(asyncio.CancelledError):
        await engine.trigger("tick")
    assert redis_client.zcard(KEYS.triggers) == 1
    # Kept as long as a fire marker (an APPEND may land that late), not for good.
    assert 0 < redis_client.pttl(KEYS.triggers) <= CLUSTER.fire_marker_ttl_ms, (
        "a crash's registration kept for good"
    )
    monkeypatch.setattr(scripts, "append", append)
    # Another replica's trigger is not held up by it.
    assert (await engine.trigger("tick")).status == TRIGGERED
    assert payloads(redis_client) == [7]
    # A registration older than a fire marker's lifetime (Redis clock) is swept by the next trigger.
    left: list[bytes] = redis_client.zrange(KEYS.triggers, 0, -1)  # type: ignore[assignment]
    redis_client.zadd(KEYS.triggers, dict.fromkeys(left, 1), xx=True)
    assert (await engine.trigger("tick")).status == TRIGGERED
    assert redis_client.exists(KEYS.triggers) == 0
    # And a cancel still works (and, with a registration left, stops nothing that went out).
    monkeypatch.setattr(scripts, "append", gone)
    with pytest.raises(asyncio.CancelledError):
        await engine.trigger("tick")
    assert await engine.cancel("tick")
    assert redis_client.exists(KEYS.triggers) == 0
    assert payloads(redis_client) == [7, 7]
    assert (await engine.trigger("tick")).status == UNKNOWN


@pytest.mark.two_phase_path
async def test_a_trigger_that_cannot_append_within_a_lease_sets_its_marker_and_delivers_nothing(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Past a lease its registration may be swept, so a cancel would not find it: the trigger fences.
    engine = await a_schedule(aredis, EngineConfig(two_phase=True, lease_ms=200))
    scripts = engine.state.scripts
    append = scripts.append
    sent: list[tuple[str, Any, Any]] = []

    async def slow_then_lost(target: str, items: Any, **kwargs: Any) -> Any:
        sent.append((target, items, kwargs))
        await asyncio.sleep(0.3)
        raise redis.exceptions.ConnectionError("Redis went away before the write")

    monkeypatch.setattr(scripts, "append", slow_then_lost)
    with pytest.raises(TimeoutError):
        await engine.trigger("tick")
    [(topic, items, kwargs)] = sent
    assert redis_client.get(items[0].marker) == b"late"
    # The first try, arriving now, writes nothing.
    assert await append(topic, items, **kwargs) == ["dup"]
    assert payloads(redis_client) == []
    assert history(redis_client, "triggered") == []
    # Its marker is set: nothing of it can go out, so a cancel has nothing left to stop there.
    assert redis_client.exists(KEYS.triggers) == 0, "a settled registration left for the sweep"


@pytest.mark.two_phase_path
async def test_an_append_sent_in_time_but_landing_late_is_still_stopped_by_a_cancel_answered_before(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The trigger sends its APPEND within its lease, and the command reaches the target's master
    # later (that master stalled, or the client's own retries): until then a cancel must still
    # find the registration, as it finds a claim, however many leases have passed.
    config = EngineConfig(two_phase=True, lease_ms=200)
    engine = await a_schedule(aredis, config)
    scripts = engine.state.scripts
    append = scripts.append
    sent, cancelled = asyncio.Event(), asyncio.Event()

    async def in_transit(*args: Any, **kwargs: Any) -> Any:
        sent.set()
        await cancelled.wait()
        return await append(*args, **kwargs)  # it lands now

    monkeypatch.setattr(scripts, "append", in_transit)
    trigger = asyncio.create_task(engine.trigger("tick"))
    await asyncio.wait_for(sent.wait(), 5)
    await asyncio.sleep(3 * config.lease_ms / 1000)
    # Another replica's cancel, answered OK.
    assert await make(aredis, ManualClock(T0), config).cancel("tick")
    cancelled.set()
    assert (await trigger).status == UNKNOWN
    assert payloads(redis_client) == []
    assert history(redis_client, "triggered") == []


async def test_a_trigger_request_sent_again_delivers_once_and_both_are_answered(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    engine = await a_schedule(aredis)
    # daprd's retry of one publish (same CloudEvent id): answered OK, nothing more goes out.
    assert (await engine.trigger("tick", request="ce-1")).status == TRIGGERED
    assert (await engine.trigger("tick", request="ce-1")).status == TRIGGERED
    assert payloads(redis_client) == [7]
    assert len(history(redis_client, "triggered")) == 1
    # Another request is another occurrence.
    assert (await engine.trigger("tick", request="ce-2")).status == TRIGGERED
    assert payloads(redis_client) == [7, 7]


async def test_trigger_identities_older_than_the_token_window_are_forgotten_by_later_triggers(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    # An app that triggers often and schedules seldom: the identities kept to answer retries
    # must not pile up for good (only SCHEDULE forgot them before).
    engine = await a_schedule(aredis)
    for i in range(150):
        assert (await engine.trigger("tick", request=f"ce-{i}")).status == TRIGGERED
    members: list[bytes] = redis_client.zrange(KEYS.calls, 0, -1)  # type: ignore[assignment]
    assert len([m for m in members if m.startswith(b"trigger:")]) == 150
    # All of them fall out of the window (their scores, on the Redis clock, are made old).
    redis_client.zadd(KEYS.calls, dict.fromkeys(members, 1), xx=True)
    await engine.trigger("tick", request="ce-new")
    await engine.trigger("tick", request="ce-newer")
    after: list[bytes] = redis_client.zrange(KEYS.calls, 0, -1)  # type: ignore[assignment]
    left = {m for m in after if m.startswith(b"trigger:")}
    assert left == {b"trigger:4:tick:ce-new", b"trigger:4:tick:ce-newer"}


@pytest.mark.parametrize("cluster", [False, True])
async def test_trigger_requests_of_ids_with_colons_are_not_taken_for_each_other(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis, cluster: bool
) -> None:
    # Schedule `a:b` with request `c`, and schedule `a` with request `b:c`: two triggers, each delivered.
    engine = make(aredis, ManualClock(T0), CLUSTER if cluster else None)
    await engine.schedule([recurring(1, 10_000, sid="a:b"), recurring(2, 10_000, sid="a")])
    assert (await engine.trigger("a:b", request="c")).status == TRIGGERED
    assert (await engine.trigger("a", request="b:c")).status == TRIGGERED
    assert sorted(payloads(redis_client)) == [1, 2]


async def test_a_trigger_whose_answer_was_lost_is_retried_without_a_second_occurrence(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = await a_schedule(aredis)
    scripts = engine.state.scripts
    timecontrol = scripts.timecontrol
    lost = [True]

    async def answer_lost(*args: Any, **kwargs: Any) -> Any:
        got = await timecontrol(*args, **kwargs)
        if lost[0] and kwargs.get("request"):
            lost[0] = False
            raise redis.exceptions.ConnectionError("Redis went away after the script ran")
        return got

    monkeypatch.setattr(scripts, "timecontrol", answer_lost)
    with pytest.raises(redis.exceptions.ConnectionError):
        await engine.trigger("tick", request="ce-1")
    assert (await engine.trigger("tick", request="ce-1")).status == TRIGGERED  # the publisher's retry
    assert payloads(redis_client) == [7]


def append_dies(monkeypatch: pytest.MonkeyPatch, engine: DelayEngine) -> list[tuple[str, Any, Any]]:
    """`engine`'s trigger APPENDs stop its process (their script answered): each one's arguments are
    kept (the command may still be on its way) until `monkeypatch.undo()`."""
    sent: list[tuple[str, Any, Any]] = []

    async def gone(target: str, items: Any, **kwargs: Any) -> Any:
        sent.append((target, items, kwargs))
        raise asyncio.CancelledError  # the trigger's process stops after its script answered

    monkeypatch.setattr(engine.state.scripts, "append", gone)
    return sent


async def first_attempt_held(
    aredis: Callable[[], aioredis.Redis], monkeypatch: pytest.MonkeyPatch
) -> tuple[DelayEngine, asyncio.Task[TimeResult], asyncio.Event]:
    """`tick` on Cluster's path, and a trigger of it (request `ce-1`) whose script answered and whose
    APPEND waits, not yet sent, until the returned event is set. Later APPENDs go through."""
    engine = await a_schedule(aredis, CLUSTER)
    scripts = engine.state.scripts
    append = scripts.append
    reached, go = asyncio.Event(), asyncio.Event()

    async def held(*args: Any, **kwargs: Any) -> Any:
        if not reached.is_set():
            reached.set()
            await go.wait()
        return await append(*args, **kwargs)

    monkeypatch.setattr(scripts, "append", held)
    first = asyncio.create_task(engine.trigger("tick", request="ce-1"))
    await asyncio.wait_for(reached.wait(), 5)
    return engine, first, go


# Cluster's path only: a single node decides, appends and records a request in one script.
@pytest.mark.two_phase_path
async def test_a_trigger_retried_while_the_first_attempt_is_still_appending_delivers_once(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine, first, go = await first_attempt_held(aredis, monkeypatch)
    # daprd's retry of the same publish (its first attempt timed out), through another replica.
    retry = await make(aredis, ManualClock(T0 + 500), CLUSTER).trigger("tick", request="ce-1")
    go.set()
    assert retry.status == TRIGGERED
    assert (await first).status == TRIGGERED
    assert payloads(redis_client) == [7], "a retry of one trigger delivered a second occurrence"
    assert len(history(redis_client, "triggered")) == 1
    # The same occurrence: stamped with the first attempt's trigger time.
    assert retry.at_ms == T0
    assert [m[OCCURRENCE_KEY] for m in metadata(redis_client)] == [format_instant(T0)]
    assert redis_client.exists(KEYS.triggers) == 0
    # Another request is another occurrence.
    assert (await engine.trigger("tick", request="ce-2")).status == TRIGGERED
    assert payloads(redis_client) == [7, 7]


@pytest.mark.two_phase_path
async def test_a_trigger_retried_after_its_first_attempt_died_before_appending_delivers_it_once(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = await a_schedule(aredis, CLUSTER)
    append = engine.state.scripts.append
    sent = append_dies(monkeypatch, engine)
    with pytest.raises(asyncio.CancelledError):
        await engine.trigger("tick", request="ce-1")
    monkeypatch.undo()
    assert payloads(redis_client) == []
    assert (await engine.trigger("tick", request="ce-1")).status == TRIGGERED  # daprd's retry
    assert payloads(redis_client) == [7]
    # The first attempt's APPEND, landing now, is the same occurrence: it writes nothing.
    [(topic, items, kwargs)] = sent
    assert await append(topic, items, **kwargs) == ["dup"]
    assert payloads(redis_client) == [7], "the first attempt's APPEND delivered a second occurrence"
    assert len(history(redis_client, "triggered")) == 1
    assert (await engine.trigger("tick", request="ce-1")).status == TRIGGERED
    assert payloads(redis_client) == [7]


@pytest.mark.two_phase_path
async def test_a_trigger_retried_after_a_cancel_stopped_its_first_attempt_delivers_nothing(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine, first, go = await first_attempt_held(aredis, monkeypatch)
    other = make(aredis, ManualClock(T0 + 500), CLUSTER)
    assert await other.cancel("tick")
    assert (await other.trigger("tick", request="ce-1")).status == UNKNOWN  # the retry
    go.set()
    assert (await first).status == UNKNOWN
    assert (await engine.trigger("tick", request="ce-1")).status == UNKNOWN
    assert payloads(redis_client) == []
    assert history(redis_client, "triggered") == []


@pytest.mark.two_phase_path
async def test_a_trigger_retried_after_its_first_attempt_fenced_itself_past_its_lease_delivers_once(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = await a_schedule(aredis, SHORT_LEASE)
    scripts = engine.state.scripts
    append = scripts.append

    async def slow_then_lost(*args: Any, **kwargs: Any) -> Any:
        await asyncio.sleep(0.3)
        raise redis.exceptions.ConnectionError("Redis went away before the write")

    monkeypatch.setattr(scripts, "append", slow_then_lost)
    with pytest.raises(TimeoutError):
        await engine.trigger("tick", request="ce-1")  # its resend, past its lease, fenced it
    monkeypatch.setattr(scripts, "append", append)
    # daprd's retry (a moment later): nothing went out, so it is a trigger again, delivered once.
    got = await make(aredis, ManualClock(T0 + 500), SHORT_LEASE).trigger("tick", request="ce-1")
    assert got.status == TRIGGERED
    assert payloads(redis_client) == [7]
    assert len(history(redis_client, "triggered")) == 1


@pytest.mark.two_phase_path
async def test_a_trigger_request_is_forgotten_after_the_token_window(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = await a_schedule(aredis, CLUSTER)
    append_dies(monkeypatch, engine)
    with pytest.raises(asyncio.CancelledError):
        await engine.trigger("tick", request="ce-1")
    monkeypatch.undo()
    # Its decision falls out of the token window (its score, on the Redis clock, made old) and
    # the clock moved on: a publish with the same id now is a new trigger, at its own time.
    left: list[bytes] = redis_client.zrange(KEYS.triggers, 0, -1)  # type: ignore[assignment]
    old = int(redis_client.time()[0]) * 1000 - CLUSTER.token_window_ms - 1000
    redis_client.zadd(KEYS.triggers, dict.fromkeys(left, old), xx=True)
    later = make(aredis, ManualClock(T0 + 5_000), CLUSTER)
    got = await later.trigger("tick", request="ce-1")
    assert (got.status, got.at_ms) == (TRIGGERED, T0 + 5_000)
    assert [m[OCCURRENCE_KEY] for m in metadata(redis_client)] == [format_instant(T0 + 5_000)]


@pytest.mark.two_phase_path
async def test_a_trigger_retried_twice_across_a_replace_finds_the_new_schedules_attempt_and_delivers_once(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = await a_schedule(aredis, CLUSTER)
    append_dies(monkeypatch, engine)
    with pytest.raises(asyncio.CancelledError):
        await engine.trigger("tick", request="ce-1")  # died before its APPEND: its registration stays
    monkeypatch.undo()
    await engine.schedule([recurring(8, 10_000, sid="tick")])  # published again: another envelope
    await asyncio.sleep(0.01)  # the next registration scores later on the Redis clock
    # daprd's retry triggers the new schedule; its APPEND waits while daprd retries once more.
    second = make(aredis, ManualClock(T0 + 500), CLUSTER)
    append = second.state.scripts.append
    reached, go = asyncio.Event(), asyncio.Event()

    async def held(*args: Any, **kwargs: Any) -> Any:
        reached.set()
        await go.wait()
        return await append(*args, **kwargs)

    monkeypatch.setattr(second.state.scripts, "append", held)
    retry = asyncio.create_task(second.trigger("tick", request="ce-1"))
    await asyncio.wait_for(reached.wait(), 5)
    # The old envelope's registration (same request, same token) must not hide the new one's.
    again = await make(aredis, ManualClock(T0 + 1_000), CLUSTER).trigger("tick", request="ce-1")
    go.set()
    assert (await retry).status == TRIGGERED
    assert payloads(redis_client) == [8], "a retry of one trigger delivered a second occurrence"
    assert (again.status, again.at_ms) == (TRIGGERED, T0 + 500)
    assert len(history(redis_client, "triggered")) == 1


@pytest.mark.two_phase_path
async def test_a_trigger_whose_record_failed_after_its_append_is_retried_without_a_second_occurrence(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = await a_schedule(aredis, CLUSTER)
    timecontrol = engine.state.scripts.timecontrol

    async def record_lost(op: str, *args: Any, **kwargs: Any) -> Any:
        if op == "record":
            raise redis.exceptions.ConnectionError("Redis went away before the record")
        return await timecontrol(op, *args, **kwargs)

    monkeypatch.setattr(engine.state.scripts, "timecontrol", record_lost)
    assert (await engine.trigger("tick", request="ce-1")).status == TRIGGERED  # delivered, not recorded
    monkeypatch.undo()
    assert payloads(redis_client) == [7]
    # Its answer lost too: daprd's retry of the same publish is the same trigger.
    got = await make(aredis, ManualClock(T0 + 500), CLUSTER).trigger("tick", request="ce-1")
    assert payloads(redis_client) == [7], "a retry of one trigger delivered a second occurrence"
    assert (got.status, got.at_ms) == (TRIGGERED, T0)
    assert len(history(redis_client, "triggered")) == 1
