"""What the engine's scripts take and answer: the typed arguments and results of engine/script_calls.py.

The `read_*` functions read a script's raw reply into its result, slot by
slot as the script's header (lua/*.lua) lists them.

A reply whose text fields are not UTF-8 (a hand-written envelope's topic)
must not raise here, after the script's writes: `topic()` turns those into ''
(no marker), and CLAIM's reader turns an undecodable claim into one that
RELEASE parks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from delayed_middleware.aio import text


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
    # The envelope's catch-up policy and window ms (DelayedMessage fields 19, 20).
    catchup: object = 0
    catchup_window: object = 0


class ScheduleItem(NamedTuple):
    """One envelope for SCHEDULE: its ARGV group of 9, in the script's order.

    A tuple, not a dataclass: one is made for every delayed publish, and the
    script call appends it to its arguments as it is (no field read one by one).
    """

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
    # The scheduleOccurrence its messages carry ('' for a subscriber retry: its entries keep their own).
    schedule_occurrence: str
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
class RecoverResult:
    """What one RECOVER call did (lua/recover.lua)."""

    # The last stream id walked, '' once the sweep reached its end.
    cursor: str
    # Envelopes put back in the due index, and copies of cancelled or replaced messages deleted.
    recovered: int
    dropped: int


@dataclass(frozen=True)
class PauseReply:
    """PAUSE's reply: its status ('paused', 'resumed', 'unknown', 'parked', 'already', 'busy',
    'stale'; see lua/pause.lua) and the message's topic ('' when none was named)."""

    status: str
    topic: str = ""


@dataclass(frozen=True)
class TimeControlReply:
    """TIMECONTROL's reply (lua/timecontrol.lua): its status, the message's topic, the time it
    decided at (ms), and with 'extra' the claim record of the extra occurrence to APPEND;
    with 'failed', why it was not delivered."""

    status: str
    topic: str
    now_ms: int
    claim: Claim | None = None
    detail: str = ""


@dataclass(frozen=True)
class RefillItem:
    """One REFILL compare-and-set: the ids-hash key, the ref read, the next due ms (or purge/end) and its text;
    a catch-up's changes besides (lua/refill.lua's ARGV group; '-' and '' change nothing)."""

    key: str
    ref: str
    next_due: str
    next_iso: str
    current_due: str = "-"
    current_nominal: str = "-"
    next_nominal: str = "-"
    skipped_from: str = ""
    skipped_why: str = ""


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
    """common.lua's REFILLS sextets, kept raw where they are not text: Refiller.advance guards each."""
    return [Refill(*raw[i : i + 6]) for i in range(0, len(raw) - 5, 6)]


# CLAIM's per-claim header: 13 values, then `count` (data, metadata, contentType) triples.
_CLAIM_HEADER = 13


def _claims(raw: Sequence[Any]) -> list[Claim]:
    n, pos, out = int(raw[0]), 1, []
    for _ in range(n):
        head = raw[pos : pos + _CLAIM_HEADER]
        pos += _CLAIM_HEADER
        count = int(head[12])
        try:
            c = Claim(
                id=text(head[0]),
                due=text(head[1]),
                scheduler=text(head[2]),
                schedule_next=text(head[3]),
                schedule_occurrence=text(head[4]),
                target=text(head[5]),
                target_pubsub=text(head[6]),
                topic=text(head[7]),
                bulk=text(head[8]) == "1",
                expires_at=int(head[9]),
                source=text(head[10]),
                trim=text(head[11]) == "1",
                entries=[],
            )
        except UnicodeDecodeError as exc:
            # Raising here, after CLAIM committed, left the claim in flight to be
            # taken over (and raise) again at every lease end: the shard stopped firing.
            pos += 3 * count
            why = f"undecodable: not UTF-8: {exc}"
            out.append(
                Claim(text(head[0]), text(head[1]), "", "", "", "", "", "", False, 0, "", False, [], why)
            )
            continue
        for _ in range(count):
            data, md, ct = raw[pos], raw[pos + 1], raw[pos + 2]
            pos += 3
            c.entries.append(c.fields(data, md, ct))
        out.append(c)
    return out


def read_fire(raw: Sequence[Any]) -> FireResult:
    """FIRE's reply: its fixed head, the expired pairs, then the refill quads."""
    head, rest = _header(raw, _FIRE_REPLY)
    expired, rest = _expired(rest)
    return FireResult(**head, expired=expired, refills=_refills(rest))


def read_claim(raw: Sequence[Any]) -> ClaimResult:
    """CLAIM's reply: its fixed head, the expired pairs, then one record per claim."""
    head, rest = _header(raw, _CLAIM_REPLY)
    expired, rest = _expired(rest)
    return ClaimResult(**head, expired=expired, claims=_claims(rest))


def read_release(raw: Sequence[Any]) -> ReleaseResult:
    """RELEASE's reply: its fixed head, then the refill quads."""
    head, rest = _header(raw, _RELEASE_REPLY)
    return ReleaseResult(**head, refills=_refills(rest))


def read_pause(raw: Sequence[Any]) -> PauseReply:
    """PAUSE's reply: {status, topic}."""
    return PauseReply(text(raw[0]), text(raw[1]) if len(raw) > 1 else "")


def read_timecontrol(raw: Sequence[Any]) -> TimeControlReply:
    """TIMECONTROL's reply: {status, topic, now}, then with 'extra' one claim record."""
    status, now = text(raw[0]), int(raw[2])
    claim = _claims([1, *raw[3:]])[0] if status == "extra" else None
    detail = text(raw[3]) if status == "failed" else ""
    return TimeControlReply(status, topic(raw[1]), now, claim, detail)
