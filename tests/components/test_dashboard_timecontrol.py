"""The dashboard's trigger and reschedule actions in a real headless Chromium and by script, against a
real component (which fires what they move) and Redis; absent without --allow-actions."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
from playwright.async_api import Browser, expect

from delayed_middleware.instants import parse_instant
from tests.components import test_dashboard_api as api_tests
from tests.components.driver import Component, cli
from tests.components.test_dashboard import (
    ACTIONS,
    TOKEN,
    TOKEN_ENV,
    Start,
    cli_conn,
    conn,
    log_in,
    pending_ids,
    post,
    waiting,
)
from tests.components.test_dashboard_api import flags, seeded

__all__ = ["conn", "flags", "seeded", "waiting"]  # fixtures shared with the dashboard's other tests


async def test_trigger_now_from_the_message_page_delivers_it(
    waiting: Component, conn: list[str], dashboard: Start, browser: Browser
) -> None:
    stream = await waiting.subscribe("billing")
    d = dashboard(*conn, *ACTIONS, env=TOKEN_ENV)
    page = await browser.new_page()
    await log_in(page, d)
    await page.goto(f"{d.url}/message?id=bill-3")
    await page.click("button:has-text('Trigger now')")
    await expect(page.locator("#result")).to_contain_text("triggered bill-3 at ")
    msg = await stream.next(within=3)
    assert msg.data == b"bill 3"
    await stream.ack(msg.id)
    deadline = time.monotonic() + 10
    while "bill-3" in await pending_ids(conn):
        assert time.monotonic() < deadline
        await asyncio.sleep(0.2)
    # The schedules page offers it beside Pause; a recurring schedule has no Reschedule.
    await waiting.publish("reports", b"nightly", {"schedule": "@every 1h", "scheduleId": "hourly"})
    await page.goto(f"{d.url}/schedules")
    assert await page.locator("button:has-text('Trigger now')").count() == 1
    assert await page.locator("button:has-text('Reschedule')").count() == 0
    await stream.close()


async def test_reschedule_by_script_moves_it_and_refuses_bad_times(
    waiting: Component, conn: list[str], dashboard: Start
) -> None:
    d = dashboard(*conn, *ACTIONS, env=TOKEN_ENV)
    headers = {"X-Dashboard-Token": TOKEN}
    moved = await post(
        f"{d.url}/actions/reschedule", data={"id": "bill-1", "when": "2045-11-05T13:15:30Z"}, headers=headers
    )
    assert moved.status_code == 200, moved.text
    assert moved.json() == {"ok": True, "message": "rescheduled bill-1 to 2045-11-05T13:15:30.000Z"}
    rows = {r["id"]: r for r in (await cli("pending", *cli_conn(conn), "--json", "--limit", "0")).json()}
    assert parse_instant(rows["bill-1"]["due"]) == parse_instant("2045-11-05T13:15:30Z")
    bad = await post(f"{d.url}/actions/reschedule", data={"id": "bill-1", "when": "soonish"}, headers=headers)
    assert bad.status_code == 404
    assert "soonish" in bad.json()["message"]
    unknown = await post(f"{d.url}/actions/trigger", data={"id": "nobody"}, headers=headers)
    assert unknown.status_code == 404
    assert "nobody" in unknown.json()["message"]


async def test_no_trigger_or_reschedule_without_allow_actions(
    waiting: Component, conn: list[str], dashboard: Start
) -> None:
    d = dashboard(*conn, env=TOKEN_ENV)
    for path in ("/actions/trigger", "/actions/reschedule"):
        r = await post(
            f"{d.url}{path}",
            data={"id": "bill-2", "when": "1s"},
            headers={"X-Dashboard-Token": TOKEN, "Origin": d.url},
        )
        assert r.status_code in (404, 405), (path, r.status_code)
    assert "bill-2" in await pending_ids(conn)


async def test_trigger_and_reschedule_through_the_json_api(
    seeded: Component, flags: list[str], dashboard: Start
) -> None:
    d = dashboard(*flags, *api_tests.ACTIONS, env=api_tests.ENV)

    async def post(name: str, body: dict[str, Any]) -> httpx.Response:
        # api_tests.call checks every answer against docs/openapi.yaml.
        return await api_tests.call("POST", f"{d.url}/api/v1/{name}", json=body, headers=api_tests.BEARER)

    r = await post("reschedule", {"id": "order-001", "at": "2045-11-05T13:15:30Z"})
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "rescheduled"
    assert r.json()["at"] == "2045-11-05T13:15:30.000Z"
    rows = {row["id"]: row for row in await api_tests.pending_cli(flags)}
    assert parse_instant(rows["order-001"]["due"]) == parse_instant("2045-11-05T13:15:30Z")
    r = await post("trigger", {"id": "order-002"})
    assert (r.status_code, r.json()["status"], r.json()["topic"]) == (200, "triggered", "orders")
    deadline = time.monotonic() + 10
    while "order-002" in {row["id"] for row in await api_tests.pending_cli(flags)}:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.2)
    # It fired: moving it is a conflict; triggering it again finds nothing.
    assert api_tests.error_of(await post("reschedule", {"id": "order-002", "at": "1h"}))[:2] == (
        409,
        "failed_precondition",
    )
    assert api_tests.error_of(await post("trigger", {"id": "order-002"}))[:2] == (404, "not_found")
    for body, field in (
        ({"id": "order-003", "at": "soon"}, "at"),
        ({"id": "order-003"}, "at"),
        ({"id": "hourly", "at": "5m"}, "id"),
        ({"id": "order-003", "at": "5m", "force": True}, "force"),
    ):
        status, code, message = api_tests.error_of(await post("reschedule", body))
        assert (status, code) == (400, "bad_parameter"), (body, message)
        assert field in message, (body, message)
