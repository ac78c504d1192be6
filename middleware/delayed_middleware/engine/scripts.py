"""The one place that knows the engine's Lua scripts: how to call them and what they answer.

One method per script packs its KEYS and ARGV (in the order its header in
lua/*.lua lists them) and returns a frozen dataclass read from the reply.
Nobody above this layer indexes a raw reply or builds an argument list by
hand; the FIRE and CLAIM budgets come from one `_budget` builder. The script
texts themselves (with their includes resolved) stay in
`delayed_middleware.scripts`, which the broker and the benches read too.

A reply whose text fields are not UTF-8 (a hand-written envelope's topic)
must not raise here, after the script's writes: `topic()` turns those into ''
(no marker), and CLAIM's reader turns an undecodable claim into one that
RELEASE parks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from redis.exceptions import ResponseError

from delayed_middleware import scripts as lua
from delayed_middleware.aio import text
from delayed_middleware.client import RedisClient
from delayed_middleware.keys import EngineKeys


def topic(value: object) -> str:
    """A topic a script returned, for its marker; '' (no marker) when it is not UTF-8 text,
    as in a hand-written envelope: raising would come after the script's writes."""
    try:
        return text(value)
    except UnicodeDecodeError:
        return ""


@dataclass(frozen=True)
class Budget:
    """One fire call's bounds (FIRE's and CLAIM's ARGV 3..5 and their time budget)."""

    batch_size: int
    batch_entries: int
    batch_bytes: int
    fire_budget_us: int


@dataclass(frozen=True)
class Refill:
    """A cron envelope a fire step advanced (common.lua's REFILLS quad): enough to compute its next time.

    Kept as the script returned them: the envelope's fields may be anything a
    hand-written envelope holds, and the caller decodes each one under its own
    guard so one bad quad does not stop the rest of the batch's refills."""

    key: object
    ref: object
    expression: object
    published: object


@dataclass(frozen=True)
class ScheduleItem:
    """One envelope for SCHEDULE (its ARGV group of 9)."""

    raw: bytes
    due_ms: int
    schedule_id: str
    kind: int
    topic: str
    size: int
    schedule: str
    next_due: str  # '-' none, 'purge', or ms
    next_iso: str  # '-' or RFC3339


@dataclass(frozen=True)
class ScheduleCall:
    """One caller's share of a coalesced SCHEDULE: its items and its own call token."""

    items: Sequence[ScheduleItem]
    token: str


@dataclass(frozen=True)
class InFlight:
    """An envelope withdrawn (cancelled or replaced) while its occurrence was claimed, maybe not yet appended."""

    id: str
    due: str
    target: str
    # Only from CANCEL: the id's position in the call (0-based), kind, and its `cancelled` record's id.
    position: int = -1
    kind: int = 0
    history_id: str = ""


@dataclass(frozen=True)
class ScheduleResult:
    """SCHEDULE's answer: ids in order; `dup` when this call token was applied before."""

    ids: list[str]
    dup: bool = False
    replaced_in_flight: list[InFlight] = field(default_factory=list)


@dataclass(frozen=True)
class CancelResult:
    """CANCEL's answer: (cancelled?, topic or '') per id, and what was in flight (two-phase only)."""

    results: list[tuple[bool, str]]
    in_flight: list[InFlight]


@dataclass(frozen=True)
class FireResult:
    """FIRE's answer (see lua/fire.lua)."""

    fired: int
    head: str  # earliest due time left ('' none)
    first: str  # earliest due time fired ('' none)
    pending: int
    parked: int
    refill: int  # overdue refills
    entries: int
    gone: int
    decided: int  # the time the batch was decided at (ms)
    expired: list[tuple[str, str]]  # (envelope id, topic)
    refills: list[Refill]


@dataclass(frozen=True)
class Claim:
    """One envelope CLAIM handed out (see lua/claim.lua's reply)."""

    id: str
    due: str
    scheduler: str
    schedule_next: str
    target: str  # the key APPEND writes: the topic, or the outbox
    target_pubsub: str
    topic: str
    bulk: bool
    expires_at: int
    source: str
    # The caller's trim applies (published through this component, or '' = any: FIRE's rule).
    trim: bool
    entries: list[list[str | bytes]]  # XADD field/value lists
    # Why it cannot be appended (RELEASE parks it with this reason), or '': a
    # hand-written envelope whose topic or scheduleId is not UTF-8 text.
    bad: str = ""

    def fields(
        self, data: str | bytes, metadata: str | bytes, content_type: str | bytes
    ) -> list[str | bytes]:
        """One entry's XADD fields, as FIRE writes them."""
        out: list[str | bytes] = ["data", data, "metadata", metadata]
        if content_type:
            out += ["contentType", content_type]
        if self.expires_at > 0:
            out += ["expiresAt", str(self.expires_at)]
        if self.target_pubsub:
            out += ["pubsub", self.target_pubsub, "topic", self.topic, "id", self.scheduler]
            if self.bulk:
                out += ["bulk", self.scheduler]
        return out


@dataclass(frozen=True)
class ClaimResult:
    """CLAIM's answer (see lua/claim.lua)."""

    head: str
    pending: int
    parked: int
    refill: int
    first: str
    gone: int
    decided: int
    expired: list[tuple[str, str]]
    claims: list[Claim]


@dataclass(frozen=True)
class AppendItem:
    """One claimed envelope for APPEND: its fire marker key, whether the trim applies, its entries."""

    marker: str
    trim: bool
    entries: list[list[str | bytes]]


@dataclass(frozen=True)
class ReleaseResult:
    """RELEASE's answer (see lua/release.lua)."""

    released: int
    parked: int
    refill: int
    fired: int
    head: str
    refills: list[Refill]


@dataclass(frozen=True)
class RefillItem:
    """One REFILL compare-and-set: the ids-hash key, the ref read, the next due ms (or purge/end) and its text."""

    key: str
    ref: str
    next_due: str
    next_iso: str


class EngineScripts:
    """The engine's scripts, registered on one client, for one shard's keys."""

    def __init__(self, client: RedisClient, keys: EngineKeys, *, two_phase: bool) -> None:
        self._keys = keys
        # SCHEDULE and CANCEL see the in-flight keys only under the two-phase fire.
        self._keys_for_writes = keys.two_phase_keys if two_phase else keys.script_keys
        self._schedule = client.register_script(lua.SCHEDULE)
        self._fire = client.register_script(lua.FIRE)
        self._cancel = client.register_script(lua.CANCEL)
        self._refill = client.register_script(lua.REFILL)
        self._claim = client.register_script(lua.CLAIM)
        self._append = client.register_script(lua.APPEND)
        self._release = client.register_script(lua.RELEASE)
        self._uncancel = client.register_script(lua.UNCANCEL)
        self._compact = client.register_script(lua.COMPACT)
        self._pause = client.register_script(lua.PAUSE)

    async def pause(
        self, op: str, id: str, reason: str, extra: Sequence[str], *, now: int, history_len: int
    ) -> list[Any]:
        """PAUSE (lua/pause.lua): hold or resume one entry; its raw reply, read by delayed_middleware.pausing."""
        k = self._keys
        args: list[Any] = [k.buckets, now, history_len, op, id, reason, k.wake, *extra]
        return list(await self._pause(keys=self._keys_for_writes, args=args))

    async def schedule(
        self, items: Sequence[ScheduleItem], *, now: int, token: str, history_len: int, token_window_ms: int
    ) -> ScheduleResult:
        """SCHEDULE one call: store and index `items`; a token applied before answers dup.

        Raises ResponseError when the script refused the call (nothing of it is marked done).
        """
        got = await self.schedule_calls(
            [ScheduleCall(items, token)], now=now, history_len=history_len, token_window_ms=token_window_ms
        )
        if isinstance(got[0], Exception):
            raise got[0]
        return got[0]

    async def schedule_calls(
        self, calls: Sequence[ScheduleCall], *, now: int, history_len: int, token_window_ms: int
    ) -> list[ScheduleResult | ResponseError]:
        """SCHEDULE several calls in one script call: each its own result, or the ResponseError
        that refused it alone (the others are stored). Applied in order."""
        k = self._keys
        args: list[Any] = [k.buckets, k.wake, now, history_len, token_window_ms, len(calls)]
        for c in calls:
            args += [c.token, len(c.items)]
            for i in c.items:
                args += [
                    i.raw,
                    i.due_ms,
                    i.schedule_id,
                    i.kind,
                    i.topic,
                    i.size,
                    i.schedule,
                    i.next_due,
                    i.next_iso,
                ]
        raw = await self._schedule(keys=self._keys_for_writes, args=args)
        out: list[ScheduleResult | ResponseError] = []
        at = 0
        for c in calls:
            status, m = text(raw[at]), int(raw[at + 1])
            values = [text(v) for v in raw[at + 2 : at + 2 + m]]
            at += 2 + m
            if status == "dup":
                out.append(ScheduleResult([], dup=True))
            elif status == "err":
                out.append(ResponseError(values[0] if values else "SCHEDULE refused the call"))
            else:
                n = len(c.items)
                rest = values[n:]
                replaced = [InFlight(rest[i], rest[i + 1], rest[i + 2]) for i in range(0, len(rest) - 2, 3)]
                out.append(ScheduleResult(values[:n], replaced_in_flight=replaced))
        return out

    async def cancel(self, ids: Sequence[str], *, now: int, history_len: int, reason: str) -> CancelResult:
        """CANCEL: withdraw `ids` (a few hundred at most per call)."""
        raw = await self._cancel(
            keys=self._keys_for_writes,
            args=[self._keys.buckets, now, history_len, reason, len(ids), *ids],
        )
        n = 2 * len(ids)
        results = [(bool(int(raw[i])), topic(raw[i + 1])) for i in range(0, n, 2)]
        in_flight = []
        for i in range(n, len(raw), 6):
            pos, id, due, target, kind, hid = raw[i : i + 6]
            # A topic that is not text was never appended (its claim parks): nothing to stop.
            if topic(target):
                in_flight.append(
                    InFlight(text(id), text(due), text(target), int(pos) - 1, int(kind), text(hid))
                )
        return CancelResult(results, in_flight)

    async def uncancel(self, history_id: str, *, now: int, history_len: int) -> None:
        """UNCANCEL: turn a `cancelled` record into the `fired` one (the occurrence went out first)."""
        await self._uncancel(keys=[self._keys.history], args=[history_id, now, history_len])

    def _batch_args(self, now: int | str, b: Budget) -> list[Any]:
        """FIRE's and CLAIM's ARGV 1..5, the same in both: bucket prefix, now, the batch's bounds."""
        return [self._keys.buckets, now, b.batch_size, b.batch_entries, b.batch_bytes]

    async def fire(
        self, *, now: int | str, budget: Budget, trim: tuple[str, str], history_len: int, pubsub_name: str
    ) -> FireResult:
        """FIRE (single node): deliver one bounded batch of what is due."""
        args = [*self._batch_args(now, budget), *trim, history_len, budget.fire_budget_us, pubsub_name]
        raw = await self._fire(keys=self._keys.script_keys, args=args)
        head, rest = _header(raw, _FIRE_REPLY)
        expired, rest = _expired(rest)
        return FireResult(**head, expired=expired, refills=_refills(rest))

    async def claim(
        self, *, now: int | str, budget: Budget, history_len: int, lease_ms: int, pubsub_name: str
    ) -> ClaimResult:
        """CLAIM (two-phase, the shard's slot): move a bounded due batch in flight."""
        args = [*self._batch_args(now, budget), history_len, budget.fire_budget_us, lease_ms, pubsub_name]
        raw = await self._claim(keys=self._keys.two_phase_keys, args=args)
        head, rest = _header(raw, _CLAIM_REPLY)
        expired, rest = _expired(rest)
        return ClaimResult(**head, expired=expired, claims=_claims(rest))

    async def append(
        self, target: str, items: Sequence[AppendItem], *, marker_ttl_ms: int, trim: tuple[str, str]
    ) -> list[str]:
        """APPEND (two-phase, the target's slot): one status per item ('ok', 'dup', or why not)."""
        args: list[Any] = [marker_ttl_ms, *trim, len(items)]
        for item in items:
            args += [1 if item.trim else 0, len(item.entries)]
            for fields in item.entries:
                args.append(len(fields) // 2)
                args += fields
        raw = await self._append(keys=[target, *(i.marker for i in items)], args=args)
        return [text(s) for s in raw]

    async def release(
        self, outcomes: Sequence[tuple[str, str]], *, now: int | str, history_len: int
    ) -> ReleaseResult:
        """RELEASE (two-phase, the shard's slot): finalize (envelope id, APPEND outcome) pairs."""
        args: list[Any] = [self._keys.buckets, now, history_len, len(outcomes)]
        for id, outcome in outcomes:
            args += [id, outcome]
        raw = await self._release(keys=self._keys.two_phase_keys, args=args)
        head, rest = _header(raw, _RELEASE_REPLY)
        return ReleaseResult(**head, refills=_refills(rest))

    async def refill(
        self, items: Sequence[RefillItem], *, history: tuple[int, int] | None = None
    ) -> list[int]:
        """REFILL: compare-and-set each item's successor; 1 applied, 2 ended, 0 stale, -1 gone.

        `history` = (history maxlen, now ms) for the records of ended schedules.
        """
        k = self._keys
        args: list[Any] = [k.buckets, k.wake, len(items)]
        for i in items:
            args += [i.key, i.ref, i.next_due, i.next_iso]
        if history is not None:
            args += list(history)
        return [int(r) for r in await self._refill(keys=k.script_keys, args=args)]

    async def compact(self, cursor: str, end: str, *, chunk: int, budget_us: int) -> str:
        """COMPACT: re-home one stretch of the stream; the next cursor ('' once the pass ended)."""
        raw = await self._compact(keys=self._keys.script_keys, args=[cursor, end, chunk, budget_us])
        return text(raw[0])


# The fixed head of each reply, slot by slot, as the script's header lists it.
_Layout = tuple[tuple[str, Callable[[Any], Any]], ...]
_FIRE_REPLY: _Layout = (
    ("fired", int),
    ("head", text),
    ("first", text),
    ("pending", int),
    ("parked", int),
    ("refill", int),
    ("entries", int),
    ("gone", int),
    ("decided", int),
)
_CLAIM_REPLY: _Layout = (
    ("head", text),
    ("pending", int),
    ("parked", int),
    ("refill", int),
    ("first", text),
    ("gone", int),
    ("decided", int),
)
_RELEASE_REPLY: _Layout = (
    ("released", int),
    ("parked", int),
    ("refill", int),
    ("fired", int),
    ("head", text),
)


def _header(raw: Sequence[Any], layout: _Layout) -> tuple[dict[str, Any], Sequence[Any]]:
    """The reply's fixed head by name, and what follows it."""
    return {name: read(raw[i]) for i, (name, read) in enumerate(layout)}, raw[len(layout) :]


def _expired(raw: Sequence[Any]) -> tuple[list[tuple[str, str]], Sequence[Any]]:
    """A count x, then x (envelope id, topic) pairs of envelopes that expired unfired; and what follows."""
    n = int(raw[0])
    return [(topic(raw[1 + 2 * i]), topic(raw[2 + 2 * i])) for i in range(n)], raw[1 + 2 * n :]


def _refills(raw: Sequence[Any]) -> list[Refill]:
    """common.lua's REFILLS quads, kept raw where they are not text: _advance guards each."""
    return [Refill(*raw[i : i + 4]) for i in range(0, len(raw) - 3, 4)]


# CLAIM's per-claim header: 12 values, then `count` (data, metadata, contentType) triples.
_CLAIM_HEADER = 12


def _claims(raw: Sequence[Any]) -> list[Claim]:
    n, pos, out = int(raw[0]), 1, []
    for _ in range(n):
        head = raw[pos : pos + _CLAIM_HEADER]
        pos += _CLAIM_HEADER
        count = int(head[11])
        try:
            c = Claim(
                id=text(head[0]),
                due=text(head[1]),
                scheduler=text(head[2]),
                schedule_next=text(head[3]),
                target=text(head[4]),
                target_pubsub=text(head[5]),
                topic=text(head[6]),
                bulk=text(head[7]) == "1",
                expires_at=int(head[8]),
                source=text(head[9]),
                trim=text(head[10]) == "1",
                entries=[],
            )
        except UnicodeDecodeError as exc:
            # Raising here, after CLAIM committed, left the claim in flight to be
            # taken over (and raise) again at every lease end: the shard stopped firing.
            pos += 3 * count
            why = f"undecodable: not UTF-8: {exc}"
            out.append(Claim(text(head[0]), text(head[1]), "", "", "", "", "", False, 0, "", False, [], why))
            continue
        for _ in range(count):
            data, md, ct = raw[pos], raw[pos + 1], raw[pos + 2]
            pos += 3
            c.entries.append(c.fields(data, md, ct))
        out.append(c)
    return out
