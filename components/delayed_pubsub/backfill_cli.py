"""`delayed-pubsub backfill ID --from T1 --to T2 [--rate N/s] [--dry-run] [--json]`.

Delivers the occurrences a pending recurring schedule would have had in [T1, T2)
(delayed_middleware.backfill says what, and what it leaves out). Run by
operate.run like every operator command: exit 0 done, 1 the ID was not found, or
the schedule was cancelled or replaced while the backfill ran (it stopped before its
next chunk; `--json`'s `stopped` says which), 2 a refused range, rate or ID (one-shot,
parked), 3 Redis unreachable or an occurrence refused by its target (left for a later run).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from rich.console import Console

from delayed_middleware import backfill as bf
from delayed_middleware.history import Retention
from delayed_middleware.instants import format_instant, parse_instant
from delayed_middleware.publish_keys import SCHEDULE_OCCURRENCE
from delayed_pubsub import operate
from delayed_pubsub.connection import Connection
from delayed_pubsub.settings import Settings
from delayed_pubsub.terminal import printable


def rate_per_second(text: str) -> float:
    """`--rate`: `N/s` or `N` occurrences per second (backfill.parse_rate), refused as argparse
    refuses an argument: `argument --rate: '<text>': <why> (e.g. 100/s)`, exit code 2."""
    try:
        return bf.parse_rate(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e} (e.g. 100/s)") from None


def register(subparsers: Any) -> None:
    """Add `backfill` to the `delayed-pubsub` parser."""
    p = subparsers.add_parser(
        "backfill",
        parents=[operate.connection_arguments()],
        help="deliver the occurrences a recurring schedule would have had in a past range",
        description=(
            "Delivers each occurrence of schedule ID with a nominal time in [--from, --to) (by its own "
            "calendar: zone, bounds, jitter) that it did not fire itself and no backfill delivered "
            f"before; a range holds at most {bf.MAX_OCCURRENCES:,} occurrences; --to must not be in the future. "
            f"Each message carries `{SCHEDULE_OCCURRENCE}` (the nominal time) and gets a `backfilled` "
            "history record. Safe to repeat or run at once: each occurrence is delivered once."
        ),
    )
    p.add_argument("id", metavar="ID", help="scheduleId (or envelope id) of a pending recurring schedule")
    p.add_argument("--from", dest="start", required=True, metavar="T1", help="RFC 3339 instant (inclusive)")
    p.add_argument("--to", dest="end", required=True, metavar="T2", help="RFC 3339 instant (exclusive)")
    p.add_argument(
        "--rate",
        type=rate_per_second,
        default=bf.DEFAULT_RATE,
        metavar="N/s",
        help=f"occurrences per second at most (default {bf.DEFAULT_RATE:g}/s)",
    )
    p.add_argument("--dry-run", action="store_true", help="list what it would deliver; change nothing")
    p.add_argument("--json", action="store_true", help="print only a JSON object of the result")
    p.set_defaults(operate=run_backfill)


def _instant(flag: str, text: str) -> int:
    try:
        return parse_instant(text)
    except ValueError as e:
        raise operate.UsageError(f"{flag} {text!r}: {e}") from None


async def run_backfill(
    connection: Connection, settings: Settings, args: argparse.Namespace, out: Console, err: Console
) -> int:
    start, end = _instant("--from", args.start), _instant("--to", args.end)
    try:
        result = await bf.backfill(
            connection.client,
            settings.consumer_id,
            args.id,
            start,
            end,
            shards=settings.shards,
            rate=args.rate,
            dry_run=args.dry_run,
            retention=Retention(settings.history_max_len, settings.history_max_age_ms),
        )
    except bf.ScheduleNotFoundError:
        raise operate.NotFound(f"{args.id} (no pending schedule has this id)") from None
    if args.json:
        print(json.dumps(result.as_json(), ensure_ascii=False))
    else:
        _print(result, out)
    # An occurrence its target refused (a key that is no stream) is left for a later run: say so.
    if result.failed:
        return operate.EXIT_REDIS
    # Stopped: the schedule it backfilled is gone (cancelled) or another one now (replaced).
    return operate.EXIT_NOT_FOUND if result.stopped else operate.EXIT_OK


def _print(result: bf.BackfillResult, out: Console) -> None:
    verb = "would deliver" if result.dry_run else "delivered"
    lines = [
        f"backfill of {result.id} to {result.destination}, "
        f"[{format_instant(result.start_ms)}, {format_instant(result.end_ms)}): "
        f"{len(result.occurrences)} occurrences",
        f"{verb} {len(result.deliver)}:",
        *(f"  {format_instant(ms)}" for ms in result.deliver),
        f"left out: {result.fired} fired by the schedule, {result.already} backfilled before, "
        f"{result.left_to_schedule} at or after its pending occurrence",
    ]
    if result.unverified:
        lines.append(
            f"{result.unverified} of them were due while the schedule existed but before its oldest "
            "history record: whether it fired them is not known (see docs/operations.md)"
        )
    if result.empty:
        lines.append(f"{result.empty} delivered nothing: its scheduleSource held no entry at their due time")
    if result.stopped:
        lines.append(f"stopped: the schedule was {result.stopped} while the backfill ran")
    for ms, why in result.failed:
        lines.append(f"failed {format_instant(ms)}: {why}")
    out.file.write("\n".join(printable(line) for line in lines) + "\n")
    out.file.flush()
