"""`delayed-pubsub dashboard` in a real headless Chromium, against a real component and Redis.

The browser tests also write the screenshots of docs/dashboard.md (docs/images/dashboard-*.png).
"""

from __future__ import annotations

import asyncio
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.async_api import Browser, Dialog, Page, expect

from tests.components.conftest import Dashboard
from tests.components.driver import Component, cli
from tests.redis_server import RedisCluster, RedisServer, free_port
from tests.wallclock import hour_away

Factory = Callable[[str], Component]
Start = Callable[..., Dashboard]

TOKEN = "operator-token-0123456789"
TOKEN_ENV = {"DASH_TOKEN": TOKEN}
ACTIONS = ("--allow-actions", "--token-env", "DASH_TOKEN")
IMAGES = Path(__file__).resolve().parents[2] / "docs" / "images"
# Script in every attacker-controlled place: any execution shows as a dialog or as window.__xss.
PROBE = '<script>alert("xss");window.__xss=1</script><img src=x onerror="alert(2);window.__xss=2">'


@pytest.fixture
def conn(redis_server: RedisServer) -> list[str]:
    return ["--redis-host", f"127.0.0.1:{redis_server.port}", "--app-id", "app1", "--interval", "0.5"]


@pytest.fixture
async def waiting(component: Factory, props: dict[str, str]) -> Component:
    """7 on orders and 5 on billing (scheduleIds bill-0..4) due in an hour, 3 on orders due in 10 minutes."""
    c = component("delayed")
    await c.init(
        {**props, "enableDelayedMessaging": "true", "maxDeliveryAttempts": "1", "deadLetterTopic": "dlq"}
    )
    for i in range(7):
        await c.publish("orders", f'{{"order":{i}}}'.encode(), {"scheduledSendDelay": "1h"})
    for i in range(5):
        await c.publish(
            "billing", f"bill {i}".encode(), {"scheduledSendDelay": "1h", "scheduleId": f"bill-{i}"}
        )
    for i in range(3):
        await c.publish("orders", f"soon {i}".encode(), {"scheduledSendDelay": "10m"})
    return c


def cli_conn(conn: list[str]) -> list[str]:
    return conn[:4]


async def pending_ids(conn: list[str]) -> list[str]:
    result = await cli("pending", *cli_conn(conn), "--json", "--limit", "0")
    assert result.code == 0, result.err
    return [r["id"] for r in result.json()]


async def table(page: Page, selector: str) -> list[list[str]]:
    rows: list[list[str]] = await page.eval_on_selector_all(
        f"{selector} tbody tr", "rows => rows.map(r => [...r.cells].map(c => c.textContent.trim()))"
    )
    return rows


async def post(url: str, **kwargs: Any) -> httpx.Response:
    async with httpx.AsyncClient() as client:
        return await client.post(url, **kwargs)


async def get(url: str, **kwargs: Any) -> httpx.Response:
    async with httpx.AsyncClient() as client:
        return await client.get(url, **kwargs)


async def log_in(page: Page, d: Dashboard) -> None:
    await page.goto(f"{d.url}/login")
    await page.fill("#token", TOKEN)
    await page.click("button[type=submit]")
    await expect(page.locator("header .mode")).to_have_text("actions on")


async def shot(page: Page, name: str) -> None:
    IMAGES.mkdir(parents=True, exist_ok=True)
    await page.set_viewport_size({"width": 1280, "height": 900})
    await page.screenshot(path=str(IMAGES / f"dashboard-{name}.png"), full_page=True)


async def test_overview_counts_match_pending_json(
    waiting: Component, conn: list[str], dashboard: Start, browser: Browser
) -> None:
    # Six fire at once (their lateness is in the history), one recurs every hour.
    for i in range(6):
        await waiting.publish("reminders", f"r{i}".encode(), {"scheduledSendDelay": "200ms"})
    await waiting.publish("reports", b"nightly", {"schedule": "@every 1h", "scheduleId": "hourly-report"})
    deadline = time.monotonic() + 15
    while len(rows := (await cli("pending", *cli_conn(conn), "--json", "--limit", "0")).json()) != 16:
        assert time.monotonic() < deadline, rows
        await asyncio.sleep(0.2)
    d = dashboard(*conn)
    page = await browser.new_page()
    await page.goto(f"{d.url}/")
    assert await page.inner_text("#total-pending") == "16"
    by_topic = {topic: int(n) for topic, n in await table(page, "#by-topic")}
    assert by_topic == Counter(r["topic"] for r in rows) == {"orders": 10, "billing": 5, "reports": 1}
    by_window = {label: int(n) for label, n, _ in await table(page, "#by-window")}
    assert by_window == {
        "overdue": 0,
        "within 1 min": 0,
        "within 10 min": 3,
        "within 1 h": 13,
        "within 1 day": 0,
        "later": 0,
    }
    # Due next: the earliest ten, in the order `pending --json` lists them.
    soonest = [cells[0] for cells in await table(page, "#soonest")]
    assert soonest == [r["id"] for r in rows[:10]]
    # The six fires: counted in their minute(s), with their lateness.
    fires = sum(int(n) for _, n, _ in await table(page, "#fires"))
    assert fires == 6
    assert sum(int(n) for _, n, _ in await table(page, "#lateness-histogram")) == 6
    assert "of the last 6 fires" in await page.inner_text("main")
    await shot(page, "overview")
    await page.goto(f"{d.url}/pending")
    assert len(await table(page, "#pending")) == 16
    await shot(page, "pending")
    await page.goto(f"{d.url}/schedules")
    schedules = await table(page, "#schedules")
    report = next(r for r in rows if r["id"] == "hourly-report")
    assert [(r[0], r[1], r[2], r[3], r[4], r[6]) for r in schedules] == [
        ("hourly-report", "reports", "@every 1h0m0s", "UTC", report["due"], "running")
    ]
    await shot(page, "schedules")


async def test_schedules_show_their_zone_and_paused_state(
    waiting: Component, conn: list[str], dashboard: Start, browser: Browser
) -> None:
    # Daily at an hour half a day away: a fire between `pending` and the page would move its due.
    daily = f"0 0 {hour_away('America/New_York')} * * *"
    await waiting.publish(
        "reports",
        b"ny",
        {"schedule": daily, "scheduleTimeZone": "America/New_York", "scheduleId": "ny-morning"},
    )
    await waiting.publish("reports", b"h", {"schedule": "@every 1h", "scheduleId": "held"})
    await waiting.publish("reports", b"", {"scheduleId": "held", "schedulePause": "true"})
    rows = {r["id"]: r for r in (await cli("pending", *cli_conn(conn), "--json", "--limit", "0")).json()}
    assert rows["held"]["paused"] is True
    d = dashboard(*conn)
    page = await browser.new_page()
    await page.goto(f"{d.url}/schedules")
    shown = {r[0]: r for r in await table(page, "#schedules")}
    assert set(shown) == {"ny-morning", "held"}
    assert shown["ny-morning"][3] == "America/New_York"
    assert shown["ny-morning"][4] == rows["ny-morning"]["due"]
    assert shown["ny-morning"][6] == "running"
    assert shown["held"][3] == "UTC"
    assert shown["held"][6].startswith("paused since ")


async def test_a_published_message_appears_live_without_a_reload(
    waiting: Component, conn: list[str], dashboard: Start, browser: Browser
) -> None:
    d = dashboard(*conn)
    page = await browser.new_page()
    await page.goto(f"{d.url}/")
    await expect(page.locator("#total-pending")).to_have_text("15")
    # Gone on any navigation or reload: proves the update came over the open page's event stream.
    await page.evaluate("window.__samePage = 'yes'")
    await waiting.publish("fresh", b"new", {"scheduledSendDelay": "2m", "scheduleId": "live-one"})
    await expect(page.locator("#total-pending")).to_have_text("16", timeout=15_000)
    assert ["fresh", "1"] in await table(page, "#by-topic")
    await expect(page.locator("#soonest")).to_contain_text("live-one")
    assert await page.evaluate("window.__samePage") == "yes"
    assert d.health()["watchers"] == 1


async def test_cancel_with_the_token_cancels(
    waiting: Component, conn: list[str], dashboard: Start, browser: Browser
) -> None:
    d = dashboard(*conn, *ACTIONS, env=TOKEN_ENV)
    page = await browser.new_page()
    await log_in(page, d)
    await page.goto(f"{d.url}/message?id=bill-0")
    await expect(page.locator("#topic")).to_have_text("billing")
    await expect(page.locator("#history")).to_contain_text("scheduled")
    await shot(page, "message")
    await page.click("button:has-text('Cancel')")
    await expect(page.locator("#result")).to_have_text("cancelled bill-0")
    ids = await pending_ids(conn)
    assert "bill-0" not in ids
    assert len(ids) == 14
    # Once more: nothing left to cancel, and the page says so.
    await page.go_back()
    await page.reload()
    await expect(page.locator("main")).to_contain_text("No pending message bill-0")


async def test_pause_and_resume_with_the_token_and_not_without(
    waiting: Component, conn: list[str], dashboard: Start, browser: Browser
) -> None:
    await waiting.publish("reports", b"h", {"schedule": "@every 1h", "scheduleId": "hourly"})
    d = dashboard(*conn, *ACTIONS, env=TOKEN_ENV)
    # Without a session: no button, and a same-origin POST is refused; the schedule runs on.
    anonymous = await (await browser.new_context()).new_page()
    await anonymous.goto(f"{d.url}/schedules")
    assert await anonymous.locator("button:has-text('Pause')").count() == 0
    status = await anonymous.evaluate(
        """async url => (await fetch(url, {method: 'POST', body: new URLSearchParams({id: 'hourly'})})).status""",
        f"{d.url}/actions/pause",
    )
    assert status == 403

    async def paused() -> bool:
        rows = (await cli("pending", *cli_conn(conn), "--json", "--limit", "0")).json()
        return bool(next(r for r in rows if r["id"] == "hourly")["paused"])

    assert not await paused()
    page = await browser.new_page()
    await log_in(page, d)
    await page.goto(f"{d.url}/schedules")
    await page.click("button:has-text('Pause')")
    await expect(page.locator("#result")).to_have_text("paused hourly")
    assert await paused()
    await page.goto(f"{d.url}/schedules")
    await page.click("button:has-text('Resume')")
    await expect(page.locator("#result")).to_have_text("resumed hourly")
    assert not await paused()


async def test_without_the_token_nothing_changes(
    waiting: Component, conn: list[str], dashboard: Start, browser: Browser
) -> None:
    d = dashboard(*conn, *ACTIONS, env=TOKEN_ENV)
    context = await browser.new_context()
    page = await context.new_page()
    await page.goto(f"{d.url}/message?id=bill-1")
    await expect(page.locator("#topic")).to_have_text("billing")
    assert await page.locator("button:has-text('Cancel')").count() == 0
    # A same-origin POST without a session, from the page itself.
    status = await page.evaluate(
        """async url => (await fetch(url, {method: 'POST', body: new URLSearchParams({id: 'bill-1'})})).status""",
        f"{d.url}/actions/cancel",
    )
    assert status == 403
    # A wrong token does not log in.
    await page.goto(f"{d.url}/login")
    await page.fill("#token", TOKEN[:-1] + "x")
    await page.click("button[type=submit]")
    await expect(page.locator("main")).to_contain_text("That is not the dashboard's token")
    # Logged in, the session cookie alone is not enough: no CSRF field, or a foreign Origin, is refused.
    await log_in(page, d)
    await page.goto(f"{d.url}/message?id=bill-1")
    csrf = await page.get_attribute("input[name=csrf]", "value")
    assert csrf
    no_field = await context.request.post(
        f"{d.url}/actions/cancel", form={"id": "bill-1"}, headers={"Origin": d.url}
    )
    assert no_field.status == 403
    foreign = await context.request.post(
        f"{d.url}/actions/cancel",
        form={"id": "bill-1", "csrf": csrf},
        headers={"Origin": "http://evil.example"},
    )
    assert foreign.status == 403
    wrong_header = await post(
        f"{d.url}/actions/cancel", data={"id": "bill-1"}, headers={"X-Dashboard-Token": "nope" * 8}
    )
    assert wrong_header.status_code == 403
    assert "bill-1" in await pending_ids(conn)
    assert len(await pending_ids(conn)) == 15
    # The token in the header is how a script acts (no browser can send it cross-site).
    scripted = await post(
        f"{d.url}/actions/cancel", data={"id": "bill-1"}, headers={"X-Dashboard-Token": TOKEN}
    )
    assert scripted.status_code == 200, scripted.text
    assert "bill-1" not in await pending_ids(conn)


async def test_read_only_without_allow_actions(
    waiting: Component, conn: list[str], dashboard: Start, browser: Browser
) -> None:
    d = dashboard(*conn, env=TOKEN_ENV)
    page = await browser.new_page()
    await page.goto(f"{d.url}/message?id=bill-2")
    await expect(page.locator("header .mode")).to_have_text("read-only")
    assert await page.locator("form[method=post]").count() == 0
    for path in (
        "/actions/cancel",
        "/actions/pause",
        "/actions/resume",
        "/actions/retry-dead",
        "/actions/delete-dead",
    ):
        r = await post(
            f"{d.url}{path}", data={"id": "bill-2"}, headers={"X-Dashboard-Token": TOKEN, "Origin": d.url}
        )
        assert r.status_code in (404, 405), (path, r.status_code)
    assert len(await pending_ids(conn)) == 15


class _Attacker(BaseHTTPRequestHandler):
    page = b""

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.end_headers()
        self.wfile.write(self.page)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def attacker_site() -> Iterator[Callable[[str], str]]:
    """Factory: serve one HTML page from another origin (http://localhost:<port>/); its URL."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Attacker)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()

    def serve(html: str) -> str:
        _Attacker.page = html.encode()
        return f"http://localhost:{server.server_address[1]}/"

    yield serve
    server.shutdown()
    server.server_close()


async def test_a_forged_cross_site_post_changes_nothing(
    waiting: Component,
    conn: list[str],
    dashboard: Start,
    browser: Browser,
    attacker_site: Callable[[str], str],
) -> None:
    d = dashboard(*conn, *ACTIONS, env=TOKEN_ENV)
    context = await browser.new_context()
    page = await context.new_page()
    await log_in(page, d)
    await page.goto(f"{d.url}/message?id=bill-3")
    # Worst case: the attacker even knows this session's CSRF value.
    csrf = await page.get_attribute("input[name=csrf]", "value")
    url = attacker_site(
        f"""<form id=f method=post action="{d.url}/actions/cancel">
        <input name=id value=bill-3><input name=csrf value="{csrf}"></form>
        <script>document.getElementById('f').submit()</script>"""
    )
    async with page.expect_navigation(url=f"{d.url}/actions/cancel") as nav:
        await page.goto(url)
    response = await nav.value
    assert response is not None
    assert response.status == 403
    assert "bill-3" in await pending_ids(conn)
    assert len(await pending_ids(conn)) == 15


async def _assert_inert(page: Page, dialogs: list[str]) -> None:
    assert dialogs == []
    assert await page.evaluate("typeof window.__xss") == "undefined"
    assert await page.locator("img").count() == 0
    assert PROBE in await page.inner_text("body")


async def test_script_in_topic_id_metadata_and_reason_stays_text(
    waiting: Component, conn: list[str], dashboard: Start, browser: Browser
) -> None:
    c = waiting
    topic, sid = f"t{PROBE}", f"id{PROBE}"
    await c.publish(
        topic, PROBE.encode(), {"scheduledSendDelay": "1h", "scheduleId": sid, f"k{PROBE}": PROBE}
    )
    await c.publish(topic, b"x", {"schedule": "@every 1h", "scheduleId": f"every{PROBE}"})
    # A dead letter whose topic and reason are the probe (the app's error text is shown).
    stream = await c.subscribe(topic)
    await c.publish(topic, b"poison")
    await stream.nack((await stream.next(within=10)).id, PROBE)
    d = dashboard(*conn, *ACTIONS, env=TOKEN_ENV)
    page = await browser.new_page()
    dialogs: list[str] = []

    async def record(dialog: Dialog) -> None:
        dialogs.append(dialog.message)
        await dialog.dismiss()

    page.on("dialog", record)
    await log_in(page, d)
    deadline = time.monotonic() + 15
    while "1 dead letters" not in (await cli("dead", *cli_conn(conn))).out:
        assert time.monotonic() < deadline, "no dead letter"
        await asyncio.sleep(0.2)
    for path in ("/", "/pending", "/schedules", "/dead"):
        await page.goto(f"{d.url}{path}")
        await _assert_inert(page, dialogs)
    await page.goto(f"{d.url}/pending?" + str(httpx.QueryParams({"q": "id<script"})))
    await expect(page.locator("#pending")).to_contain_text(sid)
    await _assert_inert(page, dialogs)
    await page.goto(f"{d.url}/message?" + str(httpx.QueryParams({"id": sid})))
    await expect(page.locator("#metadata")).to_contain_text(f"k{PROBE}")
    await _assert_inert(page, dialogs)
    # Live: a probe that arrives over the event stream into an open page is text too.
    await page.goto(f"{d.url}/")
    await c.publish(f"live{PROBE}", b"x", {"scheduledSendDelay": "1m"})
    await expect(page.locator("#by-topic")).to_contain_text(f"live{PROBE}", timeout=15_000)
    await _assert_inert(page, dialogs)


async def test_dead_letters_retry_and_delete(
    waiting: Component, conn: list[str], dashboard: Start, browser: Browser
) -> None:
    c = waiting
    stream = await c.subscribe("payments")
    for body in (b"first", b"second"):
        await c.publish("payments", body, {"k": "v"})
        await stream.nack((await stream.next(within=10)).id, f"handler failed on {body.decode()}")
    deadline = time.monotonic() + 15
    while "2 dead letters" not in (await cli("dead", *cli_conn(conn))).out:
        assert time.monotonic() < deadline, "no dead letters"
        await asyncio.sleep(0.2)
    d = dashboard(*conn, *ACTIONS, env=TOKEN_ENV)
    page = await browser.new_page()
    await log_in(page, d)
    await page.goto(f"{d.url}/dead")
    rows = await table(page, "#dead")
    assert [r[6] for r in rows] == ["handler failed on first", "handler failed on second"]
    await shot(page, "dead-letters")
    await page.locator("#dead tbody tr").nth(0).locator("button:has-text('Retry')").click()
    await expect(page.locator("#result")).to_contain_text("back to payments")
    again = await stream.next(within=10)
    assert again.data == b"first"
    await stream.ack(again.id)
    await page.goto(f"{d.url}/dead")
    assert [r[6] for r in await table(page, "#dead")] == ["handler failed on second"]
    await page.locator("#dead tbody tr").nth(0).locator("button:has-text('Delete')").click()
    await expect(page.locator("#result")).to_contain_text("deleted")
    assert "0 dead letters" in (await cli("dead", *cli_conn(conn))).out
    assert await stream.nothing_for(1.0)


async def test_one_poller_whatever_the_number_of_open_pages(
    waiting: Component, conn: list[str], dashboard: Start, browser: Browser
) -> None:
    d = dashboard(*conn)
    pages = [await browser.new_page() for _ in range(4)]
    for page in pages:
        await page.goto(f"{d.url}/")
    deadline = time.monotonic() + 10
    while d.health()["watchers"] != 4:
        assert time.monotonic() < deadline, d.health()
        await asyncio.sleep(0.1)
    before, started = d.health()["polls"], time.monotonic()
    await asyncio.sleep(3)
    polls = d.health()["polls"] - before
    elapsed = time.monotonic() - started
    # One poll per interval (0.5 s) for all four pages, not one per page.
    assert 1 <= polls <= elapsed / 0.5 + 1, (polls, elapsed)
    for page in pages:
        await page.close()
    # Nobody looks: polling stops (after three intervals of grace).
    deadline = time.monotonic() + 10
    while d.health()["watchers"] != 0:
        assert time.monotonic() < deadline, d.health()
        await asyncio.sleep(0.1)
    await asyncio.sleep(2.5)
    idle = d.health()["polls"]
    await asyncio.sleep(2)
    assert d.health()["polls"] == idle


async def test_pending_pages_and_prefix_search(
    component: Factory, props: dict[str, str], conn: list[str], dashboard: Start
) -> None:
    c = component("delayed")
    await c.init({**props, "enableDelayedMessaging": "true"})
    for i in range(120):
        await c.publish("orders", b"x", {"scheduledSendDelay": "1h", "scheduleId": f"order-{i:03d}"})
    for _ in range(3):
        await c.publish("orders", b"y", {"scheduledSendDelay": "1h"})
    d = dashboard(*conn)
    seen: list[str] = []
    url: str | None = "/pending"
    pages = 0
    while url is not None:
        html = (await get(f"{d.url}{url}")).text
        seen += re.findall(r'<a href="/message\?id=[^"]*">([^<]*)</a>', html)
        next_link = re.search(r'<a href="([^"]*)" id="next">', html)
        url = next_link.group(1).replace("&amp;", "&") if next_link else None
        pages += 1
    assert pages == 3
    assert sorted(seen) == sorted(await pending_ids(conn))
    assert len(seen) == len(set(seen)) == 123

    async def found(q: str) -> list[str]:
        html = (await get(f"{d.url}/pending", params={"q": q})).text
        return re.findall(r'<a href="/message\?id=[^"]*">([^<]*)</a>', html)

    assert sorted(await found("order-11")) == [f"order-11{i}" for i in range(10)]
    assert await found("order-0*") == []  # a glob character is a character, not a pattern
    bare = [i for i in await pending_ids(conn) if not i.startswith("order-")]
    assert await found(bare[0]) == [bare[0]]


async def test_every_shard_on_redis_cluster(
    component: Factory, cluster: RedisCluster, admin: Any, dashboard: Start, browser: Browser
) -> None:
    c = component("delayed")
    props = {
        "redisHost": cluster.nodes[0].address,
        "redisType": "cluster",
        "consumerID": "app1",
        "enableDelayedMessaging": "true",
        "delayShards": "4",
    }
    await c.init(props)
    for i in range(60):
        extra = {"scheduleId": f"job-{i}"} if i % 2 else {}
        await c.publish(f"topic-{i % 3}", b"x", {"scheduledSendDelay": f"{i + 5}m", **extra})
    flags = ["--redis-host", cluster.nodes[1].address, "--redis-type", "cluster", "--delay-shards", "4"]
    flags += ["--app-id", "app1"]
    rows = (await cli("pending", *flags, "--json", "--limit", "0")).json()
    assert len(rows) == 60
    shards = {r["id"].rpartition("@")[2] for r in rows if r["scheduleId"] is None}
    assert len(shards) > 1, "the envelopes should be spread over several shards"
    d = dashboard(*flags, "--interval", "0.5")
    page = await browser.new_page()
    await page.goto(f"{d.url}/")
    await expect(page.locator("#total-pending")).to_have_text("60")
    assert {t: int(n) for t, n in await table(page, "#by-topic")} == Counter(r["topic"] for r in rows)
    assert [cells[0] for cells in await table(page, "#soonest")] == [r["id"] for r in rows[:10]]
    # The pending pages walk every shard, each envelope once, named as `pending` names it.
    seen: list[str] = []
    url: str | None = "/pending"
    while url is not None:
        await page.goto(f"{d.url}{url}")
        seen += [cells[0] for cells in await table(page, "#pending")]
        url = await page.get_attribute("#next", "href") if await page.locator("#next").count() else None
    assert sorted(seen) == sorted(r["id"] for r in rows)
    # An `<id>@<shard>` envelope id and a scheduleId both open their message.
    bare = next(r for r in rows if r["scheduleId"] is None and not r["id"].endswith("@0"))
    for id in (bare["id"], "job-7"):
        await page.goto(f"{d.url}/message?" + str(httpx.QueryParams({"id": id})))
        await expect(page.locator("#message-id")).to_have_text(id)
    await page.goto(f"{d.url}/pending?q=job-1")
    assert sorted(cells[0] for cells in await table(page, "#pending")) == sorted(
        ["job-1", *(f"job-1{i}" for i in range(1, 10, 2))]
    )


async def test_hand_edited_urls_never_break_a_page(
    waiting: Component, conn: list[str], dashboard: Start
) -> None:
    d = dashboard(*conn)
    huge = "9" * 30
    for path, params in [
        ("/pending", {"after": f"{huge}-0"}),
        ("/pending", {"after": f"{huge}-0@0"}),
        ("/pending", {"after": "1-0@99"}),
        ("/pending", {"after": "not a cursor"}),
        ("/pending", {"q": "["}),
        ("/pending", {"q": "\\"}),
        ("/pending", {"q": f"{huge}"}),
        ("/pending", {"q": "x" * 10_000}),
        ("/schedules", {"cursor": f"0:{huge}"}),
        ("/schedules", {"cursor": "7:0"}),
        ("/message", {"id": f"{huge}-0"}),
        ("/message", {"id": f"1-0@{huge}"}),
        ("/message", {"id": ""}),
    ]:
        r = await get(f"{d.url}{path}", params=params)
        assert r.status_code in (200, 400, 404), (path, params, r.status_code, r.text[-300:])
    # The first page still lists everything that waits.
    r = await get(f"{d.url}/pending")
    assert len(re.findall(r'<a href="/message\?id=', r.text)) == 15


async def test_a_foreign_host_name_is_refused(waiting: Component, conn: list[str], dashboard: Start) -> None:
    """A DNS-rebinding page (evil.example resolving to 127.0.0.1) reads nothing."""
    d = dashboard(*conn)
    port = d.url.rpartition(":")[2]
    r = await get(f"{d.url}/pending", headers={"Host": f"evil.example:{port}"})
    assert r.status_code == 400
    assert "bill-0" not in r.text
    assert (await get(f"{d.url}/pending", headers={"Host": f"localhost:{port}"})).status_code == 200


async def test_actions_need_a_strong_token_to_start(conn: list[str], redis_client: object) -> None:
    for args, env in [
        (ACTIONS[:1], {}),
        (ACTIONS, {}),
        (ACTIONS, {"DASH_TOKEN": "short"}),
        (("--token-env", "DASH_TOKEN"), TOKEN_ENV),
    ]:
        result = await cli("dashboard", *conn, *args, env=env, within=30)
        assert result.code == 2, (args, result.err)
        assert "token" in result.err


async def test_redis_going_away_is_shown_and_the_page_recovers(tmp_path: Path, dashboard: Start) -> None:
    server = RedisServer(tmp_path)
    server.start()
    try:
        d = dashboard("--redis-host", f"127.0.0.1:{server.port}", "--app-id", "app1", "--interval", "0.3")
        assert ">0</span>" in (await get(f"{d.url}/")).text
        server.stop(kill=True)
        deadline = time.monotonic() + 30
        while "Not current: Redis" not in (page := (await get(f"{d.url}/")).text):
            assert time.monotonic() < deadline, page[-500:]
            await asyncio.sleep(0.2)
        # A page read while Redis is away says so.
        down = await get(f"{d.url}/pending")
        assert down.status_code == 503
        assert "Redis is not reachable" in down.text
        server.start()
        server.client().xadd("orders", {"data": "x"})
        # An operator reloading the overview (a page view is what keeps the poller polling).
        deadline = time.monotonic() + 60
        while "Not current" in (await get(f"{d.url}/")).text:
            assert time.monotonic() < deadline, d.health()
            await asyncio.sleep(0.2)
        assert d.health()["error"] == ""
        assert (await get(f"{d.url}/pending")).status_code == 200
    finally:
        server.stop()


async def overview_within(d: Dashboard, seconds: float) -> httpx.Response:
    """GET / with a deadline: a dashboard whose first poll failed must still answer."""
    async with httpx.AsyncClient(timeout=seconds) as client:
        return await client.get(f"{d.url}/")


async def test_a_dashboard_started_before_redis_shows_the_error_then_recovers(
    tmp_path: Path, dashboard: Start
) -> None:
    server = RedisServer(tmp_path / "late", port=free_port())
    d = dashboard("--redis-host", server.address, "--app-id", "app1", "--interval", "0.3")
    try:
        first = await overview_within(d, 10)
        assert first.status_code == 200
        assert "Not current: Redis" in first.text
        assert "no poll has succeeded yet" in first.text
        server.start()
        server.client().xadd("orders", {"data": "x"})
        deadline = time.monotonic() + 60
        while "Not current" in (page := await overview_within(d, 10)).text:
            assert time.monotonic() < deadline, (page.text[-500:], d.health())
            await asyncio.sleep(0.2)
        assert d.health()["error"] == ""
        assert d.health()["polls"] >= 1
        assert 'id="total-pending">0<' in page.text
        assert (await get(f"{d.url}/pending")).status_code == 200
    finally:
        server.stop()


async def test_a_wrong_password_is_shown_and_polled_again_not_hung(tmp_path: Path, dashboard: Start) -> None:
    server = RedisServer(tmp_path / "locked")
    server.start()
    try:
        server.client().config_set("requirepass", "right-password-123")
        d = dashboard(
            "--redis-host",
            server.address,
            "--app-id",
            "app1",
            "--interval",
            "0.3",
            env={"DELAYED_PUBSUB_REDIS_PASSWORD": "wrong-password"},
        )
        first = await overview_within(d, 10)
        assert first.status_code == 200
        assert "Not current: Redis" in first.text
        version = d.health()["version"]
        # Still polling (each failed poll is a new snapshot), and still answering.
        deadline = time.monotonic() + 30
        while d.health()["version"] <= version:
            assert time.monotonic() < deadline, d.health()
            assert (await overview_within(d, 10)).status_code == 200
            await asyncio.sleep(0.2)
        assert d.health()["error"]
    finally:
        server.stop()


async def test_a_cookie_that_does_not_parse_is_no_session(
    waiting: Component, conn: list[str], dashboard: Start
) -> None:
    # Any page on 127.0.0.1 can set a cookie for the dashboard's host: never an error, never a session.
    for args, env in (((), {}), (ACTIONS, TOKEN_ENV)):
        d = dashboard(*conn, *args, env=env)
        for cookie in ("é", "x.é", "\u2603.\u2603", ".", "a.b.c", "é" * 1000):
            headers = {"Cookie": f"dps_session={cookie}".encode()}
            for path in ("/", "/pending", "/dead", "/message?id=bill-1", "/login"):
                r = await get(f"{d.url}{path}", headers=headers)
                assert r.status_code in (200, 404), (args, cookie[:8], path, r.status_code)
            acted = await post(
                f"{d.url}/actions/cancel",
                data={"id": "bill-1", "csrf": "é"},
                headers={**headers, "Origin": d.url},
            )
            assert acted.status_code in (403, 404, 405), (args, cookie[:8], acted.status_code)
    assert "bill-1" in await pending_ids(conn)
