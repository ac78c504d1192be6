"""`delayed-pubsub backfill`, run as a real process against a Redis populated through the real
component: --json, a dry run, twice = once, the exit codes of refusals; and on a real 3-master
Redis Cluster with `delayShards: 6`."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis

from delayed_middleware.entry import decode_entry
from delayed_middleware.instants import format_instant
from tests.components.driver import DELAY_SHARDS, Component, cli, cluster_conn, cluster_props, now_ms
from tests.components.serve import Serve, instance
from tests.redis_server import RedisCluster, RedisServer, stream_entries
from tests.wallclock import Hourly

HOUR = 3_600_000


@pytest.fixture
def conn(redis_server: RedisServer) -> list[str]:
    return ["--redis-host", f"127.0.0.1:{redis_server.port}", "--app-id", "app1"]


def last_hours(hourly: Hourly, n: int) -> tuple[str, str, list[str]]:
    """--from and --to around `hourly`'s last `n` occurrences, and those occurrences."""
    start, end, hours = hourly.window(n)
    return format_instant(start), format_instant(end), [format_instant(h) for h in hours]


def occurrences(client: Any, topic: str = "orders") -> list[str]:
    return [decode_entry(f).metadata["scheduleOccurrence"] for _, f in stream_entries(client, topic)]


@pytest.fixture
async def hourly(component: Callable[[str], Component], props: dict[str, str]) -> tuple[Component, Hourly]:
    """App app1 with the hourly schedule `hourly` on orders (published now; its own next fire is half an
    hour away)."""
    c = component("delayed")
    await c.init({**props, "enableDelayedMessaging": "true"})
    cron = Hourly.away_from_now()
    await c.publish("orders", b"tick", {"schedule": cron.cron, "scheduleId": "hourly"})
    return c, cron


async def test_backfill_json_dry_run_then_twice_delivers_each_hour_once(
    hourly: tuple[Component, Hourly], conn: list[str], redis_client: redis.Redis
) -> None:
    start, end, hours = last_hours(hourly[1], 6)

    dry = await cli("backfill", *conn, "hourly", "--from", start, "--to", end, "--dry-run", "--json")
    assert dry.code == 0, dry.err
    assert dry.json()["deliver"] == hours
    assert dry.json()["dryRun"] is True
    assert not redis_client.exists("orders")

    first = await cli("backfill", *conn, "hourly", "--from", start, "--to", end, "--json")
    again = await cli("backfill", *conn, "hourly", "--from", start, "--to", end, "--json")
    assert first.code == again.code == 0, first.err + again.err
    assert (first.json()["delivered"], again.json()["delivered"]) == (6, 0)
    assert again.json()["alreadyBackfilled"] == 6
    assert occurrences(redis_client) == hours

    text = await cli("backfill", *conn, "hourly", "--from", start, "--to", end, "--dry-run")
    assert text.code == 0, text.err
    assert "would deliver 0:" in text.out
    assert "6 backfilled before" in text.out


async def test_backfill_refusals_exit_2_and_an_unknown_id_exits_1(
    hourly: tuple[Component, Hourly], conn: list[str], redis_client: redis.Redis
) -> None:
    component, cron = hourly
    await component.publish("orders", b"once", {"scheduledSendDelay": "1h", "scheduleId": "once"})
    start, end, _ = last_hours(cron, 2)
    future = format_instant(now_ms() + HOUR)

    unknown = await cli("backfill", *conn, "nobody", "--from", start, "--to", end)
    assert unknown.code == 1
    assert "not found" in unknown.err
    one_shot = await cli("backfill", *conn, "once", "--from", start, "--to", end)
    assert one_shot.code == 2
    assert "not a recurring schedule" in one_shot.err
    ahead = await cli("backfill", *conn, "hourly", "--from", start, "--to", future)
    assert ahead.code == 2
    assert "--to" in ahead.err
    assert "in the future" in ahead.err
    backwards = await cli("backfill", *conn, "hourly", "--from", end, "--to", start)
    assert backwards.code == 2
    assert "is not before --to" in backwards.err
    bad_rate = await cli("backfill", *conn, "hourly", "--from", start, "--to", end, "--rate", "0/s")
    assert bad_rate.code == 2
    assert "argument --rate: '0/s': must be a number more than 0 per second (e.g. 100/s)" in bad_rate.err
    assert not redis_client.exists("orders")


@pytest.mark.slow
async def test_backfill_on_a_cluster_delivers_once_from_the_schedules_shard(
    folder: Path, cluster: RedisCluster, admin: Any
) -> None:
    serve = Serve(folder, "a")
    props = {**cluster_props(cluster), "delayShards": str(DELAY_SHARDS)}
    cron = Hourly.away_from_now()
    start, end, hours = last_hours(cron, 12)
    try:
        async with instance(serve, props) as c:
            for n in range(4):
                await c.publish(f"t{n}", b"tick", {"schedule": cron.cron, "scheduleId": f"hourly-{n}"})
            conn = cluster_conn(cluster)
            for n in range(4):
                result = await cli("backfill", *conn, f"hourly-{n}", "--from", start, "--to", end, "--json")
                assert result.code == 0, result.err
                assert result.json()["delivered"] == 12
            again = await cli("backfill", *conn, "hourly-2", "--from", start, "--to", end, "--json")
            assert again.json()["delivered"] == 0
            assert again.json()["alreadyBackfilled"] == 12
            history = await cli("history", *conn, "--id", "hourly-2", "--json")
            assert [r["event"] for r in history.json()].count("backfilled") == 12
    finally:
        serve.stop()
    for n in range(4):
        assert occurrences(admin, f"t{n}") == hours
