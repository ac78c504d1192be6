"""Trigger and reschedule on a real 3-master Redis Cluster with several shard streams (the two-phase
fire): a triggered one-shot is delivered once even racing replicas that fire it; a trigger or a
reschedule landing while its occurrence is in flight (claimed, not yet appended) waits or answers
`fired`, never delivering twice; a reschedule racing the fire is exactly once and its answer says
what happened; a schedule's extra occurrence reaches its topic in another slot, stamped, once for
a request retried while its first attempt is still appending it."""

from __future__ import annotations

import asyncio
from typing import Any

import redis.asyncio.cluster as acluster
import redis.cluster

from delayed_middleware.clock import ManualClock
from delayed_middleware.engine import ShardedEngine
from delayed_middleware.engine.timecontrol import FIRED, OCCURRENCE_KEY, RESCHEDULED, TRIGGERED, UNKNOWN
from delayed_middleware.entry import decode_entry
from delayed_middleware.instants import format_instant
from tests.middleware.test_pause_cluster import LEASE, T0, aclient, delivered, fire_all, msg, sharded
from tests.redis_server import RedisCluster

__all__ = ["aclient"]  # the fixture, shared with the pause tests


async def test_a_triggered_one_shot_on_a_cluster_is_delivered_once_racing_its_fire(
    aclient: acluster.RedisCluster, admin: redis.cluster.RedisCluster
) -> None:
    for round in range(10):
        admin.flushall()
        clock = ManualClock(T0 + 1_000)
        engines = [sharded(aclient, clock) for _ in range(3)]
        sid = f"o-{round}"
        await engines[0].schedule([msg(sid, T0 + 1_000 if round % 2 else T0 + 60_000)])
        got = await asyncio.gather(
            engines[0].trigger(sid), engines[1].trigger(sid), fire_all(engines[1]), fire_all(engines[2])
        )
        await fire_all(engines[0])
        assert delivered(admin) == [sid]
        assert {got[0].status, got[1].status} <= {TRIGGERED, FIRED}


async def test_a_trigger_or_reschedule_landing_in_flight_never_delivers_twice(
    aclient: acluster.RedisCluster, admin: redis.cluster.RedisCluster
) -> None:
    clock = ManualClock(T0)
    engine = sharded(aclient, clock)
    await engine.schedule([msg("a", T0 + 1_000)])
    clock.set(T0 + 1_000)
    # A replica that claimed the occurrence and holds it, not yet appended, until `go_on`.
    points: asyncio.Queue[str] = asyncio.Queue()
    go_on = asyncio.Event()

    async def fault(point: str) -> None:
        await points.put(point)
        if point == "claimed":
            await go_on.wait()

    fire = asyncio.create_task(fire_all(sharded(aclient, clock, fault)))
    assert await asyncio.wait_for(points.get(), 10) == "claimed"
    # In flight: a reschedule answers at once that it fired; a trigger waits for RELEASE.
    assert (await engine.reschedule("a", T0 + 600_000)).status == FIRED
    trigger = asyncio.create_task(engine.trigger("a"))
    await asyncio.sleep(0.3)
    assert not trigger.done()
    go_on.set()
    await fire
    assert (await trigger).status == FIRED
    clock.set(T0 + 600_000)
    await fire_all(engine)
    assert delivered(admin) == ["a"]


async def test_a_reschedule_racing_the_fire_on_a_cluster_is_exactly_once(
    aclient: acluster.RedisCluster, admin: redis.cluster.RedisCluster
) -> None:
    outcomes = set()
    for round in range(12):
        admin.flushall()
        clock = ManualClock(T0 + 1_000)
        a, b = sharded(aclient, clock), sharded(aclient, clock)
        sid = f"r-{round}"
        await a.schedule([msg(sid, T0 + 1_000)])
        moved, _ = await asyncio.gather(a.reschedule(sid, T0 + 90_000), fire_all(b))
        outcomes.add(moved.status)
        if moved.status == RESCHEDULED:
            assert delivered(admin) == []
            clock.set(T0 + 90_000)
            await fire_all(b)
        else:
            assert moved.status == FIRED
        assert delivered(admin) == [sid]
    assert outcomes <= {RESCHEDULED, FIRED}


async def test_a_reschedule_racing_a_cancel_on_a_cluster_never_revives_it(
    aclient: acluster.RedisCluster, admin: redis.cluster.RedisCluster
) -> None:
    for round in range(8):
        admin.flushall()
        clock = ManualClock(T0)
        a, b = sharded(aclient, clock), sharded(aclient, clock)
        sid = f"c-{round}"
        await a.schedule([msg(sid, T0 + 60_000)])
        moved, cancelled = await asyncio.gather(a.reschedule(sid, T0 + 1_000), b.cancel(sid))
        assert cancelled
        assert moved.status in (RESCHEDULED, UNKNOWN)
        clock.set(T0 + 120_000)
        await fire_all(a)
        assert delivered(admin) == []


async def a_schedule(aclient: acluster.RedisCluster, clock: ManualClock, due: int) -> ShardedEngine:
    """The recurring schedule `tick`, its first occurrence at `due`."""
    engine = sharded(aclient, clock)
    await engine.schedule([msg("tick", due, recurring=True)])
    return engine


async def test_a_triggered_schedule_on_a_cluster_delivers_an_extra_stamped_occurrence(
    aclient: acluster.RedisCluster, admin: redis.cluster.RedisCluster
) -> None:
    clock = ManualClock(T0)
    engine = await a_schedule(aclient, clock, T0 + 1_000)
    clock.set(T0 + 400)
    assert (await engine.trigger("tick")).status == TRIGGERED
    assert (await engine.trigger("nope")).status == UNKNOWN
    rows = admin.xrange("orders")
    assert rows
    assert len(rows) == 1
    md = decode_entry(dict(rows[0][1])).metadata  # type: ignore[arg-type]
    assert md["scheduler"] == "tick"
    assert md[OCCURRENCE_KEY] == format_instant(T0 + 400)
    assert md["scheduleNext"] == format_instant(T0 + 1_000)
    clock.set(T0 + 1_000)
    await fire_all(engine)
    assert delivered(admin) == ["tick", "tick"]


async def test_a_trigger_request_sent_again_on_a_cluster_delivers_once(
    aclient: acluster.RedisCluster, admin: redis.cluster.RedisCluster
) -> None:
    engine = await a_schedule(aclient, ManualClock(T0), T0 + 60_000)
    # The same publish retried (same CloudEvent id): both answered OK, one extra occurrence.
    assert (await engine.trigger("tick", request="ce-1")).status == TRIGGERED
    assert (await engine.trigger("tick", request="ce-1")).status == TRIGGERED
    assert delivered(admin) == ["tick"]
    assert (await engine.trigger("tick", request="ce-2")).status == TRIGGERED
    assert delivered(admin) == ["tick", "tick"]


async def test_a_trigger_request_retried_while_its_first_attempt_appends_delivers_once_on_a_cluster(
    aclient: acluster.RedisCluster, admin: redis.cluster.RedisCluster
) -> None:
    triggerer = await a_schedule(aclient, ManualClock(T0), T0 + 60_000)
    shard = triggerer.shard_of("tick")
    timecontrol = shard.state.scripts.timecontrol
    retries: list[str] = []

    async def retried_after_the_script(*args: Any, **kwargs: Any) -> Any:
        got = await timecontrol(*args, **kwargs)
        if not retries:
            # The first attempt decided, its APPEND not yet sent: daprd's retry of the same
            # publish (same CloudEvent id) reaches another replica and runs to its answer.
            retries.append("")
            retry = await sharded(aclient, ManualClock(T0 + 500)).trigger("tick", request="ce-1")
            retries[0] = retry.status
        return got

    shard.state.scripts.timecontrol = retried_after_the_script  # type: ignore[method-assign]
    assert (await triggerer.trigger("tick", request="ce-1")).status == TRIGGERED
    assert retries == [TRIGGERED]
    assert delivered(admin) == ["tick"], "a retried trigger delivered a second occurrence"
    assert admin.exists(shard.state.keys.triggers) == 0


async def test_a_cancel_answered_while_a_trigger_is_being_delivered_stops_it_on_a_cluster(
    aclient: acluster.RedisCluster, admin: redis.cluster.RedisCluster
) -> None:
    clock = ManualClock(T0)
    triggerer = await a_schedule(aclient, clock, T0 + 60_000)
    canceller = sharded(aclient, clock)
    shard = triggerer.shard_of("tick")
    timecontrol = shard.state.scripts.timecontrol
    answers: list[bool] = []

    async def cancel_after_the_script(*args: Any, **kwargs: Any) -> Any:
        got = await timecontrol(*args, **kwargs)
        # The trigger decided (its occurrence's messages are in hand); another replica's cancel lands.
        answers.append(await canceller.cancel("tick"))
        return got

    shard.state.scripts.timecontrol = cancel_after_the_script  # type: ignore[method-assign]
    assert (await triggerer.trigger("tick")).status == UNKNOWN  # as a trigger after the cancel
    assert answers == [True]
    assert delivered(admin) == []
    assert admin.exists(shard.state.keys.triggers) == 0
    clock.set(T0 + 120_000)
    await fire_all(triggerer)
    assert delivered(admin) == []


async def test_a_cancel_answered_while_a_triggers_append_waits_on_a_stalled_master_comes_after_it(
    aclient: acluster.RedisCluster, admin: redis.cluster.RedisCluster, cluster: RedisCluster
) -> None:
    # The trigger sends its APPEND at once, and the topic's master holds every write for longer
    # than two leases (CLIENT PAUSE WRITE: a stalled master). A cancel of the schedule on its own
    # master meanwhile must not be answered OK while that APPEND can still land after it.
    clock = ManualClock(T0)
    triggerer = sharded(aclient, clock)
    shard = triggerer.shard_of("tick")
    engine_node = cluster.owner(shard.state.keys.stream)
    topic = next(t for t in (f"orders-{i}" for i in range(100)) if cluster.owner(t) is not engine_node)
    await triggerer.schedule([msg("tick", T0 + 60_000, topic=topic, recurring=True)])
    target = cluster.owner(topic)
    stall_s = 3.5 * LEASE / 1000
    timecontrol = shard.state.scripts.timecontrol
    stalled = asyncio.Event()

    async def stall_after_the_script(*args: Any, **kwargs: Any) -> Any:
        got = await timecontrol(*args, **kwargs)
        with target.client() as c:
            c.client_pause(int(stall_s * 1000), all=False)  # WRITE: reads go on
        stalled.set()
        return got

    shard.state.scripts.timecontrol = stall_after_the_script  # type: ignore[method-assign]
    trigger = asyncio.create_task(triggerer.trigger("tick"))
    await asyncio.wait_for(stalled.wait(), 10)
    await asyncio.sleep(2.5 * LEASE / 1000)
    assert await sharded(aclient, clock).cancel("tick")  # another replica's cancel, answered OK
    at_the_answer = delivered(admin, topic)
    assert (await trigger).status in (TRIGGERED, UNKNOWN)
    assert delivered(admin, topic) == at_the_answer, "an occurrence went out after the cancel was answered"
    clock.set(T0 + 120_000)
    await fire_all(triggerer)
    assert delivered(admin, topic) == at_the_answer
