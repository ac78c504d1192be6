"""A subscription's ack batcher: the subscriber's acks gathered into few XACKs.

Acks come in one per message; each Redis call costs ~50 us of CPU in redis-py, so
the ack loop sends, in one XACK per round trip, every ack that came in while the
previous XACK was on the wire, lingering a moment under load to gather more. When
the fetch loop is about to read (`reading_soon`), the read carries the queued acks
instead (fetch.Fetcher, one round trip for both), and the loop waits longer for it.
A slot is freed at the ack itself; only Redis waits. A batch whose call fails past
its retries goes back to the head of the queue, and close() sends whatever was on
the wire once more (XACK is idempotent).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Sequence
from typing import Any

import redis.exceptions

from delayed_pubsub.calls import SubscriptionCalls

# The subscription's parts log as the broker did before they had files of their own.
log = logging.getLogger("delayed_pubsub.broker")

# How long acks gather before one XACK sends them all (unless half a window is in).
ACK_LINGER_S = 0.002
# How long they may wait instead when the fetch loop waits for the slots they free:
# the read that fills those slots carries them, one round trip for both, unless the
# subscriber is slower than this (daprd calls the app for each message in turn).
ACK_LINGER_MAX_S = 0.01

Batch = tuple[list[str], "asyncio.Future[None] | None"]


class AckBatcher:
    """Queues a subscription's acks and XACKs them in batches (the ack loop, `run`)."""

    def __init__(self, calls: SubscriptionCalls) -> None:
        self._calls = calls
        self._window = calls.window
        # Acked (or expired) ids not yet sent to Redis, and the future the ack
        # loop resolves once the XACK holding them has landed.
        self.queued: list[str] = []
        self._landed: asyncio.Future[None] | None = None
        # When the first of the queued acks came (loop time): the ack loop sends them
        # ACK_LINGER_S after it, unless a read has carried them by then.
        self._since = 0.0
        # True while the fetch loop waits for free slots or an empty buffer: its
        # next read will carry the queued acks (Fetcher._read_new_acking).
        self.reading_soon = False
        # The batches on the wire (the ack loop's, a read's), each with its future.
        self._on_wire: list[Batch] = []
        self._wake = asyncio.Event()

    def queue(self, entry_id: str) -> None:
        """XACK `entry_id` with the next batch."""
        if not self.queued:
            self._since = asyncio.get_running_loop().time()
        self.queued.append(entry_id)
        self._wake.set()

    def landed(self) -> asyncio.Future[None]:
        """A future resolved once the XACK holding the acks queued so far has landed."""
        if self._landed is None:
            self._landed = asyncio.get_running_loop().create_future()
        return self._landed

    def wake(self) -> None:
        """Let the ack loop look at its stop flag (stopping)."""
        self._wake.set()

    async def run(self, stop: asyncio.Event) -> None:
        """The ack loop (a Supervised body)."""
        while not stop.is_set():
            if not self.queued:
                self._wake.clear()
                await self._wake.wait()
                continue
            if len(self.queued) < self._window.low_water or self.reading_soon:
                # Under load acks arrive one per message: gathering them for a
                # moment makes one XACK of many (each Redis call costs ~50 us of
                # CPU in redis-py). Slots are freed already; only Redis waits.
                # Counted from the first queued ack: a read that carried the
                # earlier ones (Fetcher._read_new_acking) started the count again.
                linger = ACK_LINGER_MAX_S if self.reading_soon else ACK_LINGER_S
                wait_s = self._since + linger - asyncio.get_running_loop().time()
                if wait_s > 0:
                    await asyncio.sleep(wait_s)
                    continue
            batch, landed = self.take()
            try:
                await self._calls.retrying("XACK", functools.partial(self._xack, batch))
            except redis.exceptions.ResponseError as e:
                # Ids come from Redis, so only a key turned into something else
                # gets here; never let it end the stream.
                self.refused(batch, e)
            except BaseException:
                self.back(batch, landed)
                raise
            self.landed_now(batch, landed)

    def take(self) -> Batch:
        """The acks queued so far, and their future, now on the wire (close() sends them again
        if the call carrying them does not come back)."""
        batch, landed = self.queued, self._landed
        self.queued, self._landed = [], None
        self._on_wire.append((batch, landed))
        return batch, landed

    def back(self, batch: list[str], landed: asyncio.Future[None] | None) -> None:
        """A batch whose call failed past its retries: back at the head of the queue, its
        future resolved with the batch that carries it next (or by close()). Left on the
        wire list, nothing would send it before close(), and its entries would time out
        in our PEL and be delivered again by another stream."""
        self._on_wire = [b for b in self._on_wire if b[0] is not batch]
        if not batch:
            return
        if not self.queued:
            self._since = asyncio.get_running_loop().time()
        self.queued[:0] = batch
        if landed is not None and not landed.done():

            def carried(_: asyncio.Future[None]) -> None:
                if not landed.done():
                    landed.set_result(None)

            self.landed().add_done_callback(carried)
        self._wake.set()

    def landed_now(self, batch: list[str], landed: asyncio.Future[None] | None) -> None:
        """The call carrying `batch` came back: its entries are no longer ours."""
        self._on_wire = [b for b in self._on_wire if b[0] is not batch]
        self._window.owned.difference_update(batch)
        self._calls.metrics.acked.inc(len(batch))
        if landed is not None and not landed.done():
            landed.set_result(None)

    def refused(self, batch: list[str], e: BaseException) -> None:
        """Redis refused the XACK of `batch` (logged; the stream goes on)."""
        log.warning("cannot ack %d entries on %s: %s", len(batch), self._calls.topic, e)

    def unsent(self) -> list[str]:
        """Every ack not known to have landed: those on the wire (the batch that was on the
        wire when the ack loop was cancelled may or may not have landed) and those queued."""
        return [*(i for batch, _ in self._on_wire for i in batch), *self.queued]

    def forget(self) -> None:
        """Closing: resolve every waiting future (the acks were sent once more, or could not
        be) and drop the queue."""
        for landed in (self._landed, *(f for _, f in self._on_wire)):
            if landed is not None and not landed.done():
                landed.set_result(None)
        self.queued, self._on_wire = [], []

    async def _xack(self, ids: Sequence[str]) -> Any:
        calls = self._calls
        if not calls.lean:
            return await calls.client.xack(calls.topic, calls.group, *ids)
        (reply,) = await calls.round_trip(("XACK", calls.topic, calls.group, *ids))
        if isinstance(reply, Exception):
            raise reply
        return reply
