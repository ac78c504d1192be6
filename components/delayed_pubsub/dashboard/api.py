"""The dashboard's JSON API, `/api/v1/...` (docs/openapi.yaml): the pages' reads and the actions, for scripts.

Each operation is the one the pages, the actions and the CLI run (through
`Source` and `operate`): the API only reads parameters, checks who asks and
writes JSON. Who may call it is the dashboard's rule (dashboard.guard):

- read-only dashboard (no `--allow-actions`): the reads are open, every write
  answers 403;
- with `--allow-actions`: every call needs the token (`Authorization: Bearer`,
  or `X-Dashboard-Token`) or a logged-in browser session; a session's call must
  come from the dashboard's own Origin, and a session's write must carry the
  CSRF value in `X-CSRF-Token` (a cross-site form can send neither header).

Every answer is JSON, errors as `{"error": {"code": ..., "message": ...}}`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from redis.exceptions import ResponseError
from starlette.applications import Starlette
from starlette.datastructures import QueryParams
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from delayed_middleware import backfill as bf
from delayed_middleware.control import Reschedule, read_control
from delayed_middleware.engine import pause as pausing
from delayed_middleware.engine import timecontrol
from delayed_middleware.errors import FailedPreconditionError, InvalidArgumentError
from delayed_middleware.history_reader import HistoryPosition
from delayed_middleware.instants import display_instant
from delayed_middleware.keys import is_stream_id, split_shard_id
from delayed_middleware.publish_keys import SCHEDULE_ID, SCHEDULE_RESCHEDULE
from delayed_pubsub import operate, operate_time
from delayed_pubsub.connection import REDIS_ERRORS
from delayed_pubsub.dashboard.backfill_request import run_backfill
from delayed_pubsub.dashboard.guard import Guard
from delayed_pubsub.dashboard.source import MessageInfo, PendingMessage, Source

MOUNT = "/api"
VERSION = "/v1"
# Page sizes: `limit` defaults to DEFAULT_LIMIT; above MAX_LIMIT it is refused (400), not cut.
DEFAULT_LIMIT = 50
MAX_LIMIT = 500
# `offset` skips that many matches by reading them: bounded, so one call never reads without end.
MAX_OFFSET = 10_000
# A write's JSON body: an id or a prefix, never more than this.
MAX_BODY = 64 * 1024
CSRF_HEADER = "x-csrf-token"
PAYLOAD_PREVIEW = 4096


class ApiError(Exception):
    """An answer other than 200: its status, a stable code and a message for the operator."""

    def __init__(
        self, status: int, code: str, message: str, headers: Mapping[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message
        self.headers = dict(headers or {})

    def response(self) -> Response:
        return error_response(self.status, self.code, self.message, self.headers)


def error_response(
    status: int, code: str, message: str, headers: Mapping[str, str] | None = None
) -> Response:
    return JSONResponse({"error": {"code": code, "message": message}}, status_code=status, headers=headers)


def bad_parameter(name: str, value: object, why: str) -> ApiError:
    return ApiError(400, "bad_parameter", f"{name}={value!r}: {why}")


def not_found(id: str, what: str = "not pending (unknown, already fired, cancelled or parked)") -> ApiError:
    return ApiError(404, "not_found", f"{id}: {what}")


# --- parameters ------------------------------------------------------------------------


def _number(params: QueryParams, name: str, default: int, low: int, high: int) -> int:
    text = params.get(name)
    if text is None:
        return default
    if not (text.isascii() and text.isdigit()) or len(text) > 9:
        raise bad_parameter(name, text, f"not a whole number from {low} to {high}")
    value = int(text)
    if not low <= value <= high:
        raise bad_parameter(name, text, f"must be from {low} to {high}")
    return value


def page_limit(params: QueryParams) -> int:
    """`limit`: 1..MAX_LIMIT, DEFAULT_LIMIT when absent (400 otherwise)."""
    return _number(params, "limit", DEFAULT_LIMIT, 1, MAX_LIMIT)


def listing_cursor(params: QueryParams, shards: int, name: str = "cursor") -> str | None:
    """A pending listing's cursor (`<stream id>`, `<stream id>@<shard>` with several shards), or 400."""
    text = params.get(name) or None
    if text is not None and split_shard_id(text, shards) is None and not is_stream_id(text):
        raise bad_parameter(name, text, "not a cursor of this listing (give back a `next` it answered)")
    return text


@dataclass(frozen=True)
class PendingPage:
    """A page of the pending listing: each message with its cursor, and the cursor of the next page
    (None when this page is not full: nothing more matched)."""

    items: tuple[tuple[str, PendingMessage], ...]
    next: str | None


async def pending_page(
    source: Source, *, prefix: str, cursor: str | None, offset: int, limit: int
) -> PendingPage:
    """The pending listing `delayed-pubsub pending --prefix P --after CURSOR` writes (Inspector.listing:
    stream order, shard by shard, one page of the delayed topic in memory), `offset` matches skipped,
    at most `limit` kept. A full page names a next cursor: the next page may be empty."""
    # Without a prefix every entry read is shown: read what the page needs, not a full step of 500
    # (the first page of 50 costs a tenth of the CPU). A prefix may skip many: full steps.
    reader = source.inspector if prefix else source.reader(min(offset + limit, source.page_size))
    rows = reader.listing(prefix=prefix, after=cursor)
    items: list[tuple[str, PendingMessage]] = []
    skipped = 0
    try:
        async for at, m in rows:
            if skipped < offset:
                skipped += 1
                continue
            items.append((at, m))
            if len(items) >= limit:
                break
    finally:
        await rows.aclose()
    return PendingPage(tuple(items), items[-1][0] if len(items) >= limit else None)


def message_json(source: Source, info: MessageInfo) -> dict[str, Any]:
    """One message as the message page (and `delayed-pubsub inspect`) shows it."""
    m, env = info.message, info.envelope
    return {
        **operate.pending_json(m),
        "state": info.state,
        "parkedReason": info.parked_reason or None,
        "stream": source.stream_of(m),
        "streamId": m.stream_id,
        "schedule": env.schedule or None,
        "published": display_instant(m.published_at_ms) if m.published_at_ms else None,
        "contentType": env.content_type or None,
        "metadata": dict(sorted(env.metadata.items())),
        "payload": info.preview(PAYLOAD_PREVIEW),
        # Its newest records, as the page shows them; /history/{id} pages through all of them.
        "history": [_without_cursor(operate.history_json("", r)) for r in info.history],
    }


def _without_cursor(record: dict[str, Any]) -> dict[str, Any]:
    record.pop("cursor")
    return record


# --- the JSON body of a write ----------------------------------------------------------


class Body:
    """A write's JSON object; each accessor answers 400 naming the field when it does not fit."""

    def __init__(self, fields: Mapping[str, Any]) -> None:
        self.fields = fields

    @classmethod
    async def of(cls, request: Request) -> Body:
        kind = request.headers.get("content-type", "").partition(";")[0].strip().lower()
        if kind != "application/json":
            raise ApiError(
                415,
                "unsupported_media_type",
                f"send a JSON object (Content-Type: application/json), not {kind!r}",
            )
        raw = await request.body()
        if len(raw) > MAX_BODY:
            raise ApiError(413, "body_too_large", f"the body has {len(raw)} bytes: at most {MAX_BODY}")
        try:
            fields = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise ApiError(400, "bad_body", f"the body is not JSON: {e}") from None
        if not isinstance(fields, dict):
            raise ApiError(400, "bad_body", f"the body must be a JSON object, not {type(fields).__name__}")
        return cls(fields)

    def has(self, name: str) -> bool:
        return self.fields.get(name) is not None

    def text(self, name: str) -> str:
        """A field that must be a non-empty string."""
        value = self.fields.get(name)
        if not isinstance(value, str) or not value:
            raise bad_parameter(name, value, "give a non-empty string")
        return value

    def flag(self, name: str, default: bool = False) -> bool:
        value = self.fields.get(name, default)
        if not isinstance(value, bool):
            raise bad_parameter(name, value, "give true or false")
        return value

    def only(self, *names: str) -> None:
        """400 for a field no operation here reads (a typo must not be ignored)."""
        extra = sorted(set(self.fields) - set(names))
        if extra:
            raise bad_parameter(
                extra[0], self.fields[extra[0]], f"unknown field (this call takes {', '.join(names)})"
            )


# --- the writes ------------------------------------------------------------------------

Answer = Mapping[str, Any]
WriteRun = Callable[[Source, Body], Awaitable[Answer]]


async def cancel(source: Source, body: Body) -> Answer:
    """`{"id": ID}` as `delayed-pubsub cancel ID`; `{"prefix": P, "dryRun": bool}` as `cancel --prefix P`."""
    body.only("id", "prefix", "dryRun")
    if body.has("id") == body.has("prefix"):
        raise ApiError(400, "bad_parameter", "give one of id and prefix")
    if body.has("prefix"):
        prefix, dry_run = body.text("prefix"), body.flag("dryRun")
        count = await source.cancel_prefix(prefix, dry_run=dry_run)
        return {"prefix": prefix, "dryRun": dry_run, "matching" if dry_run else "cancelled": count}
    id = body.text("id")
    if not await source.cancel(id):
        raise not_found(id, "not pending (unknown, already fired or cancelled)")
    return {"id": id, "status": "cancelled"}


def by_id(operation: Callable[[Source, str], Awaitable[str | None]]) -> WriteRun:
    """A write of one `{"id": ID}` whose operation answers a status, or None when the id is unknown."""

    async def run(source: Source, body: Body) -> Answer:
        body.only("id")
        id = body.text("id")
        status = await operation(source, id)
        if status is None:
            raise not_found(id)
        return {"id": id, "status": status}

    return run


def set_paused(pause: bool) -> Callable[[Source, str], Awaitable[str | None]]:
    """`delayed-pubsub pause ID` (or `resume`): the status (paused, resumed, already: it was so,
    ended: its schedule had no fire left and it was cancelled), None for an unknown or parked id."""

    async def operation(source: Source, id: str) -> str | None:
        status = await source.set_paused(id, pause)
        return status if status in (pausing.PAUSED, pausing.RESUMED, pausing.ALREADY, pausing.ENDED) else None

    return operation


async def trigger(source: Source, body: Body) -> Answer:
    """`{"id": ID}` as `delayed-pubsub trigger ID`: delivered now (a schedule: one extra occurrence)."""
    body.only("id")
    id = body.text("id")
    result = await source.trigger(id)
    if not result.done:
        raise not_found(id, operate_time.WHY_NOT.get(result.status, result.detail or result.status))
    return operate_time.outcome_json(id, result)


async def reschedule(source: Source, body: Body) -> Answer:
    """`{"id": ID, "at": RFC 3339 | Go duration}` as `delayed-pubsub reschedule ID`: read as the
    publish key scheduleReschedule is (the same grammar and bounds)."""
    body.only("id", "at")
    id, at = body.text("id"), body.text("at")
    try:
        request = read_control(
            {SCHEDULE_RESCHEDULE: at, SCHEDULE_ID: id}, enabled=True, now_ms=int(time.time() * 1000)
        )
    except InvalidArgumentError as e:
        field = "id" if e.key == SCHEDULE_ID else "at"
        raise bad_parameter(field, e.value, e.reason) from None
    assert isinstance(request, Reschedule)
    result = await source.reschedule(id, request.due_ms)
    if result.status == timecontrol.RECURRING:
        raise bad_parameter("id", id, operate_time.WHY_NOT[timecontrol.RECURRING])
    if result.status == timecontrol.FIRED:
        raise ApiError(409, "failed_precondition", f"{id}: already fired")
    if not result.done:
        raise not_found(id, operate_time.WHY_NOT.get(result.status, result.detail or result.status))
    return operate_time.outcome_json(id, result)


async def backfill(source: Source, body: Body) -> Answer:
    """`{"id", "from", "to", "rate"?, "dryRun"?}` as `delayed-pubsub backfill ID --from --to --rate`,
    the dashboard's backfill action's parsing. A dry run unless `"dryRun": false`: a script that
    forgets the field lists what it would deliver and delivers nothing."""
    body.only("id", "from", "to", "rate", "dryRun")
    id, dry_run = body.text("id"), body.flag("dryRun", default=True)
    rate = body.fields.get("rate")
    if rate is not None and (isinstance(rate, bool) or not isinstance(rate, (int, float, str))):
        raise bad_parameter("rate", rate, 'give a number of occurrences per second (e.g. 10 or "10/s")')
    try:
        result = await run_backfill(
            source, id, body.text("from"), body.text("to"), "" if rate is None else str(rate), dry_run=dry_run
        )
    except bf.ScheduleNotFoundError:
        raise not_found(id, "no pending schedule has this id") from None
    except InvalidArgumentError as e:
        raise bad_parameter(e.key, e.value, e.reason) from None
    return result.as_json()


@dataclass(frozen=True)
class Write:
    """A write endpoint: POST /api/v1/<name>, its JSON body given to `run`."""

    name: str
    run: WriteRun


WRITES: tuple[Write, ...] = (
    Write("cancel", cancel),
    Write("pause", by_id(set_paused(True))),
    Write("resume", by_id(set_paused(False))),
    Write("trigger", trigger),
    Write("reschedule", reschedule),
    Write("backfill", backfill),
    # EXTENSION POINTS: an operation the CLI and the dashboard's actions gain is wired here with one
    # line (and its path added to docs/openapi.yaml: test_dashboard_api checks both agree). `run` reads
    # the body with Body's accessors (400 names the field), calls the operation the action calls,
    # raises not_found(id) for an unknown id, and returns the JSON answer. E.g.:
    #   Write("purge", purge),  # {"id"}
)


# --- the app ---------------------------------------------------------------------------


class Api:
    """The API's routes over one dashboard's Source and Guard."""

    def __init__(self, source: Source, guard: Guard, writes: Sequence[Write] = WRITES) -> None:
        self._source = source
        self._guard = guard
        self._writes = tuple(writes)

    def app(self) -> Starlette:
        """The API as its own app, mounted at MOUNT: its errors (an unknown path, a wrong method)
        answer JSON, whatever the pages answer."""
        routes = [
            Route(f"{VERSION}/pending", self._read(self.pending)),
            Route(f"{VERSION}/messages/{{id:path}}", self._read(self.message)),
            Route(f"{VERSION}/history/{{id:path}}", self._read(self.history)),
        ]
        for write in self._writes:
            routes.append(Route(f"{VERSION}/{write.name}", self._write(write.run), methods=["POST"]))
        return Starlette(routes=routes, exception_handlers={HTTPException: _http_error})

    def _authorise(self, request: Request, write: bool) -> None:
        """Raise ApiError unless this request may read (write: act); see the module's docstring."""
        guard = self._guard
        if not guard.enabled:
            if write:
                raise ApiError(
                    403, "actions_disabled", "this dashboard is read-only (started without --allow-actions)"
                )
            return
        token = guard.presented_token(request)
        if token is None and not guard.logged_in(request):
            raise ApiError(
                401,
                "unauthenticated",
                "give the dashboard's token: Authorization: Bearer <token>",
                _CHALLENGE,
            )
        if not guard.same_origin(request):
            raise ApiError(403, "foreign_origin", "the request's Origin is not this dashboard")
        if token is not None:
            if not guard.token_matches(token):
                raise ApiError(401, "invalid_token", "that is not the dashboard's token", _CHALLENGE)
            return
        if write and not guard.allows(request, request.headers.get(CSRF_HEADER, "")):
            raise ApiError(403, "csrf", f"a session's write needs its CSRF value in {CSRF_HEADER}")

    def _read(self, run: Callable[[Request], Awaitable[Answer]]) -> Callable[[Request], Awaitable[Response]]:
        return self._endpoint(run, write=False)

    def _write(self, run: WriteRun) -> Callable[[Request], Awaitable[Response]]:
        async def act(request: Request) -> Answer:
            return await run(self._source, await Body.of(request))

        return self._endpoint(act, write=True)

    def _endpoint(
        self, run: Callable[[Request], Awaitable[Answer]], *, write: bool
    ) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            try:
                self._authorise(request, write)
                return JSONResponse(await run(request), headers={"cache-control": "no-store"})
            except ApiError as e:
                return e.response()
            except InvalidArgumentError as e:
                # An id the engine cannot place (a bare stream id on several shards): be precise.
                return error_response(400, "bad_parameter", str(e))
            except FailedPreconditionError as e:
                return error_response(409, "failed_precondition", str(e))
            except ResponseError as e:
                return error_response(400, "redis_refused", f"Redis refused the request: {e}")
            except REDIS_ERRORS as e:
                return error_response(503, "redis_unavailable", f"Redis is not reachable: {e}")

        return endpoint

    # --- reads -------------------------------------------------------------------------

    async def pending(self, request: Request) -> Answer:
        params = request.query_params
        limit = page_limit(params)
        offset = _number(params, "offset", 0, 0, MAX_OFFSET)
        cursor = listing_cursor(params, self._source.shards)
        if cursor is not None and offset:
            raise bad_parameter("offset", params["offset"], "give a cursor or an offset, not both")
        prefix = params.get("prefix", "")
        page = await pending_page(self._source, prefix=prefix, cursor=cursor, offset=offset, limit=limit)
        items = [{**operate.pending_json(m), "cursor": at} for at, m in page.items]
        return {"items": items, "next": page.next, "limit": limit}

    async def message(self, request: Request) -> Answer:
        id = request.path_params["id"]
        info = await self._source.message(id)
        if info is None:
            raise not_found(id)
        return message_json(self._source, info)

    async def history(self, request: Request) -> Answer:
        """Records of one id, oldest first, from after `cursor` (a `next` this answered)."""
        id, params = request.path_params["id"], request.query_params
        limit = page_limit(params)
        shards = self._source.shards
        cursor = params.get("cursor") or None
        after = HistoryPosition.parse(cursor, shards) if cursor is not None else None
        if cursor is not None and after is None:
            raise bad_parameter("cursor", cursor, "not a history cursor (give back a `next` it answered)")
        records = self._source.inspector.history_forward(id=id, after=after)
        items: list[dict[str, Any]] = []
        try:
            async for position, record in records:
                items.append(operate.history_json(position.text(shards), record))
                if len(items) >= limit:
                    break
        finally:
            await records.aclose()
        if not items and after is None:
            raise not_found(id, "no history (never published, or its records have been trimmed)")
        return {
            "id": id,
            "items": items,
            "next": items[-1]["cursor"] if len(items) >= limit else None,
            "limit": limit,
        }


_CHALLENGE = {"www-authenticate": 'Bearer realm="delayed-pubsub dashboard"'}


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    message = f"{request.method} {request.url.path}: {exc.detail}"
    return error_response(exc.status_code, code, message, exc.headers)
