"""Coalescing: the SCHEDULE calls of concurrent publishes go to Redis as one script call.

Each delayed publish used to make its own SCHEDULE round trip (its own script
call, its own redis-py command overhead). Calls that reach one engine in the
same event-loop pass now wait for the end of that pass and go out together,
as the calls of one SCHEDULE script (lua/schedule.lua); while a call is on the
wire the next ones gather behind it. Under load (a call within
schedule_linger_ms of the previous one) a batch waits that long for more
before it goes, and so do the calls that gathered behind a batch on the wire
once it returns: grpc.aio hands each RPC over in a loop pass of its own, so
without the wait nearly every unary publish went alone, and a round trip
gathers only one or two.

Invariants, the same as one call at a time:
- every call keeps its own token: a retry after a lost reply finds it whatever
  batch it joins, and stores nothing twice;
- every call is atomic on its own: the script applies the calls in arrival
  order, and one the script refuses fails alone with its own error (the calls
  before and after it are stored; its token is not recorded);
- a script call holds at most schedule_chunk envelopes and schedule_chunk_bytes
  (a bigger batch is split between calls, never inside one caller's chunk);
- a caller that gives up (timeout, cancelled RPC) before its batch is sent is
  left out: nothing of it is stored. Once sent, its call is stored whole or not
  at all, as before; a connection error or timeout fails every call of that
  script call (none of them can know whether it landed: each retries with its
  own token).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from redis.exceptions import ResponseError

from delayed_middleware.engine.replies import ScheduleCall, ScheduleResult

Send = Callable[[Sequence[ScheduleCall]], Awaitable[Sequence[ScheduleResult | ResponseError]]]


@dataclass
class _Waiting:
    call: ScheduleCall
    size: int
    # loop.time() by which the caller gives up (TimeoutError); None: never.
    deadline: float | None
    future: asyncio.Future[ScheduleResult]


class ScheduleCoalescer:
    """Gathers SCHEDULE calls of one engine (one shard) into as few script calls as the chunk limits allow."""

    def __init__(self, send: Send, *, max_items: int, max_bytes: int, linger_s: float = 0.0) -> None:
        self._send = send
        self._linger_s = linger_s
        self._last_submit = -1e9
        self._max_items = max(1, max_items)
        self._max_bytes = max_bytes
        self._queue: list[_Waiting] = []
        # The part on the wire (its callers' deadlines are watched with the queue's).
        self._sending: list[_Waiting] = []
        self._watch: asyncio.TimerHandle | None = None
        self._busy = False
        self._loop: asyncio.AbstractEventLoop | None = None
        # The flush task is kept referenced until it ends (the loop holds tasks weakly).
        self._flusher: asyncio.Task[None] | None = None

    async def schedule(self, call: ScheduleCall, *, timeout_s: float | None = None) -> ScheduleResult:
        """SCHEDULE `call` together with the calls that arrive in the same loop pass.

        TimeoutError after `timeout_s`: nothing stored if its batch was not sent yet, else
        the call stored whole or not at all. The deadline is kept by the batch's timers,
        not by a timeout per caller (a timer and a cancellation scope per publish).
        """
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            # An engine reused on a new loop (tests): what the old loop left is moot.
            self._loop, self._queue, self._sending, self._busy = loop, [], [], False
        future: asyncio.Future[ScheduleResult] = loop.create_future()
        size = sum(len(i.raw) for i in call.items)
        now = loop.time()
        deadline = None if timeout_s is None else now + timeout_s
        self._queue.append(_Waiting(call, size, deadline, future))
        if self._sending and deadline is not None and (self._watch is None or deadline < self._watch.when()):
            # Queued behind a batch on the wire, and less patient than any caller watched so far.
            if self._watch is not None:
                self._watch.cancel()
            self._watch = loop.call_at(deadline, self._rewatch, loop)
        if not self._busy:
            self._busy = True
            if now - self._last_submit < 5 * self._linger_s:
                # Under load (calls coming within a few lingers): wait for the
                # next ones, which gRPC hands over one loop pass each.
                loop.call_later(self._linger_s, self._start)
            else:
                # After this pass: every publish handled in it joins the same script call.
                loop.call_soon(self._start)
        self._last_submit = now
        return await future

    def _start(self) -> None:
        self._flusher = asyncio.get_running_loop().create_task(self._flush(), name="schedule coalescer")

    async def _flush(self) -> None:
        try:
            while True:
                # A caller that gave up before its batch was sent is not stored.
                batch = [w for w in self._queue if not w.future.done()]
                self._queue = []
                if not batch:
                    return
                for part in self._split(batch):
                    await self._send_part(part)
                if self._queue and self._linger_s:
                    # Calls keep coming while a batch is on the wire (a round trip gathers
                    # one or two): wait a linger for more, as the first batch did.
                    await asyncio.sleep(self._linger_s)
        finally:
            self._busy = False
            self._flusher = None

    def _split(self, batch: list[_Waiting]) -> list[list[_Waiting]]:
        """Runs of whole calls within the chunk limits (a call over them alone is a run of its own)."""
        parts: list[list[_Waiting]] = []
        part: list[_Waiting] = []
        items = size = 0
        for w in batch:
            n = len(w.call.items)
            if part and (items + n > self._max_items or size + w.size > self._max_bytes):
                parts.append(part)
                part, items, size = [], 0, 0
            part.append(w)
            items += n
            size += w.size
        if part:
            parts.append(part)
        return parts

    async def _send_part(self, part: list[_Waiting]) -> None:
        loop = asyncio.get_running_loop()
        now = loop.time()
        # A caller whose deadline passed before its batch went out is not stored.
        part = [w for w in part if not _expired(w, now)]
        if not part:
            return
        # Bounded by the most patient caller: a frozen Redis must not hold the
        # batch (and every later one) for ever. A less patient caller is answered
        # TimeoutError at its own deadline (_watch_deadlines), its call stored whole or not at all.
        deadlines = [w.deadline for w in part]
        last = None if None in deadlines else max(d for d in deadlines if d is not None)
        self._sending = part
        self._watch = self._watch_deadlines(loop)
        try:
            async with asyncio.timeout_at(last):
                results: Sequence[ScheduleResult | BaseException] = await self._send([w.call for w in part])
        except asyncio.CancelledError:
            for w in part:
                w.future.cancel()
            raise
        except Exception as e:
            results = [e] * len(part)
        finally:
            self._sending = []
            if self._watch is not None:
                self._watch.cancel()
                self._watch = None
        for w, result in zip(part, results, strict=True):
            if w.future.done():
                continue
            if isinstance(result, BaseException):
                w.future.set_exception(result)
            else:
                w.future.set_result(result)

    def _watch_deadlines(self, loop: asyncio.AbstractEventLoop) -> asyncio.TimerHandle | None:
        """One timer, at the earliest deadline of the callers on the wire or waiting
        behind them: it answers those past theirs TimeoutError and sets itself again."""
        now = loop.time()
        first: float | None = None
        for w in (*self._sending, *self._queue):
            if _expired(w, now) or w.deadline is None:
                continue
            if first is None or w.deadline < first:
                first = w.deadline
        if first is None:
            return None
        return loop.call_at(first, self._rewatch, loop)

    def _rewatch(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._sending:
            self._watch = self._watch_deadlines(loop)


def _expired(w: _Waiting, now: float) -> bool:
    """Whether `w` is answered already, or (then answered TimeoutError) past its deadline."""
    if w.future.done():
        return True
    if w.deadline is not None and w.deadline <= now:
        w.future.set_exception(TimeoutError())
        return True
    return False
