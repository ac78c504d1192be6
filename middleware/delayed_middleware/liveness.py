"""Long-running loops that end only when we stop them (the design's liveness invariant).

Every background loop of the component (the fire loop of each delay shard, its
wake listener, each subscription's fetch and ack loops, the retry poller, the
hand-off forwarder, the pending gauge) runs under `Supervised`:

- "we are stopping" is our own stop flag, set by `Supervised.stop()`; it is
  never inferred from `Task.cancelling()`. Cancellation requests can be left on
  a task that nobody means to stop: Python 3.11's TaskGroup leaves one on its
  parent when a child fails while the parent waits in `__aexit__`, and
  redis-py can swallow a CancelledError and fail the call instead;
- the loop body runs in a task of its own, started afresh for each run, so
  such a stray request dies with that run and never reaches the next one;
- any end that is not our stop (a return, an exception, a stray cancellation)
  is logged at ERROR, reported through `on_state` (metrics, health) and
  followed by a restart after a backoff;
- a loop that calls `beat()` on each pass can be found stalled: no beat for
  `stall_after_s` (a call that never returns, a wait nothing will end);
- a real stop is prompt even when a library swallows the CancelledError: the
  run is cancelled again until it ends (or `stop`'s bound passes).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from delayed_middleware.backoff import LIVENESS, Backoff

log = logging.getLogger(__name__)

# (up, error): up=False with the error (None if the body returned) when a run
# ended without a stop; up=True when a (re)started run begins, and when stop()
# ends a loop that was waiting for its restart (it is no longer down).
StateHook = Callable[[bool, BaseException | None], None]
Body = Callable[[asyncio.Event], Awaitable[None]]

# How often stop() cancels a run again that swallowed the previous cancellation.
RECANCEL_S = 0.05
# A run that lasted this long was healthy: the next failure starts the backoff afresh.
HEALTHY_RUN_S = 30.0


async def supervise(
    name: str,
    body: Body,
    stop: asyncio.Event,
    backoff: Backoff | None = None,
    on_state: StateHook | None = None,
    on_run: Callable[[asyncio.Task[None]], None] | None = None,
) -> None:
    """Run `body(stop)` until `stop` is set, restarting it after any other end.

    `on_run` is handed each run's task as it starts (Supervised.current_run).

    Each run is a task of its own. The supervising task awaits nothing but that
    task and its backoff sleep, so a cancellation of the supervising task
    comes from its owner (a stop); the run is then cancelled until it ends,
    and the cancellation goes on.
    """
    backoff = backoff or LIVENESS.backoff()
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        if on_state is not None:
            on_state(True, None)
        started = loop.time()
        run = asyncio.create_task(_call(body, stop), name=name)
        if on_run is not None:
            on_run(run)
        try:
            await asyncio.wait({run})
        except asyncio.CancelledError:
            stop.set()
            await _end(run, None, owned=True)
            raise
        if stop.is_set():
            # Ended by our stop (whether it returned, raised or was cancelled):
            # nothing to report, nothing to restart.
            _consume(run)
            return
        error = _consume(run)
        why = "returned" if error is None else repr(error)
        if isinstance(error, asyncio.CancelledError):
            why = "was cancelled without a stop (a stray or swallowed cancellation)"
        if loop.time() - started >= HEALTHY_RUN_S:
            backoff.reset()
        delay = backoff.next()
        log.error(
            "%s ended unexpectedly: %s; restarting it in %.2fs",
            name,
            why,
            delay,
            exc_info=error if isinstance(error, Exception) else None,
        )
        if on_state is not None:
            on_state(False, error)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(delay):
                await stop.wait()


async def _call(body: Body, stop: asyncio.Event) -> None:
    await body(stop)


def _consume(run: asyncio.Task[None]) -> BaseException | None:
    """The run's end: its exception, a CancelledError if it was cancelled, None if it returned."""
    if run.cancelled():
        return asyncio.CancelledError()
    return run.exception()


async def _end(run: asyncio.Task[None], timeout_s: float | None, *, owned: bool = False) -> bool:
    """Cancel `run` until it ends (a swallowed cancellation is repeated); True if it did.

    `owned`: the caller is the supervising task, which is being stopped; its
    own further cancellations only repeat that stop and must not abandon `run`.
    Any other caller's cancellation goes on up."""
    loop = asyncio.get_running_loop()
    deadline = None if timeout_s is None else loop.time() + timeout_s
    while not run.done():
        run.cancel()
        wait = RECANCEL_S if deadline is None else min(RECANCEL_S, deadline - loop.time())
        if wait <= 0:
            return False
        if owned:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait({run}, timeout=wait)
        else:
            await asyncio.wait({run}, timeout=wait)
    _consume(run)
    return True


class Supervised:
    """One supervised loop: start() it, stop() it; `up`, `restarts` and `stalled` say how it does."""

    def __init__(
        self,
        name: str,
        body: Body,
        *,
        backoff: Backoff | None = None,
        on_state: StateHook | None = None,
        stall_after_s: float | None = None,
    ) -> None:
        self.name = name
        self._body = body
        self._backoff = backoff
        self._on_state = on_state
        self.stall_after_s = stall_after_s
        self.stop_flag = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        # The task of the run going on (each run has its own; see supervise).
        self.current_run: asyncio.Task[None] | None = None
        self.up = False
        self.restarts = 0
        self.last_error: BaseException | None = None
        self._last_beat = time.monotonic()

    def start(self) -> None:
        """Start the loop (once)."""
        if self._task is None:
            self._last_beat = time.monotonic()
            self._task = asyncio.create_task(
                supervise(
                    self.name, self._run_body, self.stop_flag, self._backoff, self._state, self._set_run
                ),
                name=f"supervise {self.name}",
            )

    async def _run_body(self, stop: asyncio.Event) -> None:
        # Looked up at each run, so a restart runs whatever body is set now.
        await self._body(stop)

    def _set_run(self, run: asyncio.Task[None]) -> None:
        self.current_run = run

    def _state(self, up: bool, error: BaseException | None) -> None:
        self.up = up
        if up:
            self._last_beat = time.monotonic()
        else:
            self.restarts += 1
            self.last_error = error
        if self._on_state is not None:
            self._on_state(up, error)

    def beat(self) -> None:
        """The loop made a pass (called by the loop itself): it is not stalled."""
        self._last_beat = time.monotonic()

    @property
    def stalled(self) -> bool:
        """Up, but without a beat for longer than stall_after_s (never, without a bound)."""
        if self.stall_after_s is None or not self.up:
            return False
        return time.monotonic() - self._last_beat > self.stall_after_s

    @property
    def healthy(self) -> bool:
        """Running, and beating if it beats."""
        return self.up and not self.stalled

    @property
    def down(self) -> bool:
        """Started, not being stopped, and ended (waiting for its restart) or stalled.

        A loop whose first run has not begun yet (start() only schedules it) is
        neither: a health report made in the same loop pass as start() must not
        call a loop that is about to run "ended"."""
        begun = self.up or self.restarts > 0
        return self._task is not None and begun and not self.stopping and not self.healthy

    @property
    def stopping(self) -> bool:
        """True once stop() was called."""
        return self.stop_flag.is_set()

    async def stop(self, timeout_s: float = 5.0) -> bool:
        """Set the stop flag and end the loop within about `timeout_s`; True if it ended.

        A run that swallows the cancellation is cancelled again every
        RECANCEL_S; one that outlives the bound is abandoned, loudly.
        """
        self.stop_flag.set()
        task, self._task = self._task, None
        if not self.up and self.restarts and self._on_state is not None:
            self._on_state(True, None)
        self.up = False
        if task is None:
            return True
        if await _end(task, timeout_s):
            return True
        log.error("%s did not stop within %.1fs; abandoning it", self.name, timeout_s)
        return False


async def run_until_cancelled(loops: list[Supervised]) -> None:
    """Start `loops` and keep them until this task is cancelled, then stop them.

    For callers that stop a loop by cancelling the task that runs it: the
    cancellation reaches only this task, which stops each loop by its flag
    (so a cancellation swallowed inside a loop still ends it).
    """
    for loop in loops:
        loop.start()
    try:
        await asyncio.Event().wait()
    finally:
        await asyncio.gather(*(loop.stop() for loop in loops))
