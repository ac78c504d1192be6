"""The dashboard's web app: Starlette routes, Jinja2 pages (autoescaped), Server-Sent Events.

Pages are rendered on the server; the only script (static/dashboard.js)
swaps the live fragments the poller rendered into the page when an event
arrives. Every value from Redis (topics, ids, metadata, payloads) goes
through Jinja2's autoescape, and the Content-Security-Policy allows no
inline script, so a `<script>` in a topic name is text on the page.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlencode

import jinja2
from markupsafe import Markup
from redis.exceptions import ResponseError
from starlette.applications import Starlette
from starlette.datastructures import FormData, MutableHeaders
from starlette.middleware import Middleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, RedirectResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from delayed_middleware import pausing
from delayed_middleware.deadletters import GONE, MOVED
from delayed_middleware.instants import display_instant
from delayed_pubsub import operate
from delayed_pubsub.connection import TRANSIENT_ERRORS
from delayed_pubsub.dashboard.guard import COOKIE, CSRF_FIELD, Guard
from delayed_pubsub.dashboard.poller import Poller, Snapshot
from delayed_pubsub.dashboard.source import DUE_WINDOWS, Source

PAGE_SIZE = 50
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
    """The dashboard for one app (consumerID), every shard of it."""
    tpl = templates()

    def render_parts(snap: Snapshot) -> Mapping[str, str]:
        context = {"snap": snap, "shards": source.shards}
        return {"live-overview": tpl.get_template("_overview_live.html").render(context)}

    poller = Poller(
        source, interval_s=config.interval_s, history_records=config.history_records, render=render_parts
    )

    def page(request: Request, name: str, status: int = 200, **context: Any) -> Response:
        poller.touch()
        base = {
            "app_id": source.consumer_id,
            "shards": source.shards,
            "actions": guard.enabled,
            "logged_in": guard.logged_in(request),
            "csrf": guard.csrf_for(request),
            "csrf_field": CSRF_FIELD,
            "path": request.url.path,
        }
        return tpl.TemplateResponse(request, name, {**base, **context}, status_code=status)

    async def overview(request: Request) -> Response:
        snap = await poller.latest()
        # Rendered (and escaped) by the live fragment's own template: inserted as it is.
        live = Markup(snap.parts.get("live-overview", ""))
        return page(request, "overview.html", snap=snap, live=live)

    async def pending(request: Request) -> Response:
        q = request.query_params.get("q", "").strip()
        after = request.query_params.get("after") or None
        if q:
            messages = await source.search(q, PAGE_SIZE)
            next_after = None
        else:
            result = await source.pending_page(after, PAGE_SIZE)
            messages, next_after = list(result.messages), result.next_after
        return page(
            request,
            "pending.html",
            messages=messages,
            q=q,
            after=after,
            next_url=f"/pending?{urlencode({'after': next_after})}" if next_after else None,
        )

    async def message(request: Request) -> Response:
        id = request.query_params.get("id", "")
        info = await source.message(id) if id else None
        if info is None:
            return page(request, "missing.html", status=404, id=id)
        env = info.envelope
        return page(
            request,
            "message.html",
            id=id,
            info=info,
            m=info.message,
            env=env,
            stream=source.stream_of(info.message),
            metadata=sorted(env.metadata.items()),
            preview=info.preview(4096),
        )

    async def schedules(request: Request) -> Response:
        cursor = request.query_params.get("cursor") or None
        result = await source.schedules(cursor, PAGE_SIZE)
        next_url = f"/schedules?{urlencode({'cursor': result.next_cursor})}" if result.next_cursor else None
        return page(request, "schedules.html", rows=result.rows, next_url=next_url, examined=result.examined)

    async def dead(request: Request) -> Response:
        letters = await source.dead_letters()
        return page(request, "dead.html", letters=letters[:500], total=len(letters))

    async def events(request: Request) -> Response:
        async def stream() -> AsyncIterator[str]:
            # Tells the browser how long to wait before it reconnects after a drop.
            yield f"retry: {int(config.interval_s * 1000)}\n\n"
            async for snap in poller.updates():
                data = json.dumps({"version": snap.version, "parts": snap.parts}, separators=(",", ":"))
                yield f"event: snapshot\ndata: {data}\n\n"

        headers = {"cache-control": "no-store", "x-accel-buffering": "no"}
        return StreamingResponse(stream(), media_type="text/event-stream", headers=headers)

    async def healthz(request: Request) -> Response:
        snap = poller.snapshot
        return JSONResponse(
            {
                "polls": poller.polls,
                "watchers": poller.watchers,
                "version": snap.version if snap else 0,
                "pollMs": round(snap.poll_ms, 1) if snap else None,
                "error": snap.error if snap else "",
            }
        )

    async def login(request: Request) -> Response:
        if not guard.enabled:
            return page(request, "readonly.html", status=404)
        if request.method == "GET":
            return page(request, "login.html", failed=False)
        form = await request.form()
        if not guard.same_origin(request) or not guard.token_matches(_field(form, "token")):
            return page(request, "login.html", status=403, failed=True)
        response = RedirectResponse("/", status_code=303)
        response.set_cookie(COOKIE, guard.new_session(), httponly=True, samesite="strict", path="/")
        return response

    def action(
        run: Callable[[FormData], Awaitable[tuple[bool, str]]],
    ) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            form = await request.form()
            if not guard.allows(request, _field(form, CSRF_FIELD)):
                return PlainTextResponse("forbidden: log in with the dashboard's token", status_code=403)
            done, text = await run(form)
            if "text/html" not in request.headers.get("accept", ""):
                return JSONResponse({"ok": done, "message": text}, status_code=200 if done else 404)
            return page(request, "done.html", status=200 if done else 404, done=done, text=text)

        return endpoint

    async def do_cancel(form: FormData) -> tuple[bool, str]:
        id = _field(form, "id")
        if await source.cancel(id):
            return True, f"cancelled {id}"
        return False, f"{id} is not pending (unknown, already fired or cancelled)"

    def do_set_paused(pause: bool) -> Callable[[FormData], Awaitable[tuple[bool, str]]]:
        async def run(form: FormData) -> tuple[bool, str]:
            id = _field(form, "id")
            status = await source.set_paused(id, pause)
            if status in (pausing.PAUSED, pausing.RESUMED):
                return True, f"{status} {id}"
            if status == pausing.ALREADY:
                return True, f"{id} is {'paused' if pause else 'running'} already"
            if status == pausing.ENDED:
                return True, f"{id}: its schedule has no fire left after now; cancelled"
            return False, f"{id} is not pending (unknown, already fired, cancelled or parked)"

        return run

    async def do_retry_dead(form: FormData) -> tuple[bool, str]:
        topic, id = _field(form, "topic"), _field(form, "id")
        moved = await source.retry_dead(topic, id)
        if moved is None:
            return False, f"no dead letter {id} on {topic}"
        status, where = moved
        if status == operate.NO_SOURCE:
            return False, f"{id} on {topic} records no source topic: left where it is"
        if status == GONE:
            # A double click, or another operator: the letter went back once, by the other.
            return False, f"{id} is no longer on {topic}: moved back or deleted by someone else"
        if status != MOVED:
            return False, f"{id} left on {topic}: {where}: {status}"
        return True, f"moved {id} from {topic} back to {where}"

    async def do_delete_dead(form: FormData) -> tuple[bool, str]:
        topic, id = _field(form, "topic"), _field(form, "id")
        if await source.delete_dead(topic, id):
            return True, f"deleted {id} from {topic}"
        return False, f"no dead letter {id} on {topic}"

    routes = [
        Route("/", overview),
        Route("/pending", pending),
        Route("/message", message),
        Route("/schedules", schedules),
        Route("/dead", dead),
        Route("/events", events),
        Route("/healthz", healthz),
        Route("/login", login, methods=["GET", "POST"]),
        Mount("/static", StaticFiles(packages=[("delayed_pubsub.dashboard", "static")]), name="static"),
    ]
    if guard.enabled:
        routes += [
            Route("/actions/cancel", action(do_cancel), methods=["POST"]),
            Route("/actions/pause", action(do_set_paused(True)), methods=["POST"]),
            Route("/actions/resume", action(do_set_paused(False)), methods=["POST"]),
            Route("/actions/retry-dead", action(do_retry_dead), methods=["POST"]),
            Route("/actions/delete-dead", action(do_delete_dead), methods=["POST"]),
        ]

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        poller.start()
        try:
            yield
        finally:
            await poller.stop()

    async def redis_refused(request: Request, exc: Exception) -> Response:
        # A cursor or id Redis cannot parse (a hand-edited URL): the request's fault, shown as such.
        return page(request, "failed.html", status=400, text=f"Redis refused the request: {exc}")

    async def redis_unreachable(request: Request, exc: Exception) -> Response:
        return page(request, "failed.html", status=503, text=f"Redis is not reachable: {exc}")

    handlers: dict[Any, Callable[[Request, Exception], Awaitable[Response]]] = {
        ResponseError: redis_refused,
        **dict.fromkeys(TRANSIENT_ERRORS, redis_unreachable),
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


def _field(form: FormData, name: str) -> str:
    value = form.get(name)
    return value if isinstance(value, str) else ""
