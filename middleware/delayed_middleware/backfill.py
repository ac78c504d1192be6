"""Backfill: deliver the occurrences a recurring schedule would have had in a past range.

`delayed-pubsub backfill ID --from T1 --to T2`, the dashboard's backfill action and
the JSON API call `backfill()`. What it delivers, per occurrence of the schedule's
own calendar (its zone, bounds and jitter: schedules.occurrences) whose nominal
time is in [T1, T2):

- the message the fire would have delivered: the schedule's body (every entry
  of a bulk one), or with `scheduleSource` the source topic's latest entry at
  the occurrence's due time (nothing when the source held none then, as a fire
  of an empty source delivers nothing);
- to the schedule's topic, or with `targetPubsub` into its shard's outbox (the
  forwarder hands it off, as after a fire);
- with the metadata a fire stamps (the user's keys, `scheduler`, `scheduleNext`:
  the occurrence after it, as the fire would have named it) and
  `scheduleOccurrence`: the occurrence's nominal time (RFC 3339 UTC, ms);
- and one `backfilled` history record each (`due` = the nominal time).

What it leaves out:
- occurrences the schedule fired itself: its `fired` history records name the
  occurrence (`occ`, written when a fire's due time is not the nominal one:
  jitter, a paced catch-up), else their due time is the occurrence's window (a
  record of a release before `occ`: its due time may be jittered). The history is read as far as it reaches: an
  occurrence due after the schedule was accepted but before the history's
  oldest record may have been fired with its record trimmed since; it is
  delivered, and counted as `unverified` (the dry run shows how many);
- occurrences at or after the schedule's pending one (it fires those itself,
  or skips them as missed: a later backfill then finds them);
- occurrences after now (a jittered due time not yet reached);
- occurrences a backfill delivered before (the record below);
- with `scheduleSource`, occurrences whose source held nothing at their due
  time (or was trimmed since): counted as `empty`, not recorded (EMPTY).

A backfill stops before its next chunk when the schedule was cancelled or
replaced since it began (`stopped`): a chunk already sent still goes out.

Exactly once across backfills: each occurrence enters a per-schedule record
(keys.backfill_record: a sorted set of nominal times in the target's slot) in
the same Lua step as its XADDs (lua/backfill.lua), so the same range twice, two
overlapping ranges, or five operators at once deliver it once. The record
expires RECORD_RETENTION_MS after the schedule's last backfill: a backfill of
the same range that much later delivers again. The `backfilled` history records
go in a second step (a MULTI on the shard's history): a crash between the two
loses history records, never a delivery or its record.

Bounds (refused with BackfillRefusedError, naming the flag): T1 not before T2,
T2 after now, more than MAX_OCCURRENCES occurrences in the range.
"""

from __future__ import annotations

import asyncio
import bisect
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Final

from delayed_middleware import history as hist
from delayed_middleware.clock import Clock, SystemClock
from delayed_middleware.engine.refill import ref_nominal
from delayed_middleware.entry import StreamEntry, decode_metadata, encode_entry
from delayed_middleware.envelope import Envelope
from delayed_middleware.errors import DelayedPubSubError, InvalidArgumentError, echo
from delayed_middleware.inspection import AnyRedis, MessageInfo, shown
from delayed_middleware.inspector import Inspector
from delayed_middleware.instants import format_instant
from delayed_middleware.keys import backfill_record
from delayed_middleware.lua_scripts import SCHEDULE_NEXT, SCHEDULER, load
from delayed_middleware.outbox import OutboxEntry, encode_outbox_entry
from delayed_middleware.publish_keys import SCHEDULE_OCCURRENCE
from delayed_middleware.redis_errors import is_wrong_type
from delayed_middleware.schedules import Schedule, occurrences, parse_stored_schedule, schedule_next_value

BACKFILL: Final = load("backfill.lua")

# The `reason` of those records.
REASON: Final = "backfill"

# The most occurrences one backfill delivers: a longer range is refused (split it).
MAX_OCCURRENCES: Final = 10_000
# Occurrences per second when no rate is given.
DEFAULT_RATE: Final = 100.0
# How long the record of a schedule's backfilled occurrences outlives its last backfill.
RECORD_RETENTION_MS: Final = 30 * 86_400_000
# One script call's chunk: at most this many occurrences, and about this many argument bytes
# and XADDs (a bulk schedule's occurrence is one per entry; an occurrence bigger than that goes
# alone), so one call holds Redis ~ms.
CHUNK_OCCURRENCES: Final = 64
CHUNK_BYTES: Final = 256 * 1024
CHUNK_ENTRIES: Final = 512
# Records per call when the schedule's history is read.
HISTORY_PAGE: Final = 100

# lua/backfill.lua's statuses besides an error text.
OK: Final = "ok"
DUP: Final = "dup"
# Not a script status: an occurrence whose `scheduleSource` held nothing at its due time (or was
# trimmed since) delivers nothing, as its fire would have. Not recorded: a later backfill looks
# again (and finds the same: entries added since have later ids), so it is never counted as
# backfilled before, and writes no `backfilled` record.
EMPTY: Final = "empty"
# Why a backfill stopped before the end (BackfillResult.stopped): the schedule's ids ref no longer
# names the envelope it started with, checked before each chunk.
CANCELLED: Final = "cancelled"
REPLACED: Final = "replaced"

_MAX_SEQ: Final = "18446744073709551615"


class ScheduleNotFoundError(DelayedPubSubError):
    """No pending schedule or message has this id."""


class BackfillRefusedError(InvalidArgumentError):
    """A backfill refused as asked (a bad range or rate, an ID that is no pending recurring
    schedule): names the flag (`--from`, `--to`, `--rate`, `ID`) and its value. An
    InvalidArgumentError, so it maps to exit code 2 and to a 400 / INVALID_ARGUMENT."""

    def __str__(self) -> str:
        return f"{self.key} {echo(self.value)}: {self.reason}"


@dataclass(frozen=True)
class Occurrence:
    """One occurrence of a schedule: its nominal time (identity), when it was due (jittered), and
    the due time and nominal time of the one after it (None: it was the last)."""

    nominal_ms: int
    due_ms: int
    next_ms: int | None
    next_nominal_ms: int | None = None


@dataclass(frozen=True)
class BackfillResult:
    """What a backfill delivered, or (dry run) would deliver.

    occurrences: nominal times (epoch ms) of every occurrence in the range up to now.
    deliver: those it delivers (dry run: would deliver), after leaving out the
        ones fired by the schedule, left to it, and backfilled before.
    delivered: how many of `deliver` went out by this call (0 on a dry run).
    already: backfilled before (or by a backfill running at the same time).
    fired: fired by the schedule itself (its history says so).
    left_to_schedule: at or after the schedule's pending occurrence.
    unverified: in `deliver`, due after the schedule's acceptance but before the
        history's oldest record: whether the schedule fired them is unknown.
    failed: (nominal ms, why) of occurrences the target refused (not recorded).
    empty: occurrences of a `scheduleSource` schedule whose source held nothing at their due
        time: nothing delivered, nothing recorded (a dry run does not read the source).
    stopped: '' when it ran to the end; `cancelled` or `replaced` when the schedule was while it
        ran (checked before each chunk: the chunk in flight then still goes out).
    """

    id: str
    topic: str
    target_pubsub: str
    start_ms: int
    end_ms: int
    dry_run: bool
    occurrences: tuple[int, ...]
    deliver: tuple[int, ...]
    delivered: int = 0
    already: int = 0
    fired: int = 0
    left_to_schedule: int = 0
    unverified: int = 0
    failed: tuple[tuple[int, str], ...] = ()
    elapsed_s: float = 0.0
    empty: int = 0
    stopped: str = ""

    @property
    def destination(self) -> str:
        """`topic`, or `pubsub/topic` for a hand-off."""
        return f"{self.target_pubsub}/{self.topic}" if self.target_pubsub else self.topic

    def as_json(self) -> dict[str, Any]:
        """The result as `backfill --json` prints it (times as RFC 3339 UTC with ms)."""
        return {
            "id": self.id,
            "topic": self.topic,
            "targetPubsub": self.target_pubsub or None,
            "from": format_instant(self.start_ms),
            "to": format_instant(self.end_ms),
            "dryRun": self.dry_run,
            "occurrences": len(self.occurrences),
            "deliver": [format_instant(ms) for ms in self.deliver],
            "delivered": self.delivered,
            "alreadyBackfilled": self.already,
            "firedBySchedule": self.fired,
            "leftToSchedule": self.left_to_schedule,
            "unverified": self.unverified,
            "failed": [{"occurrence": format_instant(ms), "error": why} for ms, why in self.failed],
            "empty": self.empty,
            "stopped": self.stopped or None,
            "elapsedSeconds": round(self.elapsed_s, 3),
        }


def parse_rate(text: str) -> float:
    """A rate as the CLI's `--rate`, the dashboard's form and the JSON API give it: `N/s` or `N`
    occurrences per second (blanks around it ignored), finite and more than 0 (check_rate).

    Raises:
        ValueError: its message the reason alone; the caller names the flag or field and the value.
    """
    try:
        rate = float(text.strip().removesuffix("/s"))
    except ValueError:
        raise ValueError("not a number of occurrences per second") from None
    return check_rate(rate)


def check_rate(rate: float) -> float:
    """`rate`, if it is a number of occurrences per second a backfill takes: more than 0 and finite
    (float() reads "1e999" and "inf" as infinity); ValueError with the reason otherwise."""
    if not 0 < rate < math.inf:
        raise ValueError("must be a number more than 0 per second")
    return rate


def check_range(start_ms: int, end_ms: int, now_ms: int) -> None:
    """Refuse a range a backfill does not take (BackfillRefusedError naming the flag)."""
    if start_ms >= end_ms:
        raise BackfillRefusedError(
            "--from", format_instant(start_ms), f"is not before --to {format_instant(end_ms)}"
        )
    if end_ms > now_ms:
        raise BackfillRefusedError(
            "--to",
            format_instant(end_ms),
            f"is in the future (now is {format_instant(now_ms)}): a backfill delivers past occurrences only",
        )


def plan_occurrences(
    schedule: Schedule, *, origin_ms: int, key: str, start_ms: int, end_ms: int, now_ms: int
) -> list[Occurrence]:
    """The occurrences with a nominal time in [start, end) and a due time not after now, in order;
    BackfillRefusedError when there are more than MAX_OCCURRENCES."""
    found: list[Occurrence] = []
    pending: tuple[int, int] | None = None
    for nominal, due in occurrences(schedule, origin_ms=origin_ms, after_ms=start_ms - 1, key=key):
        if pending is not None:
            found.append(Occurrence(pending[0], pending[1], due, nominal))
            pending = None
        if nominal >= end_ms or len(found) > MAX_OCCURRENCES:
            break
        if due <= now_ms:
            pending = (nominal, due)
    else:
        if pending is not None:
            found.append(Occurrence(pending[0], pending[1], None))
    if len(found) > MAX_OCCURRENCES:
        raise BackfillRefusedError(
            "--from",
            format_instant(start_ms),
            f"the range to {format_instant(end_ms)} holds more than {MAX_OCCURRENCES:,} occurrences of "
            f"{schedule.expr}: backfill it in shorter ranges",
        )
    return found


@dataclass
class _Run:
    """What one backfill works with, found once."""

    client: AnyRedis
    info: MessageInfo
    shard_keys: Any
    key: str
    target: str
    record: str
    schedule: Schedule
    retention: hist.Retention
    clock: Clock

    @property
    def envelope(self) -> Envelope:
        return self.info.envelope


async def backfill(
    client: AnyRedis,
    consumer_id: str,
    id: str,
    start_ms: int,
    end_ms: int,
    *,
    shards: int = 1,
    rate: float = DEFAULT_RATE,
    dry_run: bool = False,
    clock: Clock | None = None,
    retention: hist.Retention | None = None,
    progress: Callable[[int, int], None] | None = None,
    max_seconds: float | None = None,
) -> BackfillResult:
    """Deliver (or, `dry_run`, list) the occurrences of schedule `id` in [start_ms, end_ms).

    Args:
        client: the app's Redis (node or Cluster).
        consumer_id, shards: the app and its delayShards (as the Inspector takes them).
        id: a scheduleId, or a recurring envelope's id (`<stream id>@<shard>` with shards).
        rate: occurrences per second at most (> 0).
        retention: the component's history settings (historyMaxLen, historyMaxAge):
            the `backfilled` records are bound by them; max_len 0 writes none.
        progress: called with (done, total) after each chunk.
        max_seconds: refuse (BackfillRefusedError naming `rate`) a delivery whose occurrences at
            `rate` take longer than this (the dashboard: it runs inside an HTTP request).

    Raises:
        ScheduleNotFoundError: nothing pending has this id.
        BackfillRefusedError: a bad range (check_range, MAX_OCCURRENCES), a rate not > 0,
            or `id` is not a pending recurring schedule (one-shot, parked, a retry).
    """
    clock = clock or SystemClock()
    now_ms = clock.now_ms()
    try:
        check_rate(rate)
    except ValueError as e:
        raise BackfillRefusedError("--rate", str(rate), str(e)) from None
    check_range(start_ms, end_ms, now_ms)
    # Small pages: the schedule's history is walked along its by-id chain (hist_walk.lua), which
    # holds its own `backfilled` records too; 100 a call keeps each call ~ms.
    inspector = Inspector(client, consumer_id, HISTORY_PAGE, shards=shards)
    info = await inspector.get_bounded(id)
    if info is None:
        raise ScheduleNotFoundError(f"{id}: no pending schedule has this id")
    schedule = _recurring(id, info, now_ms)
    run = _make_run(client, inspector, info, schedule, clock, retention or hist.Retention())
    # In a thread: a long range of a sparse or zoned cron takes up to seconds of CPU, and the
    # dashboard runs this in its event loop (its pages and live updates would wait).
    planned = await asyncio.to_thread(
        plan_occurrences,
        schedule,
        origin_ms=info.envelope.published_at_ms,
        key=run.key,
        start_ms=start_ms,
        end_ms=end_ms,
        now_ms=now_ms,
    )
    started = time.monotonic()
    pending = await _pending_nominal(client, run)
    fires, reach_ms = await _fired(inspector, client, run, start_ms)
    left = [o for o in planned if o.due_ms >= info.message.due_ms or o.nominal_ms >= pending]
    candidates = [o for o in _not_left(planned, left) if not fires.fired(o)]
    fired = len(planned) - len(left) - len(candidates)
    base = BackfillResult(
        id=info.message.id,
        topic=info.envelope.topic,
        target_pubsub=info.envelope.target_pubsub,
        start_ms=start_ms,
        end_ms=end_ms,
        dry_run=dry_run,
        occurrences=tuple(o.nominal_ms for o in planned),
        deliver=(),
        fired=fired,
        left_to_schedule=len(left),
    )
    # Those a backfill delivered before are not sent again (the script would refuse them anyway).
    done = await _recorded(client, run.record, candidates)
    todo = [o for o in candidates if o.nominal_ms not in done]
    if dry_run:
        return replace(
            base,
            deliver=tuple(o.nominal_ms for o in todo),
            already=len(done),
            unverified=_unverified(todo, info, reach_ms),
            elapsed_s=time.monotonic() - started,
        )
    if max_seconds is not None and len(todo) / rate > max_seconds:
        raise BackfillRefusedError(
            "rate",
            f"{rate:g}",
            f"{len(todo):,} occurrences in [{format_instant(start_ms)}, {format_instant(end_ms)}) take "
            f"~{len(todo) / rate:,.0f} s at this rate, more than {max_seconds:g} s: give a higher rate "
            "or a shorter range, or run `delayed-pubsub backfill` from the command line",
        )
    statuses, stopped = await _deliver(run, todo, rate, progress)
    sent = [o for o in todo if statuses.get(o.nominal_ms) == OK]
    settled = (OK, DUP, EMPTY, None)
    return replace(
        base,
        deliver=tuple(o.nominal_ms for o in sent),
        delivered=len(sent),
        already=len(done) + sum(1 for s in statuses.values() if s == DUP),
        unverified=_unverified(sent, info, reach_ms),
        failed=tuple((o.nominal_ms, s) for o in todo if (s := statuses.get(o.nominal_ms)) not in settled),
        empty=sum(1 for s in statuses.values() if s == EMPTY),
        stopped=stopped,
        elapsed_s=time.monotonic() - started,
    )


def _recurring(id: str, info: MessageInfo, now_ms: int) -> Schedule:
    """The schedule of `info`, or BackfillRefusedError when it is no pending recurring schedule."""
    env = info.envelope
    if not env.is_recurring or not env.schedule:
        raise BackfillRefusedError("ID", id, f"is not a recurring schedule (a {info.message.kind} message)")
    if info.state == "parked":
        raise BackfillRefusedError("ID", id, f"is parked ({info.parked_reason}): resolve that first")
    try:
        return parse_stored_schedule(env.schedule, now_ms=now_ms)
    except InvalidArgumentError as e:
        raise BackfillRefusedError(
            "ID", id, f"its schedule {env.schedule!r} does not parse: {e.reason}"
        ) from None


def _make_run(
    client: AnyRedis,
    inspector: Inspector,
    info: MessageInfo,
    schedule: Schedule,
    clock: Clock,
    retention: hist.Retention,
) -> _Run:
    m, env = info.message, info.envelope
    shard_keys = inspector.shards[m.shard or 0]
    key = m.schedule_id or m.stream_id
    target = shard_keys.outbox if env.target_pubsub else env.topic
    record = backfill_record(target, shard_keys.stream, key)
    return _Run(client, info, shard_keys, key, target, record, schedule, retention, clock)


@dataclass(frozen=True)
class _Fires:
    """What the schedule's `fired` records say it fired: the occurrences they name (`occ`, or a
    `due` written with none: a fire at its nominal time), and the due times of records from
    releases before `occ` (a due time that may be jittered: matched by window)."""

    named: frozenset[int]
    unnamed_dues: tuple[int, ...]

    def fired(self, o: Occurrence) -> bool:
        return o.nominal_ms in self.named or _was_fired(o, self.unnamed_dues)


async def _fired(inspector: Inspector, client: AnyRedis, run: _Run, start_ms: int) -> tuple[_Fires, int | None]:
    """The schedule's `fired` records from `start_ms` on, and when the shard's history begins (its
    oldest record's time; None: no history). Read after the schedule's pending occurrence was
    (MessageInfo): every occurrence before that one has its record written by now."""
    named: set[int] = set()
    dues: set[int] = set()
    # From 1970 at the earliest: a history record's time is its stream id, never negative.
    records = inspector.history_forward(id=run.info.message.id, since_ms=max(0, start_ms))
    try:
        async for _, record in records:
            if record.event != hist.FIRED or record.due_ms is None:
                continue
            if record.occurrence_ms is not None:
                # Jittered or paced: `due` lies anywhere (a catch-up's, after the span).
                named.add(record.occurrence_ms)
            else:
                # Its nominal time, or (an older release's record) a due time in its window.
                dues.add(record.due_ms)
    finally:
        await records.aclose()
    head: Any = await client.xrange(run.shard_keys.history, "-", "+", count=1)
    reach = int(shown(head[0][0]).partition("-")[0]) if head else None
    return _Fires(frozenset(named), tuple(sorted(dues))), reach


def _not_left(planned: Sequence[Occurrence], left: Sequence[Occurrence]) -> list[Occurrence]:
    """`planned` less `left` (the schedule's own), in order."""
    mine = {o.nominal_ms for o in left}
    return [o for o in planned if o.nominal_ms not in mine]


async def _pending_nominal(client: AnyRedis, run: _Run) -> int:
    """The nominal time of the schedule's pending occurrence (its ids ref), read before its history.
    Not its due time: a paced catch-up (scheduleCatchup `all`) holds a missed occurrence due at a
    time after now, and fires it and every one after it itself."""
    m = run.info.message
    ref: Any = await client.hget(run.shard_keys.ids, run.key)
    if ref is None or shown(ref).split()[0] != m.stream_id:
        return m.due_ms
    return ref_nominal(shown(ref), m.due_ms)


def _was_fired(o: Occurrence, fired_dues: Sequence[int]) -> bool:
    """Did the schedule fire occurrence `o`? A `fired` record due in its window [nominal, next
    nominal) says so. Not its exact due time: a replace of the schedule under the same id may have
    changed its jitter, and the fires of before name the due times of the jitter of before (each
    due time lies in its occurrence's window whatever the jitter: schedules._jittered)."""
    at = bisect.bisect_left(fired_dues, o.nominal_ms)
    end = math.inf if o.next_nominal_ms is None else o.next_nominal_ms
    return at < len(fired_dues) and fired_dues[at] < end


def _unverified(sent: Iterable[Occurrence], info: MessageInfo, reach_ms: int | None) -> int:
    """How many of `sent` the schedule (as accepted now) could have fired with the record trimmed."""
    accepted = info.envelope.published_at_ms
    return sum(1 for o in sent if o.due_ms >= accepted and (reach_ms is None or o.due_ms < reach_ms))


async def _recorded(client: AnyRedis, record: str, planned: Sequence[Occurrence]) -> set[int]:
    """The nominal times of `planned` a backfill delivered before (read only)."""
    if not planned:
        return set()
    scores: Any = await client.zmscore(record, [str(o.nominal_ms) for o in planned])
    return {o.nominal_ms for o, s in zip(planned, scores, strict=True) if s is not None}


async def _deliver(
    run: _Run, todo: Sequence[Occurrence], rate: float, progress: Callable[[int, int], None] | None
) -> tuple[dict[int, str], str]:
    """Deliver `todo` in chunks paced to `rate` per second; each occurrence's status (none for those
    not reached), and why it stopped early ('' when it did not)."""
    statuses: dict[int, str] = {}
    per_chunk = max(1, min(CHUNK_OCCURRENCES, int(rate)))
    started = time.monotonic()
    for i in range(0, len(todo), per_chunk):
        # Between chunks, not in the script: the ids ref lives in the shard's slot, the target in
        # its own (Cluster). A cancel or replace is so seen within one chunk.
        stopped = await _withdrawn(run)
        if stopped:
            return statuses, stopped
        chunk = todo[i : i + per_chunk]
        messages = await _messages(run, chunk)
        statuses.update({o.nominal_ms: EMPTY for o, msgs in zip(chunk, messages, strict=True) if not msgs})
        for part in _split(chunk, messages):
            got = await _call(run, part)
            statuses.update(got)
            await _write_history(run, [o for o, _ in part if got[o.nominal_ms] == OK])
        done = i + len(chunk)
        if progress is not None:
            progress(done, len(todo))
        # Paced: the n-th occurrence goes out no sooner than n / rate seconds after the first.
        wait = done / rate - (time.monotonic() - started)
        if wait > 0 and done < len(todo):
            # Wall-clock pacing (Redis's load), whatever clock the occurrences are judged by.
            await asyncio.sleep(wait)
    return statuses, ""


async def _withdrawn(run: _Run) -> str:
    """'' while the schedule's ids ref still names the envelope this backfill started with, else why
    not: `cancelled` (no ref) or `replaced` (another envelope under its id)."""
    ref: Any = await run.client.hget(run.shard_keys.ids, run.key)
    if ref is None:
        return CANCELLED
    return "" if shown(ref).split()[0] == run.info.message.stream_id else REPLACED


# One occurrence's messages: each the flat field/value list of one XADD.
_Fields = list[bytes]


async def _messages(run: _Run, chunk: Sequence[Occurrence]) -> list[list[_Fields]]:
    """Each occurrence's messages as its fire would have written them."""
    env = run.envelope
    if env.schedule_source:
        samples = await _samples(run.client, env.schedule_source, [o.due_ms for o in chunk])
    now_ms = run.clock.now_ms()
    out: list[list[_Fields]] = []
    for n, o in enumerate(chunk):
        bodies: Sequence[tuple[bytes, Mapping[str, str], str]]
        if env.schedule_source:
            bodies = samples[n]
        elif env.is_bulk:
            bodies = [(e.event, e.metadata, e.content_type) for e in env.bulk_entries]
        else:
            bodies = [(env.message, env.metadata, env.content_type)]
        out.append([_fields(run, o, body, now_ms) for body in bodies])
    return out


def _fields(run: _Run, o: Occurrence, body: tuple[bytes, Mapping[str, str], str], now_ms: int) -> _Fields:
    env = run.envelope
    data, metadata, content_type = body
    stamped = {
        **metadata,
        SCHEDULER: run.key,
        SCHEDULE_NEXT: schedule_next_value(o.next_ms),
        SCHEDULE_OCCURRENCE: format_instant(o.nominal_ms),
    }
    expires = now_ms + env.schedule_ttl_ms if env.schedule_ttl_ms > 0 else env.expires_at_ms
    if env.target_pubsub:
        encoded = encode_outbox_entry(
            OutboxEntry(
                pubsub=env.target_pubsub,
                topic=env.topic,
                data=data,
                id=run.key,
                metadata=stamped,
                content_type=content_type,
                bulk=run.key if env.is_bulk else "",
                expires_at_ms=expires,
            )
        )
    else:
        encoded = encode_entry(StreamEntry(data, stamped, content_type, expires))
    return [item for name, value in encoded.items() for item in (name.encode(), value)]


async def _samples(
    client: AnyRedis, source: str, dues: Sequence[int]
) -> list[list[tuple[bytes, Mapping[str, str], str]]]:
    """The source topic's latest entry at each due time (none when it held none then)."""
    pipe = client.pipeline(transaction=False)
    for due in dues:
        pipe.xrevrange(source, f"{due}-{_MAX_SEQ}", "-", count=1)
    out: list[list[tuple[bytes, Mapping[str, str], str]]] = []
    for rows in await pipe.execute(raise_on_error=False):
        # A source whose key is no stream (anyone's key) gives nothing, as in a fire
        # (engine.two_phase): raised, it stopped every backfill of the range at that chunk.
        if isinstance(rows, BaseException) and not is_wrong_type(rows):
            raise rows
        if not rows or isinstance(rows, BaseException):
            out.append([])
            continue
        f = {shown(k): v for k, v in rows[0][1].items()}
        ct = f.get("contentType", b"")
        out.append([(bytes(f.get("data", b"")), decode_metadata(f.get("metadata")), shown(ct))])
    return out


def _split(
    chunk: Sequence[Occurrence], messages: Sequence[list[_Fields]]
) -> Iterable[list[tuple[Occurrence, list[_Fields]]]]:
    """The chunk in parts of at most about CHUNK_BYTES of arguments and CHUNK_ENTRIES XADDs (at
    least one occurrence each)."""
    part: list[tuple[Occurrence, list[_Fields]]] = []
    size = entries = 0
    for o, msgs in zip(chunk, messages, strict=True):
        if not msgs:
            continue  # an empty source's occurrence: nothing to deliver or record (EMPTY)
        bytes_ = sum(len(x) for fields in msgs for x in fields)
        if part and (size + bytes_ > CHUNK_BYTES or entries + len(msgs) > CHUNK_ENTRIES):
            yield part
            part, size, entries = [], 0, 0
        part.append((o, msgs))
        size += bytes_
        entries += len(msgs)
    if part:
        yield part


async def _call(run: _Run, part: Sequence[tuple[Occurrence, list[_Fields]]]) -> dict[int, str]:
    args: list[Any] = [RECORD_RETENTION_MS, len(part)]
    for o, msgs in part:
        args += [o.nominal_ms, len(msgs)]
        for fields in msgs:
            args.append(len(fields) // 2)
            args += fields
    script = run.client.register_script(BACKFILL)
    reply: Any = await script(keys=[run.target, run.record], args=args)
    return {o.nominal_ms: shown(s) for (o, _), s in zip(part, reply, strict=True)}


async def _write_history(run: _Run, sent: Sequence[Occurrence]) -> None:
    """One `backfilled` record per occurrence sent, in one MULTI on the shard's history."""
    if not sent or not run.retention.enabled:
        return
    env, m = run.envelope, run.info.message
    now_ms = run.clock.now_ms()
    pipe = run.client.pipeline(transaction=True)
    for o in sent:
        record = {
            "event": hist.BACKFILLED,
            "at": str(now_ms),
            "id": run.key,
            "sid": m.schedule_id,
            "topic": env.topic,
            "kind": m.kind,
            "due": str(o.nominal_ms),
            "late": "",
            "size": str(env.size),
            "attempt": "1",
            "reason": REASON,
            "schedule": env.schedule,
        }
        run.retention.append(pipe, run.shard_keys.history, record, now_ms)
    await pipe.execute()
