"""What becomes of a delivery the subscriber failed (a nack) or that used up its attempts.

Without a retry policy a nacked entry is held (NACK_HOLD: its idle time reset, so no
other stream reclaims it while it waits) and claimed back after redeliverInterval,
under the delivery count of the nack: if another stream delivered it meanwhile, that
delivery was the redelivery. With a retry policy the Retrier (redelivery.py) decides
and records instead. An entry claimed with its deliveries used up is dead-lettered in
the background. The entry stays in the group's PEL throughout, so whatever dies, it is
reclaimed after processingTimeout.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable, Coroutine
from typing import Any

from delayed_pubsub.calls import SubscriptionCalls
from delayed_pubsub.claims import Claimed, claim_unchanged, nack_hold
from delayed_pubsub.redelivery import Retrier

# The subscription's parts log as the broker did before they had files of their own.
log = logging.getLogger("delayed_pubsub.broker")


class Nacks:
    """One subscription's failed and given-up deliveries, each handled in a task of its own."""

    def __init__(
        self,
        calls: SubscriptionCalls,
        retry: Retrier | None,
        push: Callable[[str, Any, int, bool], None],
        slot_freed: Callable[[], None],
    ) -> None:
        self._calls = calls
        self._window = calls.window
        self._retry = retry
        self._push = push
        self._slot_freed = slot_freed
        self._timers: set[asyncio.Task[None]] = set()

    def retry_later(self, entry_id: str, attempt: int, error: str = "") -> None:
        """What happens to a message the subscriber failed on its `attempt`-th delivery.

        Without a retry policy: delivered again after redeliverInterval. With
        one, the Retrier records when it may come back (or dead-letters it).
        """
        if self._retry is not None:
            work: Coroutine[Any, Any, None] = self._retry_nack(self._retry, entry_id, error, attempt)
        else:
            work = self._redeliver(entry_id, attempt, self._calls.settings.redeliver_interval_ms / 1000)
        self._spawn(work, f"redeliver {entry_id}")

    def give_up(self, claimed: Claimed) -> None:
        """Dead-letter an entry claimed with its deliveries used up (claim_unchanged), in the
        background: a dead-letter topic that refuses writes must not hold up the fetch loop or
        the retry poller. Ours meanwhile, so our own reclaim passes leave it alone."""
        if self._retry is None or self._window.closed:
            return  # stays pending: another stream gives it up after processingTimeout
        self._window.owned.add(claimed.id)
        last = claimed.attempt - 1
        timeout_ms = self._calls.settings.processing_timeout_ms
        reason = f"delivery {last} not answered within processingTimeout ({timeout_ms}ms)"
        self._spawn(self._giving_up(self._retry, claimed, reason), f"give up {claimed.id}")

    async def hold(self, entry_id: str, attempt: int) -> tuple[int, Any]:
        """NACK_HOLD `entry_id` for this stream under delivery count `attempt` (claims.nack_hold)."""
        c = self._calls
        return await nack_hold(c.client, c.topic, c.group, c.consumer, entry_id, attempt)

    def cancel(self) -> list[asyncio.Task[None]]:
        """Closing: cancel every task still waiting; returns them, to be awaited."""
        timers = list(self._timers)
        for task in timers:
            task.cancel()
        return timers

    def _spawn(self, work: Coroutine[Any, Any, None], name: str) -> None:
        timer = asyncio.create_task(work, name=name)
        self._timers.add(timer)
        timer.add_done_callback(self._timers.discard)

    async def _retry_nack(self, retry: Retrier, entry_id: str, error: str, attempt: int) -> None:
        try:
            await retry.on_nack(entry_id, error, attempt)
        except Exception:
            # Still in the PEL: reclaimed after processingTimeout like any abandoned entry.
            log.exception("retry of %s on %s failed", entry_id, self._calls.topic)
        finally:
            # Its durable retry record (or its dead letter) owns it now: whichever
            # stream of the group the record's time finds redelivers it.
            self._window.disown(entry_id)
            self._window.can_fetch.set()

    async def _giving_up(self, retry: Retrier, claimed: Claimed, reason: str) -> None:
        try:
            await retry.give_up(claimed, reason)
        except Exception:
            # Still in the PEL, its count past the maximum: given up by the next reclaim pass.
            log.exception("giving up %s on %s failed", claimed.id, self._calls.topic)
        finally:
            self._window.disown(claimed.id)

    async def _redeliver(self, entry_id: str, attempt: int, delay_s: float) -> None:
        """Deliver `entry_id`, nacked on its `attempt`-th delivery, again after `delay_s`.

        Its idle time is reset now (NACK_HOLD), or another stream could reclaim it while
        it waits here; and the claim after the wait is made only under the delivery count
        of the nack: when redeliverInterval outlasts processingTimeout, another stream may
        still have delivered it meanwhile, and that delivery is the redelivery.
        """
        c = self._calls
        _, fields = await c.retrying("XCLAIM", lambda: self.hold(entry_id, attempt))
        claimed: list[Claimed] = []
        if fields is not None:
            await c.clock.sleep(delay_s)
            nonce = uuid.uuid4().hex
            claimed = await c.retrying(
                "XCLAIM",
                lambda: claim_unchanged(c.client, c.topic, c.group, c.consumer, {entry_id: attempt}, nonce=nonce),
            )
        if not claimed:
            # Deleted or trimmed while it waited, acked elsewhere, or delivered again by
            # another stream: nothing to redeliver here.
            self._window.owned.discard(entry_id)
            self._slot_freed()
            return
        self._push(entry_id, claimed[0].fields, claimed[0].attempt, True)
