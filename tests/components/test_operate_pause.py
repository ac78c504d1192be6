"""The operator CLI's pause, resume, cancel --prefix and paged pending, run as real processes
against a Redis populated through the real component."""

from __future__ import annotations

import asyncio
import os
import pty
import subprocess
from collections.abc import Callable

import pytest
import redis

from tests.components.driver import EXE, Component, cli
from tests.redis_server import RedisServer

Factory = Callable[[str], Component]


@pytest.fixture
def conn(redis_server: RedisServer) -> list[str]:
    return ["--redis-host", f"127.0.0.1:{redis_server.port}", "--app-id", "app1"]


@pytest.fixture
async def app(component: Factory, props: dict[str, str]) -> Component:
    c = component("delayed")
    await c.init({**props, "enableDelayedMessaging": "true"})
    return c


async def test_pause_and_resume_show_in_pending_and_inspect(app: Component, conn: list[str]) -> None:
    await app.publish("ticks", b"t", {"schedule": "@every 1h", "scheduleId": "tick"})
    await app.publish("orders", b"o", {"scheduledSendDelay": "1h", "scheduleId": "order-1"})
    paused = await cli("pause", *conn, "tick", "order-1")
    assert paused.code == 0, paused.err
    assert paused.out.split("\n")[:2] == ["paused tick", "paused order-1"]
    rows = {r["id"]: r for r in (await cli("pending", *conn, "--json")).json()}
    assert rows["tick"]["paused"] is True
    assert rows["tick"]["pausedAt"]
    assert rows["order-1"]["paused"] is True
    table = await cli("pending", *conn)
    assert "recurring (paused)" in table.out
    shown = await cli("inspect", *conn, "tick")
    assert "paused since" in shown.out
    assert "paused" in shown.out.split("history")[-1]  # the history record
    again = await cli("pause", *conn, "tick")
    assert (again.code, again.out.strip()) == (0, "tick: paused already")
    resumed = await cli("resume", *conn, "tick")
    assert (resumed.code, resumed.out.strip()) == (0, "resumed tick"), resumed.err
    rows = {r["id"]: r for r in (await cli("pending", *conn, "--json")).json()}
    assert rows["tick"]["paused"] is False
    assert rows["tick"]["pausedAt"] is None
    assert rows["order-1"]["paused"] is True


async def test_pause_of_an_unknown_id_exits_1_naming_it(app: Component, conn: list[str]) -> None:
    result = await cli("pause", *conn, "nobody")
    assert result.code == 1
    assert "nobody" in result.err


async def test_cancel_by_prefix_asks_first_and_cancels_with_yes(
    app: Component, conn: list[str], redis_client: redis.Redis
) -> None:
    for i in range(30):
        await app.publish("orders", b"x", {"scheduledSendDelay": "1h", "scheduleId": f"tenant-1:{i}"})
    await app.publish("orders", b"x", {"scheduledSendDelay": "1h", "scheduleId": "tenant-2:0"})
    # Not a terminal, no --yes: refused, with what it would have cancelled.
    asked = await cli("cancel", *conn, "--prefix", "tenant-1:")
    assert asked.code == 2
    assert "cancel the 30 pending" in asked.err
    assert "--yes" in asked.err
    assert redis_client.hlen("{app1-delayed}:ids") == 31
    empty = await cli("cancel", *conn, "--prefix", "", "--yes")
    assert empty.code == 2
    assert "every pending message and schedule" in empty.err
    done = await cli("cancel", *conn, "--prefix", "tenant-1:", "--yes")
    assert done.code == 0, done.err
    assert done.out.strip() == "cancelled 30 whose id starts with 'tenant-1:'"
    assert redis_client.hkeys("{app1-delayed}:ids") == [b"tenant-2:0"]
    nothing = await cli("cancel", *conn, "--prefix", "tenant-1:", "--yes")
    assert nothing.out.strip() == "cancelled 0 whose id starts with 'tenant-1:'"


async def test_pending_by_prefix_pages_through_every_match_once(app: Component, conn: list[str]) -> None:
    for i in range(1_250):
        await app.publish("orders", b"x", {"scheduledSendDelay": "1h", "scheduleId": f"a:{i}"})
        if i % 5 == 0:
            await app.publish("orders", b"y", {"scheduledSendDelay": "1h", "scheduleId": f"b:{i}"})
    seen: list[str] = []
    after: list[str] = []
    pages = 0
    while True:
        page = await cli("pending", *conn, "--prefix", "a:", "--limit", "300", "--json", *after)
        assert page.code == 0, page.err
        rows = page.json()
        assert len(rows) <= 300
        seen += [r["id"] for r in rows]
        pages += 1
        if "next page: --after " not in page.err:
            break
        after = ["--after", page.err.split("next page: --after ")[1].split()[0]]
        assert after[1] == rows[-1]["cursor"]
    assert pages == 5
    assert sorted(seen) == sorted(f"a:{i}" for i in range(1_250))
    # --after alone pages everything, in stream order.
    first = (await cli("pending", *conn, "--after", "0-0", "--limit", "2", "--json")).json()
    assert [r["id"] for r in first] == ["a:0", "b:0"]
    bad = await cli("pending", *conn, "--after", "tomorrow")
    assert bad.code == 2
    assert "tomorrow" in bad.err


def _answer_on_a_terminal(args: list[str], answer: str) -> tuple[int, str]:
    """Run the CLI with a pseudo-terminal as stdin, type `answer`; its exit code and output."""
    controller, terminal = pty.openpty()
    try:
        proc = subprocess.Popen(
            [str(EXE), *args], stdin=terminal, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        os.write(controller, answer.encode() + b"\n")
        out, _ = proc.communicate(timeout=60)
    finally:
        os.close(controller)
        os.close(terminal)
    return proc.returncode, out.decode()


async def test_cancel_by_prefix_on_a_terminal_cancels_only_when_the_answer_is_yes(
    app: Component, conn: list[str], redis_client: redis.Redis
) -> None:
    for i in range(3):
        await app.publish("orders", b"x", {"scheduledSendDelay": "1h", "scheduleId": f"job:{i}"})
    args = ["cancel", *conn, "--prefix", "job:"]
    code, out = await asyncio.to_thread(_answer_on_a_terminal, args, "n")
    assert code == 0
    assert "cancel the 3 pending messages and schedules of app1 whose id starts with 'job:'?" in out
    assert "nothing cancelled" in out
    assert redis_client.hlen("{app1-delayed}:ids") == 3
    code, out = await asyncio.to_thread(_answer_on_a_terminal, args, "y")
    assert code == 0
    assert "cancelled 3 whose id starts with 'job:'" in out
    assert redis_client.hlen("{app1-delayed}:ids") == 0
