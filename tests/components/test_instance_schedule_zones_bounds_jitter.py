"""Schedules in a time zone, with bounds and jitter, through the component over its gRPC socket, as
daprd drives it, on a real Redis: zones, bounds and jitter as a subscriber and an operator (the CLI)
see them, and every bad value refused with nothing stored."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

import grpc
import pytest
import redis

from delayed_middleware.history import decode_record
from delayed_middleware.instants import parse_instant
from delayed_pubsub_pb.dapr.proto.components.v1 import pubsub_pb2
from tests.components.driver import Component, cli
from tests.redis_server import RedisServer, stream_entries
from tests.wallclock import hour_away

HISTORY = "{app1-delayed}:history"


def now_ms() -> int:
    return time.time_ns() // 1_000_000


@pytest.fixture
def delayed_props(props: dict[str, str]) -> dict[str, str]:
    return {**props, "enableDelayedMessaging": "true"}


@pytest.fixture
def conn(redis_server: RedisServer) -> list[str]:
    return ["--redis-host", f"127.0.0.1:{redis_server.port}", "--app-id", "app1"]


def events(client: redis.Redis, event: str) -> list[str]:
    return [
        r.id for r in (decode_record(i, f) for i, f in stream_entries(client, HISTORY)) if r.event == event
    ]


@pytest.mark.parametrize(
    ("metadata", "key"),
    [
        ({"schedule": "@daily", "scheduleTimeZone": "Mars/Olympus"}, "scheduleTimeZone"),
        ({"schedule": "@daily", "scheduleTimeZone": ""}, "scheduleTimeZone"),
        ({"schedule": "@every 1m", "scheduleTimeZone": "Europe/London"}, "scheduleTimeZone"),
        (
            {"schedule": "CRON_TZ=Europe/London @daily", "scheduleTimeZone": "America/New_York"},
            "scheduleTimeZone",
        ),
        ({"schedule": "CRON_TZ=Atlantis/Capital @daily"}, "schedule"),
        ({"schedule": "@daily", "scheduleStart": "next tuesday"}, "scheduleStart"),
        ({"schedule": "@daily", "scheduleEnd": "2020-01-01T00:00:00Z"}, "scheduleEnd"),
        (
            {
                "schedule": "@daily",
                "scheduleStart": "2031-01-02T00:00:00Z",
                "scheduleEnd": "2031-01-01T00:00:00Z",
            },
            "scheduleEnd",
        ),
        ({"schedule": "@daily", "scheduleLimit": "0"}, "scheduleLimit"),
        ({"schedule": "@daily", "scheduleLimit": "many"}, "scheduleLimit"),
        ({"schedule": "@every 10s", "scheduleJitter": "10s"}, "scheduleJitter"),
        ({"schedule": "@every 10s", "scheduleJitter": "soon"}, "scheduleJitter"),
        ({"scheduledSendDelay": "1h", "scheduleLimit": "3"}, "scheduleLimit"),
        ({"scheduleTimeZone": "Europe/London"}, "scheduleTimeZone"),
        ({"schedule": "@at 2031-01-01T00:00:00Z", "scheduleJitter": "1s"}, "scheduleJitter"),
        ({"schedule": "@every 1m", "scheduleCatchup": "some"}, "scheduleCatchup"),
        ({"schedule": "@every 1m", "scheduleCatchupWindow": "0s"}, "scheduleCatchupWindow"),
        ({"schedule": "@daily", "scheduleCatchupWindow": "a day"}, "scheduleCatchupWindow"),
        ({"schedule": "@at 2031-01-01T00:00:00Z", "scheduleCatchup": "all"}, "scheduleCatchup"),
        ({"scheduledSendDelay": "1h", "scheduleCatchup": "none"}, "scheduleCatchup"),
        # Names that read a host file or a variant of the zone data, in either key.
        ({"schedule": "@daily", "scheduleTimeZone": "localtime"}, "scheduleTimeZone"),
        ({"schedule": "@daily", "scheduleTimeZone": "right/America/New_York"}, "scheduleTimeZone"),
        ({"schedule": "@daily", "scheduleTimeZone": "posixrules"}, "scheduleTimeZone"),
        ({"schedule": "@daily", "scheduleTimeZone": "Factory"}, "scheduleTimeZone"),
        ({"schedule": "CRON_TZ=posix/Europe/Paris @daily"}, "schedule"),
        ({"schedule": "CRON_TZ=localtime 0 0 9 * * *"}, "schedule"),
        # A start whose wall-clock time in the zone is past year 9999.
        (
            {
                "schedule": "* * * * * *",
                "scheduleTimeZone": "Asia/Kathmandu",
                "scheduleStart": "9999-12-31T23:59:59Z",
            },
            "scheduleStart",
        ),
    ],
)
async def test_bad_zone_bound_and_jitter_values_are_invalid_argument_naming_the_key_and_nothing_is_stored(
    component: Callable[[str], Component],
    delayed_props: dict[str, str],
    redis_client: redis.Redis,
    metadata: dict[str, str],
    key: str,
) -> None:
    c = component("delayed")
    await c.init(delayed_props)
    before = redis_client.dbsize()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await c.publish("orders", b"{}", {**metadata, "scheduleId": "bad"})
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = err.value.details() or ""
    assert f"invalid metadata {key}=" in details
    assert repr(metadata.get(key, ""))[1:-1] in details
    assert redis_client.dbsize() == before


@pytest.mark.parametrize(
    "metadata",
    [
        {"schedule": "@every 1s", "scheduleStart": "9999-12-31T23:59:50Z", "scheduleLimit": "1000000"},
        {"schedule": "@every 8760h", "scheduleLimit": "1000000"},
        {"schedule": "@every 1m", "scheduleTimeZone": "UTC"},
        {"schedule": "@at 2099-01-01T00:00:00Z", "scheduleTimeZone": "UTC"},
        {"schedule": "0 5 * * * *", "scheduleTimeZone": "US/Eastern", "scheduleJitter": "59m59s"},
        {"schedule": "CRON_TZ=Etc/GMT+5 @daily", "scheduleJitter": "23h"},
    ],
)
async def test_far_limits_utc_and_tzdata_link_names_are_accepted_and_stored(
    component: Callable[[str], Component],
    delayed_props: dict[str, str],
    redis_client: redis.Redis,
    metadata: dict[str, str],
) -> None:
    c = component("delayed")
    await c.init(delayed_props)
    await c.publish("orders", b"{}", {**metadata, "scheduleId": "ok"})
    assert redis_client.hexists("{app1-delayed}:ids", "ok")
    assert int(redis_client.get("{app1-delayed}:pending") or 0) == 1


async def test_the_keys_need_delayed_messaging_enabled(
    component: Callable[[str], Component], props: dict[str, str], redis_client: redis.Redis
) -> None:
    c = component("plain")
    await c.init(props)
    before = redis_client.dbsize()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await c.publish("orders", b"{}", {"schedule": "@daily", "scheduleTimeZone": "Europe/London"})
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert redis_client.dbsize() == before


async def test_a_limit_of_1_delivers_once_and_the_schedule_is_gone_with_a_completed_record(
    component: Callable[[str], Component], delayed_props: dict[str, str], redis_client: redis.Redis
) -> None:
    c = component("delayed")
    await c.init(delayed_props)
    stream = await c.subscribe("ticks")
    await c.publish("ticks", b"t", {"schedule": "@every 1s", "scheduleId": "one", "scheduleLimit": "1"})
    msg = await stream.next(within=5)
    await stream.ack(msg.id)
    assert (msg.metadata["scheduler"], msg.metadata["scheduleNext"]) == ("one", "purge")
    assert await stream.nothing_for(2.5)
    assert events(redis_client, "completed") == ["one"]
    assert int(redis_client.get("{app1-delayed}:pending") or 0) == 0
    assert not redis_client.hexists("{app1-delayed}:ids", "one")
    await stream.close()


async def test_a_thousand_every_10s_schedules_with_jitter_5s_fire_spread_over_5_seconds(
    component: Callable[[str], Component],
    delayed_props: dict[str, str],
    redis_client: redis.Redis,
    conn: list[str],
) -> None:
    c = component("delayed")
    await c.init(delayed_props)
    stream = await c.subscribe("spread")
    md = {"schedule": "@every 10s", "scheduleJitter": "5s"}
    t0 = now_ms()
    reply = await c.bulk_publish(
        "spread",
        [
            pubsub_pb2.BulkMessageEntry(entry_id=str(i), event=b"x", metadata={**md, "scheduleId": f"s{i}"})
            for i in range(1000)
        ],
    )
    t1 = now_ms()
    assert not reply.failed_entries
    # The index, and so pending's `due`, holds each schedule's jittered time. One bulk publish is
    # accepted at one instant, so every nominal fire is that instant + 10 s and the dues spread
    # over the 5 s of jitter after it.
    listed = (await cli("pending", *conn, "--limit", "0", "--json")).json()
    due_of = {r["id"]: parse_instant(r["due"]) for r in listed}
    assert len(due_of) == 1000
    first_due = min(due_of.values())
    assert all(t0 + 10_000 <= d < t1 + 15_000 for d in due_of.values())
    assert 4_900 <= max(due_of.values()) - first_due < 5_000
    per_second = Counter((d - first_due) // 1000 for d in due_of.values())
    assert all(140 <= per_second[s] <= 260 for s in range(5)), per_second
    # And they fire at those times (the history's fired-at): never before their own due time,
    # over ~5 s, not at one instant.
    received: set[str] = set()
    while len(received) < 1000:
        got = await stream.next(within=20)
        received.add(got.metadata["scheduler"])
        await stream.ack(got.id)
    fired: dict[str, int] = {}
    for r in (decode_record(i, f) for i, f in stream_entries(redis_client, HISTORY)):
        if r.event == "fired":
            fired.setdefault(r.id, r.at_ms)
    assert set(fired) == set(due_of)
    assert all(fired[sid] >= due_of[sid] for sid in due_of)
    first_fires = sorted(fired.values())
    assert first_fires[-1] - first_fires[0] >= 4_000
    by_second = Counter((t - first_fires[0]) // 1000 for t in first_fires)
    assert max(by_second.values()) <= 350, by_second
    cancels = [
        pubsub_pb2.BulkMessageEntry(
            entry_id=str(i), event=b"", metadata={"scheduleCancel": "true", "scheduleId": f"s{i}"}
        )
        for i in range(1000)
    ]
    assert not (await c.bulk_publish("spread", cancels)).failed_entries
    await stream.close()


async def test_pending_and_inspect_show_the_zone_and_the_next_fire_in_utc_and_in_the_zone(
    component: Callable[[str], Component], delayed_props: dict[str, str], conn: list[str]
) -> None:
    c = component("delayed")
    await c.init(delayed_props)
    # Daily at an hour half a day away: a fire between the three commands would move its due.
    hour = hour_away("America/New_York")
    await c.publish(
        "reports",
        b"r",
        {
            "schedule": f"0 0 {hour} * * *",
            "scheduleTimeZone": "America/New_York",
            "scheduleId": "ny",
            "scheduleLimit": "3",
        },
    )
    await c.publish("reports", b"u", {"schedule": "@daily", "scheduleId": "utc"})
    rows = {r["id"]: r for r in (await cli("pending", *conn, "--json")).json()}
    ny = rows["ny"]
    assert ny["timeZone"] == "America/New_York"
    # `due` stays UTC; `dueLocal` is the same instant at that hour of New York time.
    assert ny["due"].endswith("Z")
    assert ny["dueLocal"][11:19] == f"{hour:02d}:00:00"
    assert ny["dueLocal"][19:] in ("-05:00", "-04:00")
    assert parse_instant(ny["dueLocal"]) == parse_instant(ny["due"])
    assert (rows["utc"]["timeZone"], rows["utc"]["dueLocal"]) == (None, None)
    table = await cli("pending", *conn)
    assert table.code == 0, table.err
    assert "America/New_York" in table.out
    assert ny["dueLocal"] in table.out
    shown = await cli("inspect", *conn, "ny")
    assert shown.code == 0, shown.err
    lines = [line.split() for line in shown.out.splitlines()]
    assert ["timeZone", "America/New_York"] in lines
    assert ["due", "in", "zone", ny["dueLocal"]] in lines
    assert any(line[:1] == ["schedule"] and "limit=3" in " ".join(line) for line in lines)
