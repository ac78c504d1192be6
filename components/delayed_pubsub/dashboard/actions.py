"""The dashboard's actions (cancel, pause, resume, trigger, reschedule, retry or delete a dead letter,
backfill): POST only, behind the guard.

Each action is a runner (form -> (done, text)) wrapped by the one `endpoint`,
which checks the login and CSRF token and answers in JSON or HTML.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from starlette.datastructures import FormData
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from delayed_middleware import backfill as bf
from delayed_middleware.control import Reschedule, read_control
from delayed_middleware.deadletters import GONE, MOVED
from delayed_middleware.engine import pause as pausing
from delayed_middleware.errors import InvalidArgumentError
from delayed_middleware.instants import format_instant
from delayed_middleware.publish_keys import SCHEDULE_ID, SCHEDULE_RESCHEDULE
from delayed_pubsub import operate, operate_time
from delayed_pubsub.dashboard.backfill_request import run_backfill
from delayed_pubsub.dashboard.guard import CSRF_FIELD, Guard
from delayed_pubsub.dashboard.pages import Pages, form_field
from delayed_pubsub.dashboard.source import Source

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
            Route("/actions/trigger", self.endpoint(self.trigger), methods=["POST"]),
            Route("/actions/reschedule", self.endpoint(self.reschedule), methods=["POST"]),
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

    async def trigger(self, form: FormData) -> Outcome:
        id = form_field(form, "id")
        result = await self._source.trigger(id)
        if result.done:
            return True, f"triggered {id} at {format_instant(result.at_ms)}"
        return False, f"{id}: {operate_time.WHY_NOT.get(result.status, result.detail)}"

    async def reschedule(self, form: FormData) -> Outcome:
        id, when = form_field(form, "id"), form_field(form, "when").strip()
        try:
            # Read as the publish key is: the same grammar and bounds.
            request = read_control(
                {SCHEDULE_RESCHEDULE: when, SCHEDULE_ID: id}, enabled=True, now_ms=int(time.time() * 1000)
            )
        except InvalidArgumentError as e:
            return False, str(e)
        assert isinstance(request, Reschedule)
        result = await self._source.reschedule(id, request.due_ms)
        if result.done:
            return True, f"rescheduled {id} to {format_instant(result.at_ms)}"
        return False, f"{id}: {operate_time.WHY_NOT.get(result.status, result.detail)}"

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
        start, end, rate = (form_field(form, name) for name in ("from", "to", "rate"))
        return await run_backfill(self._source, id, start, end, rate, dry_run=dry_run)
