"""Trigger now, and reschedule, one pending message or schedule (scheduleTrigger, scheduleReschedule).

One Lua script (lua/timecontrol.lua), atomic against the fire step, decides:

- a one-shot, triggered or rescheduled, moves inside the due index (to now, or to
  its new due time) and the fire step delivers it there, exactly once, as it
  delivers any due message. Racing its own fire, either FIRE (or CLAIM) took it
  first and the move answers `fired`, or it waits at its new time: never both.
  A triggered one-shot leaves a `triggered` record, then the fire step's `fired`.
- a recurring schedule, triggered, delivers one extra occurrence now, stamped as
  a fire stamps them (`scheduler`, `scheduleNext` = its pending occurrence, and
  OCCURRENCE_KEY = the trigger's time). On a single node the script appends it
  itself (lua/target_append.lua, FIRE's append) with its `triggered` record: one
  atomic step, so a cancel is answered before it (nothing goes out) or after.
  On Cluster (the target is in another slot) the script returns the messages and
  this part APPENDs them (lua/append.lua) under a fire marker of their own. The
  script registers that marker beside the claims (keys.EngineKeys.triggers), where
  a cancel finds it as it finds a claimed occurrence and sets it first (engine/
  cancel.py): a cancel answered OK before the APPEND stops the extra occurrence,
  and the trigger answers `unknown`, as a trigger of the cancelled schedule would.
  The schedule's ref, index entry and pause are untouched, so its grid is.
  Rescheduling a recurring schedule is refused (`recurring`): publish it again.

Crash points: a one-shot's move, and a single node's extra occurrence, are one
script each: nothing is left half-done. On Cluster, an extra occurrence's `triggered`
record is written after its APPEND (TIMECONTROL 'record'): a crash before the APPEND
leaves only its registration, and the caller, unanswered, triggers again once; a reply
lost after the APPEND landed is sent again under the same fire marker (`dup`, and the
marker's value tells this APPEND's from a cancel's). A crash after the APPEND, before
the answer, leaves the delivery, and a caller who triggers again without a request
identity gets a second one. With one (`request`), the script registers the occurrence
under a token derived from it, and the caller records the request ('record') before it
removes that registration: a retry of the request within the token window finds the one
or the other. Recorded: `again`. Registered (the first attempt between its decision and
its record, or dead there): the script answers the same claim, at the first attempt's
trigger time, so the retry APPENDs under the same fire marker; one of the two writes, each
reads the marker, and each answers `triggered` (a marker a cancel set: `unknown`; one the
other attempt fenced past its lease: TimeoutError, as that attempt's). 'record' writes one
`triggered` record per request. A schedule published again meanwhile (another envelope)
is not that registration's: its retry is a new trigger.
A registration is removed once its APPEND is settled; one a crash or an error left blocks
nothing (a cancel sets a marker no APPEND will use) and is swept once as old as a fire
marker's lifetime (EngineConfig.fire_marker_ttl_ms): an APPEND sent in time may reach
the target's master much later (a stalled master, the client's own retries), and until
then a cancel must find it, as it finds a claim; the fire path bounds that lateness by
the same lifetime. A trigger does not send its APPEND later than one lease after its
script answered: past it, it sets its own marker instead (nothing goes out, unless a
cancel or its own first try set it first), removes its registration, and raises
TimeoutError. Redis Cluster: an occurrence in flight (claimed,
not yet released) answers `busy`, and the caller waits for RELEASE, as a pause
does; a one-shot in flight is reported `fired` to a reschedule at once.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Final

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from delayed_middleware.engine.core import ShardState

# UNKNOWN (nothing pending under that id) and PARKED (held for a bad target): as a pause says them;
# an occurrence in flight (Cluster) is waited for as a pause waits.
from delayed_middleware.engine.pause import BUSY_RETRY_S, PARKED, UNKNOWN
from delayed_middleware.engine.replies import AppendItem, Claim, TimeControlReply
from delayed_middleware.keys import fire_marker_prefix, is_delayed_topic, is_engine_key
from delayed_middleware.publish_keys import SCHEDULE_OCCURRENCE

# The metadata key a triggered occurrence carries: the trigger's time, RFC 3339 UTC
# with milliseconds (every fire stamps its occurrence's nominal time under it).
OCCURRENCE_KEY: Final = SCHEDULE_OCCURRENCE

TRIGGERED: Final = "triggered"
RESCHEDULED: Final = "rescheduled"
# Nothing pending, and its newest history record is `fired`: it already went out.
FIRED: Final = "fired"
EXPIRED: Final = "expired"
# Reschedule of a recurring schedule: refused.
RECURRING: Final = "recurring"
# An extra occurrence APPEND could not write (its target is not a stream).
FAILED: Final = "failed"

__all__ = [
    "EXPIRED",
    "FAILED",
    "FIRED",
    "OCCURRENCE_KEY",
    "PARKED",
    "RECURRING",
    "RESCHEDULED",
    "TRIGGERED",
    "UNKNOWN",
    "Sampler",
    "TimeController",
    "TimeResult",
]

log = logging.getLogger(__name__)


def _token(id: str, request: str) -> str:
    """The extra occurrence's marker token: random, or with a request derived from it (and the id),
    the same for its retries (TIMECONTROL finds the first attempt's registration by it)."""
    if not request:
        return secrets.token_hex(4)
    return hashlib.blake2b(f"{id}\n{request}".encode(), digest_size=8).hexdigest()


class _Late(TimeoutError):
    """A trigger past its lease set its own marker: its occurrence is settled, not delivered."""


# Reads a scheduleSource's latest entry as claim `c` delivers it (two_phase.TwoPhaseFire.sample).
Sampler = Callable[[str, Claim], Awaitable[list[list[str | bytes]]]]


@dataclass(frozen=True)
class TimeResult:
    """What a trigger or reschedule did: its status, the message's topic, and when (ms):
    the trigger's time, or the new due time."""

    status: str
    topic: str = ""
    at_ms: int = 0
    detail: str = ""

    @property
    def done(self) -> bool:
        return self.status in (TRIGGERED, RESCHEDULED)


class TimeController:
    """trigger and reschedule on one shard."""

    def __init__(self, state: ShardState, sample: Sampler, *, two_phase: bool) -> None:
        self._state = state
        self._sample = sample
        self._two_phase = two_phase

    async def trigger(self, id: str, *, reason: str = "", request: str = "") -> TimeResult:
        """Deliver `id` now (see the module docstring); waits while an occurrence is in flight.
        `request`: the trigger request's identity; sent again (a retry after a lost answer), it
        is answered as the first and delivers nothing more ('' = every call is a new trigger)."""
        # Two-phase path: the extra occurrence's marker token, registered by the script; a
        # request's is derived from it, so that its retry finds the first attempt's decision.
        token = _token(id, request) if self._two_phase else ""
        got = await self._until_settled("trigger", id, reason, None, request, token)
        if got.status == "again":
            return TimeResult(TRIGGERED, got.topic, got.now_ms)
        if got.status == "moved":
            self._state.wake.set()
            return TimeResult(TRIGGERED, got.topic, got.now_ms)
        if got.status == "appended":
            return TimeResult(TRIGGERED, got.topic, got.now_ms)
        if got.status == "failed":
            return TimeResult(FAILED, got.topic, got.now_ms, got.detail)
        if got.status == "extra" and got.claim is not None:
            return await self._extra(id, reason, got, got.claim, request, token)
        return TimeResult(got.status, got.topic)

    async def _extra(
        self, id: str, reason: str, got: TimeControlReply, c: Claim, request: str, token: str
    ) -> TimeResult:
        """Cluster: APPEND the extra occurrence the script decided, then its `triggered` record."""
        deadline = asyncio.get_running_loop().time() + self._state.config.lease_ms / 1000
        # An error leaves the registration (the APPEND may still land): the sweep takes it.
        try:
            failed = await self._deliver(c, token, deadline)
        except _Late:
            await self._unregister(c, token)  # its marker is set: nothing of it can go out
            raise
        # Recorded before its registration goes: a retry of this request finds one or the other
        # (a request's record that failed leaves its registration, for the retry, then the sweep).
        recorded = failed != "" or await self._record(id, reason, got.now_ms, request)
        if recorded or not request:
            await self._unregister(c, token)
        if failed is None:
            # A cancel answered before the APPEND stopped it: as a trigger after that cancel.
            log.info(
                "trigger of %r on %s stopped by a cancel before it went out", id, self._state.keys.stream
            )
            return TimeResult(UNKNOWN, got.topic)
        if failed:
            return TimeResult(FAILED, got.topic, got.now_ms, failed)
        return TimeResult(TRIGGERED, got.topic, got.now_ms)

    async def _unregister(self, c: Claim, token: str) -> None:
        """Remove the extra occurrence's registration (keys.EngineKeys.triggers), its APPEND settled;
        a failure leaves it to the script's sweep."""
        st = self._state
        try:
            await st.redis.zrem(st.keys.triggers, f"{c.id} t{c.due}:{token}")
        except (RedisError, OSError) as exc:
            log.warning("trigger on %s: its registration stays until swept: %r", st.keys.stream, exc)

    async def reschedule(self, id: str, due_ms: int, *, reason: str = "") -> TimeResult:
        """Move the pending one-shot `id` to `due_ms` (see the module docstring)."""
        got = await self._until_settled("reschedule", id, reason, due_ms)
        if got.status == "moved":
            self._state.wake.set()
            # A past time moved it to now (the script's clock).
            return TimeResult(RESCHEDULED, got.topic, max(due_ms, got.now_ms))
        return TimeResult(got.status, got.topic)

    async def _record(self, id: str, reason: str, at_ms: int, request: str) -> bool:
        """The extra occurrence's `triggered` history record, once it went out; False if not written.
        A failure here is logged, not raised: the occurrence was delivered, and an error would have
        the caller trigger again (a second delivery) for a missing record."""
        try:
            await self._script("record", id, reason, at_ms, request)
        except (RedisError, OSError) as exc:
            stream = self._state.keys.stream
            log.warning("trigger of %r on %s delivered, its history record not written: %r", id, stream, exc)
            return False
        return True

    async def _script(
        self, op: str, id: str, reason: str, due_ms: int | None, request: str = "", token: str = ""
    ) -> TimeControlReply:
        st = self._state
        return await st.scripts.timecontrol(
            op,
            id,
            reason,
            now=st.decide_at()[1],
            history_len=st.history_len,
            pubsub_name=st.pubsub_name,
            occurrence_key=OCCURRENCE_KEY,
            due_ms=due_ms,
            trim=st.trim_args(st.clock.now_ms()),
            append_here=not self._two_phase,
            request=request,
            token_window_ms=st.config.token_window_ms,
            trigger_token=token,
            # As long as a fire marker: an APPEND may land that late (see the module docstring).
            keep_trigger_ms=st.config.fire_marker_ttl_ms,
        )

    async def _until_settled(
        self, op: str, id: str, reason: str, due_ms: int | None, request: str = "", token: str = ""
    ) -> TimeControlReply:
        st = self._state
        deadline = asyncio.get_running_loop().time() + 2 * st.config.lease_ms / 1000 + 5
        while True:
            got = await self._script(op, id, reason, due_ms, request, token)
            if got.status != "busy":
                return got
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"{id!r} on {st.keys.stream}: an occurrence stayed in flight")
            await asyncio.sleep(BUSY_RETRY_S)

    async def _deliver(self, c: Claim, token: str, deadline: float) -> str | None:
        """APPEND one extra occurrence under its registered marker: '' when written, None when a
        cancel stopped it first, else why not."""
        st = self._state
        if c.bad:
            return c.bad
        if not c.target_pubsub and (is_delayed_topic(c.target) or is_engine_key(c.target)):
            return "reserved: an engine key or a delayed topic"
        entries = c.entries
        if c.source:
            # Stamped as the claim says (scheduler, scheduleNext, scheduleOccurrence = the trigger's time).
            entries = await self._sample(c.source, c)
        if not entries:
            return ""  # scheduleSource with an empty source: nothing, as at a fire
        mode, threshold = st.trim_args(st.clock.now_ms())
        # Its own marker (not a fire's `<id>:<due>`): two triggers in one millisecond are two
        # occurrences. The script registered its end, `t<due>:<token>`, for a cancel to set it.
        marker = f"{fire_marker_prefix(c.target, st.keys.stream)}{c.id}:t{c.due}:{token}"
        item = AppendItem(marker, c.trim, entries)
        trim = ("" if c.target_pubsub else mode, threshold)
        try:
            status = await self._append(c.target, item, trim, deadline)
        except (RedisConnectionError, OSError):
            # A reply lost after the write landed: sent again under the same marker, it answers
            # `dup` (the caller, answered an error, would trigger again: a second delivery).
            status = await self._append(c.target, item, trim, deadline)
        if status == "dup":
            # Set before: by this APPEND's first try (its reply lost), by the other attempt of
            # the same request (its first, or its retry), or by a cancel first.
            value = await st.redis.get(marker)
            if value in (b"late", "late"):
                raise _Late(f"a trigger on {st.keys.stream} was fenced past its lease: not delivered")
            return "" if value in (b"1", "1") else None
        return "" if status == "ok" else status

    async def _append(self, target: str, item: AppendItem, trim: tuple[str, str], deadline: float) -> str:
        """One APPEND of the extra occurrence `item`, unless its deadline passed: then its marker
        is set instead (an APPEND still on its way writes nothing), _Late if that set it."""
        st = self._state
        ttl = st.config.fire_marker_ttl_ms
        if asyncio.get_running_loop().time() > deadline:
            if await st.redis.set(item.marker, "late", nx=True, px=ttl):
                raise _Late(f"a trigger on {st.keys.stream} took over a lease to APPEND: not delivered")
            return "dup"
        [status] = await st.scripts.append(target, [item], marker_ttl_ms=ttl, trim=trim)
        return str(status)
