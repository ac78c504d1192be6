"""The two-phase fire on a real 3-master Redis Cluster: every crash point of
CLAIM -> APPEND -> RELEASE loses and doubles nothing; a claim whose lease ended
is taken over; a slow replica that wakes after the takeover writes nothing."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
import redis.asyncio.cluster as acluster
import redis.cluster

from delayed_middleware.clock import ManualClock, SystemClock
from delayed_middleware.engine import DelayEngine, EngineConfig, ShardedEngine
from delayed_middleware.entry import decode_entry
from delayed_middleware.envelope import RECURRING, Envelope
from delayed_middleware.errors import InvalidArgumentError
from delayed_middleware.history import decode_record
from delayed_middleware.instants import format_instant
from delayed_middleware.keys import EngineKeys, fire_marker_prefix, is_engine_key, key_slot, shard_topics
from delayed_middleware.plan import PlanContext, plan_publish
from delayed_middleware.schedules import EnvelopeRecurrence
from tests.conftest import SkewedClock
from tests.redis_server import RedisCluster
from tests.waiting import wait_until

T0 = 1_800_000_000_000
LEASE = 1_000
SHARD = EngineKeys.for_topic(shard_topics("app", 3)[0])


class Crash(Exception):
    """Stands for the process dying at a fault point."""


@pytest.fixture
async def aclient(cluster: RedisCluster) -> AsyncIterator[acluster.RedisCluster]:
    c = acluster.RedisCluster(host="127.0.0.1", port=cluster.nodes[0].port)
    yield c
    await c.aclose()


def topics_over_all_masters(cluster: RedisCluster, per_master: int = 4) -> list[str]:
    by_port: dict[int, list[str]] = {n.port: [] for n in cluster.nodes}
    i = 0
    while any(len(t) < per_master for t in by_port.values()):
        t = f"t{i}"
        owned = by_port[cluster.owner(t).port]
        if len(owned) < per_master:
            owned.append(t)
        i += 1
    return [t for ts in by_port.values() for t in ts]


def env(n: int, topic: str, due: int = T0 + 100, **kw: object) -> Envelope:
    return Envelope(
        id=f"m{n}",
        topic=topic,
        due_ms=due,
        published_at_ms=T0,
        message=json.dumps({"n": n}).encode(),
        metadata={"k": str(n)},
        **kw,  # type: ignore[arg-type]
    )


def engine(
    client: acluster.RedisCluster,
    clock: ManualClock,
    fault: Callable[[str], Awaitable[None]] | None = None,
    keys: EngineKeys = SHARD,
) -> DelayEngine:
    return DelayEngine(
        client,
        keys,
        clock,
        # No Redis-time budget: each batch takes all 120 however loaded the machine.
        config=EngineConfig(two_phase=True, lease_ms=LEASE, batch_size=500, fire_budget_us=0),
        fault=fault,
        recurrence=lambda e, after: (after // 1_000 + 1) * 1_000,
    )


def crash_at(point: str) -> Callable[[str], Awaitable[None]]:
    async def fault(at: str) -> None:
        if at == point:
            raise Crash(point)

    return fault


def rows(admin: redis.cluster.RedisCluster, key: str) -> list[tuple[str, dict[bytes, bytes]]]:
    got: Any = admin.xrange(key)
    return [(i.decode(), dict(f)) for i, f in got]


def delivered(admin: redis.cluster.RedisCluster, topics: list[str]) -> dict[str, list[int]]:
    out = {}
    for t in topics:
        # Sorted: messages due at one instant have no order among themselves.
        out[t] = sorted(json.loads(decode_entry(f).data)["n"] for _, f in rows(admin, t))
    return out


def fired_records(admin: redis.cluster.RedisCluster, keys: EngineKeys = SHARD) -> list[str]:
    return [r.id for r in (decode_record(i, f) for i, f in rows(admin, keys.history)) if r.event == "fired"]


async def schedule_spread(e: DelayEngine, topics: list[str], n: int) -> dict[str, list[int]]:
    want: dict[str, list[int]] = {t: [] for t in topics}
    envs = []
    for i in range(n):
        t = topics[i % len(topics)]
        want[t].append(i)
        envs.append(env(i, t))
    await e.schedule(envs)
    return want


def test_fire_markers_hash_to_their_target_and_are_engine_keys(cluster: RedisCluster) -> None:
    for topic in ["orders", "{tenant-1}orders", "odd}name", "{}x}", "a{b}c", "x" * 300]:
        marker = fire_marker_prefix(topic, SHARD.stream) + "1-0:5"
        # Redis's own CLUSTER KEYSLOT, not our copy of its rule.
        assert cluster.keyslot(marker) == cluster.keyslot(topic), topic
        assert key_slot(topic) == cluster.keyslot(topic)
        assert is_engine_key(marker)


@pytest.mark.parametrize("point", ["claimed", "appended:1", "appended:6", "appended:12", "released"])
async def test_a_crash_at_any_step_loses_and_doubles_nothing(
    cluster: RedisCluster, admin: redis.cluster.RedisCluster, aclient: acluster.RedisCluster, point: str
) -> None:
    """12 targets over 3 masters: crash after CLAIM, after APPEND of 1, 6 or all 12
    targets (= before RELEASE), after RELEASE; another replica finishes the batch."""
    topics = topics_over_all_masters(cluster)
    clock = ManualClock(T0 + 100)
    doomed = engine(aclient, clock, crash_at(point))
    want = await schedule_spread(doomed, topics, 120)

    with pytest.raises(Crash):
        await doomed.fire_due()
    survivor = engine(aclient, clock)
    if point != "released":
        # The lease still runs: the survivor must not touch the claimed batch.
        assert await survivor.fire_due() == (0, T0 + 100 + LEASE)
        assert admin.zcard(SHARD.inflight) == 120
        clock.advance(LEASE)
    while (await survivor.fire_due())[0]:
        pass

    assert delivered(admin, topics) == want
    assert len(set(fired_records(admin))) == 120
    assert len(fired_records(admin)) == 120  # one 'fired' record per message, whoever appended it
    assert admin.xlen(SHARD.stream) == 0
    assert admin.zcard(SHARD.inflight) == 0
    assert admin.hlen(SHARD.claims) == 0
    assert await survivor.pending() == 0


async def test_a_slow_replica_that_wakes_after_the_takeover_writes_nothing(
    cluster: RedisCluster, admin: redis.cluster.RedisCluster, aclient: acluster.RedisCluster
) -> None:
    topics = topics_over_all_masters(cluster)
    clock = ManualClock(T0 + 100)
    resume = asyncio.Event()
    stalled = asyncio.Event()

    async def stall(at: str) -> None:
        if at == "appended:3":
            stalled.set()
            await resume.wait()

    slow = engine(aclient, clock, stall)
    want = await schedule_spread(slow, topics, 60)
    slow_fire = asyncio.create_task(slow.fire_due())
    await asyncio.wait_for(stalled.wait(), 10)
    # Its lease ends while it is stalled; another replica takes the batch over.
    clock.advance(LEASE + 1)
    fast = engine(aclient, clock)
    while (await fast.fire_due())[0]:
        pass
    assert delivered(admin, topics) == want
    resume.set()
    await asyncio.wait_for(slow_fire, 10)  # its remaining APPENDs find markers; RELEASE finds nothing

    assert delivered(admin, topics) == want
    assert len(fired_records(admin)) == 60
    assert admin.zcard(SHARD.inflight) == 0


async def test_a_lease_taken_over_mid_append_by_a_replica_that_then_crashes(
    cluster: RedisCluster, admin: redis.cluster.RedisCluster, aclient: acluster.RedisCluster
) -> None:
    """Two crashes in a row on one batch: the third replica still delivers each message once."""
    topics = topics_over_all_masters(cluster)
    clock = ManualClock(T0 + 100)
    first = engine(aclient, clock, crash_at("appended:2"))
    want = await schedule_spread(first, topics, 60)
    with pytest.raises(Crash):
        await first.fire_due()
    clock.advance(LEASE + 1)
    with pytest.raises(Crash):
        await engine(aclient, clock, crash_at("appended:7")).fire_due()
    clock.advance(LEASE + 1)
    third = engine(aclient, clock)
    while (await third.fire_due())[0]:
        pass
    assert delivered(admin, topics) == want
    assert len(fired_records(admin)) == 60


async def test_recurring_crash_before_release_fires_the_occurrence_once_then_the_next(
    cluster: RedisCluster, admin: redis.cluster.RedisCluster, aclient: acluster.RedisCluster
) -> None:
    clock = ManualClock(T0 + 1_000)
    doomed = engine(aclient, clock, crash_at("appended:1"))
    rec = Envelope(
        id="tick",
        topic="ticks",
        due_ms=T0 + 1_000,
        published_at_ms=T0,
        message=b'{"n":1}',
        schedule_id="tick",
        kind=RECURRING,
        schedule="@every 1s",
    )
    await doomed.schedule([rec])
    with pytest.raises(Crash):
        await doomed.fire_due()
    clock.advance(LEASE + 1)
    survivor = engine(aclient, clock)
    await survivor.fire_due()
    assert admin.xlen("ticks") == 1
    clock.set(T0 + 2_500)
    await survivor.fire_due()
    [(_, a), (_, b)] = rows(admin, "ticks")
    # The first occurrence once, announcing the second; then the second.
    assert decode_entry(a).metadata == {
        "scheduler": "tick",
        "scheduleNext": format_instant(T0 + 2_000),
        "scheduleOccurrence": format_instant(T0 + 1_000),
    }
    assert decode_entry(b).metadata == {
        "scheduler": "tick",
        "scheduleNext": format_instant(T0 + 3_000),
        "scheduleOccurrence": format_instant(T0 + 2_000),
    }
    assert admin.zcard(SHARD.inflight) == 0


async def test_a_wrong_type_target_parks_its_envelopes_and_the_rest_fire(
    cluster: RedisCluster, admin: redis.cluster.RedisCluster, aclient: acluster.RedisCluster
) -> None:
    topics = topics_over_all_masters(cluster, per_master=1)
    admin.set("a-string", "x")
    clock = ManualClock(T0 + 100)
    e = engine(aclient, clock)
    await e.schedule([env(1, "a-string"), env(2, topics[0]), env(3, "x-delayed"), env(4, topics[1])])
    while (await e.fire_due())[0]:
        pass
    assert delivered(admin, topics[:2]) == {topics[0]: [2], topics[1]: [4]}
    assert admin.hlen(SHARD.parked) == 2
    assert admin.xlen(SHARD.stream) == 2  # kept for an operator
    assert admin.get("a-string") == b"x"


async def test_sharded_engine_spreads_over_masters_and_cancel_finds_every_shard(
    cluster: RedisCluster, admin: redis.cluster.RedisCluster, aclient: acluster.RedisCluster
) -> None:
    clock = ManualClock(T0)
    shards = ShardedEngine(
        [engine(aclient, clock, keys=EngineKeys.for_topic(t)) for t in shard_topics("app", 6)]
    )
    slots = {cluster.owner(e.keys.stream).port for e in shards.engines}
    assert len(slots) == 3  # six shards land on all three masters
    ids = []
    for i in range(12):
        ids += await shards.schedule([env(i, "orders", due=T0 + 100)])
    with_sid = [env(100 + i, "orders", due=T0 + 100, schedule_id=f"s{i}") for i in range(12)]
    await shards.schedule(with_sid)
    used = [e.keys.stream for e in shards.engines if admin.xlen(e.keys.stream)]
    assert len(used) > 1
    # By envelope id (shard-qualified: stream ids repeat across shards) and by
    # scheduleId (its shard by hash).
    assert all("@" in i for i in ids)
    assert await shards.cancel(ids[5])
    assert not await shards.cancel(ids[5])
    assert await shards.cancel("s3")
    assert not await shards.cancel("s3")
    assert not await shards.cancel("1-1")
    # Replace by scheduleId finds the pending one, whatever shard spread would pick.
    await shards.schedule([env(999, "orders", due=T0 + 100, schedule_id="s4")])
    assert await shards.pending() == 22
    clock.set(T0 + 100)
    while (await shards.fire_due())[0]:
        pass
    got = sorted(delivered(admin, ["orders"])["orders"])
    assert got == sorted(
        [i for i in range(12) if i != 5] + [100 + i for i in range(12) if i not in (3, 4)] + [999]
    )


async def test_a_schedule_retried_with_its_token_stores_nothing_twice_on_any_shard(
    admin: redis.cluster.RedisCluster, aclient: acluster.RedisCluster
) -> None:
    """A lost reply, then the same call again (same token): envelopes without a
    scheduleId go to the shard the token picks, not the next in turn, and each
    shard's chunks (`<token>:<shard>/<offset>`) are recognised as stored."""
    clock = ManualClock(T0)
    shards = ShardedEngine(
        [engine(aclient, clock, keys=EngineKeys.for_topic(t)) for t in shard_topics("app", 4)]
    )
    plain = [env(i, "orders") for i in range(7)]
    named = [env(100 + i, "orders", schedule_id=f"s{i}") for i in range(9)]
    batch = [e for pair in zip(plain, named, strict=False) for e in pair] + named[7:]
    for _ in range(3):
        await shards.schedule(batch, token="call-1")
    assert await shards.pending() == 16
    assert sum(admin.xlen(e.keys.stream) for e in shards.engines) == 16


async def test_cancel_many_finds_each_id_on_its_shard_and_marks_each_topic(
    admin: redis.cluster.RedisCluster, aclient: acluster.RedisCluster
) -> None:
    """scheduleIds, shard-qualified envelope ids and unknown ids in one call:
    the answer per id in order, and a Remove marker (deleteMarkerTTL) on each
    cancelled message's topic, whatever its slot."""
    clock = ManualClock(T0)
    shards = ShardedEngine(
        [
            DelayEngine(
                aclient,
                EngineKeys.for_topic(t),
                clock,
                config=EngineConfig(two_phase=True, lease_ms=LEASE, marker_ttl_ms=60_000),
            )
            for t in shard_topics("app", 3)
        ]
    )
    topics = [f"c{i}" for i in range(6)]
    await shards.schedule([env(i, t, schedule_id=f"s{i}") for i, t in enumerate(topics)])
    [plain] = await shards.schedule([env(50, "plain")])
    got = await shards.cancel_many(["s0", "nope", plain, "s5", "s0"])
    assert got == [(True, "c0"), (False, ""), (True, "plain"), (True, "c5"), (False, "")]
    assert await shards.pending() == 4
    for t in ("c0", "plain", "c5"):
        [(_, fields)] = rows(admin, t)
        assert json.loads(fields[b"metadata"])["markerReason"] == "Remove"
    assert admin.xlen("c1") == 0


async def test_a_bare_stream_id_on_two_shards_is_refused_not_guessed(
    cluster: RedisCluster, admin: redis.cluster.RedisCluster, aclient: acluster.RedisCluster
) -> None:
    clock = ManualClock(T0)
    shards = ShardedEngine(
        [engine(aclient, clock, keys=EngineKeys.for_topic(t)) for t in shard_topics("app", 2)]
    )
    for e in shards.engines:
        admin.xadd(e.keys.stream, {"data": "x"}, id="5-1")
    with pytest.raises(InvalidArgumentError, match="5-1"):
        await shards.cancel("5-1")
    assert [admin.xlen(e.keys.stream) for e in shards.engines] == [1, 1]
    assert await shards.cancel("5-1@1")
    assert [admin.xlen(e.keys.stream) for e in shards.engines] == [1, 0]
    assert await shards.cancel("5-1")  # now only one shard holds it


async def test_a_sleeping_replica_is_woken_through_the_cluster_by_an_earlier_schedule(
    cluster: RedisCluster, admin: redis.cluster.RedisCluster, aclient: acluster.RedisCluster
) -> None:
    """The wake channel works on Cluster: a replica with nothing due sleeps up to
    max_sleep_s (here 30 s); another's schedule of a message due in 0.3 s wakes it."""
    keys = EngineKeys.for_topic(shard_topics("app", 3)[2])
    sleeper = DelayEngine(
        aclient,
        keys,
        SystemClock(),
        config=EngineConfig(two_phase=True, max_sleep_s=30.0),
    )
    task = asyncio.create_task(sleeper.run())
    try:
        await asyncio.sleep(1.0)  # asleep, subscribed
        publisher = engine(aclient, ManualClock(T0), keys=keys)
        due = int(time.time() * 1000) + 300
        await publisher.schedule([env(1, "woken", due=due)])
        deadline = time.monotonic() + 5
        while not admin.xlen("woken"):
            assert time.monotonic() < deadline, "the sleeping replica was not woken"
            await asyncio.sleep(0.02)
        landed = int(rows(admin, "woken")[0][0].split("-")[0])
        assert due <= landed < due + 1_000
    finally:
        task.cancel()
        await asyncio.wait({task}, timeout=5)


async def test_topics_with_their_own_hash_tags_or_odd_braces_fire_once_after_a_crash(
    cluster: RedisCluster, admin: redis.cluster.RedisCluster, aclient: acluster.RedisCluster
) -> None:
    """Markers of `{tenant}orders`, `x}y`, `{}z` and `a{b}c` land in their topics' slots
    (APPEND declares them with the topic: a wrong slot would fail with CROSSSLOT)."""
    topics = ["{tenant}orders", "{tenant}payments", "x}y", "{}z", "a{b}c", "é{ü}"]
    clock = ManualClock(T0 + 100)
    doomed = engine(aclient, clock, crash_at("appended:3"))
    want = await schedule_spread(doomed, topics, 60)
    with pytest.raises(Crash):
        await doomed.fire_due()
    clock.advance(LEASE + 1)
    survivor = engine(aclient, clock)
    while (await survivor.fire_due())[0]:
        pass
    assert delivered(admin, topics) == want
    assert admin.hlen(SHARD.parked) == 0


# --- cancels that land while an occurrence is in flight (between CLAIM and APPEND) ----------


def history_events(admin: redis.cluster.RedisCluster, event: str) -> list[str]:
    return [r.id for r in (decode_record(i, f) for i, f in rows(admin, SHARD.history)) if r.event == event]


@pytest.mark.parametrize("by", ["scheduleId", "envelope id"])
async def test_a_cancel_between_claim_and_append_stops_that_delivery(
    cluster: RedisCluster, admin: redis.cluster.RedisCluster, aclient: acluster.RedisCluster, by: str
) -> None:
    """Cancelled after CLAIM took them, before any APPEND: none of them goes out, the
    others do; each cancelled one has its `cancelled` record and no `fired` one."""
    topics = topics_over_all_masters(cluster)
    clock = ManualClock(T0 + 100)
    canceller = engine(aclient, clock)
    envs = [
        env(i, topics[i % len(topics)], schedule_id=f"s{i}" if by == "scheduleId" else "") for i in range(60)
    ]
    ids = await canceller.schedule(envs)
    victims = ids[::3]
    answers: list[list[tuple[bool, str]]] = []

    async def cancel_in_flight(at: str) -> None:
        if at == "claimed":
            assert admin.zcard(SHARD.inflight) == 60
            answers.append(await canceller.cancel_many(victims))

    await engine(aclient, clock, cancel_in_flight).fire_due()
    assert answers == [[(True, envs[i].topic) for i in range(0, 60, 3)]]
    got = delivered(admin, topics)
    assert sorted(n for ns in got.values() for n in ns) == [i for i in range(60) if i % 3]
    assert sorted(history_events(admin, "cancelled")) == sorted(victims)
    assert set(history_events(admin, "fired")).isdisjoint(victims)
    assert (admin.zcard(SHARD.inflight), admin.hlen(SHARD.claims), admin.xlen(SHARD.stream)) == (0, 0, 0)


async def test_a_cancel_after_the_append_is_too_late_and_says_so(
    admin: redis.cluster.RedisCluster, aclient: acluster.RedisCluster
) -> None:
    """Cancelled after APPEND wrote them, before RELEASE: they went out (once), and the
    cancel answers False for each (a one-shot it could not stop)."""
    clock = ManualClock(T0 + 100)
    canceller = engine(aclient, clock)
    await canceller.schedule([env(i, "late", schedule_id=f"s{i}") for i in range(20)])
    answers: list[list[tuple[bool, str]]] = []

    async def cancel_after_append(at: str) -> None:
        if at == "appended:1":
            answers.append(await canceller.cancel_many([f"s{i}" for i in range(20)]))

    await engine(aclient, clock, cancel_after_append).fire_due()
    assert answers == [[(False, "late")] * 20]
    assert delivered(admin, ["late"]) == {"late": list(range(20))}
    assert (admin.zcard(SHARD.inflight), admin.hlen(SHARD.claims), admin.xlen(SHARD.stream)) == (0, 0, 0)
    # The history tells what happened: each fired, none was cancelled.
    assert sorted(history_events(admin, "fired")) == sorted(f"s{i}" for i in range(20))
    assert history_events(admin, "cancelled") == []


async def test_a_cancel_racing_the_appends_answers_true_only_for_what_never_arrives(
    cluster: RedisCluster, admin: redis.cluster.RedisCluster, aclient: acluster.RedisCluster
) -> None:
    """Cancelled while the APPENDs to 12 targets run concurrently: whichever way each
    race goes, a message whose cancel said True never arrives, one that said False
    arrived exactly once."""
    topics = topics_over_all_masters(cluster)
    clock = ManualClock(T0 + 100)
    canceller = engine(aclient, clock)
    envs = [env(i, topics[i % len(topics)], schedule_id=f"s{i}") for i in range(120)]
    await canceller.schedule(envs)
    answers: list[list[tuple[bool, str]]] = []

    async def cancel_mid_append(at: str) -> None:
        if at == "appended:1":
            answers.append(await canceller.cancel_many([f"s{i}" for i in range(120)]))

    await engine(aclient, clock, cancel_mid_append).fire_due()
    [answer] = answers
    stopped = {i for i, (found, _) in enumerate(answer) if found}
    got = delivered(admin, topics)
    assert sorted(n for ns in got.values() for n in ns) == sorted(set(range(120)) - stopped)
    assert (admin.zcard(SHARD.inflight), admin.hlen(SHARD.claims), admin.xlen(SHARD.stream)) == (0, 0, 0)


async def test_a_cancel_in_flight_survives_the_firing_replicas_crash_and_takeover(
    cluster: RedisCluster, admin: redis.cluster.RedisCluster, aclient: acluster.RedisCluster
) -> None:
    """The replica that claimed crashes after the cancel; the one taking its lease
    over appends only what was not cancelled (one-shots and a recurring schedule)."""
    topics = topics_over_all_masters(cluster)
    clock = ManualClock(T0 + 1_000)
    canceller = engine(aclient, clock)
    envs = [env(i, topics[i % len(topics)], due=T0 + 1_000, schedule_id=f"s{i}") for i in range(24)]
    tick = Envelope(
        id="tick",
        topic=topics[0],
        due_ms=T0 + 1_000,
        published_at_ms=T0,
        message=b'{"n":99}',
        schedule_id="tick",
        kind=RECURRING,
        schedule="@every 1s",
    )
    await canceller.schedule([*envs, tick])

    async def cancel_then_crash(at: str) -> None:
        if at == "claimed":
            got = await canceller.cancel_many(["tick", *(f"s{i}" for i in range(0, 24, 2))])
            assert all(found for found, _ in got)
            raise Crash(at)

    with pytest.raises(Crash):
        await engine(aclient, clock, cancel_then_crash).fire_due()
    clock.advance(LEASE + 1)
    survivor = engine(aclient, clock)
    while (await survivor.fire_due())[0]:
        pass
    clock.advance(5_000)  # the schedule's later occurrences would be due by now
    while (await survivor.fire_due())[0]:
        pass
    got = delivered(admin, topics)
    assert sorted(n for ns in got.values() for n in ns) == list(range(1, 24, 2))
    assert (admin.zcard(SHARD.inflight), admin.xlen(SHARD.stream), await survivor.pending()) == (0, 0, 0)


async def test_a_replace_between_claim_and_append_stops_the_old_delivery(
    cluster: RedisCluster, admin: redis.cluster.RedisCluster, aclient: acluster.RedisCluster
) -> None:
    """Replaced (same scheduleId, later due) after CLAIM took the old one: the old one
    never goes out, the new one does at its own time; the others are unaffected."""
    topics = topics_over_all_masters(cluster)
    clock = ManualClock(T0 + 100)
    publisher = engine(aclient, clock)
    await publisher.schedule([env(i, topics[i % len(topics)], schedule_id=f"s{i}") for i in range(24)])

    async def replace_in_flight(at: str) -> None:
        if at == "claimed":
            await publisher.schedule(
                [
                    env(100 + i, topics[i % len(topics)], due=T0 + 5_000, schedule_id=f"s{i}")
                    for i in range(0, 24, 4)
                ]
            )

    await engine(aclient, clock, replace_in_flight).fire_due()
    got = delivered(admin, topics)
    assert sorted(n for ns in got.values() for n in ns) == [i for i in range(24) if i % 4]
    clock.set(T0 + 5_000)
    survivor = engine(aclient, clock)
    while (await survivor.fire_due())[0]:
        pass
    got = delivered(admin, topics)
    assert sorted(n for ns in got.values() for n in ns) == sorted(
        [i for i in range(24) if i % 4] + [100 + i for i in range(0, 24, 4)]
    )
    assert (admin.zcard(SHARD.inflight), admin.xlen(SHARD.stream), await survivor.pending()) == (0, 0, 0)


async def test_a_cancel_in_flight_stops_a_message_bound_for_another_pubsub(
    admin: redis.cluster.RedisCluster, aclient: acluster.RedisCluster
) -> None:
    """targetPubsub: APPEND writes the shard's outbox, not the topic; the cancel's
    marker must be the outbox's, or the forwarder would hand it to the sidecar."""
    clock = ManualClock(T0 + 100)
    canceller = engine(aclient, clock)
    await canceller.schedule(
        [env(i, "orders", schedule_id=f"s{i}", target_pubsub="kafka") for i in range(10)]
    )

    async def cancel_in_flight(at: str) -> None:
        if at == "claimed":
            assert await canceller.cancel_many(["s0", "s1", "s2"]) == [(True, "orders")] * 3

    await engine(aclient, clock, cancel_in_flight).fire_due()
    handed = sorted(int(f[b"id"].decode()[1:]) for _, f in rows(admin, SHARD.outbox))
    assert handed == list(range(3, 10))
    assert admin.xlen("orders") == 0


async def test_a_marker_that_cannot_be_set_neither_stops_the_others_nor_answers_ok(
    cluster: RedisCluster,
    admin: redis.cluster.RedisCluster,
    aclient: acluster.RedisCluster,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A bulk cancel of in-flight occurrences whose first marker SET fails (that target's
    master unreachable): every other occurrence still gets its marker and is not delivered,
    and the call raises instead of answering OK."""
    topics = topics_over_all_masters(cluster)
    clock = ManualClock(T0 + 100)
    canceller = engine(aclient, clock)
    envs = [env(i, topics[i % len(topics)], schedule_id=f"s{i}") for i in range(12)]
    await canceller.schedule(envs)
    real_set = canceller.parts.canceller._set_fire_marker
    calls = 0

    async def flaky_set(id: str, due: str, target: str, why: str) -> bool:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise redis.exceptions.ConnectionError("the target's master is unreachable")
        return await real_set(id, due, target, why)

    monkeypatch.setattr(canceller.parts.canceller, "_set_fire_marker", flaky_set)
    raised: list[BaseException] = []

    async def cancel_in_flight(at: str) -> None:
        if at == "claimed":
            try:
                await canceller.cancel_many([f"s{i}" for i in range(6)])
            except redis.exceptions.ConnectionError as exc:
                raised.append(exc)

    await engine(aclient, clock, cancel_in_flight).fire_due()
    assert len(raised) == 1
    assert calls == 6
    got = sorted(n for ns in delivered(admin, topics).values() for n in ns)
    # Occurrence 0's marker failed: it may go out (the cancel did not answer OK); 1-5 must not.
    assert set(got) - {0} == set(range(6, 12))


async def test_fire_decisions_on_cluster_use_each_shards_redis_time_not_the_replicas_clock(
    cluster: RedisCluster, admin: redis.cluster.RedisCluster, aclient: acluster.RedisCluster
) -> None:
    """Six shards over three masters: a replica ten minutes ahead claims nothing due in a
    minute on any of them; one ten minutes behind fires what is due now on every shard, with
    lateness measured on the shard master's clock."""
    keys = [EngineKeys.for_topic(t) for t in shard_topics("app", 6)]
    assert len({cluster.owner(k.stream).port for k in keys}) == 3
    cfg = EngineConfig(two_phase=True, lease_ms=LEASE, batch_size=500, fire_budget_us=0)

    def replica(skew_ms: int) -> ShardedEngine:
        clock = SkewedClock(skew_ms)
        return ShardedEngine([DelayEngine(aclient, k, clock, config=cfg) for k in keys])

    fast, slow = replica(600_000), replica(-600_000)
    now = SystemClock().now_ms()
    await fast.schedule([env(i, "orders", due=now + 60_000, schedule_id=f"later-{i}") for i in range(12)])
    fired, _ = await fast.fire_due()
    assert fired == 0
    assert admin.exists("orders") == 0
    assert all(admin.zcard(k.inflight) == 0 for k in keys)

    due = now + 200
    await slow.schedule([env(100 + i, "orders", due=due, schedule_id=f"now-{i}") for i in range(12)])
    await wait_until(lambda: SystemClock().now_ms() > due + 50, "the due time")
    while (await slow.fire_due())[0]:
        pass
    assert delivered(admin, ["orders"]) == {"orders": list(range(100, 112))}
    late = [
        r.lateness_ms
        for k in keys
        for r in (decode_record(i, f) for i, f in rows(admin, k.history))
        if r.event == "fired"
    ]
    assert len(late) == 12
    assert all(lat is not None and 0 <= lat < 10_000 for lat in late)
    assert len({e.keys.stream for e in slow.engines if admin.xlen(e.keys.history)}) > 1


async def test_a_jittered_catch_up_taken_over_mid_append_delivers_each_occurrence_once_named(
    cluster: RedisCluster, admin: redis.cluster.RedisCluster, aclient: acluster.RedisCluster
) -> None:
    """scheduleCatchup=all of a jittered cron on the Cluster path: a replica dies after its APPEND,
    the survivor takes the claim over, and every missed minute arrives once, in order, named by its
    nominal time (the ids ref keeps it through the takeover)."""
    minute = 60_000
    start = T0 - T0 % minute + 30_000
    clock = ManualClock(start)

    def replica(fault: Callable[[str], Awaitable[None]] | None = None) -> DelayEngine:
        config = EngineConfig(two_phase=True, lease_ms=LEASE, fire_budget_us=0)
        return DelayEngine(aclient, SHARD, clock, config=config, fault=fault, recurrence=EnvelopeRecurrence())

    metadata = {
        "schedule": "0 * * * * *",
        "scheduleId": "tick",
        "scheduleJitter": "20s",
        "scheduleCatchup": "all",
    }
    plan = plan_publish("ticks", b"t", metadata, "", PlanContext(now_ms=start, pubsub_name="p", enabled=True))
    doomed = replica(crash_at("appended:1"))
    await doomed.schedule([d.envelope for d in plan.delayed])
    clock.set(start + 30 * minute)  # nothing ran for half an hour: 30 minutes missed
    with pytest.raises(Crash):
        await doomed.fire_due()
    clock.advance(LEASE + 1)
    survivor = replica()
    end = clock.now_ms() + 10_000
    while True:
        _, head = await survivor.fire_due()
        if head is None or head > end:
            break
        clock.set(max(head, clock.now_ms()))
    got = [json.loads(f[b"metadata"])["scheduleOccurrence"] for _, f in rows(admin, "ticks")]
    assert got == [format_instant(start + 30_000 + k * minute) for k in range(30)]
