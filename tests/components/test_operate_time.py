"""The operator CLI's trigger and reschedule, run as real processes against a Redis populated through
the real component (which fires what they move): outputs, --json, exit codes, history."""

from __future__ import annotations

import time
from collections.abc import Callable

import redis

from delayed_middleware.history import decode_record
from delayed_middleware.instants import format_instant, parse_instant
from tests.components.driver import Component, cli
from tests.components.test_operate_pause import app, conn
from tests.redis_server import stream_entries

Factory = Callable[[str], Component]
HISTORY = "{app1-delayed}:history"


__all__ = ["app", "conn"]  # the fixtures of the operator CLI's tests (test_operate_pause.py)


def records(client: redis.Redis, id: str) -> list[tuple[str, str]]:
    return [
        (r.event, r.reason)
        for r in (decode_record(i, f) for i, f in stream_entries(client, HISTORY))
        if r.id == id
    ]


async def test_trigger_delivers_now_and_exits_1_naming_what_was_not_pending(
    app: Component, conn: list[str], redis_client: redis.Redis
) -> None:
    stream = await app.subscribe("orders")
    await app.publish("orders", b"o", {"scheduledSendDelay": "1h", "scheduleId": "order-1"})
    done = await cli("trigger", *conn, "order-1", "nobody")
    assert done.code == 1
    assert done.out.startswith("triggered order-1 at ")
    assert "not found" in done.err
    assert "nobody" in done.err
    assert "order-1" not in done.err
    msg = await stream.next(within=3)
    assert msg.data == b"o"
    await stream.ack(msg.id)
    assert records(redis_client, "order-1")[1] == ("triggered", "operator (delayed-pubsub trigger)")
    again = await cli("trigger", *conn, "order-1", "--json")
    assert again.code == 1
    [row] = again.json()
    assert row["id"] == "order-1"
    assert row["status"] == "fired"
    assert row["done"] is False
    assert row["why"] == "already fired"
    await stream.close()


async def test_trigger_json_of_a_schedule_says_when(app: Component, conn: list[str]) -> None:
    await app.publish("ticks", b"t", {"schedule": "@every 1h", "scheduleId": "tick"})
    before = time.time_ns() // 1_000_000
    done = await cli("trigger", *conn, "tick", "--json")
    assert done.code == 0, done.err
    [row] = done.json()
    assert (row["id"], row["status"], row["done"], row["topic"], row["why"]) == (
        "tick",
        "triggered",
        True,
        "ticks",
        None,
    )
    assert 0 <= parse_instant(row["at"]) - before < 10_000


async def test_reschedule_at_and_in_move_the_message_and_json_reports_it(
    app: Component, conn: list[str], redis_client: redis.Redis
) -> None:
    await app.publish("orders", b"o", {"scheduledSendDelay": "1h", "scheduleId": "m"})
    moved = await cli("reschedule", *conn, "m", "--at", "2045-11-05T13:15:30Z")
    assert moved.code == 0, moved.err
    assert moved.out.strip() == "rescheduled m to 2045-11-05T13:15:30.000Z"
    pending = {r["id"]: r for r in (await cli("pending", *conn, "--json")).json()}
    assert parse_instant(pending["m"]["due"]) == parse_instant("2045-11-05T13:15:30Z")
    before = time.time_ns() // 1_000_000
    again = await cli("reschedule", *conn, "m", "--in", "2h", "--json")
    assert again.code == 0, again.err
    row = again.json()
    assert row["status"] == "rescheduled"
    assert abs(parse_instant(row["at"]) - before - 7_200_000) < 10_000
    event, reason = records(redis_client, "m")[-1]
    assert event == "rescheduled"
    assert (
        reason
        == f"operator (delayed-pubsub reschedule) from {format_instant(parse_instant('2045-11-05T13:15:30Z'))}"
    )


async def test_reschedule_refusals_exit_with_their_codes(app: Component, conn: list[str]) -> None:
    await app.publish("ticks", b"t", {"schedule": "@every 1h", "scheduleId": "tick"})
    recurring = await cli("reschedule", *conn, "tick", "--in", "5m")
    assert recurring.code == 2
    assert "recurring schedule" in recurring.err
    missing = await cli("reschedule", *conn, "nobody", "--in", "5m")
    assert missing.code == 1
    assert "not found" in missing.err
    assert "nobody" in missing.err
    bad = await cli("reschedule", *conn, "tick", "--at", "tomorrow")
    assert bad.code == 2
    assert "--at 'tomorrow'" in bad.err
    both = await cli("reschedule", *conn, "tick", "--at", "2045-01-01T00:00:00Z", "--in", "5m")
    assert both.code == 2
