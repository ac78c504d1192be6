"""The dashboard's JSON API (`/api/v1`, docs/openapi.yaml) against a real `delayed-pubsub dashboard`
(uvicorn) and Redis, checked with what the CLI (`pending --json`) then shows."""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
import yaml
from openapi_schema_validator import OAS31Validator
from openapi_spec_validator import validate
from playwright.async_api import Browser
from starlette.routing import BaseRoute, Mount, Route

from delayed_middleware.instants import format_instant
from delayed_pubsub.connection import connect
from delayed_pubsub.dashboard import api
from delayed_pubsub.dashboard.app import DashboardConfig, build_app
from delayed_pubsub.dashboard.guard import Guard
from delayed_pubsub.dashboard.source import Source
from delayed_pubsub.settings import parse_settings
from tests.components.conftest import Dashboard
from tests.components.driver import Component, cli
from tests.redis_server import free_port
from tests.wallclock import Hourly

Factory = Callable[[str], Component]
Start = Callable[..., Dashboard]

TOKEN = "api-operator-token-0123456789"
ACTIONS = ("--allow-actions", "--token-env", "DASH_TOKEN")
ENV = {"DASH_TOKEN": TOKEN}
BEARER = {"Authorization": f"Bearer {TOKEN}"}
HOUR = 3_600_000
OPENAPI = Path(__file__).resolve().parents[2] / "docs" / "openapi.yaml"


@pytest.fixture
def flags(props: dict[str, str]) -> list[str]:
    """The CLI's (and the dashboard's) flags for the app the component serves."""
    return ["--redis-host", props["redisHost"], "--app-id", props["consumerID"]]


@pytest.fixture
async def seeded(component: Factory, props: dict[str, str]) -> Component:
    """app1: order-000..order-029 (scheduleIds) and 5 bare envelopes due in an hour, and `hourly` @every 1h."""
    c = component("delayed")
    await c.init({**props, "enableDelayedMessaging": "true"})
    for i in range(30):
        await c.publish(
            "orders", f"o{i}".encode(), {"scheduledSendDelay": "1h", "scheduleId": f"order-{i:03d}"}
        )
    for i in range(5):
        await c.publish("billing", f"b{i}".encode(), {"scheduledSendDelay": "1h"})
    await c.publish("reports", b"r", {"schedule": "@every 1h", "scheduleId": "hourly"})
    return c


async def pending_cli(flags: list[str], *extra: str) -> list[dict[str, Any]]:
    result = await cli("pending", *flags, "--json", "--limit", "0", *extra)
    assert result.code == 0, result.err
    rows: list[dict[str, Any]] = result.json()
    return rows


SPEC: dict[str, Any] = yaml.safe_load(OPENAPI.read_text())


def schema_of(path: str, method: str, status: int) -> dict[str, Any]:
    """The schema docs/openapi.yaml gives the answer `status` of `method path` (any error: Error)."""
    error = {"$ref": "#/components/schemas/Error"}
    for template, ops in SPEC["paths"].items():
        if re.fullmatch("/api/v1" + re.sub(r"\{\w+\}", ".*", template), path) and method in ops:
            answer = ops[method]["responses"].get(str(status))
            assert answer is not None, f"{method} {path}: {status} is not documented"
            name = answer.get("$ref", "").rpartition("/")[2]
            answer = SPEC["components"]["responses"].get(name, answer)
            schema: dict[str, Any] = answer["content"]["application/json"]["schema"]
            return schema
    return error


async def call(method: str, url: str, **kwargs: Any) -> httpx.Response:
    async with httpx.AsyncClient(timeout=30) as client:
        r = await client.request(method, url, **kwargs)
    # Whatever the call, never HTML, and always what docs/openapi.yaml says it answers.
    assert r.headers["content-type"] == "application/json", (url, r.headers["content-type"], r.text[:200])
    if r.url.path.startswith(api.MOUNT):
        schema = schema_of(r.url.path, method.lower(), r.status_code)
        OAS31Validator({**schema, "components": SPEC["components"]}).validate(r.json())
    return r


def error_of(r: httpx.Response) -> tuple[int, str, str]:
    body = r.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"code", "message"}, body
    return r.status_code, body["error"]["code"], body["error"]["message"]


async def walk(url: str, **params: Any) -> tuple[list[str], int]:
    """Every id of /pending paged by cursor, and how many pages it took."""
    ids: list[str] = []
    pages, cursor = 0, None
    while True:
        page = (await call("GET", url, params={**params, **({"cursor": cursor} if cursor else {})})).json()
        pages += 1
        ids += [item["id"] for item in page["items"]]
        cursor = page["next"]
        if cursor is None:
            return ids, pages


async def test_pending_pages_list_what_the_cli_lists(
    seeded: Component, flags: list[str], dashboard: Start
) -> None:
    d = dashboard(*flags)
    url = f"{d.url}/api/v1/pending"
    cli_rows = await pending_cli(flags)
    ids, pages = await walk(url, limit=8)
    assert pages == 5  # 36 in pages of 8: the fifth not full
    assert sorted(ids) == sorted(r["id"] for r in cli_rows)
    assert len(ids) == len(set(ids)) == 36
    # Each item is what `pending --json` prints for it, plus its cursor.
    first = (await call("GET", url, params={"limit": 1})).json()["items"][0]
    assert {k: v for k, v in first.items() if k != "cursor"} in cli_rows
    # offset + limit: the same order, the same slices.
    by_offset = []
    for offset in range(0, 36, 10):
        by_offset += [
            i["id"] for i in (await call("GET", url, params={"offset": offset, "limit": 10})).json()["items"]
        ]
    assert by_offset == ids
    # The prefix: what `pending --prefix` lists (and what a prefix cancel would cancel).
    prefixed, _ = await walk(url, prefix="order-01", limit=3)
    assert prefixed == [r["id"] for r in await pending_cli(flags, "--prefix", "order-01")]
    assert prefixed == [f"order-01{i}" for i in range(10)]
    assert (await call("GET", url, params={"prefix": "order-0*"})).json()["items"] == []
    # The dashboard's own pending page is a page of this listing.
    async with httpx.AsyncClient() as client:
        html = (await client.get(f"{d.url}/pending")).text
    assert re.findall(r'<a href="/message\?id=[^"]*">([^<]*)</a>', html) == ids


async def test_bad_paging_is_refused_naming_the_parameter(
    seeded: Component, flags: list[str], dashboard: Start
) -> None:
    d = dashboard(*flags)
    url = f"{d.url}/api/v1/pending"
    for params, name in [
        ({"limit": "0"}, "limit"),
        ({"limit": "-1"}, "limit"),
        ({"limit": "ten"}, "limit"),
        ({"limit": str(api.MAX_LIMIT + 1)}, "limit"),
        ({"limit": "9" * 40}, "limit"),
        ({"offset": "-5"}, "offset"),
        ({"offset": str(api.MAX_OFFSET + 1)}, "offset"),
        ({"cursor": "not a cursor"}, "cursor"),
        ({"cursor": "9" * 30 + "-0"}, "cursor"),
        ({"cursor": "1-0", "offset": "3"}, "offset"),
    ]:
        status, code, message = error_of(await call("GET", url, params=params))
        assert (status, code) == (400, "bad_parameter"), params
        assert message.startswith(f"{name}="), message
        assert repr(params[name]) in message, message
    # The bound itself is served, and no page is longer.
    page = (await call("GET", url, params={"limit": str(api.MAX_LIMIT)})).json()
    assert len(page["items"]) == 36
    assert page["next"] is None
    assert page["limit"] == api.MAX_LIMIT
    assert len((await call("GET", url)).json()["items"]) == 36
    for path in ("/api/v1/history/order-001", "/api/v1/history/order-001"):
        status, _, message = error_of(await call("GET", f"{d.url}{path}", params={"limit": "501"}))
        assert status == 400
        assert "limit='501'" in message
    status, _, message = error_of(
        await call("GET", f"{d.url}/api/v1/history/order-001", params={"cursor": "x"})
    )
    assert status == 400
    assert "cursor='x'" in message


async def test_a_message_and_its_history_and_404_for_an_unknown_id(
    seeded: Component, flags: list[str], dashboard: Start
) -> None:
    await seeded.publish(
        "odd", b"\xff\x00", {"scheduledSendDelay": "1h", "scheduleId": "a/b?c#d e", "k": "v"}
    )
    d = dashboard(*flags)
    row = next(r for r in await pending_cli(flags) if r["id"] == "order-007")
    m = (await call("GET", f"{d.url}/api/v1/messages/order-007")).json()
    assert {k: m[k] for k in row} == row
    assert (m["state"], m["payload"], m["stream"]) == ("pending", "o7", "app1-delayed")
    assert [r["event"] for r in m["history"]] == ["scheduled"]
    odd = (await call("GET", f"{d.url}/api/v1/messages/a%2Fb%3Fc%23d%20e")).json()
    assert (odd["id"], odd["topic"], odd["metadata"]["k"], odd["payload"]) == (
        "a/b?c#d e",
        "odd",
        "v",
        "0xff00",
    )
    for path in ("/api/v1/messages/nope", "/api/v1/messages/1-0", "/api/v1/history/nope"):
        status, code, message = error_of(await call("GET", f"{d.url}{path}"))
        assert (status, code) == (404, "not_found"), path
        assert path.rpartition("/")[2] in message
    # History outlives the message: cancelled, it is 404 as a message and has its records.
    assert (await cli("cancel", *flags, "order-007")).code == 0
    assert (await call("GET", f"{d.url}/api/v1/messages/order-007")).status_code == 404
    history = (await call("GET", f"{d.url}/api/v1/history/order-007")).json()
    assert [r["event"] for r in history["items"]] == ["scheduled", "cancelled"]
    assert history["items"] == list((await cli("history", *flags, "--id", "order-007", "--json")).json())
    # Paged one at a time by cursor: the same records.
    first = (await call("GET", f"{d.url}/api/v1/history/order-007", params={"limit": 1})).json()
    rest = (await call("GET", f"{d.url}/api/v1/history/order-007", params={"cursor": first["next"]})).json()
    assert first["items"] + rest["items"] == history["items"]
    assert rest["next"] is None


async def test_cancel_and_pause_through_the_api_change_what_pending_shows(
    seeded: Component, flags: list[str], dashboard: Start
) -> None:
    d = dashboard(*flags, *ACTIONS, env=ENV)

    async def post(name: str, body: dict[str, Any], headers: dict[str, str] = BEARER) -> httpx.Response:
        return await call("POST", f"{d.url}/api/v1/{name}", json=body, headers=headers)

    r = await post("cancel", {"id": "order-003"})
    assert (r.status_code, r.json()) == (200, {"id": "order-003", "status": "cancelled"})
    ids = [r["id"] for r in await pending_cli(flags)]
    assert "order-003" not in ids
    assert len(ids) == 35
    assert error_of(await post("cancel", {"id": "order-003"}))[:2] == (404, "not_found")
    # The existing header works as well as the bearer token.
    r = await post("cancel", {"id": "order-004"}, headers={"X-Dashboard-Token": TOKEN})
    assert r.status_code == 200
    # A prefix: counted first (nothing changes), then cancelled; only what it names.
    r = await post("cancel", {"prefix": "order-01", "dryRun": True})
    assert r.json() == {"prefix": "order-01", "dryRun": True, "matching": 10}
    assert len(await pending_cli(flags)) == 34
    r = await post("cancel", {"prefix": "order-01"})
    assert r.json() == {"prefix": "order-01", "dryRun": False, "cancelled": 10}
    rows = await pending_cli(flags)
    assert len(rows) == 24
    assert not any(r["id"].startswith("order-01") for r in rows)
    # Pause and resume: `pending` shows the schedule held, then running.
    assert (await post("pause", {"id": "hourly"})).json() == {"id": "hourly", "status": "paused"}
    assert next(r for r in await pending_cli(flags) if r["id"] == "hourly")["paused"] is True
    assert (await post("pause", {"id": "hourly"})).json()["status"] == "already"
    assert (await post("resume", {"id": "hourly"})).json() == {"id": "hourly", "status": "resumed"}
    assert next(r for r in await pending_cli(flags) if r["id"] == "hourly")["paused"] is False
    assert error_of(await post("pause", {"id": "nope"}))[:2] == (404, "not_found")
    # Bodies that do not fit: refused, naming the field; nothing changed.
    misfits: list[tuple[dict[str, Any], str]] = [
        ({}, "id"),
        ({"id": "order-005", "prefix": "order"}, "prefix"),
        ({"prefix": ""}, "prefix"),
        ({"id": 5}, "id"),
        ({"prefix": "order-02", "dryRun": "yes"}, "dryRun"),
        ({"id": "order-005", "force": True}, "force"),
    ]
    for body, name in misfits:
        status, code, message = error_of(await post("cancel", body))
        assert (status, code) == (400, "bad_parameter"), (body, message)
        assert name in message, (body, message)
    raw = {**BEARER, "Content-Type": "application/json"}
    assert (
        error_of(await call("POST", f"{d.url}/api/v1/cancel", content=b"[1]", headers=raw))[1] == "bad_body"
    )
    assert error_of(await call("POST", f"{d.url}/api/v1/cancel", content=b"{", headers=raw))[1] == "bad_body"
    form = await call("POST", f"{d.url}/api/v1/cancel", data={"id": "order-005"}, headers=BEARER)
    assert error_of(form)[:2] == (415, "unsupported_media_type")
    big = await call("POST", f"{d.url}/api/v1/cancel", content=b" " * (api.MAX_BODY + 1), headers=raw)
    assert error_of(big)[:2] == (413, "body_too_large")
    assert len(await pending_cli(flags)) == 24


async def test_a_prefix_never_reaches_past_the_app(
    component: Factory, props: dict[str, str], flags: list[str], dashboard: Start
) -> None:
    mine, theirs = component("mine"), component("theirs")
    await mine.init({**props, "enableDelayedMessaging": "true"})
    await theirs.init({**props, "consumerID": "app2", "enableDelayedMessaging": "true"})
    for c in (mine, theirs):
        for id in ("shared-1", "app2-x", "*", "app1-delayed"):
            await c.publish("t", b"x", {"scheduledSendDelay": "1h", "scheduleId": id})
    d = dashboard(*flags, *ACTIONS, env=ENV)
    url = f"{d.url}/api/v1/cancel"
    other = ["--redis-host", flags[1], "--app-id", "app2"]
    before = sorted(r["id"] for r in await pending_cli(other))
    assert (await call("GET", f"{d.url}/api/v1/pending", params={"prefix": "app2"}, headers=BEARER)).json()[
        "items"
    ][0]["id"] == "app2-x"
    # Prefixes naming the other app, its keys, or a glob: each cancels only app1's own matching ids.
    for prefix, expected in [("app2", 1), ("app1-delayed", 1), ("*", 1), ("shared", 1), ("?", 0), ("app", 0)]:
        r = await call("POST", url, json={"prefix": prefix}, headers=BEARER)
        assert r.json()["cancelled"] == expected, (prefix, r.json())
    assert await pending_cli(flags) == []
    assert (
        sorted(r["id"] for r in await pending_cli(other))
        == before
        == sorted(["shared-1", "app2-x", "*", "app1-delayed"])
    )


async def test_who_may_call(seeded: Component, flags: list[str], dashboard: Start) -> None:
    d = dashboard(*flags, *ACTIONS, env=ENV)
    read, write = f"{d.url}/api/v1/pending", f"{d.url}/api/v1/cancel"
    body = {"id": "order-001"}
    # No token: 401 with a challenge, for reads and writes.
    for method, url, kwargs in (("GET", read, {}), ("POST", write, {"json": body})):
        r = await call(method, url, **kwargs)
        assert error_of(r)[:2] == (401, "unauthenticated")
        assert r.headers["www-authenticate"].startswith("Bearer")
        for wrong in (
            {"Authorization": "Bearer " + TOKEN[:-1]},
            {"X-Dashboard-Token": "x" * 30},
            {"Authorization": TOKEN},
        ):
            r = await call(method, url, headers=wrong, **kwargs)
            assert r.status_code == 401, (wrong, r.text)
    assert (await call("GET", read, headers=BEARER)).status_code == 200
    # A token from a foreign Origin (a page elsewhere that learnt it) is refused too.
    r = await call("POST", write, json=body, headers={**BEARER, "Origin": "http://evil.example"})
    assert error_of(r)[:2] == (403, "foreign_origin")
    # A browser session: logged in through the login form.
    async with httpx.AsyncClient(base_url=d.url, timeout=30) as browser:
        login = await browser.post("/login", data={"token": TOKEN}, headers={"Origin": d.url})
        assert login.status_code == 303
        page = (await browser.get("/message", params={"id": "order-001"})).text
        csrf = re.search(r'name="csrf" value="([0-9a-f]+)"', page)
        assert csrf
        own, foreign = {"Origin": d.url}, {"Origin": "http://evil.example"}
        assert (await browser.get("/api/v1/pending", headers=own)).status_code == 200
        assert (
            await browser.get("/api/v1/pending", headers={"Referer": f"{d.url}/pending"})
        ).status_code == 200
        assert error_of(await browser.get("/api/v1/pending", headers=foreign))[:2] == (403, "foreign_origin")
        cross = {**own, "Sec-Fetch-Site": "cross-site"}
        assert error_of(await browser.get("/api/v1/pending", headers=cross))[:2] == (403, "foreign_origin")
        # A session's write needs the CSRF value in its header, and the own Origin.
        assert error_of(await browser.post("/api/v1/cancel", json=body, headers=own))[:2] == (403, "csrf")
        wrong_csrf = {**own, "X-CSRF-Token": "0" * 64}
        assert error_of(await browser.post("/api/v1/cancel", json=body, headers=wrong_csrf))[:2] == (
            403,
            "csrf",
        )
        with_csrf = {"X-CSRF-Token": csrf.group(1)}
        r = await browser.post("/api/v1/cancel", json=body, headers={**foreign, **with_csrf})
        assert error_of(r)[:2] == (403, "foreign_origin")
        assert "order-001" in [r["id"] for r in await pending_cli(flags)]
        r = await browser.post("/api/v1/cancel", json=body, headers={**own, **with_csrf})
        assert r.json() == {"id": "order-001", "status": "cancelled"}
    assert "order-001" not in [r["id"] for r in await pending_cli(flags)]


async def test_read_only_reads_are_open_and_writes_forbidden(
    seeded: Component, flags: list[str], dashboard: Start
) -> None:
    d = dashboard(*flags, env=ENV)
    assert len((await call("GET", f"{d.url}/api/v1/pending")).json()["items"]) == 36
    assert (await call("GET", f"{d.url}/api/v1/messages/hourly")).json()["kind"] == "recurring"
    for name, body in (
        ("cancel", {"id": "hourly"}),
        ("cancel", {"prefix": "order"}),
        ("pause", {"id": "hourly"}),
        ("resume", {"id": "hourly"}),
    ):
        for headers in ({}, BEARER, {"X-Dashboard-Token": TOKEN, "Origin": d.url}):
            r = await call("POST", f"{d.url}/api/v1/{name}", json=body, headers=headers)
            assert error_of(r)[:2] == (403, "actions_disabled"), (name, headers)
    rows = await pending_cli(flags)
    assert len(rows) == 36
    assert next(r for r in rows if r["id"] == "hourly")["paused"] is False


async def test_every_answer_is_json_even_for_a_wrong_path_or_method(
    flags: list[str], redis_client: object, dashboard: Start
) -> None:
    d = dashboard(*flags)
    for method, path, status, code in [
        ("GET", "/api/v1/nope", 404, "not_found"),
        ("GET", "/api/v2/pending", 404, "not_found"),
        ("GET", "/api/v1/messages/", 404, "not_found"),
        ("GET", "/api/v1/cancel", 405, "method_not_allowed"),
        ("DELETE", "/api/v1/pending", 405, "method_not_allowed"),
        ("POST", "/api/v1/pending", 405, "method_not_allowed"),
    ]:
        assert error_of(await call(method, f"{d.url}{path}"))[:2] == (status, code), (method, path)


async def test_redis_away_is_503_json(dashboard: Start) -> None:
    d = dashboard("--redis-host", f"127.0.0.1:{free_port()}", "--app-id", "app1")
    for path in ("/api/v1/pending", "/api/v1/messages/x", "/api/v1/history/x"):
        assert error_of(await call("GET", f"{d.url}{path}"))[:2] == (503, "redis_unavailable")


# --- the route table against docs/openapi.yaml, and the extension point ----------------


def _app(token: str | None, writes: tuple[api.Write, ...] = api.WRITES) -> Any:
    settings = parse_settings({"redisHost": "127.0.0.1:1", "consumerID": "app1"})
    source = Source(connect(settings), settings)
    if writes is api.WRITES:
        return build_app(source, Guard(token), DashboardConfig())
    return api.Api(source, Guard(token), writes).app()


def api_routes(routes: list[BaseRoute], prefix: str = "") -> set[tuple[str, str]]:
    """(method, path) of every API route, `{id:path}` written `{id}` as OpenAPI writes it."""
    out: set[tuple[str, str]] = set()
    for route in routes:
        if isinstance(route, Mount):
            out |= api_routes(list(route.routes), prefix + route.path)
        elif isinstance(route, Route) and (prefix + route.path).startswith(api.MOUNT):
            path = re.sub(r"\{(\w+):\w+\}", r"{\1}", prefix + route.path)
            out |= {(m.lower(), path) for m in (route.methods or set()) if m != "HEAD"}
    return out


def test_openapi_names_every_route_and_no_other() -> None:
    spec = yaml.safe_load(OPENAPI.read_text())
    validate(spec)
    assert spec["openapi"].startswith("3.1")
    assert spec["info"]["title"]
    assert spec["info"]["version"]
    [server] = spec["servers"]
    base = "/" + server["url"].split("/", 3)[3]
    documented = {(m, base + path) for path, ops in spec["paths"].items() for m in ops if m != "parameters"}
    assert api_routes(_app(TOKEN).routes) == documented
    # Read-only, the same routes exist (writes answer 403, documented as such).
    assert api_routes(_app(None).routes) == documented
    for path, ops in spec["paths"].items():
        for method, op in ops.items():
            assert op["responses"], (method, path)
            codes = set(op["responses"])
            assert {"401", "403", "503"} <= codes, (method, path)
            if method == "post":
                assert {"400", "404"} <= codes, (method, path)


@pytest.fixture
async def served() -> AsyncIterator[Callable[[Any], Awaitable[str]]]:
    """Factory: serve an ASGI app with uvicorn in this process; its base URL."""
    servers: list[tuple[uvicorn.Server, asyncio.Task[None]]] = []

    async def serve(app: Any) -> str:
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        task = asyncio.create_task(server.serve())
        servers.append((server, task))
        while not server.started:
            assert not task.done(), "uvicorn did not start"
            await asyncio.sleep(0.05)
        return f"http://127.0.0.1:{port}"

    yield serve
    for server, task in servers:
        server.should_exit = True
        await task


async def test_a_write_wired_at_the_extension_point_is_served_under_the_same_rules(
    served: Callable[[Any], Awaitable[str]],
) -> None:
    nudged: list[str] = []

    async def nudge(source: Source, id: str) -> str | None:
        if id != "known":
            return None
        nudged.append(id)
        return "nudged"

    # The one line an operation is wired with (a made-up one: trigger and reschedule are wired for real).
    wired = (*api.WRITES, api.Write("nudge", api.by_id(nudge)))
    on, off = await served(_app(TOKEN, wired)), await served(_app(None, wired))
    url = f"{on}/v1/nudge"
    assert error_of(await call("POST", url, json={"id": "known"}))[:2] == (401, "unauthenticated")
    assert error_of(await call("POST", f"{off}/v1/nudge", json={"id": "known"}))[:2] == (
        403,
        "actions_disabled",
    )
    assert error_of(await call("POST", url, json={"id": "other"}, headers=BEARER))[:2] == (404, "not_found")
    assert error_of(await call("POST", url, json={"id": ""}, headers=BEARER))[:2] == (400, "bad_parameter")
    r = await call("POST", url, json={"id": "known"}, headers=BEARER)
    assert r.json() == {"id": "known", "status": "nudged"}
    assert nudged == ["known"]


async def test_a_pause_in_the_rollback_window_is_refused_as_the_cli_refuses_it(
    seeded: Component, flags: list[str], redis_client: Any, dashboard: Start
) -> None:
    # The app's data kept in format 1 (an older release may still read it): a paused message is format 2.
    redis_client.set("{app1-delayed}:format", "1")
    assert (await cli("pause", *flags, "hourly")).code == 3
    d = dashboard(*flags, *ACTIONS, env=ENV)
    r = await call("POST", f"{d.url}/api/v1/pause", json={"id": "hourly"}, headers=BEARER)
    status, code, message = error_of(r)
    assert (status, code) == (409, "failed_precondition")
    assert "storageFormat" in message
    # The page's Pause button too (it used to write format 2 data here).
    async with httpx.AsyncClient() as client:
        page = await client.post(
            f"{d.url}/actions/pause", data={"id": "hourly"}, headers={"X-Dashboard-Token": TOKEN}
        )
    assert page.status_code == 409
    assert "storageFormat" in page.text
    assert next(r for r in await pending_cli(flags) if r["id"] == "hourly")["paused"] is False
    # A resume writes nothing of format 2: it is answered.
    assert (await call("POST", f"{d.url}/api/v1/resume", json={"id": "hourly"}, headers=BEARER)).json()[
        "status"
    ] == "already"


async def test_a_logged_in_page_calls_the_api_with_its_session(
    seeded: Component, flags: list[str], dashboard: Start, browser: Browser
) -> None:
    """What a real browser sends (Referer, Sec-Fetch-Site, the cookie) passes the session rules."""
    d = dashboard(*flags, *ACTIONS, env=ENV)
    page = await (await browser.new_context()).new_page()
    await page.goto(f"{d.url}/pending")
    fetch = "async ([url, init]) => { const r = await fetch(url, init); return [r.status, await r.json()]; }"
    status, answer = await page.evaluate(fetch, ["/api/v1/pending?limit=2", {}])
    assert (status, answer["error"]["code"]) == (401, "unauthenticated")
    await page.goto(f"{d.url}/login")
    await page.fill("#token", TOKEN)
    await page.click("button[type=submit]")
    await page.goto(f"{d.url}/message?id=order-002")
    csrf = await page.get_attribute("input[name=csrf]", "value")
    status, answer = await page.evaluate(fetch, ["/api/v1/pending?limit=2", {}])
    assert status == 200
    assert len(answer["items"]) == 2
    headers: dict[str, str | None] = {"Content-Type": "application/json"}
    post = {"method": "POST", "headers": headers, "body": '{"id": "order-002"}'}
    status, answer = await page.evaluate(fetch, ["/api/v1/cancel", post])
    assert (status, answer["error"]["code"]) == (403, "csrf")
    headers["X-CSRF-Token"] = csrf
    status, answer = await page.evaluate(fetch, ["/api/v1/cancel", post])
    assert (status, answer) == (200, {"id": "order-002", "status": "cancelled"})
    assert "order-002" not in [r["id"] for r in await pending_cli(flags)]


async def test_backfill_is_a_dry_run_unless_asked_and_delivers_once(
    component: Factory, props: dict[str, str], flags: list[str], dashboard: Start, redis_client: Any
) -> None:
    c = component("delayed")
    await c.init({**props, "enableDelayedMessaging": "true"})
    # Its own next fire is half an hour away: it cannot go out during the test.
    cron = Hourly.away_from_now()
    await c.publish("ticks", b"tick", {"schedule": cron.cron, "scheduleId": "hourly"})
    end = cron.last()
    body = {"id": "hourly", "from": format_instant(end - 3 * HOUR), "to": format_instant(end), "rate": "50/s"}
    d = dashboard(*flags, *ACTIONS, env=ENV)
    url = f"{d.url}/api/v1/backfill"

    listed = (await call("POST", url, json=body, headers=BEARER)).json()
    assert (listed["dryRun"], listed["delivered"], len(listed["deliver"])) == (True, 0, 3)
    assert listed["deliver"] == [format_instant(end - k * HOUR) for k in (3, 2, 1)]
    assert not redis_client.exists("ticks"), "a dry run delivered"
    # 3 occurrences at 0.05/s (~60 s) would hold the request past its 30 s bound: left to the CLI.
    slow = error_of(await call("POST", url, json={**body, "rate": "0.05/s", "dryRun": False}, headers=BEARER))
    assert slow[:2] == (400, "bad_parameter"), slow
    assert slow[2].startswith("rate="), slow
    assert "delayed-pubsub backfill" in slow[2], slow
    assert not redis_client.exists("ticks"), "a refused backfill delivered"

    done = (await call("POST", url, json={**body, "dryRun": False}, headers=BEARER)).json()
    again = (await call("POST", url, json={**body, "dryRun": False}, headers=BEARER)).json()
    assert (done["delivered"], again["delivered"], again["alreadyBackfilled"]) == (3, 0, 3)
    assert redis_client.xlen("ticks") == 3

    changes: list[tuple[dict[str, Any], str]] = [
        ({"to": format_instant(end + 2 * HOUR)}, "to"),
        ({"from": "yesterday"}, "from"),
        ({"from": body["to"]}, "from"),
        ({"rate": 0}, "rate"),
        ({"rate": "fast"}, "rate"),
        ({"rate": True}, "rate"),
        ({"dryRun": "no"}, "dryRun"),
        ({"id": ""}, "id"),
        ({"since": "x"}, "since"),
    ]
    for change, field in changes:
        status, code, message = error_of(await call("POST", url, json={**body, **change}, headers=BEARER))
        assert (status, code) == (400, "bad_parameter"), (change, message)
        assert message.startswith(f"{field}="), message
    fast = error_of(await call("POST", url, json={**body, "rate": "fast"}, headers=BEARER))
    assert fast[2] == "rate='fast': not a number of occurrences per second", fast
    assert error_of(await call("POST", url, json={**body, "id": "nobody"}, headers=BEARER))[:2] == (
        404,
        "not_found",
    )
    assert error_of(await call("POST", url, json=body))[:2] == (401, "unauthenticated")
    read_only = dashboard(*flags)
    r = await call("POST", f"{read_only.url}/api/v1/backfill", json={**body, "dryRun": False})
    assert error_of(r)[:2] == (403, "actions_disabled")
    assert redis_client.xlen("ticks") == 3
