"""The dashboard's read pages: one method per route, each rendered by the one `render`.

Every page touches the poller (a page open keeps it polling) and gets the
same base context (app, shards, login state, CSRF token).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

from markupsafe import Markup
from starlette.datastructures import FormData
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.templating import Jinja2Templates

from delayed_pubsub.dashboard.api import ApiError, listing_cursor, pending_page
from delayed_pubsub.dashboard.guard import COOKIE, CSRF_FIELD, Guard
from delayed_pubsub.dashboard.poller import Poller
from delayed_pubsub.dashboard.source import Source

PAGE_SIZE = 50


def form_field(form: FormData, name: str) -> str:
    """A form's text field, '' when it is missing or a file."""
    value = form.get(name)
    return value if isinstance(value, str) else ""


@dataclass(eq=False, repr=False)
class Pages:
    """The pages of one app's dashboard, read through `source`, live through `poller`."""

    source: Source
    guard: Guard
    poller: Poller
    tpl: Jinja2Templates
    interval_s: float

    def routes(self) -> list[Route]:
        return [
            Route("/", self.overview),
            Route("/pending", self.pending),
            Route("/message", self.message),
            Route("/schedules", self.schedules),
            Route("/dead", self.dead),
            Route("/events", self.events),
            Route("/healthz", self.healthz),
            Route("/login", self.login, methods=["GET", "POST"]),
        ]

    def render(self, request: Request, name: str, status: int = 200, **context: Any) -> Response:
        """Template `name` with the base context every page has, and `context`."""
        self.poller.touch()
        guard = self.guard
        base = {
            "app_id": self.source.consumer_id,
            "shards": self.source.shards,
            "actions": guard.enabled,
            "logged_in": guard.logged_in(request),
            "csrf": guard.csrf_for(request),
            "csrf_field": CSRF_FIELD,
            "path": request.url.path,
        }
        return self.tpl.TemplateResponse(request, name, {**base, **context}, status_code=status)

    async def overview(self, request: Request) -> Response:
        snap = await self.poller.latest()
        # Rendered (and escaped) by the live fragment's own template: inserted as it is.
        live = Markup(snap.parts.get("live-overview", ""))
        return self.render(request, "overview.html", snap=snap, live=live)

    async def pending(self, request: Request) -> Response:
        q = request.query_params.get("q", "").strip()
        after = request.query_params.get("after") or None
        next_after = None
        if q:
            messages = await self.source.search(q, PAGE_SIZE)
        else:
            # The listing /api/v1/pending answers, a page of it: the two never differ.
            try:
                cursor = listing_cursor(request.query_params, self.source.shards, name="after")
            except ApiError as e:
                return self.render(request, "failed.html", status=e.status, text=e.message)
            page = await pending_page(self.source, prefix="", cursor=cursor, offset=0, limit=PAGE_SIZE)
            messages, next_after = [m for _, m in page.items], page.next
        return self.render(
            request,
            "pending.html",
            messages=messages,
            q=q,
            after=after,
            next_url=f"/pending?{urlencode({'after': next_after})}" if next_after else None,
        )

    async def message(self, request: Request) -> Response:
        id = request.query_params.get("id", "")
        info = await self.source.message(id) if id else None
        if info is None:
            return self.render(request, "missing.html", status=404, id=id)
        env = info.envelope
        return self.render(
            request,
            "message.html",
            id=id,
            info=info,
            m=info.message,
            env=env,
            stream=self.source.stream_of(info.message),
            metadata=sorted(env.metadata.items()),
            preview=info.preview(4096),
        )

    async def schedules(self, request: Request) -> Response:
        cursor = request.query_params.get("cursor") or None
        result = await self.source.schedules(cursor, PAGE_SIZE)
        next_url = f"/schedules?{urlencode({'cursor': result.next_cursor})}" if result.next_cursor else None
        return self.render(
            request, "schedules.html", rows=result.rows, next_url=next_url, examined=result.examined
        )

    async def dead(self, request: Request) -> Response:
        letters = await self.source.dead_letters()
        return self.render(request, "dead.html", letters=letters[:500], total=len(letters))

    async def events(self, request: Request) -> Response:
        poller, interval_s = self.poller, self.interval_s

        async def stream() -> AsyncIterator[str]:
            # Tells the browser how long to wait before it reconnects after a drop.
            yield f"retry: {int(interval_s * 1000)}\n\n"
            async for snap in poller.updates():
                data = json.dumps({"version": snap.version, "parts": snap.parts}, separators=(",", ":"))
                yield f"event: snapshot\ndata: {data}\n\n"

        headers = {"cache-control": "no-store", "x-accel-buffering": "no"}
        return StreamingResponse(stream(), media_type="text/event-stream", headers=headers)

    async def healthz(self, request: Request) -> Response:
        poller = self.poller
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

    async def login(self, request: Request) -> Response:
        guard = self.guard
        if not guard.enabled:
            return self.render(request, "readonly.html", status=404)
        if request.method == "GET":
            return self.render(request, "login.html", failed=False)
        form = await request.form()
        if not guard.same_origin(request) or not guard.token_matches(form_field(form, "token")):
            return self.render(request, "login.html", status=403, failed=True)
        response = RedirectResponse("/", status_code=303)
        response.set_cookie(COOKIE, guard.new_session(), httponly=True, samesite="strict", path="/")
        return response

    async def redis_refused(self, request: Request, exc: Exception) -> Response:
        # A cursor or id Redis cannot parse (a hand-edited URL): the request's fault, shown as such.
        return self.render(request, "failed.html", status=400, text=f"Redis refused the request: {exc}")

    async def refused(self, request: Request, exc: Exception) -> Response:
        # An action the app's state does not allow now (a pause in the storage format's rollback window).
        return self.render(request, "failed.html", status=409, text=str(exc))

    async def redis_unreachable(self, request: Request, exc: Exception) -> Response:
        return self.render(request, "failed.html", status=503, text=f"Redis is not reachable: {exc}")
