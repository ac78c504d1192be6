"""The dashboard's backfill action against a real dashboard process, component and Redis: a dry run
first (nothing delivered, a button that delivers that range), then the delivery, once; refusals."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import pytest
import redis

from delayed_middleware.instants import format_instant
from tests.components.conftest import Dashboard
from tests.components.driver import Component
from tests.redis_server import RedisServer, stream_entries
from tests.wallclock import Hourly

TOKEN = "operator-token-0123456789"
HEADERS = {"X-Dashboard-Token": TOKEN}
HOUR = 3_600_000


@pytest.fixture
def conn(redis_server: RedisServer) -> list[str]:
    return ["--redis-host", f"127.0.0.1:{redis_server.port}", "--app-id", "app1", "--interval", "0.5"]


async def post(url: str, **kwargs: Any) -> httpx.Response:
    async with httpx.AsyncClient() as client:
        return await client.post(url, **kwargs)


@pytest.fixture
async def hourly(
    component: Callable[[str], Component],
    props: dict[str, str],
    conn: list[str],
    dashboard: Callable[..., Dashboard],
) -> tuple[int, str]:
    """Schedule `hourly` published through a component, and a dashboard with actions on: (its last
    occurrence, the backfill action's URL). Its own next fire is half an hour away."""
    c = component("delayed")
    await c.init({**props, "enableDelayedMessaging": "true"})
    cron = Hourly.away_from_now()
    await c.publish("orders", b"tick", {"schedule": cron.cron, "scheduleId": "hourly"})
    d = dashboard(*conn, "--allow-actions", "--token-env", "DASH_TOKEN", env={"DASH_TOKEN": TOKEN})
    return cron.last(), f"{d.url}/actions/backfill"


async def test_backfill_shows_the_dry_run_first_then_delivers_once(
    hourly: tuple[int, str], redis_client: redis.Redis
) -> None:
    end, url = hourly
    form = {"id": "hourly", "from": format_instant(end - 3 * HOUR), "to": format_instant(end)}

    page = await post(url, data=form, headers={**HEADERS, "Accept": "text/html"})
    assert page.status_code == 200, page.text
    assert "Would deliver 3 of 3 occurrences to orders" in " ".join(page.text.split())
    assert 'name="confirm" value="yes"' in page.text
    assert not redis_client.exists("orders")

    done = await post(url, data={**form, "confirm": "yes"}, headers=HEADERS)
    twice = await post(url, data={**form, "confirm": "yes"}, headers=HEADERS)
    assert done.json()["result"]["delivered"] == 3
    assert twice.json()["result"]["delivered"] == 0
    assert len(stream_entries(redis_client, "orders")) == 3

    future = await post(url, data={**form, "to": format_instant(end + 2 * HOUR)}, headers=HEADERS)
    assert future.status_code == 400
    assert "in the future" in future.json()["message"]
    unknown = await post(url, data={**form, "id": "nobody"}, headers=HEADERS)
    assert unknown.status_code == 404
    forbidden = await post(url, data={**form, "confirm": "yes"})
    assert forbidden.status_code == 403


async def test_a_backfill_longer_than_the_request_may_take_is_refused_and_left_to_the_cli(
    hourly: tuple[int, str], redis_client: redis.Redis
) -> None:
    end, url = hourly
    # 3 occurrences at 0.05/s: ~60 s, past the dashboard's 30 s bound (it runs inside the request).
    form = {
        "id": "hourly",
        "from": format_instant(end - 3 * HOUR),
        "to": format_instant(end),
        "rate": "0.05/s",
    }

    slow = await post(url, data={**form, "confirm": "yes"}, headers=HEADERS)
    assert slow.status_code == 400, slow.text
    message = slow.json()["message"]
    assert message.startswith("rate '0.05'"), message
    assert "3 occurrences in" in message
    assert "delayed-pubsub backfill" in message
    assert not redis_client.exists("orders")
    # The dry run changes nothing: still shown, whatever the rate.
    dry = await post(url, data=form, headers=HEADERS)
    assert dry.status_code == 200
    assert len(dry.json()["result"]["deliver"]) == 3
    zero = await post(url, data={**form, "rate": "0/s", "confirm": "yes"}, headers=HEADERS)
    assert (zero.status_code, zero.json()["message"]) == (400, "rate '0/s': must be a number more than 0 per second")
    quick = await post(url, data={**form, "rate": "1/s", "confirm": "yes"}, headers=HEADERS)
    assert quick.json()["result"]["delivered"] == 3
