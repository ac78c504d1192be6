"""Operator commands `delayed-pubsub trigger ID…` and `delayed-pubsub reschedule ID --at T | --in D`.

The engine's own trigger and reschedule (delayed_middleware.engine.timecontrol),
with the component's settings, as scheduleTrigger / scheduleReschedule run them
(operate.operator_engine: on Redis Cluster the two-phase fire's keys, so an
occurrence in flight is waited for). `trigger_ids` and `reschedule_id` are the
plain functions the dashboard (and its API) call.

Exit codes as operate's: 0 done; 1 an ID was not found (nothing pending under
it, or a reschedule that came after its fire: "already fired"); 2 bad usage (a
recurring schedule cannot be rescheduled); 3 Redis unreachable or refusing.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from typing import Any, Final

from rich.console import Console

from delayed_middleware.durations import parse_go_duration
from delayed_middleware.engine import timecontrol as tc
from delayed_middleware.engine.timecontrol import TimeResult
from delayed_middleware.instants import MAX_INSTANT_MS, format_instant, parse_instant
from delayed_pubsub import operate
from delayed_pubsub.connection import Connection
from delayed_pubsub.settings import Settings

# The `reason` of the `triggered` / `rescheduled` history records the CLI writes.
TRIGGER_REASON: Final = "operator (delayed-pubsub trigger)"
RESCHEDULE_REASON: Final = "operator (delayed-pubsub reschedule)"

# What an operator reads for each outcome that did nothing.
WHY_NOT: Final = {
    tc.UNKNOWN: "not pending: unknown, already fired or cancelled",
    tc.FIRED: "already fired",
    tc.PARKED: "parked for a bad target",
    tc.EXPIRED: "its TTL ended: it will not be delivered",
    tc.RECURRING: "a recurring schedule: publish it again with its scheduleId to replace it",
}


def register(subparsers: Any) -> None:
    """Add `trigger` and `reschedule` to the `delayed-pubsub` parser."""
    common = operate.connection_arguments()
    p = subparsers.add_parser(
        "trigger",
        parents=[common],
        help="deliver pending messages now, or one extra occurrence of schedules (as scheduleTrigger)",
    )
    p.add_argument("ids", metavar="ID", nargs="+", help="scheduleIds (or a recurring envelope's id)")
    p.add_argument("--json", action="store_true", help="print only a JSON array of the outcomes")
    p.set_defaults(operate=_trigger)

    p = subparsers.add_parser(
        "reschedule",
        parents=[common],
        help="move a pending one-shot message to another time (as scheduleReschedule)",
    )
    p.add_argument("id", metavar="ID", help="the message's scheduleId")
    when = p.add_mutually_exclusive_group(required=True)
    when.add_argument("--at", metavar="RFC3339", help="the new due time, e.g. 2026-11-29T09:00:00Z")
    when.add_argument(
        "--in", dest="in_", metavar="DURATION", help="the new due time from now, e.g. 90s or 2h"
    )
    p.add_argument("--json", action="store_true", help="print only a JSON object of the outcome")
    p.set_defaults(operate=_reschedule)


async def trigger_ids(
    connection: Connection, settings: Settings, ids: Sequence[str], *, reason: str = TRIGGER_REASON
) -> list[TimeResult]:
    """Trigger each id as scheduleTrigger does; one TimeResult per id, in order."""
    engine = operate.operator_engine(connection, settings)
    return [await engine.trigger(id, reason=reason) for id in ids]


async def reschedule_id(
    connection: Connection, settings: Settings, id: str, due_ms: int, *, reason: str = RESCHEDULE_REASON
) -> TimeResult:
    """Move the pending one-shot `id` to `due_ms` as scheduleReschedule does."""
    return await operate.operator_engine(connection, settings).reschedule(id, due_ms, reason=reason)


def outcome_json(id: str, r: TimeResult) -> dict[str, Any]:
    """One outcome as --json (and the dashboard's API) prints it."""
    return {
        "id": id,
        "status": r.status,
        "done": r.done,
        "topic": r.topic or None,
        "at": format_instant(r.at_ms) if r.done else None,
        "why": None if r.done else WHY_NOT.get(r.status, r.detail or r.status),
    }


def due_from(at: str | None, in_: str | None, now_ms: int) -> int:
    """--at / --in as epoch ms; UsageError naming the flag for a bad value."""
    try:
        if at is not None:
            return parse_instant(at)
        ms = parse_go_duration(in_ or "")
    except ValueError as e:
        flag, value = ("--at", at) if at is not None else ("--in", in_)
        raise operate.UsageError(f"{flag} {value!r}: {e}") from None
    if ms < 0:
        raise operate.UsageError(f"--in {in_!r}: must not be negative")
    if now_ms + ms > MAX_INSTANT_MS:
        raise operate.UsageError(f"--in {in_!r}: ends after {format_instant(MAX_INSTANT_MS)}")
    return now_ms + ms


async def _trigger(
    connection: Connection, settings: Settings, args: argparse.Namespace, out: Console, err: Console
) -> int:
    results = await trigger_ids(connection, settings, args.ids)
    if args.json:
        print(json.dumps([outcome_json(i, r) for i, r in zip(args.ids, results, strict=True)]))
    else:
        for id, r in zip(args.ids, results, strict=True):
            if r.done:
                out.print(f"triggered {id} at {format_instant(r.at_ms)}", markup=False)
    missing = [
        f"{id} ({WHY_NOT.get(r.status, r.detail)})"
        for id, r in zip(args.ids, results, strict=True)
        if not r.done
    ]
    if missing:
        raise operate.NotFound(", ".join(missing))
    return operate.EXIT_OK


async def _reschedule(
    connection: Connection, settings: Settings, args: argparse.Namespace, out: Console, err: Console
) -> int:
    due = due_from(args.at, args.in_, int(time.time() * 1000))
    r = await reschedule_id(connection, settings, args.id, due)
    if args.json:
        print(json.dumps(outcome_json(args.id, r)))
    elif r.done:
        out.print(f"rescheduled {args.id} to {format_instant(r.at_ms)}", markup=False)
    if r.status == tc.RECURRING:
        raise operate.UsageError(f"{args.id}: {WHY_NOT[tc.RECURRING]}")
    if not r.done:
        raise operate.NotFound(f"{args.id} ({WHY_NOT.get(r.status, r.detail)})")
    return operate.EXIT_OK
