"""The one place that knows the engine's Lua scripts: how to call them.

One method per script packs its KEYS and ARGV (in the order its header in
lua/*.lua lists them) and returns a frozen dataclass read from the reply
(engine/replies.py: the dataclasses and their readers). Nobody above this
layer indexes a raw reply or builds an argument list by hand; the FIRE and
CLAIM budgets come from one `_batch_args` builder. The script texts
themselves (with their includes resolved) stay in
`delayed_middleware.lua_scripts`, which the broker and the benches read too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from redis.exceptions import ResponseError

from delayed_middleware import lua_scripts as lua
from delayed_middleware.aio import text
from delayed_middleware.client import RedisClient
from delayed_middleware.engine.replies import (
    AppendItem,
    Budget,
    CancelResult,
    ClaimResult,
    FireResult,
    InFlight,
    PauseReply,
    RecoverResult,
    RefillItem,
    ReleaseResult,
    ScheduleCall,
    ScheduleItem,
    ScheduleResult,
    TimeControlReply,
    read_claim,
    read_fire,
    read_pause,
    read_release,
    read_timecontrol,
    topic,
)
from delayed_middleware.keys import EngineKeys
from delayed_middleware.redis_errors import DUP, script_status


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
        self._recover = client.register_script(lua.RECOVER)
        self._pause = client.register_script(lua.PAUSE)
        self._timecontrol = client.register_script(lua.TIMECONTROL)

    async def pause(
        self, op: str, id: str, reason: str, extra: Sequence[str], *, now: int, history_len: int
    ) -> PauseReply:
        """PAUSE (lua/pause.lua): hold or resume one entry (engine/pause.py)."""
        k = self._keys
        args: list[Any] = [k.buckets, now, history_len, op, id, reason, k.wake, *extra]
        return read_pause(await self._pause(keys=self._keys_for_writes, args=args))

    async def timecontrol(
        self,
        op: str,
        id: str,
        reason: str,
        *,
        now: int | str,
        history_len: int,
        pubsub_name: str,
        occurrence_key: str,
        due_ms: int | None = None,
        trim: tuple[str, int | str] = ("", ""),
        append_here: bool = False,
        request: str = "",
        token_window_ms: int = 0,
        trigger_token: str = "",
        keep_trigger_ms: int = 0,
    ) -> TimeControlReply:
        """TIMECONTROL (lua/timecontrol.lua): trigger or reschedule one entry (engine/timecontrol.py).
        `append_here` (a single node): a schedule's extra occurrence is appended in the script,
        trimmed by `trim` (FIRE's trim mode and threshold). `request`: a trigger's identity
        (a retry of it answers 'again'; '' = none), forgotten after `token_window_ms`.
        `trigger_token` (two-phase path): an 'extra' occurrence is registered under it, for a
        cancel to stop, and swept after `keep_trigger_ms` (keys.EngineKeys.triggers)."""
        k = self._keys
        args: list[Any] = [k.buckets, now, history_len, op, id, reason, k.wake, pubsub_name, occurrence_key]
        args += ("" if due_ms is None else due_ms, *trim, 1 if append_here else 0, request, token_window_ms)
        args += (trigger_token, keep_trigger_ms)
        return read_timecontrol(await self._timecontrol(keys=self._keys_for_writes, args=args))

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
            args += (c.token, len(c.items))
            for i in c.items:
                # A ScheduleItem is its ARGV group, in order.
                args += i
        raw = await self._schedule(keys=self._keys_for_writes, args=args)
        out: list[ScheduleResult | ResponseError] = []
        at = 0
        for c in calls:
            status, m = raw[at], int(raw[at + 1])
            values = [text(v) for v in raw[at + 2 : at + 2 + m]]
            at += 2 + m
            status = script_status(status)
            if status == DUP:
                out.append(ScheduleResult([], dup=True))
            elif status == "err":
                out.append(ResponseError(values[0] if values else "SCHEDULE refused the call"))
            else:
                n = len(c.items)
                if m == n:
                    # Nothing replaced while in flight (nearly always).
                    out.append(ScheduleResult(values))
                    continue
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
        return read_fire(raw)

    async def claim(
        self, *, now: int | str, budget: Budget, history_len: int, lease_ms: int, pubsub_name: str
    ) -> ClaimResult:
        """CLAIM (two-phase, the shard's slot): move a bounded due batch in flight."""
        args = [*self._batch_args(now, budget), history_len, budget.fire_budget_us, lease_ms, pubsub_name]
        raw = await self._claim(keys=self._keys.two_phase_keys, args=args)
        return read_claim(raw)

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
        return read_release(raw)

    async def refill(
        self, items: Sequence[RefillItem], *, history: tuple[int, int] | None = None
    ) -> list[int]:
        """REFILL: compare-and-set each item's successor; 1 applied, 2 ended, 0 stale, -1 gone.

        `history` = (history maxlen, now ms) for the records of ended schedules.
        """
        k = self._keys
        args: list[Any] = [k.buckets, k.wake, len(items)]
        for i in items:
            args += [i.key, i.ref, i.next_due, i.next_iso, i.current_due, i.current_nominal, i.next_nominal]
            args += [i.skipped_from, i.skipped_why]
        if history is not None:
            args += list(history)
        return [int(r) for r in await self._refill(keys=k.script_keys, args=args)]

    async def compact(self, cursor: str, end: str, *, chunk: int, budget_us: int) -> str:
        """COMPACT: re-home one stretch of the stream; the next cursor ('' once the pass ended)."""
        raw = await self._compact(keys=self._keys.script_keys, args=[cursor, end, chunk, budget_us])
        return text(raw[0])

    async def recover(
        self, cursor: str, end: str, *, chunk: int, budget_us: int, now: int | str, history_len: int
    ) -> RecoverResult:
        """RECOVER: walk one stretch of the stream, putting orphaned envelopes back in the index."""
        k = self._keys
        args: list[Any] = [k.buckets, cursor, end, chunk, budget_us, now, history_len, k.wake]
        # The two-phase layout on every path: its claims hash says what is in flight (none on one node).
        raw = await self._recover(keys=k.two_phase_keys, args=args)
        return RecoverResult(text(raw[0]), int(raw[1]), int(raw[2]))
