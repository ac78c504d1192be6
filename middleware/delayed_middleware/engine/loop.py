"""The run loop and the wake listener: fire when due, with no fixed polling tick.

The loop fires a batch, then sleeps until the earliest due time left (or a
lease end, two-phase), at most max_sleep_s. A replica that schedules an
earlier message PUBLISHes on the wake channel (SCHEDULE does, in its script);
every replica's listener hears it and cuts its sleep short. A lost wake
message (a dropped pub/sub connection) or a stepped clock delays a fire by at
most max_sleep_s.

Liveness: the loop ends only on its stop flag. A Redis error or a timeout
(each pass is bounded by op_timeout_s) backs off (retry_min_s..retry_max_s)
and goes on; any other exception is logged and backed off too, never the
end of firing. The listener runs supervised beside it and restarts on its
own. After a failover the loop reconnects through Sentinel or the refreshed
cluster slot map and fires whatever is due.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Callable

from redis.exceptions import RedisError

from delayed_middleware.engine.core import ShardState
from delayed_middleware.engine.fire import Firer
from delayed_middleware.engine.recovery import Recoverer
from delayed_middleware.engine.retention import HistoryTrimmer
from delayed_middleware.liveness import StateHook, Supervised, run_until_cancelled

log = logging.getLogger(__name__)


class FireLoop:
    """run: the fire loop of one shard (with one orphan recovery sweep beside it); wake: cut its sleep short."""

    def __init__(
        self,
        state: ShardState,
        firer: Firer,
        trimmer: HistoryTrimmer,
        recoverer: Recoverer,
        *,
        on_listener_state: StateHook | None = None,
    ) -> None:
        self._state = state
        self._firer = firer
        self._trimmer = trimmer
        self._recoverer = recoverer
        # The wake listener of the running loop (supervised), and who hears of its ends.
        self.listener: Supervised | None = None
        self._on_listener_state = on_listener_state

    async def run(self, stop: asyncio.Event | None = None, beat: Callable[[], None] | None = None) -> None:
        """Fire due messages until `stop` is set; survives Redis outages.

        `beat` is called before each pass (liveness.Supervised.beat: a loop
        that stops beating shows as stalled). A cancellation request left on
        the task is not read as a stop: stopping is the stop flag's business
        (see liveness.py). Without `stop`, the loop runs supervised until this
        task is cancelled.
        """
        st = self._state
        if stop is None:
            body = functools.partial(self.run, beat=beat)
            await run_until_cancelled([Supervised(f"fire loop of {st.keys.stream}", body)])
            return
        listener = Supervised(
            f"wake listener of {st.keys.stream}", self._listen_wake, on_state=self._on_listener_state
        )
        self.listener = listener
        listener.start()
        # Beside the loop, not before it: a long stream must not hold up the first fires.
        recovery = (
            asyncio.create_task(
                self._recoverer.recover_at_start(stop), name=f"orphan recovery of {st.keys.stream}"
            )
            if st.config.recover_orphans
            else None
        )
        backoff = st.config.retry_profile().backoff()
        try:
            while not stop.is_set():
                if beat is not None:
                    beat()
                try:
                    # Cleared before looking, not before sleeping: a wake-up that
                    # arrives while this batch runs (the listener's first one
                    # after subscribing, a schedule) must cut the next sleep short.
                    st.wake.clear()
                    # asyncio.timeout, not wait_for: wait_for can swallow a
                    # cancellation that races with completion (Python < 3.12).
                    async with asyncio.timeout(st.config.op_timeout_s):
                        # Refills a dead replica left are reported by FIRE as due
                        # and completed by fire_due, like this replica's own.
                        fired, head = await self._firer.fire_due()
                        await self._trimmer.trim()
                    backoff.reset()
                except (RedisError, TimeoutError) as exc:
                    delay = backoff.next()
                    log.warning(
                        "delay engine on %s: redis error %s; retrying in %.2fs", st.keys.stream, exc, delay
                    )
                    await self._sleep_or_stop(stop, delay)
                    continue
                except Exception:
                    # A bug here or in a hook must not end firing for the whole
                    # app (the task would just be gone): log it, back off, go on.
                    delay = backoff.next()
                    log.exception("delay engine on %s failed; retrying in %.2fs", st.keys.stream, delay)
                    await self._sleep_or_stop(stop, delay)
                    continue
                if stop.is_set():
                    break
                if fired or (head is not None and head <= st.clock.now_ms()):
                    continue  # more may be due right now: no sleep between batches
                await self._sleep_until(head, stop)
        finally:
            if recovery is not None:
                recovery.cancel()
                # Waited for, not awaited: its cancellation is not this task's.
                await asyncio.wait({recovery})
            # Bounded: closing a pub/sub connection to a dead server may hang.
            await listener.stop(timeout_s=1.0)

    async def _sleep_or_stop(self, stop: asyncio.Event, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await stop.wait()

    async def _sleep_until(self, head: int | None, stop: asyncio.Event) -> None:
        st = self._state
        timeout = st.config.max_sleep_s
        if head is not None:
            timeout = min(timeout, max(0.0, (head - st.clock.now_ms()) / 1000))
        waker = asyncio.ensure_future(st.wake.wait())
        sleeper = asyncio.ensure_future(st.clock.sleep(timeout))
        stopper = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait({waker, sleeper, stopper}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (waker, sleeper, stopper):
                t.cancel()

    def wake(self) -> None:
        """Re-check the index now (used by this process after it schedules)."""
        self._state.wake.set()

    async def _listen_wake(self, stop: asyncio.Event) -> None:
        st = self._state
        backoff = st.config.retry_profile().backoff()
        while not stop.is_set():
            pubsub = st.listen_redis.pubsub(ignore_subscribe_messages=True)
            try:
                # A Redis Cluster client maps the slots on its first command; its
                # pub/sub cannot find the channel's node before that (KeyError).
                await st.listen_redis.ping()
                await pubsub.subscribe(st.keys.wake)
                # A message may have been missed while (re)subscribing.
                st.wake.set()
                backoff.reset()
                while not stop.is_set():
                    # get_message with a timeout, not listen(): an idle channel
                    # must not look like a dead socket to the read timeout.
                    msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                    if msg is not None:
                        st.wake.set()
            except RedisError as exc:
                log.debug("wake listener on %s: %s", st.keys.wake, exc)
                await self._sleep_or_stop(stop, backoff.next())
            except Exception:
                # Never die silently: a dead listener delays fires by up to max_sleep_s.
                log.warning("wake listener on %s failed; restarting it", st.keys.wake, exc_info=True)
                await self._sleep_or_stop(stop, backoff.next())
            finally:
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(1.0):
                        await pubsub.aclose()
