"""Catch-up: which of a recurring schedule's missed occurrences fire, and when (scheduleCatchup).

An occurrence is *missed* when nothing fired it before its successor's nominal
time passed too (the component or Redis was down across at least one whole
interval): the fire script then leaves it to REFILL (lua/common.lua's
recurring_step), which applies the schedule's policy through `plan_wait`. An
occurrence that is merely late (its successor still ahead) fires, under every policy.

- `one` (the default): one delivery for everything missed -- the oldest missed
  occurrence within the window -- then the schedule goes on from now.
- `all`: every missed occurrence within the window is delivered once, in
  order, each with its own nominal time (scheduleOccurrence), paced at one per
  CATCHUP_PACE_MS per schedule (`plan_advance` spaces each successor), so a month
  of missed `@every 1s` neither floods a subscriber nor holds Redis.
- `none`: every missed occurrence is skipped; the next one after now fires.

Missed occurrences older than the window (scheduleCatchupWindow, default 24h)
are skipped under `one` and `all`. Whatever is skipped is counted and recorded in
the history (event `skipped`, its reason naming the policy or the window, the count
and the span). What is missed while *paused* is not this module's: a pause is a
decision to skip, and resume goes on from the next occurrence (engine/pause.py).

Pure: the caller passes the schedule's occurrences (schedules.Occurrences) and now.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from delayed_middleware.instants import format_instant
from delayed_middleware.kinds import DEFAULT_CATCHUP_WINDOW_MS, Catchup
from delayed_middleware.schedules import Occurrences

# The pace of a catch-up `all`: one missed occurrence every CATCHUP_PACE_MS per schedule (20 a
# second: at least the 10 a second promised, with room for a late fire loop). 4,320 missed
# occurrences (3 days of a 1-minute schedule) take 3.6 minutes.
CATCHUP_PACE_MS: Final = 50
# Skipped occurrences of a cron are counted by stepping through them, at most this many, and for
# at most COUNT_BUDGET_S (a REFILL plans in the engine's event loop: ~80 us a cron step, so 100,000
# steps, a per-second cron down for 28 hours, held it ~8 s). Beyond either the record says "N+".
COUNT_LIMIT: Final = 100_000
COUNT_BUDGET_S: Final = 0.02

Occurrence = tuple[int, int]  # (nominal ms, due ms)


@dataclass(frozen=True)
class Skip:
    """What a plan skips: how many occurrences (at least, unless `complete`), from which nominal time."""

    count: int
    first_ms: int
    last_before_ms: int
    reason: str  # "CatchupNone" | "CatchupWindow"
    complete: bool = True

    def describe(self) -> str:
        """The history record's reason: the policy or window, the count, the nominal span."""
        more = "" if self.complete else "+"
        return (
            f"{self.reason}: {self.count}{more} missed occurrences from {format_instant(self.first_ms)} "
            f"to before {format_instant(self.last_before_ms)}"
        )


@dataclass(frozen=True)
class Plan:
    """A REFILL of one waiting or advanced envelope: where its current occurrence fires and what follows.

    current: the (nominal, due) the envelope fires next, or None to leave it where it is;
    following: the occurrence after it, or None when it is the schedule's last;
    skip: what was skipped (None: nothing).
    """

    current: Occurrence | None
    following: Occurrence | None
    skip: Skip | None = None


def _skip(occ: Occurrences, first_ms: int, before_ms: int, reason: str) -> Skip:
    """The occurrences with nominal times in [first_ms, before_ms), skipped for `reason`, counted."""
    count, complete = occ.count(first_ms, before_ms, COUNT_LIMIT, COUNT_BUDGET_S)
    return Skip(count, first_ms, before_ms, reason, complete)


def window_of(window_ms: int) -> int:
    """The catch-up window of an envelope (0 = the default)."""
    return window_ms if window_ms > 0 else DEFAULT_CATCHUP_WINDOW_MS


def paced(nxt: Occurrence | None, current_due: int, now: int) -> Occurrence | None:
    """The successor of an occurrence due at `current_due`, spaced CATCHUP_PACE_MS after it (or after
    now) when it is missed itself or would not come after the current one."""
    if nxt is None:
        return None
    nominal, due = nxt
    if nominal <= now or due <= current_due:
        due = max(due, max(current_due, now) + CATCHUP_PACE_MS)
    return nominal, due


def plan_advance(occ: Occurrences, policy: int, window_ms: int, current: Occurrence, now: int) -> Plan:
    """The successor of the occurrence a fire step just advanced an envelope to (`current`)."""
    nominal, due = current
    if policy != Catchup.ALL:
        return Plan(None, occ.due_after(max(due, now)))
    nxt = occ.nominal_after(nominal)
    floor = now - window_of(window_ms)
    skip: Skip | None = None
    if nxt is not None and nxt[0] < floor:
        # Older than the window by now (a catch-up that outlives its window): skipped.
        later = occ.nominal_after(floor - 1)
        before = later[0] if later is not None else floor
        skip = _skip(occ, nxt[0], before, "CatchupWindow")
        nxt = later
    return Plan(None, paced(nxt, due, now), skip)


def plan_wait(occ: Occurrences, policy: int, window_ms: int, current: Occurrence, now: int) -> Plan | None:
    """The plan of an envelope whose occurrence `current` is due but whose successor was unknown or
    passed (recurring_step's 'wait'). None: nothing is left to fire (the schedule ends)."""
    nominal, due = current
    succ = occ.nominal_after(nominal)
    if succ is None or succ[0] > now:
        # Not missed: late at most. It fires; its successor follows as always.
        nxt = paced(succ, due, now) if policy == Catchup.ALL else occ.due_after(max(due, now))
        return Plan(None, nxt)
    if policy == Catchup.NONE:
        first = occ.nominal_after(now)
        skipped = _skip(occ, nominal, now + 1, "CatchupNone")
        if first is None:
            return None
        return Plan(first, occ.nominal_after(first[0]), skipped)
    floor = now - window_of(window_ms)
    start: Occurrence = current
    skip: Skip | None = None
    if nominal < floor:
        later = occ.nominal_after(floor - 1)
        before = later[0] if later is not None and later[0] <= now else now + 1
        skip = _skip(occ, nominal, before, "CatchupWindow")
        if later is None:
            return None
        start = later
    moved = start if start != current else None
    at = start[1] if moved is not None else due
    if start[0] > now:
        # Every missed occurrence was older than the window: the next one fires, on time.
        return Plan(moved, occ.nominal_after(start[0]), skip)
    if policy == Catchup.ALL:
        return Plan(moved, paced(occ.nominal_after(start[0]), at, now), skip)
    return Plan(moved, occ.due_after(max(at, now)), skip)
