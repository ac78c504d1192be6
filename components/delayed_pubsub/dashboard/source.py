"""What the dashboard reads and changes in Redis, over the operator CLI's own reader.

The one module of the dashboard that imports the Inspector (and the CLI's
actions): every page goes through `Source`, so the Inspector's home is named
once here.

Cost: every read is bounded by a page, never by the number of pending
messages, except `Source.census` (a full scan, as `delayed-pubsub pending`
makes one), which only the shared poller (dashboard.poller) calls.
"""

from __future__ import annotations

import heapq
import itertools
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from delayed_middleware.engine.pause import paused_at_ms
from delayed_middleware.engine.timecontrol import TimeResult
from delayed_middleware.envelope import EnvelopeDecodeError, decode_envelope
from delayed_middleware.history import HistoryRecord
from delayed_middleware.inspector import (
    DeadLetterInfo,
    Inspector,
    MessageInfo,
    PendingMessage,
)
from delayed_middleware.schedules import schedule_zone
from delayed_pubsub import operate, operate_time
from delayed_pubsub.connection import Connection
from delayed_pubsub.settings import Settings

__all__ = [
    "Census",
    "DeadLetterInfo",
    "MessageInfo",
    "PendingMessage",
    "ScheduleRow",
    "SchedulesPage",
    "Source",
]

# Upper bounds of the overview's due windows (ms from now), each with its label; the last is open.
DUE_WINDOWS: tuple[tuple[str, int | None], ...] = (
    ("overdue", 0),
    ("within 1 min", 60_000),
    ("within 10 min", 600_000),
    ("within 1 h", 3_600_000),
    ("within 1 day", 86_400_000),
    ("later", None),
)
# How many of the soonest-due messages the overview shows.
SOONEST = 10


@dataclass(frozen=True)
class Census:
    """Everything that waits, counted in one scan (what `delayed-pubsub pending --limit 0` lists)."""

    total: int
    by_topic: Mapping[str, int]
    by_window: Mapping[str, int]
    by_kind: Mapping[str, int]
    soonest: tuple[PendingMessage, ...]
    parked: int
    undecodable: int
    scanned: int


@dataclass(frozen=True)
class ScheduleRow:
    """A recurring message: its expression and its next fire."""

    id: str
    topic: str
    schedule: str
    next_ms: int | None
    following: str
    shard: int | None
    # Its scheduleTimeZone ('' = UTC), and when schedulePause held it (None while it runs).
    zone: str = ""
    paused_at_ms: int | None = None


@dataclass(frozen=True)
class SchedulesPage:
    """Recurring messages found in one bounded part of the scheduleId index, and where to go on."""

    rows: tuple[ScheduleRow, ...]
    next_cursor: str | None
    examined: int


@dataclass
class _Tally:
    total: int = 0
    by_topic: Counter[str] = field(default_factory=Counter)
    by_window: Counter[str] = field(default_factory=Counter)
    by_kind: Counter[str] = field(default_factory=Counter)


def due_window(due_ms: int, now_ms: int) -> str:
    """The overview's window label of a due time."""
    ahead = due_ms - now_ms
    for label, bound in DUE_WINDOWS:
        if bound is None or ahead <= bound:
            return label
    return DUE_WINDOWS[-1][0]


def _s(value: bytes | str | None) -> str:
    if value is None:
        return ""
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def _named(rows: Any) -> list[tuple[str, Any]]:
    """Stream rows under their envelopes' ids: a copy compaction made (lua/compact.lua) carries the
    id it was first stored at in its field `origin`, the id cancel and inspect know it by."""
    out: list[tuple[str, Any]] = []
    for raw_id, fields in rows:
        origin = fields.get(b"origin", fields.get("origin"))
        out.append((_s(origin if origin is not None else raw_id), fields))
    return out


def _glob_escape(text: str) -> str:
    """`text` with Redis glob specials escaped, for a MATCH prefix."""
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


class Source:
    """The dashboard's reads and actions on one app's delayed messages (every shard)."""

    def __init__(self, connection: Connection, settings: Settings, page_size: int = 500) -> None:
        self.connection = connection
        self.settings = settings
        client: Any = connection.client
        self.client = client
        self.page_size = page_size
        self.inspector = self.reader(page_size)

    def reader(self, page_size: int) -> Inspector:
        """An Inspector of this app that reads `page_size` entries a step: a listing that shows
        fewer than the usual page reads (and decodes) no more than it shows."""
        return Inspector(self.client, self.settings.consumer_id, page_size, shards=self.settings.shards)

    @property
    def shards(self) -> int:
        return len(self.inspector.shards)

    @property
    def consumer_id(self) -> str:
        return self.settings.consumer_id

    def stream_of(self, message: PendingMessage) -> str:
        return self.inspector.stream_of(message)

    async def now_ms(self) -> int:
        """Redis's clock: the one the engine fires by."""
        seconds, micros = await self.client.time()
        return int(seconds) * 1000 + int(micros) // 1000

    # --- the poller's reads ------------------------------------------------------------

    async def census(self, now_ms: int) -> Census:
        """Pending by topic, due window and kind, and the soonest due: one scan of everything that
        waits, as `delayed-pubsub pending` makes (envelopes, retries and hand-offs)."""
        stats: Counter[str] = Counter()
        tally = _Tally()
        tie = itertools.count()
        heap: list[tuple[int, int, PendingMessage]] = []
        waiting = (
            self.inspector.scan(stats=stats),
            self.inspector.retries(),
            self.inspector.handoffs(now_ms=now_ms),
        )
        for source in waiting:
            async for m in source:
                tally.total += 1
                tally.by_topic[m.topic] += 1
                tally.by_window[due_window(m.due_ms, now_ms)] += 1
                tally.by_kind[m.kind] += 1
                item = (-m.due_ms, -next(tie), m)
                if len(heap) < SOONEST:
                    heapq.heappush(heap, item)
                else:
                    heapq.heappushpop(heap, item)
        soonest = sorted((m for _, _, m in heap), key=lambda m: (m.due_ms, m.stream_id))
        return Census(
            total=tally.total,
            by_topic=dict(tally.by_topic),
            by_window={label: tally.by_window.get(label, 0) for label, _ in DUE_WINDOWS},
            by_kind=dict(tally.by_kind),
            soonest=tuple(soonest),
            parked=stats["parked"],
            undecodable=stats["undecodable"],
            scanned=stats["scanned"],
        )

    async def newest_history(self, limit: int) -> list[HistoryRecord]:
        """The newest `limit` lifecycle records of every shard, oldest first."""
        return [record for _, record in await self.inspector.history_newest(limit)]

    async def dead_letters(self) -> list[DeadLetterInfo]:
        return await self.inspector.dead_letters()

    # --- pages -------------------------------------------------------------------------

    async def search(self, prefix: str, count: int) -> list[PendingMessage]:
        """Up to `count` pending envelopes whose id or scheduleId starts with `prefix`."""
        found: dict[tuple[int, str], PendingMessage] = {}
        if re.fullmatch(r"[0-9]{1,13}(-[0-9]*)?", prefix):
            for m in await self._by_id_prefix(prefix, count):
                found[(m.shard or 0, m.stream_id)] = m
        for m in await self._by_schedule_prefix(prefix, count):
            found.setdefault((m.shard or 0, m.stream_id), m)
        return sorted(found.values(), key=lambda m: (m.due_ms, m.stream_id))[:count]

    async def _by_id_prefix(self, prefix: str, count: int) -> list[PendingMessage]:
        ms, dash, _ = prefix.partition("-")
        if dash:
            low, high = f"{ms}-0", f"{ms}-{2**64 - 1}"
        else:
            width = max(13, len(ms))
            low, high = f"{ms.ljust(width, '0')}-0", f"{ms.ljust(width, '9')}-{2**64 - 1}"
        out: list[PendingMessage] = []
        for shard, keys in enumerate(self.inspector.shards):
            start = low
            while len(out) < count:
                rows: Any = await self.client.xrange(keys.stream, start, high, count=200)
                if not rows:
                    break
                start = "(" + _s(rows[-1][0])
                hits = [(i, f) for i, f in _named(rows) if i.startswith(prefix)]
                out.extend(await self.inspector.decode_page(shard, hits))
                if len(rows) < 200:
                    break
        return out[:count]

    async def _by_schedule_prefix(self, prefix: str, count: int) -> list[PendingMessage]:
        """scheduleIds starting with `prefix` (HSCAN MATCH over each shard's ids hash, bounded)."""
        out: list[PendingMessage] = []
        pattern = _glob_escape(prefix) + "*"
        for shard, keys in enumerate(self.inspector.shards):
            cursor, examined = 0, 0
            while len(out) < count and examined < 200_000:
                cursor, page = await self.client.hscan(keys.ids, cursor, match=pattern, count=1000)
                examined += 1000
                refs = [(_s(k), _s(v).split()[0]) for k, v in page.items() if _s(v).split()]
                if refs:
                    out.extend(await self._load_envelopes(shard, [sid for _, sid in refs]))
                if cursor == 0:
                    break
        return out[:count]

    async def _load_envelopes(self, shard: int, stream_ids: Sequence[str]) -> list[PendingMessage]:
        keys = self.inspector.shards[shard]
        pipe = self.client.pipeline(transaction=False)
        for sid in stream_ids:
            pipe.hget(keys.moved, sid)
        moved = await pipe.execute()
        pipe = self.client.pipeline(transaction=False)
        for sid, at in zip(stream_ids, moved, strict=True):
            stored = sid if at is None else _s(at)
            pipe.xrange(keys.stream, stored, stored)
        replies = await pipe.execute()
        rows = [(sid, r[0][1]) for sid, r in zip(stream_ids, replies, strict=True) if r]
        return list(await self.inspector.decode_page(shard, rows))

    async def message(self, id: str) -> MessageInfo | None:
        """One message with its history, by scheduleId or envelope id; None if not waiting.

        As `delayed-pubsub inspect` finds it, less its last resort (a scan of the whole
        delayed topic): a page request never costs O(pending)."""
        return await self.inspector.get_bounded(id)

    async def schedules(self, cursor: str | None, count: int, budget: int = 5_000) -> SchedulesPage:
        """Recurring messages from the ids hashes (HSCAN from `cursor`, `<shard>:<hscan cursor>`),
        at most `count` of them and `budget` hash entries examined per call."""
        shard, at = 0, 0
        if cursor:
            a, _, b = cursor.partition(":")
            if a.isdigit() and b.isdigit():
                shard, at = int(a), int(b)
        rows: list[ScheduleRow] = []
        examined = 0
        while shard < self.shards and len(rows) < count and examined < budget:
            keys = self.inspector.shards[shard]
            at, page = await self.client.hscan(keys.ids, at, count=1000)
            examined += max(len(page), 1)
            # Whether an entry recurs is the envelope's to say (an @every's ref names no next fire):
            # each envelope is read, a page of the hash at a time, within the budget.
            refs = [(_s(k), _s(v).split()) for k, v in page.items()]
            refs = [(key, parts) for key, parts in refs if parts]
            envs = await self._raw_envelopes(shard, [parts[0] for _, parts in refs]) if refs else []
            for (key, parts), env in zip(refs, envs, strict=True):
                if env is None or not env.is_recurring:
                    continue
                due = int(parts[1]) if len(parts) > 1 and parts[1].lstrip("-").isdigit() else None
                paused = paused_at_ms(" ".join(parts))
                rows.append(
                    ScheduleRow(
                        id=key,
                        topic=env.topic,
                        schedule=env.schedule,
                        next_ms=due,
                        following=parts[3] if len(parts) > 3 and parts[3] != "-" and not paused else "",
                        shard=shard if self.shards > 1 else None,
                        zone=schedule_zone(env.schedule),
                        paused_at_ms=paused,
                    )
                )
            if at == 0:
                shard += 1
        more = shard < self.shards
        rows.sort(key=lambda r: (r.next_ms is None, r.next_ms or 0, r.id))
        return SchedulesPage(tuple(rows), f"{shard}:{at}" if more else None, examined)

    async def _raw_envelopes(self, shard: int, stream_ids: Sequence[str]) -> list[Any]:
        """The envelopes (decoded, None where gone or undecodable) at these ids; one that is not
        at its id is looked for where compaction may have moved it (the moved hash)."""
        keys = self.inspector.shards[shard]
        pipe = self.client.pipeline(transaction=False)
        for sid in stream_ids:
            pipe.xrange(keys.stream, sid, sid)
        replies = list(await pipe.execute())
        missing = [n for n, reply in enumerate(replies) if not reply]
        if missing:
            moved = await self.client.hmget(keys.moved, [stream_ids[n] for n in missing])
            found = [(n, _s(at)) for n, at in zip(missing, moved, strict=True) if at is not None]
            pipe = self.client.pipeline(transaction=False)
            for _, at in found:
                pipe.xrange(keys.stream, at, at)
            for (n, _), reply in zip(found, await pipe.execute() if found else [], strict=True):
                replies[n] = reply
        out: list[Any] = []
        for reply in replies:
            try:
                out.append(decode_envelope(reply[0][1].get(b"data", b"")) if reply else None)
            except EnvelopeDecodeError:
                out.append(None)
        return out

    # --- actions -----------------------------------------------------------------------

    async def cancel(self, id: str) -> bool:
        """Cancel one pending message as `delayed-pubsub cancel` does; False if it was not pending."""
        done, _ = await operate.cancel_ids(self.connection, self.settings, [id])
        return bool(done)

    async def set_paused(self, id: str, pause: bool) -> str:
        """Pause or resume one schedule or pending message as `delayed-pubsub pause`/`resume` do;
        the outcome (pausing.PAUSED, RESUMED, ALREADY, ENDED, UNKNOWN, PARKED). A pause in the
        storage format's rollback window is refused as the CLI refuses it (FailedPreconditionError)."""
        engine = operate.operator_engine(self.connection, self.settings)
        if pause:
            await operate.refuse_pause_in_rollback_window(self.connection, engine, "the dashboard's pause")
        reason = operate.PAUSE_REASON if pause else operate.RESUME_REASON
        result = await engine.set_paused(
            id, pause=pause, reason=reason.replace("delayed-pubsub", "dashboard")
        )
        return result.status

    async def cancel_prefix(self, prefix: str, *, dry_run: bool = False) -> int:
        """Cancel every pending message and schedule of this app whose id starts with `prefix`, as
        `delayed-pubsub cancel --prefix` does: how many; with `dry_run`, how many would be."""
        engine = operate.operator_engine(self.connection, self.settings)
        if dry_run:
            return await operate.count_prefix(engine, prefix)
        return await engine.cancel_prefix(prefix, reason=operate.CANCEL_REASON)

    async def trigger(self, id: str) -> TimeResult:
        """Trigger one pending message or schedule as `delayed-pubsub trigger` does."""
        reason = operate_time.TRIGGER_REASON.replace("delayed-pubsub", "dashboard")
        [result] = await operate_time.trigger_ids(self.connection, self.settings, [id], reason=reason)
        return result

    async def reschedule(self, id: str, due_ms: int) -> TimeResult:
        """Move one pending one-shot as `delayed-pubsub reschedule` does."""
        reason = operate_time.RESCHEDULE_REASON.replace("delayed-pubsub", "dashboard")
        return await operate_time.reschedule_id(self.connection, self.settings, id, due_ms, reason=reason)

    async def _dead_letter(self, topic: str, stream_id: str) -> DeadLetterInfo | None:
        # Only a dead letter of this app, as the listing shows it: never an arbitrary stream entry.
        for d in await self.inspector.dead_letters():
            if d.dead_letter_topic == topic and d.stream_id == stream_id:
                return d
        return None

    async def retry_dead(self, topic: str, stream_id: str) -> tuple[str, str] | None:
        """Move one dead letter back as `delayed-pubsub retry-dead` does (exactly once, whoever
        else moves it at the same time): its status (operate.retry_dead_letters) and where it
        goes, or None if this app has no such dead letter."""
        d = await self._dead_letter(topic, stream_id)
        if d is None:
            return None
        [(_, status, where)] = await operate.retry_dead_letters(self.client, self.settings, [d])
        return status, where

    async def delete_dead(self, topic: str, stream_id: str) -> bool:
        """Delete one dead letter of this app; False if there is no such one."""
        d = await self._dead_letter(topic, stream_id)
        if d is None:
            return False
        return bool(await self.client.xdel(d.dead_letter_topic, d.stream_id))
