"""Operator commands: `delayed-pubsub pending|inspect|cancel|pause|resume|dead|retry-dead|history`.

Every command reads Redis with the component's own settings:

- `--component PATH.yaml`: our Component YAML, read as `stats` reads it
  (delayed_pubsub.component_file: `secretKeyRef` values from environment
  variables, `key: redis-password` -> `REDIS_PASSWORD`).
- or `--redis-host host:port` with `--redis-password` (or the environment
  variable DELAYED_PUBSUB_REDIS_PASSWORD, which keeps it out of `ps`).
- `--app-id`: the consumerID whose delayed topic, history and dead letters to
  read (defaults to the YAML's consumerID when that is a plain value).

Redis Cluster: the delayed topic is split into `delayShards` shard streams
(keys.shard_topics: `<consumerID>-delayed`, `<consumerID>~1-delayed`, ...).
Every command reads all of them, with the shard count the component uses: the
YAML's `redisType`/`delayShards` (16 shards by default on a cluster), or
`--redis-type cluster` and `--delay-shards N` beside `--redis-host`. With
several shards an envelope id reads `<stream id>@<shard>` (as `pending` lists
it); `inspect` and `cancel` take it, or a scheduleId, or a bare stream id that
only one shard holds.

Exit codes: 0 done; 1 an ID was not found (cancel, inspect); 2 bad usage or
configuration; 3 Redis unreachable or refusing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from rich import box
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from delayed_middleware import history as hist
from delayed_middleware import storage_format
from delayed_middleware.clock import SystemClock
from delayed_middleware.deadletters import DL_KEYS, GONE, MOVED, MoveBack, move_back
from delayed_middleware.durations import parse_go_duration
from delayed_middleware.engine import ShardedEngine
from delayed_middleware.engine import pause as pausing
from delayed_middleware.engine.pause import scan_prefix
from delayed_middleware.entry import StreamEntry, encode_entry
from delayed_middleware.errors import DelayedPubSubError, InvalidArgumentError
from delayed_middleware.inspector import DeadLetterInfo, HistoryPosition, Inspector, PendingMessage
from delayed_middleware.inspector import Progress as ProgressFn
from delayed_middleware.instants import display_instant, parse_instant
from delayed_middleware.keys import EngineKeys, consumer_id_problem, delayed_topic, is_stream_id, shard_topics
from delayed_middleware.lua_scripts import SCHEDULER
from delayed_middleware.outbox import OutboxEntry, encode_outbox_entry
from delayed_middleware.redis_errors import is_moved
from delayed_middleware.schedules import EnvelopeRecurrence, schedule_zone
from delayed_middleware.zones import local_time, zone
from delayed_pubsub.component_file import ComponentFileError, component_properties
from delayed_pubsub.connection import REDIS_ERRORS, Connection, connect
from delayed_pubsub.engines import build_engine
from delayed_pubsub.redis_flags import PASSWORD_ENV, add_redis_flags
from delayed_pubsub.settings import Settings, parse_settings
from delayed_pubsub.terminal import printable

EXIT_OK = 0
EXIT_NOT_FOUND = 1
EXIT_USAGE = 2
EXIT_REDIS = 3

DEFAULT_LIMIT = 100
# Scans longer than this many entries show a progress bar (on a terminal).
PROGRESS_FROM = 2_000


_REDIS_FAILURES: tuple[type[BaseException], ...] = (*REDIS_ERRORS, TimeoutError)


class UsageError(Exception):
    """Bad flags or configuration: exit 2 with this message."""


class NotFound(Exception):
    """Some IDs were not found: exit 1."""


# --- argument parsing -----------------------------------------------------------


def connection_arguments() -> argparse.ArgumentParser:
    """The connection flags every operator command (and `dashboard`) takes, as a parent parser."""
    common = argparse.ArgumentParser(add_help=False)
    conn = common.add_argument_group("connection (one of --component or --redis-host)")
    conn.add_argument("--component", type=Path, metavar="PATH.yaml", help="the component's YAML")
    add_redis_flags(conn)
    return common


def register(subparsers: Any) -> None:
    """Add the operator commands to the `delayed-pubsub` parser."""
    common = connection_arguments()

    p = subparsers.add_parser("pending", parents=[common], help="list pending delayed messages and schedules")
    p.add_argument("--topic", help="only messages for this target topic")
    p.add_argument("--due-before", metavar="RFC3339", help="only messages due before this instant")
    p.add_argument(
        "--limit",
        type=int,
        default=DEFAULT_LIMIT,
        help=f"earliest N by due time (default {DEFAULT_LIMIT}; 0: all)",
    )
    p.add_argument("--json", action="store_true", help="print only a JSON array of the messages")
    p.add_argument(
        "--prefix",
        metavar="P",
        help="only messages and schedules whose scheduleId starts with P (pages in stream order, see --after)",
    )
    p.add_argument(
        "--after",
        dest="page_after",
        metavar="CURSOR",
        help="page on: list in stream order from after this cursor (stderr names the next page's); with "
        "--prefix or --after nothing is held beyond one page, whatever the number pending",
    )
    p.set_defaults(operate=_pending)

    p = subparsers.add_parser("inspect", parents=[common], help="one delayed message decoded")
    p.add_argument("id", metavar="ID", help="scheduleId or envelope id")
    p.set_defaults(operate=_inspect)

    p = subparsers.add_parser("cancel", parents=[common], help="cancel pending messages (as scheduleCancel)")
    p.add_argument("ids", metavar="ID", nargs="*", help="scheduleIds or envelope ids")
    p.add_argument(
        "--prefix",
        metavar="P",
        help="cancel every pending message and schedule whose id starts with P (asks first, unless --yes)",
    )
    p.add_argument("--yes", action="store_true", help="with --prefix: do not ask for confirmation")
    p.set_defaults(operate=_cancel)

    for name, what in (("pause", "hold"), ("resume", "resume")):
        p = subparsers.add_parser(
            name,
            parents=[common],
            help=f"{what} pending schedules or messages (as schedulePause={name == 'pause'})",
        )
        p.add_argument("ids", metavar="ID", nargs="+", help="scheduleIds (or a recurring envelope's id)")
        p.set_defaults(operate=_pause if name == "pause" else _resume)

    # `dead` lists what `retry-dead` moves: one filter, so the two always select the same letters.
    dead_filter = argparse.ArgumentParser(add_help=False)
    dead_filter.add_argument("--topic", help="only dead letters that came from this topic")
    p = subparsers.add_parser("dead", parents=[common, dead_filter], help="list this app's dead letters")
    p.set_defaults(operate=_dead)

    p = subparsers.add_parser(
        "retry-dead",
        parents=[common, dead_filter],
        help="move dead letters back to their topic (every consumer group of that topic gets them)",
    )
    p.set_defaults(operate=_retry_dead)

    p = subparsers.add_parser(
        "history",
        parents=[common],
        help="lifecycle records of delayed messages, oldest first, written as they are read",
        description="Without --after/--since: the newest --limit records. With them: the first --limit "
        "records from that point on; stderr then names the --after cursor of the next page.",
    )
    p.add_argument("--id", help="only the records of this scheduleId or envelope id")
    p.add_argument(
        "--after",
        metavar="CURSOR|TIME",
        help="only records after this one: a cursor (a record's history stream id, `<id>@<shard>` with "
        "several shards, as --json's `cursor` and the paging hint name it), or a time as --since takes",
    )
    p.add_argument("--since", help="RFC3339 instant, or a Go duration back from now (e.g. 1h)")
    p.add_argument(
        "--limit",
        type=int,
        default=DEFAULT_LIMIT,
        help=f"at most N records (default {DEFAULT_LIMIT}: the newest, or the first after --after/--since;"
        " 0: all, streamed)",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print only a JSON array of the records (streamed: one record per line)",
    )
    p.set_defaults(operate=_history)


def run(args: argparse.Namespace) -> int:
    """Run the operator command `args` selected; returns the exit code."""
    out = Console(highlight=False)
    if not out.is_terminal and "COLUMNS" not in os.environ:
        # Piped into grep or a file: never cut a column to fit 80 characters.
        out = Console(highlight=False, width=1000)
    err = Console(stderr=True, highlight=False)
    try:
        _check_flags(args)
        settings = load_settings(args, os.environ)
        return asyncio.run(_with_redis(settings, args, out, err))
    except NotFound as e:
        err.print(f"delayed-pubsub {args.command}: not found: {e}", markup=False)
        return EXIT_NOT_FOUND
    except (UsageError, InvalidArgumentError) as e:
        # InvalidArgumentError: an id that names envelopes on several shards, say; the operator
        # must be precise, as with a bad flag.
        err.print(f"delayed-pubsub {args.command}: error: {e}", markup=False)
        return EXIT_USAGE
    except DelayedPubSubError as e:
        err.print(f"delayed-pubsub {args.command}: error: {e}", markup=False)
        return EXIT_REDIS
    except _REDIS_FAILURES as e:
        err.print(f"delayed-pubsub {args.command}: redis error: {_hint(e)}", markup=False)
        return EXIT_REDIS
    except BrokenPipeError:
        # The reader went away (`| head`): not an error. Point stdout at /dev/null so the
        # interpreter's final flush does not fail again on the closed pipe.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_OK


def _check_flags(args: argparse.Namespace) -> None:
    """Parse the time flags up front: a typo fails before any connection is made."""
    args.due_before_ms = None
    if getattr(args, "due_before", None) is not None:
        try:
            args.due_before_ms = parse_instant(args.due_before)
        except ValueError as e:
            raise UsageError(f"--due-before {args.due_before!r}: {e}") from None
    if getattr(args, "limit", 0) < 0:
        raise UsageError(f"--limit {args.limit}: must be 0 (all) or more")
    args.since_ms = None
    if getattr(args, "since", None):
        args.since_ms = parse_since(args.since, int(time.time() * 1000))
    if getattr(args, "after", None):
        if args.since:
            raise UsageError("give one of --after and --since")
        if not is_stream_id(args.after.rpartition("@")[0] or args.after):
            # Not a cursor: a time, read as --since reads it.
            args.since_ms = parse_since(args.after, int(time.time() * 1000), flag="--after")
            args.after = None


async def _with_redis(settings: Settings, args: argparse.Namespace, out: Console, err: Console) -> int:
    connection = connect(settings)
    try:
        await connection.ping()
        await _warn_of_more_shards(connection, settings, err)
        command: Callable[[Connection, Settings, argparse.Namespace, Console, Console], Awaitable[int]]
        command = args.operate
        return await command(connection, settings, args, out, err)
    finally:
        await connection.aclose()


async def _warn_of_more_shards(connection: Connection, settings: Settings, err: Console) -> None:
    """Say so when the app has a shard stream beyond the count we were given (wrong --delay-shards).

    The CLI reads exactly the shards the settings name; a component with more
    (delayShards, or 16 by default on a cluster) would have pending messages
    the listing silently leaves out.
    """
    beyond = shard_topics(settings.consumer_id, settings.shards + 1)[-1]
    if int(await connection.client.exists(beyond)):
        err.print(
            f"warning: {beyond} exists: the app has more than {settings.shards} shard stream(s); "
            "give the component's delayShards (--delay-shards N, or --component) to read them all",
            markup=False,
        )


def _hint(e: BaseException) -> str:
    # A cluster node answers a plain client with MOVED: the operator forgot --redis-type cluster.
    text = str(e) or "timed out"
    if is_moved(e):
        text = f"MOVED {text}: this is a Redis Cluster node; add --redis-type cluster (or use --component)"
    return text


# --- settings -------------------------------------------------------------------


def load_settings(args: argparse.Namespace, environ: Mapping[str, str]) -> Settings:
    """Settings from --component or --redis-host, with --app-id as the consumerID."""
    if (args.component is None) == (args.redis_host is None):
        raise UsageError("give exactly one of --component PATH.yaml or --redis-host HOST:PORT")
    if args.component is not None:
        try:
            props = component_properties(args.component, environ)
        except ComponentFileError as e:
            raise UsageError(str(e)) from None
    else:
        props = {"redisHost": args.redis_host}
    password = args.redis_password or environ.get(PASSWORD_ENV)
    if password:
        props["redisPassword"] = password
    if args.app_id:
        props["consumerID"] = args.app_id
    if getattr(args, "redis_type", None):
        props["redisType"] = args.redis_type
    if getattr(args, "delay_shards", None):
        props["delayShards"] = args.delay_shards
    consumer = props.get("consumerID", "")
    if not consumer:
        raise UsageError("--app-id is required (the app id / consumerID whose messages to read)")
    if "{" in consumer and not args.app_id:
        # A YAML's `{appID}`/`{namespace}` template is resolved by daprd, not here.
        raise UsageError(
            f"--app-id is required: the consumerID {consumer!r} of {args.component} is a template "
            "daprd resolves; give the app id (the resolved consumerID) whose messages to read"
        )
    problem = consumer_id_problem(consumer.strip())
    if problem is not None:
        # Such an id could read (and cancel) another app's messages: the component refuses it at
        # Init, so no app has it and nothing of it is worth reading.
        flag = "--app-id" if args.app_id else f"consumerID of {args.component}"
        raise UsageError(f"{flag} {consumer!r}: {problem}")
    try:
        return parse_settings(props)
    except DelayedPubSubError as e:
        raise UsageError(str(e)) from None


# --- output helpers ---------------------------------------------------------------


@contextmanager
def _progress(err: Console, what: str, total_hint: int) -> Iterator[ProgressFn | None]:
    """A progress bar on stderr for a long scan on a terminal; None otherwise."""
    if total_hint < PROGRESS_FROM or not err.is_terminal:
        yield None
        return
    with Progress(
        TextColumn(what),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err,
        transient=True,
    ) as bar:
        task = bar.add_task(what, total=total_hint)

        def update(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        yield update


def _inspector(connection: Connection, settings: Settings) -> Inspector:
    return Inspector(connection.client, settings.consumer_id, shards=settings.shards)


def _title(inspector: Inspector) -> str:
    """The delayed topic's name, and how many shard streams it has beside it."""
    n = len(inspector.shards)
    return inspector.keys.stream + (f" and its {n - 1} other shards" if n > 1 else "")


def _as_json(m: PendingMessage) -> dict[str, Any]:
    zone_name, local = _in_zone(m.schedule, m.due_ms)
    return {
        "id": m.id,
        "scheduleId": m.schedule_id or None,
        "topic": m.topic,
        "due": display_instant(m.due_ms),
        # A schedule in a time zone: the zone, and `due` as local time there.
        "timeZone": zone_name or None,
        "dueLocal": local or None,
        "kind": m.kind,
        "size": m.size,
        "attempts": m.attempts,
        # A hand-off (kind handoff): the pub/sub it waits to be handed to.
        "targetPubsub": m.pubsub or None,
        # schedulePause: held until resumed (since `pausedAt`); `due` is then the occurrence it was held at.
        "paused": m.paused,
        "pausedAt": display_instant(m.paused_at_ms) or None,
    }


def pending_json(m: PendingMessage) -> dict[str, Any]:
    """A pending message as `pending --json` prints it (the dashboard's JSON API answers the same)."""
    return _as_json(m)


def _since(m: PendingMessage) -> str:
    return f" since {display_instant(m.paused_at_ms)}" if m.paused else ""


def _kind(m: PendingMessage) -> str:
    return f"{m.kind} (paused)" if m.paused else m.kind


def _in_zone(schedule: str, due_ms: int) -> tuple[str, str]:
    """(zone, the due time as RFC 3339 local time there) of a zoned schedule, else ('', '')."""
    name = schedule_zone(schedule)
    if not name:
        return "", ""
    try:
        return name, local_time(due_ms, zone(name))
    except (ValueError, OSError, KeyError, OverflowError):
        # A zone this host's tzdata does not know (written by a newer one), or a jittered due past
        # year 9999 in local time (east of UTC): show the name alone.
        return name, ""


# --- commands -----------------------------------------------------------------------


async def _pending_pages(inspector: Inspector, args: argparse.Namespace, out: Console, err: Console) -> int:
    """`pending --prefix P` / `--after CURSOR`: a page in stream order, written as it is read."""
    if args.prefix == "":
        raise UsageError("--prefix '': give a prefix (or leave --prefix out)")
    limit: int = args.limit
    rows = inspector.listing(
        prefix=args.prefix or "", after=args.page_after, topic=args.topic, due_before_ms=args.due_before_ms
    )
    sep = "["
    shown, last, more = 0, "", False
    if not args.json:
        out.file.write(f"{'cursor':<24}  {'id':<24}  {'topic':<16}  {'due':<24}  {'kind':<20}  size\n")
    try:
        async for cursor, m in rows:
            if args.json:
                out.file.write(sep + json.dumps({**_as_json(m), "cursor": cursor}, ensure_ascii=False) + "\n")
                sep = ","
            else:
                cells = (cursor, m.id, m.topic, display_instant(m.due_ms), _kind(m))
                widths = (24, 24, 16, 24, 20)
                line = "  ".join(printable(c).ljust(w) for c, w in zip(cells, widths, strict=True))
                out.file.write(f"{line}  {m.size}\n")
            shown += 1
            last = cursor
            if limit and shown >= limit:
                # Stop here: finding out whether one more matches could mean reading the
                # whole rest of the delayed topic (a rare prefix). The next page may be empty.
                more = True
                break
    finally:
        await rows.aclose()
    if args.json:
        out.file.write("[]\n" if sep == "[" else "]\n")
    else:
        out.file.write(f"{shown} messages\n")
    out.file.flush()
    if more:
        err.print(f"next page: --after {last}", markup=False)
    return EXIT_OK


async def _pending(
    connection: Connection, settings: Settings, args: argparse.Namespace, out: Console, err: Console
) -> int:
    inspector = _inspector(connection, settings)
    if args.prefix is not None or args.page_after is not None:
        return await _pending_pages(inspector, args, out, err)
    with _progress(err, "scanning", await inspector.stream_length()) as progress:
        report = await inspector.pending(
            topic=args.topic, due_before_ms=args.due_before_ms, limit=args.limit or None, progress=progress
        )
    if args.json:
        print(json.dumps([_as_json(m) for m in report.messages], ensure_ascii=False))
        return EXIT_OK
    table = Table(box=box.SIMPLE, title=f"pending on {_title(inspector)}")
    zoned = any(schedule_zone(m.schedule) for m in report.messages)
    columns = ("id", "topic", "due", *(("due in zone",) if zoned else ()), "kind", "size", "attempts")
    for column in columns:
        table.add_column(column, justify="right" if column in ("size", "attempts") else "left")
    for m in report.messages:
        topic = f"{m.pubsub}/{m.topic}" if m.pubsub else m.topic
        zone_name, local = _in_zone(m.schedule, m.due_ms)
        in_zone = (f"{local} {zone_name}" if zone_name else "",) if zoned else ()
        due = display_instant(m.due_ms)
        _add_text_row(table, m.id, topic, due, *in_zone, _kind(m), str(m.size), str(m.attempts))
    out.print(table)
    counts = Table(box=box.SIMPLE, title="pending per topic")
    counts.add_column("topic")
    counts.add_column("pending", justify="right")
    for topic, n in sorted(report.counts.items()):
        _add_text_row(counts, topic, str(n))
    counts.add_row("total", str(report.matched))
    out.print(counts)
    if len(report.messages) < report.matched:
        err.print(f"showing the earliest {len(report.messages)} of {report.matched} (--limit 0 shows all)")
    if report.parked or report.undecodable:
        err.print(
            f"not listed: {report.parked} parked, {report.undecodable} undecodable "
            "(see `delayed-pubsub inspect` / the history)"
        )
    return EXIT_OK


async def _inspect(
    connection: Connection, settings: Settings, args: argparse.Namespace, out: Console, err: Console
) -> int:
    inspector = _inspector(connection, settings)
    with _progress(err, "searching", await inspector.stream_length()) as progress:
        info = await inspector.get(args.id, progress)
    if info is None:
        raise NotFound(args.id)
    m, env = info.message, info.envelope
    table = Table(box=box.SIMPLE, show_header=False)
    table.add_column("field", style="bold")
    table.add_column("value", overflow="fold")
    rows = [
        ("id", m.id),
        ("scheduleId", m.schedule_id or "-"),
        ("envelope", f"{inspector.stream_of(m)} {m.stream_id}"),
        ("state", info.state + (f" ({info.parked_reason})" if info.parked_reason else "") + _since(m)),
        ("topic", m.topic),
        ("due", display_instant(m.due_ms)),
        *_zone_rows(env.schedule, m.due_ms),
        ("kind", m.kind),
        ("published", display_instant(m.published_at_ms) if m.published_at_ms else "-"),
        ("contentType", env.content_type or "-"),
        ("size", f"{m.size} bytes" + (f" in {len(env.bulk_entries)} bulk entries" if env.is_bulk else "")),
        ("metadata", json.dumps(dict(env.metadata), ensure_ascii=False, sort_keys=True)),
        ("payload", info.preview()),
    ]
    for field, value in rows:
        table.add_row(field, value)
    out.print(table)
    if info.history:
        out.print(_history_table(info.history, title="history"))
    return EXIT_OK


def _zone_rows(schedule: str, due_ms: int) -> list[tuple[str, str]]:
    """inspect's rows for a recurring schedule: its expression, and its zone with the due time there."""
    if not schedule:
        return []
    rows = [("schedule", schedule)]
    zone_name, local = _in_zone(schedule, due_ms)
    if zone_name:
        rows += [("timeZone", zone_name), ("due in zone", local or "-")]
    return rows


# The `reason` of the `cancelled` history record the CLI's cancel writes.
CANCEL_REASON = "operator (delayed-pubsub cancel)"


async def cancel_ids(
    connection: Connection, settings: Settings, ids: Sequence[str]
) -> tuple[list[str], list[str]]:
    """Cancel each id (scheduleId or envelope id) as scheduleCancel does; returns (cancelled, not found).

    The engine's own cancel: it removes the index entry and the envelope and
    writes the `cancelled` history record in one script, in batches, with the
    component's history and marker settings. With several shards each id goes
    to the shard that holds it (ShardedEngine.cancel_many: a scheduleId's
    home shard, `<stream id>@<shard>`, or the one shard holding a bare stream id).
    """
    # The instance's own engine settings: on Cluster the two-phase fire's keys, so a cancel
    # also stops an occurrence another replica has claimed but not yet appended.
    engine = build_engine(settings, connection.client, SystemClock())
    # The history's reason tells an operator's cancel from a publisher's scheduleCancel (`Remove`).
    results = await engine.cancel_many(list(ids), reason=CANCEL_REASON)
    done = [id for id, (found, _) in zip(ids, results, strict=True) if found]
    missing = [id for id, (found, _) in zip(ids, results, strict=True) if not found]
    return done, missing


async def _cancel(
    connection: Connection, settings: Settings, args: argparse.Namespace, out: Console, err: Console
) -> int:
    if args.prefix is not None:
        return await _cancel_prefix(connection, settings, args, out, err)
    if not args.ids:
        raise UsageError("give the IDs to cancel, or --prefix P")
    done, missing = await cancel_ids(connection, settings, args.ids)
    for id in done:
        out.print(f"cancelled {id}", markup=False)
    if missing:
        raise NotFound(", ".join(missing) + " (not pending: unknown, already fired or cancelled)")
    return EXIT_OK


def operator_engine(connection: Connection, settings: Settings) -> ShardedEngine:
    """The component's engine over every shard, for pause, resume and a prefix cancel: with its
    history and marker settings, its recurrence (a resume computes the next fire) and, on Redis
    Cluster, the two-phase fire's keys (a pause waits for an occurrence in flight)."""
    return build_engine(settings, connection.client, SystemClock(), recurrence=EnvelopeRecurrence())


async def count_prefix(engine: ShardedEngine, prefix: str) -> int:
    """How many pending messages and schedules a prefix cancel would cancel now (every shard)."""
    matching = 0
    for e in engine.engines:
        async for keys in scan_prefix(e.redis, e.keys.ids, prefix):
            matching += len(keys)
    return matching


async def _cancel_prefix(
    connection: Connection, settings: Settings, args: argparse.Namespace, out: Console, err: Console
) -> int:
    prefix: str = args.prefix
    if args.ids:
        raise UsageError("give IDs or --prefix, not both")
    if not prefix:
        raise UsageError(
            "--prefix '': an empty prefix would cancel every pending message and schedule; give a prefix"
        )
    engine = operator_engine(connection, settings)
    if not args.yes:
        matching = await count_prefix(engine, prefix)
        question = (
            f"cancel the {matching} pending messages and schedules of {settings.consumer_id} "
            f"whose id starts with {prefix!r}?"
        )
        if not sys.stdin.isatty():
            raise UsageError(f"{question} Not a terminal: confirm with --yes")
        answer = await asyncio.to_thread(input, f"{question} [y/N] ")
        if answer.strip().lower() not in ("y", "yes"):
            err.print("nothing cancelled", markup=False)
            return EXIT_OK
    cancelled = await engine.cancel_prefix(prefix, reason=CANCEL_REASON)
    out.print(f"cancelled {cancelled} whose id starts with {prefix!r}", markup=False)
    return EXIT_OK


# The `reason` of the `paused` / `resumed` history records the CLI writes.
PAUSE_REASON = "operator (delayed-pubsub pause)"
RESUME_REASON = "operator (delayed-pubsub resume)"


async def _pause(
    connection: Connection, settings: Settings, args: argparse.Namespace, out: Console, err: Console
) -> int:
    return await _set_paused(connection, settings, args.ids, True, out)


async def _resume(
    connection: Connection, settings: Settings, args: argparse.Namespace, out: Console, err: Console
) -> int:
    return await _set_paused(connection, settings, args.ids, False, out)


async def refuse_pause_in_rollback_window(connection: Connection, engine: ShardedEngine, what: str) -> None:
    """FailedPreconditionError while the app's data is kept in an older storage format: a paused
    message is format 2, so below it a pause is refused as a publish would be."""
    fmt = await storage_format.stored_format(connection.client, [e.keys for e in engine.engines])
    if fmt is not None and fmt < storage_format.PAUSE:
        raise storage_format.pinned_refusal(fmt, what, storage_format.PAUSE)


async def _set_paused(
    connection: Connection, settings: Settings, ids: Sequence[str], pause: bool, out: Console
) -> int:
    engine = operator_engine(connection, settings)
    if pause:
        await refuse_pause_in_rollback_window(connection, engine, "delayed-pubsub pause")
    missing = []
    for id in ids:
        result = await engine.set_paused(id, pause=pause, reason=PAUSE_REASON if pause else RESUME_REASON)
        if result.status in (pausing.PAUSED, pausing.RESUMED):
            out.print(f"{result.status} {id}", markup=False)
        elif result.status == pausing.ENDED:
            out.print(f"{id}: its schedule has no fire left after now; cancelled", markup=False)
        elif result.status == pausing.ALREADY:
            out.print(f"{id}: {'paused' if pause else 'running'} already", markup=False)
        else:
            missing.append(id)
    if missing:
        raise NotFound(", ".join(missing) + " (not pending: unknown, already fired, cancelled or parked)")
    return EXIT_OK


async def _dead(
    connection: Connection, settings: Settings, args: argparse.Namespace, out: Console, err: Console
) -> int:
    letters = await _inspector(connection, settings).dead_letters(source_topic=args.topic)
    table = Table(box=box.SIMPLE, title=f"dead letters of {settings.consumer_id}")
    for column in ("dead-letter topic", "id", "from topic", "attempts", "at", "size", "reason"):
        table.add_column(column, overflow="fold")
    for d in letters:
        _add_text_row(
            table,
            d.dead_letter_topic,
            d.stream_id,
            # A hand-off's: the pub/sub and topic it was bound for.
            f"{d.target_pubsub}/{d.source_topic}" if d.target_pubsub else d.source_topic,
            str(d.attempts),
            display_instant(d.at_ms),
            str(d.size),
            d.reason,
        )
    out.print(table)
    out.print(f"{len(letters)} dead letters")
    return EXIT_OK


async def _retry_dead(
    connection: Connection, settings: Settings, args: argparse.Namespace, out: Console, err: Console
) -> int:
    letters = await _inspector(connection, settings).dead_letters(source_topic=args.topic)
    moved = 0
    for d, status, where in await retry_dead_letters(connection.client, settings, letters):
        if status == NO_SOURCE:
            err.print(
                f"skipping {d.stream_id} on {d.dead_letter_topic}: no source topic recorded", markup=False
            )
        elif status == GONE:
            err.print(
                f"skipping {d.stream_id} on {d.dead_letter_topic}: moved back or deleted by someone else",
                markup=False,
            )
        elif status != MOVED:
            err.print(f"left {d.stream_id} on {d.dead_letter_topic}: {where}: {status}", markup=False)
        else:
            moved += 1
            out.print(f"moved {d.stream_id} from {d.dead_letter_topic} back to {where}", markup=False)
    out.print(f"{moved} dead letters moved back")
    return EXIT_OK


# A dead letter that records no source topic is left where it is.
NO_SOURCE = "no-source"


async def retry_dead_letters(
    client: Any, settings: Settings, letters: Sequence[DeadLetterInfo]
) -> list[tuple[DeadLetterInfo, str, str]]:
    """Move dead letters back to their topic (a hand-off's: to the outbox), each exactly once
    however many operators retry them at once (deadletters.move_back). For each letter: its
    status (MOVED, GONE: someone else moved or deleted it, NO_SOURCE, or the error that kept
    its destination from taking it) and where it goes."""
    # A hand-off goes back into the outbox (shard 0's): the forwarder hands it off again.
    outbox = EngineKeys.for_topic(delayed_topic(settings.consumer_id)).outbox
    plans: list[tuple[DeadLetterInfo, str]] = []
    moves: list[MoveBack] = []
    for d in letters:
        if not d.source_topic:
            continue
        metadata = {k: v for k, v in d.entry.metadata.items() if k not in DL_KEYS}
        if d.target_pubsub:
            again = OutboxEntry(
                pubsub=d.target_pubsub,
                topic=d.source_topic,
                data=d.entry.data,
                # The history names it as before: by its scheduleId (`scheduler`), if it had one.
                id=metadata.get(SCHEDULER, ""),
                metadata=metadata,
                content_type=d.entry.content_type,
                expires_at_ms=d.entry.expires_at_ms,
            )
            key, fields = outbox, encode_outbox_entry(again)
            where = f"the outbox for {d.target_pubsub}/{d.source_topic}"
        else:
            back = StreamEntry(d.entry.data, metadata, d.entry.content_type, d.entry.expires_at_ms)
            key, fields, where = d.source_topic, encode_entry(back), d.source_topic
        plans.append((d, where))
        moves.append(MoveBack(d.dead_letter_topic, d.stream_id, key, fields))
    statuses = await move_back(client, settings.consumer_id, moves, cluster=settings.redis_type == "cluster")
    done = {id(d): (status, where) for (d, where), status in zip(plans, statuses, strict=True)}
    return [(d, *done.get(id(d), (NO_SOURCE, ""))) for d in letters]


def _add_text_row(table: Table, *cells: str) -> None:
    """A row shown as written: Text, not markup (a reason such as "[link=…]"), and escape
    sequences escaped (topics, ids and reasons are other people's text)."""
    table.add_row(*(Text(printable(c)) for c in cells))


def _history_table(records: Sequence[hist.HistoryRecord], title: str) -> Table:
    table = Table(box=box.SIMPLE, title=title)
    for column in ("at", "event", "id", "topic", "kind", "due", "attempt", "reason"):
        table.add_column(column, overflow="fold")
    for r in records:
        at, due = display_instant(r.at_ms), display_instant(r.due_ms)
        _add_text_row(table, at, r.event, r.id, r.topic, r.kind, due, str(r.attempt), r.reason)
    return table


async def _history(
    connection: Connection, settings: Settings, args: argparse.Namespace, out: Console, err: Console
) -> int:
    inspector = _inspector(connection, settings)
    shards = len(inspector.shards)
    after = None
    if args.after is not None:
        after = HistoryPosition.parse(args.after, shards)
        if after is None:
            raise UsageError(f"--after {args.after!r}: no such shard (the app has {shards})")
    limit: int = args.limit
    write = _JsonRows(out.file) if args.json else _TextRows(out.file)
    shown = 0
    last: HistoryPosition | None = None
    more = False
    if after is None and args.since_ms is None and limit > 0:
        # The newest `limit`, as `tail` shows a log: one more read tells whether older ones exist.
        newest = await inspector.history_newest(limit + 1, id=args.id)
        more = len(newest) > limit
        for position, record in newest[-limit:]:
            write.row(position.text(shards), record)
            shown += 1
        write.close(shown)
        if more:
            err.print(
                f"showing the newest {shown} records; older ones: --limit 0 (all) or --after CURSOR|TIME",
                markup=False,
            )
        return EXIT_OK
    records = inspector.history_forward(id=args.id, after=after, since_ms=args.since_ms)
    try:
        async for position, record in records:
            if limit and shown >= limit:
                more = True
                break
            write.row(position.text(shards), record)
            shown += 1
            last = position
    finally:
        await records.aclose()
    write.close(shown)
    if more and last is not None:
        err.print(f"more records follow: --after {last.text(shards)}", markup=False)
    return EXIT_OK


# The streamed table's columns and their widths (a longer value widens its row, never cut).
_HISTORY_COLUMNS = (
    ("cursor", 17),
    ("at", 24),
    ("event", 12),
    ("id", 24),
    ("topic", 16),
    ("kind", 9),
    ("due", 24),
    ("attempt", 7),
    ("reason", 0),
)


class _TextRows:
    """History rows as aligned text, written as they come (a table needs every row first)."""

    def __init__(self, file: IO[str]) -> None:
        self._file = file
        self._line([name for name, _ in _HISTORY_COLUMNS])

    def _line(self, values: Sequence[str]) -> None:
        cells = [printable(v).ljust(width) for v, (_, width) in zip(values, _HISTORY_COLUMNS, strict=True)]
        self._file.write("  ".join(cells).rstrip() + "\n")

    def row(self, cursor: str, r: hist.HistoryRecord) -> None:
        at, due = display_instant(r.at_ms), display_instant(r.due_ms)
        self._line([cursor, at, r.event, r.id, r.topic, r.kind, due, str(r.attempt), r.reason])

    def close(self, shown: int) -> None:
        self._file.write(f"{shown} records\n")
        self._file.flush()


class _JsonRows:
    """History rows as one JSON array, an element per line, written as they come."""

    def __init__(self, file: IO[str]) -> None:
        self._file = file
        self._sep = "["

    def row(self, cursor: str, r: hist.HistoryRecord) -> None:
        self._file.write(self._sep + json.dumps(history_json(cursor, r), ensure_ascii=False) + "\n")
        self._sep = ","

    def close(self, shown: int) -> None:
        self._file.write("[]\n" if self._sep == "[" else "]\n")
        self._file.flush()


def history_json(cursor: str, r: hist.HistoryRecord) -> dict[str, Any]:
    """A history record as `history --json` prints it: times as RFC3339, absent numbers as null."""
    return {
        "cursor": cursor,
        "at": display_instant(r.at_ms),
        "event": r.event,
        "id": r.id,
        "scheduleId": r.schedule_id or None,
        "topic": r.topic,
        "kind": r.kind,
        "due": display_instant(r.due_ms) or None,
        "lateMs": r.lateness_ms,
        "size": r.size_bytes,
        "attempt": r.attempt,
        "reason": r.reason,
        "schedule": r.schedule or None,
        # A fire's occurrence when it is not `due` (jittered, paced); null: `due` is its own.
        "occurrence": display_instant(r.occurrence_ms) or None,
    }


def parse_since(text: str, now_ms: int, flag: str = "--since") -> int:
    """An RFC3339 instant, or a Go duration back from `now_ms`."""
    try:
        return parse_instant(text)
    except ValueError:
        pass
    try:
        return now_ms - parse_go_duration(text)
    except ValueError:
        what = "a history cursor (e.g. 1764167453000-0), " if flag == "--after" else ""
        raise UsageError(
            f"{flag} {text!r}: neither {what}an RFC3339 instant nor a Go duration (e.g. 1h)"
        ) from None
