"""Trigger now, and reschedule, one pending message or schedule (scheduleTrigger, scheduleReschedule).

One Lua script (lua/timecontrol.lua), atomic against the fire step, decides:

- a one-shot, triggered or rescheduled, moves inside the due index (to now, or to
  its new due time) and the fire step delivers it there, exactly once, as it
  delivers any due message. Racing its own fire, either FIRE (or CLAIM) took it
  first and the move answers `fired`, or it waits at its new time: never both.
  A triggered one-shot leaves a `triggered` record, then the fire step's `fired`.
- a recurring schedule, triggered, delivers one extra occurrence now: the script
  returns its messages stamped as a fire stamps them (`scheduler`,
  `scheduleNext` = its pending occurrence, and OCCURRENCE_KEY = the trigger's
  time) and this part APPENDs them (lua/append.lua) under a fire marker of their
  own; the schedule's ref, index entry and pause are untouched, so its grid is.
  Rescheduling a recurring schedule is refused (`recurring`): publish it again.

Crash points: a one-shot's move is one script, nothing is left half-done. An
extra occurrence's `triggered` record is written before its APPEND: a crash
between the two leaves the record without the delivery, and the caller without
an answer (it may trigger again). Redis Cluster: an occurrence in flight (claimed,
not yet released) answers `busy`, and the caller waits for RELEASE, as a pause
does; a one-shot in flight is reported `fired` to a reschedule at once.
Known window: a cancel landing between a recurring trigger's script and its
APPEND does not stop that extra occurrence (a cancel stops claimed occurrences
only).
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Final

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

    def __init__(self, state: ShardState, sample: Sampler) -> None:
        self._state = state
        self._sample = sample

    async def trigger(self, id: str, *, reason: str = "") -> TimeResult:
        """Deliver `id` now (see the module docstring); waits while an occurrence is in flight."""
        got = await self._until_settled("trigger", id, reason, None)
        if got.status == "moved":
            self._state.wake.set()
            return TimeResult(TRIGGERED, got.topic, got.now_ms)
        if got.status == "extra" and got.claim is not None:
            failed = await self._deliver(got.claim)
            if failed:
                return TimeResult(FAILED, got.topic, got.now_ms, failed)
            return TimeResult(TRIGGERED, got.topic, got.now_ms)
        return TimeResult(got.status, got.topic)

    async def reschedule(self, id: str, due_ms: int, *, reason: str = "") -> TimeResult:
        """Move the pending one-shot `id` to `due_ms` (see the module docstring)."""
        got = await self._until_settled("reschedule", id, reason, due_ms)
        if got.status == "moved":
            self._state.wake.set()
            return TimeResult(RESCHEDULED, got.topic, due_ms)
        return TimeResult(got.status, got.topic)

    async def _until_settled(self, op: str, id: str, reason: str, due_ms: int | None) -> TimeControlReply:
        st = self._state
        deadline = asyncio.get_running_loop().time() + 2 * st.config.lease_ms / 1000 + 5
        while True:
            got = await st.scripts.timecontrol(
                op,
                id,
                reason,
                now=st.decide_at()[1],
                history_len=st.history_len,
                pubsub_name=st.pubsub_name,
                occurrence_key=OCCURRENCE_KEY,
                due_ms=due_ms,
            )
            if got.status != "busy":
                return got
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"{id!r} on {st.keys.stream}: an occurrence stayed in flight")
            await asyncio.sleep(BUSY_RETRY_S)

    async def _deliver(self, c: Claim) -> str:
        """APPEND one extra occurrence under a marker of its own; '' when written, else why not."""
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
        # Its own marker (not a fire's `<id>:<due>`): two triggers in one millisecond are two occurrences.
        marker = f"{fire_marker_prefix(c.target, st.keys.stream)}{c.id}:t{c.due}:{secrets.token_hex(4)}"
        [status] = await st.scripts.append(
            c.target,
            [AppendItem(marker, c.trim, entries)],
            marker_ttl_ms=st.config.fire_marker_ttl_ms,
            trim=("" if c.target_pubsub else mode, threshold),
        )
        return "" if status in ("ok", "dup") else status
