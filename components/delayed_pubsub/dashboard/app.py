"""The dashboard's web app: Starlette routes, Jinja2 pages (autoescaped), Server-Sent Events.

Pages are rendered on the server; the only script (static/dashboard.js)
swaps the live fragments the poller rendered into the page when an event
arrives. Every value from Redis (topics, ids, metadata, payloads) goes
through Jinja2's autoescape, and the Content-Security-Policy allows no
inline script, so a `<script>` in a topic name is text on the page.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import jinja2
from redis.exceptions import ResponseError
from starlette.applications import Starlette
from starlette.datastructures import MutableHeaders
from starlette.middleware import Middleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Mount
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from delayed_middleware.errors import FailedPreconditionError
from delayed_middleware.instants import display_instant
from delayed_pubsub.connection import TRANSIENT_ERRORS
from delayed_pubsub.dashboard.actions import Actions
from delayed_pubsub.dashboard.api import MOUNT, Api
from delayed_pubsub.dashboard.guard import Guard
from delayed_pubsub.dashboard.pages import Pages
from delayed_pubsub.dashboard.poller import Poller, Snapshot
from delayed_pubsub.dashboard.source import DUE_WINDOWS, Source

# Response headers on every page: no inline script, no framing, no sniffing.
SECURITY_HEADERS = {
    "content-security-policy": "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "object-src 'none'; base-uri 'none'; frame-ancestors 'none'; form-action 'self'",
    "x-content-type-options": "nosniff",
    "referrer-policy": "same-origin",
    "x-frame-options": "DENY",
}


@dataclass(frozen=True)
class DashboardConfig:
    """How the dashboard runs (the CLI's flags)."""

    interval_s: float = 5.0
    history_records: int = 5_000
    # Host names the browser may use to reach it (DNS rebinding: any other Host header is refused).
    allowed_hosts: Sequence[str] = ("127.0.0.1", "localhost", "::1", "[::1]")


def _minute(ms: int) -> str:
    return time.strftime("%H:%M", time.gmtime(ms / 1000))


def _ms(value: int | None) -> str:
    if value is None:
        return "-"
    return f"{value} ms" if value < 10_000 else f"{value / 1000:.1f} s"


def templates() -> Jinja2Templates:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("delayed_pubsub.dashboard", "templates"),
        # Every template, whatever its name: nothing from Redis is ever emitted unescaped.
        autoescape=True,
        undefined=jinja2.StrictUndefined,
    )
    env.filters["time"] = display_instant
    env.filters["minute"] = _minute
    env.filters["ms"] = _ms
    env.filters["q"] = lambda v: quote(str(v), safe="")
    env.globals["windows"] = [label for label, _ in DUE_WINDOWS]
    return Jinja2Templates(env=env)


def build_app(source: Source, guard: Guard, config: DashboardConfig) -> Starlette:
    """The dashboard for one app (consumerID), every shard of it: its pages (dashboard.pages), its
    actions when a token is set (dashboard.actions), its JSON API (dashboard.api), the shared poller
    and the security middleware."""
    tpl = templates()

    def render_parts(snap: Snapshot) -> Mapping[str, str]:
        context = {"snap": snap, "shards": source.shards}
        return {"live-overview": tpl.get_template("_overview_live.html").render(context)}

    poller = Poller(
        source, interval_s=config.interval_s, history_records=config.history_records, render=render_parts
    )
    pages = Pages(source, guard, poller, tpl, config.interval_s)
    routes: list[BaseRoute] = [
        *pages.routes(),
        Mount("/static", StaticFiles(packages=[("delayed_pubsub.dashboard", "static")]), name="static"),
        # The JSON API (docs/openapi.yaml): the same reads and actions, for scripts.
        Mount(MOUNT, app=Api(source, guard).app()),
    ]
    if guard.enabled:
        routes += Actions(source, guard, pages).routes()

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        poller.start()
        try:
            yield
        finally:
            await poller.stop()

    handlers: dict[Any, Callable[[Request, Exception], Awaitable[Response]]] = {
        ResponseError: pages.redis_refused,
        FailedPreconditionError: pages.refused,
        **dict.fromkeys(TRANSIENT_ERRORS, pages.redis_unreachable),
    }
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers=handlers,
        middleware=[
            Middleware(TrustedHostMiddleware, allowed_hosts=list(config.allowed_hosts)),
            Middleware(SecurityHeaders),
        ],
    )
    app.state.poller = poller
    return app


class SecurityHeaders:
    """Adds SECURITY_HEADERS to every response (plain ASGI: streams such as /events pass untouched)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                for name, value in SECURITY_HEADERS.items():
                    if name not in headers:
                        headers[name] = value
            await send(message)

        await self.app(scope, receive, send_with_headers)
