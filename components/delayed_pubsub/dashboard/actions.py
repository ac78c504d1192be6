"""The dashboard's actions (cancel, pause, resume, retry or delete a dead letter, backfill): POST only,
behind the guard.

Each action is a runner (form -> (done, text)) wrapped by the one `endpoint`,
which checks the login and CSRF token and answers in JSON or HTML.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from starlette.datastructures import FormData
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from delayed_middleware import backfill as bf
from delayed_middleware.deadletters import GONE, MOVED
from delayed_middleware.engine import pause as pausing
from delayed_middleware.errors import InvalidArgumentError
from delayed_middleware.history import Retention
from delayed_middleware.instants import parse_instant
from delayed_pubsub import operate
from delayed_pubsub.dashboard.guard import CSRF_FIELD, Guard
from delayed_pubsub.dashboard.pages import Pages, form_field
from delayed_pubsub.dashboard.source import Source

# The longest backfill the dashboard delivers (its occurrences / rate, seconds): it runs inside the
# HTTP request, so a longer one is refused (400 naming `rate`) and left to the CLI.
BACKFILL_MAX_SECONDS = 30.0

# What an action did: (done, the message for the operator).
Outcome = tuple[bool, str]
Runner = Callable[[FormData], Awaitable[Outcome]]


class Actions:
    """The changes an operator may make from the dashboard, when its token is set (`guard.enabled`)."""

    def __init__(self, source: Source, guard: Guard, pages: Pages) -> None:
        self._source = source
        self._guard = guard
        self._pages = pages

    def routes(self) -> list[Route]:
        return [
            Route("/actions/cancel", self.endpoint(self.cancel), methods=["POST"]),
            Route("/actions/pause", self.endpoint(self.pause), methods=["POST"]),
            Route("/actions/resume", self.endpoint(self.resume), methods=["POST"]),
            Route("/actions/retry-dead", self.endpoint(self.retry_dead), methods=["POST"]),
            Route("/actions/delete-dead", self.endpoint(self.delete_dead), methods=["POST"]),
            Route("/actions/backfill", self.backfill, methods=["POST"]),
        ]

    def endpoint(self, run: Runner) -> Callable[[Request], Awaitable[Response]]:
        """`run` behind the login and CSRF check, answered as JSON, or as a page to a browser."""

        async def endpoint(request: Request) -> Response:
            form = await request.form()
            if not self._guard.allows(request, form_field(form, CSRF_FIELD)):
                return PlainTextResponse("forbidden: log in with the dashboard's token", status_code=403)
            done, text = await run(form)
            if "text/html" not in request.headers.get("accept", ""):
                return JSONResponse({"ok": done, "message": text}, status_code=200 if done else 404)
            return self._pages.render(request, "done.html", status=200 if done else 404, done=done, text=text)

        return endpoint

    async def cancel(self, form: FormData) -> Outcome:
        id = form_field(form, "id")
        if await self._source.cancel(id):
            return True, f"cancelled {id}"
        return False, f"{id} is not pending (unknown, already fired or cancelled)"

    async def pause(self, form: FormData) -> Outcome:
        return await self._set_paused(form_field(form, "id"), True)

    async def resume(self, form: FormData) -> Outcome:
        return await self._set_paused(form_field(form, "id"), False)

    async def _set_paused(self, id: str, pause: bool) -> Outcome:
        status = await self._source.set_paused(id, pause)
        if status in (pausing.PAUSED, pausing.RESUMED):
            return True, f"{status} {id}"
        if status == pausing.ALREADY:
            return True, f"{id} is {'paused' if pause else 'running'} already"
        if status == pausing.ENDED:
            return True, f"{id}: its schedule has no fire left after now; cancelled"
        return False, f"{id} is not pending (unknown, already fired, cancelled or parked)"

    async def retry_dead(self, form: FormData) -> Outcome:
        topic, id = form_field(form, "topic"), form_field(form, "id")
        moved = await self._source.retry_dead(topic, id)
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

    async def delete_dead(self, form: FormData) -> Outcome:
        topic, id = form_field(form, "topic"), form_field(form, "id")
        if await self._source.delete_dead(topic, id):
            return True, f"deleted {id} from {topic}"
        return False, f"no dead letter {id} on {topic}"

    async def backfill(self, request: Request) -> Response:
        """A schedule's past occurrences (delayed_middleware.backfill): without `confirm=yes` a dry
        run, shown with a button that delivers exactly that range; with it, the delivery."""
        form = await request.form()
        if not self._guard.allows(request, form_field(form, CSRF_FIELD)):
            return PlainTextResponse("forbidden: log in with the dashboard's token", status_code=403)
        id = form_field(form, "id")
        dry_run = form_field(form, "confirm") != "yes"
        status, result, text = 200, None, ""
        try:
            result = await self._backfill(form, id, dry_run)
        except bf.ScheduleNotFoundError:
            status, text = 404, f"{id}: no pending schedule has this id"
        except InvalidArgumentError as e:
            status, text = 400, str(e)
        if "text/html" not in request.headers.get("accept", ""):
            body = {"ok": result is not None, "message": text, "result": result and result.as_json()}
            return JSONResponse(body, status_code=status)
        return self._pages.render(
            request, "backfill.html", status=status, result=result, text=text, id=id, form=dict(form)
        )

    async def _backfill(self, form: FormData, id: str, dry_run: bool) -> bf.BackfillResult:
        times: list[int] = []
        for name in ("from", "to"):
            text = form_field(form, name)
            try:
                times.append(parse_instant(text))
            except ValueError as e:
                raise InvalidArgumentError(name, text, str(e)) from None
        rate_text = form_field(form, "rate").removesuffix("/s") or str(bf.DEFAULT_RATE)
        try:
            rate = float(rate_text)
        except ValueError:
            raise InvalidArgumentError("rate", rate_text, "not a number of occurrences per second") from None
        settings = self._source.settings
        return await bf.backfill(
            self._source.client,
            settings.consumer_id,
            id,
            times[0],
            times[1],
            shards=settings.shards,
            rate=rate,
            dry_run=dry_run,
            retention=Retention(settings.history_max_len, settings.history_max_age_ms),
            max_seconds=BACKFILL_MAX_SECONDS,
        )
