"""scheduleOccurrence and the catch-up policies against a real Redis, through both fire paths, with
time moved by an injected clock: every delivery names its occurrence's nominal time (one-shot,
@every, cron with jitter; kept by a subscriber retry), and what a recurring schedule delivers of
the occurrences it missed while nothing ran: `one`, `all` (each once, in order, paced), `none`,
the window, a pause (always skipped), and replicas racing the catch-up."""

from __future__ import annotations

import asyncio
import itertools
import subprocess
from collections.abc import Callable, Mapping
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis

from delayed_middleware import lua_scripts
from delayed_middleware.aio import text
from delayed_middleware.catchup import CATCHUP_PACE_MS
from delayed_middleware.clock import ManualClock
from delayed_middleware.engine import DelayEngine
from delayed_middleware.entry import decode_entry
from delayed_middleware.envelope import Envelope
from delayed_middleware.history import HistoryRecord, decode_record
from delayed_middleware.instants import format_instant, parse_instant
from delayed_middleware.kinds import Kind
from delayed_middleware.plan import PlanContext, plan_publish
from delayed_middleware.publish_keys import SCHEDULE_OCCURRENCE
from delayed_middleware.schedules import EnvelopeRecurrence
from tests.middleware.engine.helpers import KEYS
from tests.redis_server import stream_entries

ROOT = Path(__file__).resolve().parents[3]
MINUTE = 60_000
T0 = parse_instant("2026-11-29T09:00:30Z")
THREE_DAYS = 3 * 24 * 60


def engine_for(aredis: Callable[[], aioredis.Redis], clock: ManualClock) -> DelayEngine:
    return DelayEngine(aredis(), KEYS, clock, recurrence=EnvelopeRecurrence())


async def publish(engine: DelayEngine, clock: ManualClock, metadata: Mapping[str, str]) -> None:
    ctx = PlanContext(now_ms=clock.now_ms(), pubsub_name="p", enabled=True)
    plan = plan_publish("orders", b"tick", metadata, "", ctx)
    await engine.schedule([d.envelope for d in plan.delayed])


async def run_until(engines: list[DelayEngine], clock: ManualClock, end: int) -> None:
    """Move the clock from head to head, every engine firing at each, up to `end`."""
    while True:
        heads = [h for _, h in await asyncio.gather(*(e.fire_due() for e in engines))]
        head = min((h for h in heads if h is not None), default=None)
        if head is None or head > end:
            clock.set(max(end, clock.now_ms()))
            await asyncio.gather(*(e.fire_due() for e in engines))
            return
        clock.set(max(head, clock.now_ms()))


def delivered(client: redis.Redis, sid: str = "") -> list[dict[str, str]]:
    rows = [dict(decode_entry(f).metadata) for _, f in stream_entries(client, "orders")]
    return [r for r in rows if not sid or r.get("scheduler") == sid]


def events(client: redis.Redis, event: str) -> list[HistoryRecord]:
    records = [decode_record(i, f) for i, f in stream_entries(client, KEYS.history)]
    return [r for r in records if r.event == event]


def occurrences(client: redis.Redis, sid: str) -> list[int]:
    return [parse_instant(m[SCHEDULE_OCCURRENCE]) for m in delivered(client, sid)]


async def started(
    aredis: Callable[[], aioredis.Redis], metadata: Mapping[str, str], until: int
) -> tuple[DelayEngine, ManualClock]:
    """A schedule published at T0 by an engine whose clock then runs to `until`, firing on the way."""
    clock = ManualClock(T0)
    engine = engine_for(aredis, clock)
    await publish(engine, clock, metadata)
    await run_until([engine], clock, until)
    return engine, clock


async def outage(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis, metadata: Mapping[str, str], minutes: int
) -> tuple[DelayEngine, ManualClock]:
    """A 1-minute schedule fired once at 09:01, then nothing runs for `minutes` minutes."""
    engine, clock = await started(
        aredis, {"schedule": "@every 1m", "scheduleId": "tick", **metadata}, T0 + MINUTE
    )
    assert occurrences(redis_client, "tick") == [T0 + MINUTE]
    clock.set(T0 + MINUTE + minutes * MINUTE + 5_000)
    return engine, clock


@pytest.mark.both_fire_paths
async def test_every_delivery_names_its_occurrence_before_jitter(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    clock = ManualClock(parse_instant("2026-11-29T08:59:50Z"))
    engine = engine_for(aredis, clock)
    await publish(engine, clock, {"scheduledSendTime": "2026-11-29T09:00:00.250Z", "scheduleId": "once"})
    await publish(engine, clock, {"schedule": "@every 1m", "scheduleId": "every"})
    await publish(engine, clock, {"schedule": "0 * * * * *", "scheduleId": "cron", "scheduleJitter": "40s"})
    await run_until([engine], clock, parse_instant("2026-11-29T09:05:00Z"))

    assert [m[SCHEDULE_OCCURRENCE] for m in delivered(redis_client, "once")] == ["2026-11-29T09:00:00.250Z"]
    assert occurrences(redis_client, "every") == [
        parse_instant("2026-11-29T08:59:50Z") + k * MINUTE for k in range(1, 6)
    ]
    cron = occurrences(redis_client, "cron")
    assert cron == [parse_instant(f"2026-11-29T09:0{k}:00Z") for k in range(5)]
    # Jittered: each fired after its nominal time (its `due` in the history), yet names the nominal one.
    fired = [r.due_ms for r in events(redis_client, "fired") if r.id == "cron"]
    assert len(fired) == 5
    assert all(d is not None and d >= n for d, n in zip(fired, cron, strict=True))
    assert any(d != n for d, n in zip(fired, cron, strict=True))
    # scheduleNext stays the jittered due time of the next occurrence.
    nexts = [parse_instant(m["scheduleNext"]) for m in delivered(redis_client, "cron")]
    assert nexts[:-1] == [d for d in fired[1:] if d is not None]


@pytest.mark.both_fire_paths
async def test_a_subscriber_retry_keeps_the_occurrence_of_its_first_delivery(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    clock = ManualClock(T0)
    engine = engine_for(aredis, clock)
    first = "2026-11-29T08:00:00.000Z"
    retry = Envelope(
        id="r1",
        topic="orders",
        due_ms=T0 + 1_000,
        published_at_ms=T0,
        message=b"again",
        metadata={SCHEDULE_OCCURRENCE: first, "scheduler": "tick"},
        kind=Kind.RETRY.value,
        delivery_attempt=2,
    )
    await engine.schedule([retry])
    await run_until([engine], clock, T0 + 2_000)
    [m] = delivered(redis_client)
    assert m[SCHEDULE_OCCURRENCE] == first


@pytest.mark.both_fire_paths
async def test_catchup_one_delivers_one_message_for_a_whole_outage(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    engine, clock = await outage(aredis, redis_client, {}, 90)
    await run_until([engine], clock, clock.now_ms() + 2 * MINUTE)
    got = occurrences(redis_client, "tick")
    # 09:01 on time, one for the 90 missed (the oldest: 09:02), then on the grid from now.
    assert got[:2] == [T0 + MINUTE, T0 + 2 * MINUTE]
    assert got[2:] == [T0 + 92 * MINUTE, T0 + 93 * MINUTE]


@pytest.mark.both_fire_paths
async def test_catchup_all_delivers_three_days_of_missed_minutes_each_once_in_order_paced(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    engine, clock = await outage(
        aredis, redis_client, {"scheduleCatchup": "all", "scheduleCatchupWindow": "96h"}, THREE_DAYS
    )
    start = clock.now_ms()
    end = start + 8 * MINUTE
    await run_until([engine], clock, end)
    # Every occurrence once, in order: the 4,320 missed, then those that came due while it
    # caught up (also in turn), then on time.
    expected = [T0 + k * MINUTE for k in range(1, (end - T0) // MINUTE + 1)]
    assert occurrences(redis_client, "tick") == expected
    assert len(expected) > 1 + THREE_DAYS
    assert events(redis_client, "skipped") == []
    # Paced: never two of the schedule's deliveries at once, and at least 10 a second.
    at = [r.at_ms for r in events(redis_client, "fired")][1 : 1 + THREE_DAYS]
    gaps = [b - a for a, b in itertools.pairwise(at)]
    assert min(gaps) >= CATCHUP_PACE_MS
    assert at[-1] - start <= THREE_DAYS * 100


@pytest.mark.both_fire_paths
async def test_catchup_none_skips_every_missed_occurrence_and_records_how_many(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    engine, clock = await outage(aredis, redis_client, {"scheduleCatchup": "none"}, 30)
    now = clock.now_ms()
    await run_until([engine], clock, now + 2 * MINUTE)
    # Nothing of 09:02..09:31; the next after now (09:32), then 09:33.
    assert occurrences(redis_client, "tick") == [T0 + MINUTE, T0 + 32 * MINUTE, T0 + 33 * MINUTE]
    [skip] = events(redis_client, "skipped")
    assert skip.id == "tick"
    assert skip.due_ms == T0 + 2 * MINUTE
    assert skip.reason.startswith(
        "CatchupNone: 30 missed occurrences from " + format_instant(T0 + 2 * MINUTE)
    )


@pytest.mark.both_fire_paths
@pytest.mark.parametrize(("policy", "expect_one"), [("all", False), ("one", True)])
async def test_catchup_window_skips_what_is_older_counts_and_records_it(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis, policy: str, expect_one: bool
) -> None:
    engine, clock = await outage(
        aredis, redis_client, {"scheduleCatchup": policy, "scheduleCatchupWindow": "10m"}, 120
    )
    now = clock.now_ms()
    await run_until([engine], clock, now + MINUTE - 1)
    got = occurrences(redis_client, "tick")
    # Missed: 09:02 .. 11:01 (120); the window keeps those not older than 10 minutes (10:51:35 on).
    oldest_kept = T0 + 112 * MINUTE
    # Then on time: 11:02:30.
    if expect_one:
        assert got == [T0 + MINUTE, oldest_kept, T0 + 122 * MINUTE]
    else:
        assert got == [T0 + MINUTE, *(T0 + k * MINUTE for k in range(112, 123))]
    [skip] = events(redis_client, "skipped")
    assert skip.due_ms == T0 + 2 * MINUTE
    assert skip.reason.startswith("CatchupWindow: 110 missed occurrences")


@pytest.mark.both_fire_paths
async def test_a_resume_after_pause_skips_what_was_missed_while_paused_whatever_the_policy(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    metadata = {"schedule": "@every 1m", "scheduleId": "tick", "scheduleCatchup": "all"}
    engine, clock = await started(aredis, metadata, T0 + MINUTE)
    assert (await engine.set_paused("tick", pause=True)).status == "paused"
    clock.set(T0 + 60 * MINUTE + 5_000)
    assert (await engine.set_paused("tick", pause=False)).status == "resumed"
    await run_until([engine], clock, clock.now_ms() + MINUTE)
    assert occurrences(redis_client, "tick") == [T0 + MINUTE, T0 + 61 * MINUTE]


@pytest.mark.both_fire_paths
async def test_replicas_racing_a_catchup_deliver_each_missed_occurrence_exactly_once(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    engine, clock = await outage(aredis, redis_client, {"scheduleCatchup": "all"}, 200)
    others = [engine_for(aredis, clock) for _ in range(2)]
    end = clock.now_ms() + MINUTE
    await run_until([engine, *others], clock, end)
    assert occurrences(redis_client, "tick") == [T0 + k * MINUTE for k in range(1, (end - T0) // MINUTE + 1)]


@pytest.mark.both_fire_paths
async def test_a_resumed_jittered_schedule_still_names_nominal_occurrences(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    metadata = {"schedule": "0 * * * * *", "scheduleId": "tick", "scheduleJitter": "40s"}
    engine, clock = await started(aredis, metadata, T0 + 2 * MINUTE)
    assert (await engine.set_paused("tick", pause=True)).status == "paused"
    clock.set(T0 + 10 * MINUTE)
    assert (await engine.set_paused("tick", pause=False)).status == "resumed"
    await run_until([engine], clock, T0 + 13 * MINUTE)
    minute = T0 - 30_000
    assert occurrences(redis_client, "tick") == [minute + k * MINUTE for k in (1, 2, 11, 12, 13)]


def previous_release_script(name: str, version: str = "0.2.0") -> str:
    """Release `version`'s (scripts/previous-release) Lua script `name`, includes resolved."""
    commit = next(
        line.split()[0]
        for line in (ROOT / "scripts" / "previous-release").read_text().splitlines()
        if line.strip() and not line.startswith("#") and line.split()[1] == version
    )

    def show(file: str) -> str:
        path = f"{commit}:middleware/delayed_middleware/lua/{file}"
        return subprocess.run(
            ["git", "-C", str(ROOT), "show", path], capture_output=True, check=True, text=True
        ).stdout

    return lua_scripts.resolve(name, show)


async def test_a_rollback_mid_catch_up_fires_on_as_one_and_doubles_nothing(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    """What this release writes mid catch-up (the policy in the envelope, nominal times in the ids
    ref, a paced next) is fired by release 0.2.0's FIRE: each occurrence at most once, and the
    schedule goes on on its grid (it catches up as `one`). The policy needs storage format 3, which
    0.2.0 refuses to start on; this is the worst case should one of its replicas outlive the raise."""
    engine, clock = await outage(aredis, redis_client, {"scheduleCatchup": "all"}, 30)
    await engine.fire_due()  # the first missed occurrence (09:02), its successor paced
    assert occurrences(redis_client, "tick") == [T0 + MINUTE, T0 + 2 * MINUTE]
    assert len(text(redis_client.hget(KEYS.ids, "tick")).split()) == 7
    old_fire = redis_client.register_script(previous_release_script("fire.lua"))
    keys = KEYS.script_keys  # 0.2.0's FIRE takes these too (the first ten, the moved hash last)
    now = clock.now_ms()
    for _ in range(8):  # the old release's loop, for two minutes from now
        old_fire(keys=keys, args=[KEYS.buckets, now, 100, 1000, 1 << 20, "", "", 1000, 0, ""])
        now += 15_000
    metadata = delivered(redis_client, "tick")
    nexts = [m["scheduleNext"] for m in metadata]
    assert len(nexts) == len(set(nexts)), "an occurrence fired twice"
    # The paced occurrence once (announcing 09:32: no more catch-up), then 09:32 on the grid.
    assert [parse_instant(n) for n in nexts[2:]] == [T0 + 32 * MINUTE, T0 + 33 * MINUTE]


@pytest.mark.both_fire_paths
async def test_a_hand_off_to_another_pubsub_carries_the_occurrence(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    await started(
        aredis, {"schedule": "@every 1m", "scheduleId": "tick", "targetPubsub": "kafka"}, T0 + 2 * MINUTE
    )
    rows = [decode_entry(f) for _, f in stream_entries(redis_client, KEYS.outbox)]
    assert [r.metadata[SCHEDULE_OCCURRENCE] for r in rows] == [
        format_instant(T0 + k * MINUTE) for k in (1, 2)
    ]
