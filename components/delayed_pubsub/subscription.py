"""One PullMessages stream's subscription: its lifecycle and the subscriber's side of the window.

The parts, each in a file of its own: the fetch loop and reclaim pass (fetch.py), the
ack batcher (acks.py), nacks and give-ups (nacks.py), and, with a retry policy, the
Retrier (redelivery.py). Each is given one SubscriptionCalls (calls.py): who the
subscription is on Redis, the window's state they share (window.py), and its Redis
calls retried until they work. This class starts and stops them and hands
messages out: deliveries(), ack(), nack().
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from delayed_middleware.aio import raise_if_stopped
from delayed_middleware.backoff import REDIS_RECONNECT
from delayed_middleware.clock import Clock
from delayed_middleware.entry import EntryReader
from delayed_middleware.liveness import Supervised
from delayed_pubsub.acks import AckBatcher
from delayed_pubsub.calls import SubscriptionCalls
from delayed_pubsub.claims import give_back, nack_hold
from delayed_pubsub.connection import REDIS_ERRORS, RedisPyClient, call_timeout
from delayed_pubsub.fetch import BLOCK_MS, Fetcher
from delayed_pubsub.lua import DELETE_IDLE_CONSUMER
from delayed_pubsub.metrics import InstanceMetrics, Metrics
from delayed_pubsub.nacks import Nacks
from delayed_pubsub.redelivery import Retrier
from delayed_pubsub.settings import Settings
from delayed_pubsub.window import Delivery, Window, expired

# The subscription's parts log as the broker did before they had files of their own.
log = logging.getLogger("delayed_pubsub.broker")

_CLOSE_ERRORS: tuple[type[BaseException], ...] = (*REDIS_ERRORS, TimeoutError)


class Subscription:
    """One PullMessages stream's view of a topic.

    Three loops share the window: a fetch loop (XPENDING and XCLAIM of abandoned
    entries every redeliverInterval, else XREADGROUP BLOCK for new ones) fills
    its buffer; `deliveries()` hands entries out while fewer than `concurrency` are
    unacked; an ack loop XACKs, in one command per round trip, every ack that
    came in while the previous XACK was on the wire. Nacks wait
    redeliverInterval and XCLAIM the entry back, which bumps its delivery count,
    unless another stream delivered it meanwhile (the claim names the nacked
    count); with a retry policy (`retry`) the Retrier decides instead.
    Entries past their `expiresAt` are acked away, never delivered. Every Redis
    call is retried until it works or the subscription closes: daprd never
    re-opens a stream that ended.
    """

    def __init__(
        self,
        client: RedisPyClient,
        settings: Settings,
        clock: Clock,
        topic: str,
        consumer: str,
        paused: bool = False,
        metrics: InstanceMetrics | None = None,
        blocking_client: RedisPyClient | None = None,
    ) -> None:
        self._window = window = Window(settings.concurrency, settings.queue_depth, paused)
        self.topic = topic
        self.consumer = consumer
        self._settings = settings
        self._clock = clock
        self._metrics = metrics = metrics or Metrics().for_instance("")
        # The window's containers, named here as well: the subscriber's side touches them
        # once or twice per message.
        self._ready, self._unacked = window.ready, window.unacked
        self._owned, self._ready_at = window.owned, window.ready_at
        base = call_timeout(settings)
        self._calls = SubscriptionCalls(
            client=client,
            blocking_client=blocking_client if blocking_client is not None else client,
            settings=settings,
            topic=topic,
            consumer=consumer,
            window=window,
            clock=clock,
            metrics=metrics,
            timeout=None if base is None else base + BLOCK_MS / 1000,
        )
        self._acks = AckBatcher(self._calls)
        # What the fetch loop and retries read, decoded (the same metadata parsed once).
        self._decode = EntryReader()
        self._fetcher: Supervised | None = None
        self._acker: Supervised | None = None
        # Built by start(), once `retry` is known.
        self._nacks: Nacks | None = None
        self._shut = False
        # The retry policy's executor (redelivery.py), when one is configured; set before start().
        self.retry: Retrier | None = None

    # --- lifecycle ------------------------------------------------------------

    async def start(self) -> None:
        """Create the consumer group (retrying while Redis is down) and start fetching."""
        await self._calls.retrying("XGROUP CREATE", self._calls.create_group)
        raise_if_stopped(self._window.closed)  # stopped while creating the group
        nacks = self._nacks = Nacks(self._calls, self.retry, self._push, self._slot_freed)
        fetcher = Fetcher(self._calls, self._acks, self.retry, self._push, nacks.give_up)
        # Supervised: without the fetch loop nothing new is ever sent, and daprd
        # (which never re-opens a stream) would wait on this one forever; without
        # the ack loop every message would come back after processingTimeout.
        # Whatever ends either but our stop is logged, counted and restarted.
        self._fetcher = Supervised(
            f"fetch loop of {self.topic} as {self.consumer}",
            fetcher.run,
            backoff=REDIS_RECONNECT.backoff(),
            on_state=self._metrics.loop_state("fetch"),
        )
        self._acker = Supervised(
            f"ack loop of {self.topic} as {self.consumer}",
            self._acks.run,
            backoff=REDIS_RECONNECT.backoff(),
            on_state=self._metrics.loop_state("ack"),
        )
        self._fetcher.start()
        self._acker.start()
        if self.retry is not None:
            self.retry.room = self._window.room
            self.retry.start(lambda i, f, attempt: self._push(i, f, attempt, True), nacks.give_up)

    def loops(self) -> list[Supervised]:
        """The subscription's supervised loops (fetch, ack, and the retry poller), once started."""
        found = [loop for loop in (self._fetcher, self._acker) if loop is not None]
        if self.retry is not None and self.retry.loop is not None:
            found.append(self.retry.loop)
        return found

    def stop(self) -> None:
        """Make deliveries() end; close() finishes the job."""
        window = self._window
        window.closed = True
        # Our stop flag (see delayed_middleware.liveness): the loops end on it.
        for loop in (self._fetcher, self._acker):
            if loop is not None:
                loop.stop_flag.set()
        if self.retry is not None:
            self.retry.stop()
        window.can_send.set()
        window.can_fetch.set()
        self._acks.wake()

    async def close(self) -> None:
        """Stop fetching and sending, XACK what was acked, give back what was never sent, and
        remove our consumer if it holds nothing.

        Whatever was sent and not acked stays pending in Redis, and comes back after
        processingTimeout. What waited in the buffer, never sent, is given back at the
        delivery count it had before we read it, idle enough for any stream to take it at once.
        """
        if self._shut:
            return
        self._shut = True
        self.stop()
        timers = self._nacks.cancel() if self._nacks is not None else []
        loops = [loop.stop() for loop in (self._fetcher, self._acker) if loop is not None]
        await asyncio.gather(*loops, *timers, return_exceptions=True)
        if self.retry is not None:
            await self.retry.close()
        # The batch that was on the wire when the ack loop was cancelled may or
        # may not have landed: XACK is idempotent, send it again with the rest.
        last = self._acks.unsent()
        client, group = self._calls.client, self._calls.group
        try:
            if last:
                await asyncio.wait_for(client.xack(self.topic, group, *last), timeout=2)
                self._metrics.acked.inc(len(last))
            await self._give_back()
            await asyncio.wait_for(
                client.eval(DELETE_IDLE_CONSUMER, 1, self.topic, group, self.consumer),
                timeout=2,
            )
        except _CLOSE_ERRORS as e:
            # Harmless: an idle consumer left behind holds nothing, and an ack
            # that did not land means one redelivery after processingTimeout.
            log.info("closing consumer %s of %s: %s", self.consumer, self.topic, e)
        finally:
            self._acks.forget()

    async def _give_back(self) -> None:
        """Give back the entries read or claimed and never sent (GIVE_BACK): each read bumped
        the entry's delivery count, and counted toward maxDeliveryAttempts an entry buffered by
        two streams that closed in turn (two rolling restarts) would be dead-lettered unseen."""
        window = self._window
        unsent = [(d.id, d.attempt) for d in window.ready] + window.unsent
        window.ready.clear()
        window.unsent = []
        if not unsent:
            return
        c = self._calls
        given = await asyncio.wait_for(
            give_back(c.client, c.topic, c.group, c.consumer, unsent, self._settings.processing_timeout_ms),
            timeout=2,
        )
        log.info("%s on %s: gave back %d of %d unsent entries", self.consumer, self.topic, given, len(unsent))

    @property
    def closed(self) -> bool:
        """True once stop() or close() has been called."""
        return self._window.closed

    @property
    def buffered(self) -> int:
        """Entries read from Redis (pending for this stream) and not yet handed to the subscriber."""
        return len(self._ready)

    @property
    def in_flight(self) -> int:
        """Messages sent to the subscriber and not yet acked or nacked (a graceful stop waits for them)."""
        return len(self._unacked)

    def pause(self) -> None:
        """Stop handing out new messages (acks still go through)."""
        self._window.paused = True
        self._window.can_fetch.set()

    def resume(self) -> None:
        """Hand out messages again."""
        self._window.paused = False
        self._window.can_send.set()
        self._window.can_fetch.set()

    # --- the subscriber side ---------------------------------------------------

    async def deliveries(self) -> AsyncIterator[Delivery]:
        """Messages to send, at most `concurrency` unacked at once; ends on close()."""
        limit = self._settings.concurrency
        window = self._window
        ready, unacked, delivered = self._ready, self._unacked, self._metrics.delivered
        can_send, can_fetch = window.can_send, window.can_fetch
        ready_at, loop = self._ready_at, asyncio.get_running_loop()
        # A delivery that waited in the buffer this long (s) is checked before it goes out.
        check_after = self._settings.processing_timeout_ms / 2000
        while not window.closed:
            if ready and not window.paused and len(unacked) < limit:
                delivery = ready.popleft()
                waited = loop.time() - ready_at.pop(delivery.id, 0.0)
                if 0 < check_after <= waited and not await self._still_ours(delivery):
                    self._slot_freed()
                    continue
                if expired(delivery.entry, self._clock):
                    # Its TTL ended while it waited in our buffer: never delivered.
                    self._expire(delivery.id)
                    if not ready:
                        can_fetch.set()
                    continue
                unacked[delivery.id] = delivery.attempt
                if not ready:
                    can_fetch.set()  # the fetch loop may wait for an empty buffer
                delivered.inc()
                yield delivery
                continue
            can_send.clear()
            await can_send.wait()

    async def _still_ours(self, delivery: Delivery) -> bool:
        """Whether a delivery that waited in the buffer for half processingTimeout or more
        (deliveries() asks only then) may be handed out: only if nobody has taken it over
        meanwhile.

        An entry waiting in the buffer sits in our PEL going idle; past processingTimeout
        another stream's reclaim pass may deliver it, and handing out our copy as well
        would deliver it twice at once. NACK_HOLD under the count it came with tells
        (every delivery bumps the count) and resets its idle time, so no reclaim pass takes
        it while the subscriber works on it.
        """
        try:
            c = self._calls
            _, fields = await c.retrying(
                "XCLAIM",
                lambda: nack_hold(c.client, c.topic, c.group, c.consumer, delivery.id, delivery.attempt),
            )
        except asyncio.CancelledError:
            if self._window.closed:
                # Closing: back in the buffer, never sent, so close() gives it back.
                self._ready.appendleft(delivery)
                return False
            raise
        if fields is not None:
            return True
        log.info(
            "%s on %s: taken over while it waited in the buffer (delivery %d); not handed out",
            delivery.id,
            self.topic,
            delivery.attempt,
        )
        self._window.disown(delivery.id)
        return False

    def ack_nowait(self, entry_id: str) -> bool:
        """The subscriber processed `entry_id`: free its slot and queue its XACK.

        Only an id this stream sent and has not seen acked or nacked counts:
        anything else (an id of another stream, a repeat, garbage) is ignored,
        so a stream cannot ack away a message another stream holds. Returns
        whether the ack was taken.
        """
        if self._unacked.pop(entry_id, None) is None:
            log.debug("ack of %r, which this stream does not hold; ignored", entry_id)
            return False
        window = self._window
        window.acked_in_turn += 1
        if window.acked_in_turn >= window.concurrency:
            window.turned(asyncio.get_running_loop().time())
        self._acks.queue(entry_id)
        self._slot_freed()
        return True

    async def ack(self, entry_id: str) -> None:
        """ack_nowait(), then wait until the XACK holding it has landed (or the subscription closed)."""
        if self.ack_nowait(entry_id) and self._acker is not None and not self._acker.stopping:
            await asyncio.shield(self._acks.landed())

    def nack(self, entry_id: str, error: str = "") -> None:
        """The subscriber failed `entry_id` (with `error`): free its slot and decide its fate (nacks.py).

        The entry stays in the PEL meanwhile, so if this process dies it is
        reclaimed by another consumer after processingTimeout.
        """
        attempt = self._unacked.pop(entry_id, None)
        if attempt is None:
            log.warning("nack of %r, which this stream does not hold; ignored", entry_id)
            return
        self._metrics.nacked.inc()
        self._slot_freed()
        if self._nacks is not None:
            self._nacks.retry_later(entry_id, attempt, error)

    # --- the window -------------------------------------------------------------

    def _push(self, entry_id: str, fields: Any, attempt: int, requeue: bool = False) -> None:
        """Queue a delivery read or claimed from Redis (`requeue`: even if we saw the id before)."""
        window = self._window
        if entry_id in self._owned and not requeue:
            return
        if window.closed:
            # Read or claimed as the stream closed: never sent, close() gives it back.
            window.unsent.append((entry_id, attempt))
            return
        # Decoded before it counts as ours: if that fails, our own reclaim pass
        # must still be able to pick it up.
        entry = self._decode(fields)
        self._owned.add(entry_id)
        if expired(entry, self._clock):
            # Its TTL ended in the stream or while waiting for a redelivery.
            self._expire(entry_id)
            return
        self._ready.append(Delivery(entry_id, self.topic, entry, attempt))
        self._ready_at[entry_id] = asyncio.get_running_loop().time()
        window.can_send.set()

    def _slot_freed(self) -> None:
        window, retry = self._window, self.retry
        if self._ready:
            window.can_send.set()
        if retry is not None:
            retry.room_freed()
        # Wake the fetch loop once half the window is free, or at the first free
        # slot (it then lingers a moment for more acks), or when nothing is in flight.
        free, low_water = window.read_room(
            asyncio.get_running_loop().time(), retry is None or not retry.wants_room
        )
        if free >= low_water or free == 1 or not self._unacked:
            window.can_fetch.set()

    def _expire(self, entry_id: str) -> None:
        """Never deliver `entry_id` (its TTL ended): XACK it with the next batch and count it."""
        log.debug("dropping %s on %s: its TTL ended before delivery", entry_id, self.topic)
        self._metrics.expired.inc()
        self._acks.queue(entry_id)
