"""A subscription's fetch loop: new entries (XREADGROUP) and abandoned ones (the reclaim pass).

It fills the window's buffer no further than its free slots: an entry read into the
buffer sits in the group's PEL going idle, and past processingTimeout another stream
would deliver it too. Every redeliverInterval a reclaim pass takes over entries idle
past processingTimeout that no stream holds (XPENDING, then claim_unchanged);
otherwise it blocks on XREADGROUP for new ones. A read that fills slots acks freed
carries those acks (one round trip for both).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

import redis.exceptions

from delayed_middleware.aio import text
from delayed_middleware.backoff import REDIS_RECONNECT
from delayed_pubsub.acks import AckBatcher
from delayed_pubsub.calls import SubscriptionCalls
from delayed_pubsub.claims import Claimed, claim_unchanged
from delayed_pubsub.redelivery import Retrier

# The subscription's parts log as the broker did before they had files of their own.
log = logging.getLogger("delayed_pubsub.broker")

# How long the fetch loop waits for more acks when less than half the window is free.
FETCH_LINGER_S = 0.002
# A reclaim pass reads at most this many XPENDING pages to find its count of abandoned
# entries among those it holds or that wait out a retry backoff; the next pass goes on.
RECLAIM_PAGES = 4
# How many rows a page adds for entries this stream holds (XPENDING lists them too).
RECLAIM_OWNED_SLACK = 256
# The fewest rows a reclaim pass asks XPENDING for at a time.
RECLAIM_PAGE_MIN = 100

# How long an XREADGROUP blocks: short blocks keep a dead connection from going unnoticed for long.
BLOCK_MS = 1000

# Queues a delivery in the window: (entry id, fields, attempt, requeue).
Push = Callable[[str, Any, int, bool], None]


def _parsed(reply: Any) -> Any:
    """A raw XREADGROUP reply (RESP3: {stream: [[id, [field, value, ...]], ...]}; RESP2:
    [[stream, [...]], ...]) in the shape redis-py's callback gives, [[stream, [(id, fields)]]],
    but each entry's fields left as the reply's flat [field, value, ...] list (decode_entry
    reads it as it is: no dict per entry). An entry deleted while pending has no fields: left
    out, as the read of new entries (">") never returns one."""
    if not reply:
        return []
    streams = reply.items() if isinstance(reply, dict) else reply
    return [(name, [(i, f) for i, f in items if f is not None]) for name, items in streams]


class Fetcher:
    """One subscription's fetch loop (`run`), reading as `consumer` of `group` on `topic`."""

    def __init__(
        self,
        calls: SubscriptionCalls,
        acks: AckBatcher,
        retry: Retrier | None,
        push: Push,
        give_up: Callable[[Claimed], None],
    ) -> None:
        self._calls = calls
        self._settings = calls.settings
        self._window = calls.window
        self._acks = acks
        self._retry = retry
        self._push = push
        self._give_up = give_up
        self._reclaim_cursor = "-"
        self._reclaim_round_at = time.monotonic()

    async def run(self, stop: asyncio.Event) -> None:
        """The fetch loop (a Supervised body)."""
        window, acks, retry = self._window, self._acks, self._retry
        next_reclaim = 0.0
        reclaim_every = self._settings.redeliver_interval_ms / 1000
        backoff = REDIS_RECONNECT.backoff()
        lingered = False
        loop = asyncio.get_running_loop()
        # Whether this read fills slots that acks freed: then it carries those acks.
        waited = False
        while not window.closed and not stop.is_set():
            try:
                # Fetch no more than the free slots (the buffer holds some): entries
                # read into a buffer sit in our PEL, and could time out there and be
                # claimed twice. With half the window free, and more free slots than
                # entries buffered, fetch even while the buffer is being handed out:
                # PullMessages writes one message at a time, and a fire that lands
                # meanwhile is read at once, not after the last write of the one
                # before. Otherwise wait for the buffer to empty: the read then fills
                # more slots at once, and carries the acks that came meanwhile.
                free, low_water = window.read_room(loop.time(), retry is None or not retry.wants_room)
                ready = len(window.ready)
                if window.paused or free <= 0 or (ready and (free < low_water or free <= ready)):
                    acks.reading_soon = waited = not window.paused
                    await self._wait_fetch()
                    continue
                if free < low_water and window.unacked and not lingered:
                    # Under load acks come in a stream: a moment's wait lets one
                    # read fill half the window. A slow subscriber costs 2 ms.
                    lingered = waited = acks.reading_soon = True
                    await self._wait_fetch(FETCH_LINGER_S)
                    continue
                lingered = False
                # Read ahead no further than one queueDepth: what waits in the buffer
                # ages in our PEL at the pace of the writes, not of the window, and
                # past processingTimeout another stream would deliver it too.
                count = min(self._settings.queue_depth - ready, free)
                if count <= 0:
                    acks.reading_soon = waited = True
                    await self._wait_fetch()
                    continue
                carry, waited = waited and bool(acks.queued), False
                acks.reading_soon = False
                now = time.monotonic()
                # redeliverInterval 0 turns reclaiming off, as in pubsub.redis.
                if reclaim_every > 0 and now >= next_reclaim:
                    next_reclaim = now + reclaim_every
                    if await self._reclaim(count):
                        continue
                if carry and acks.queued:  # the ack loop may have sent them during the reclaim
                    await self._read_new_acking(count)
                    continue
                block = BLOCK_MS
                if reclaim_every > 0:
                    block = max(1, min(block, int((next_reclaim - time.monotonic()) * 1000)))
                await self._calls.retrying("XREADGROUP", functools.partial(self._read_new, count, block))
            except Exception:
                # Whatever retrying does not handle (a bug, a reply we did not
                # expect) must not end the loop: daprd never re-opens the stream.
                log.exception("fetching %s as %s failed; retrying", self._calls.topic, self._calls.consumer)
                await self._calls.clock.sleep(backoff.next())
            else:
                backoff.reset()

    async def _wait_fetch(self, linger_s: float | None = None) -> None:
        can_fetch = self._window.can_fetch
        can_fetch.clear()
        if linger_s is None:
            await can_fetch.wait()
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(linger_s):
                await can_fetch.wait()

    async def _read_new_acking(self, count: int) -> None:
        """XACK the queued acks and read up to `count` new entries, in one round trip.

        Under a backlog every read follows acks that freed its slots: sending
        both together halves the Redis calls per message. The read does not
        block (the XACK's reply would wait with it); if it finds nothing, the
        next pass blocks as usual.
        """
        acks, c = self._acks, self._calls
        batch, landed = acks.take()

        async def call() -> Any:
            if c.lean:
                acked, read = await c.round_trip(
                    ("XACK", c.topic, c.group, *batch),
                    ("XREADGROUP", "GROUP", c.group, c.consumer, "COUNT", count, "STREAMS", c.topic, ">"),
                )
                read = read if isinstance(read, Exception) else _parsed(read)
            else:
                pipe = c.client.pipeline(transaction=False)
                pipe.xack(c.topic, c.group, *batch)
                pipe.xreadgroup(c.group, c.consumer, {c.topic: ">"}, count=count)
                acked, read = await pipe.execute(raise_on_error=False)
            if isinstance(read, Exception):
                raise read  # retried as a plain read's error is (XACK is idempotent)
            if isinstance(acked, redis.exceptions.ResponseError):
                acks.refused(batch, acked)
            return read

        try:
            reply = await c.retrying("XREADGROUP", call)
        except BaseException:
            acks.back(batch, landed)
            raise
        acks.landed_now(batch, landed)
        self._push_read(reply)

    async def _read_new(self, count: int, block_ms: int) -> None:
        c = self._calls
        reply: Any = await c.blocking_client.xreadgroup(
            c.group, c.consumer, {c.topic: ">"}, count=count, block=block_ms
        )
        self._push_read(reply)

    def _push_read(self, reply: Any) -> None:
        push = self._push
        for _stream, items in reply or ():
            for raw_id, fields in items:
                push(text(raw_id), fields, 1, False)

    async def _reclaim(self, count: int) -> int:
        """Take over up to `count` entries idle past processingTimeout; returns how many were taken.

        Listed first, claimed after, each only if its delivery count is still the
        listed one (claim_unchanged): a retry poller that took an entry's record
        after it was listed has claimed it, or will, under that same count, and
        exactly one of the two delivers it. Listing takes nothing, so a failure
        anywhere here strands nothing: the next pass lists the same entries.
        """
        listed = await self._idle_entries(count)
        if not listed:
            return 0
        # A repeat after a lost reply claims nothing twice (the first try bumped the
        # counts) and hands back what the first try claimed (the nonce's memo).
        nonce = uuid.uuid4().hex
        c = self._calls
        claimed = await c.retrying(
            "XCLAIM",
            lambda: claim_unchanged(
                c.client,
                c.topic,
                c.group,
                c.consumer,
                listed,
                self._settings.processing_timeout_ms,
                nonce=nonce,
                max_attempts=self._max_attempts(),
            ),
        )
        unacked = self._window.unacked
        for entry in claimed:
            if entry.given_up:
                self._give_up(entry)
            else:
                # requeue: a takeover of an entry whose earlier delivery our subscriber still
                # holds (see _idle_entries) is a delivery of its own.
                self._push(entry.id, entry.fields, entry.attempt, entry.id in unacked)
        if claimed:
            log.info(
                "reclaimed %d entries of %s idle > %dms",
                len(claimed),
                c.topic,
                self._settings.processing_timeout_ms,
            )
        return len(claimed)

    async def _idle_entries(self, count: int) -> dict[str, int]:
        """Up to `count` of the group's entries idle past processingTimeout that we do not hold
        and that wait for no retry, with their delivery counts; the passes go round the PEL.

        Each pass goes on from where the last one stopped (the cursor), and once per
        processingTimeout a pass looks at the PEL's head instead, leaving the cursor where
        it was: an entry that went idle behind the cursor waits at most about two
        processingTimeouts however long a backlog lasts, and the cursor still gets round
        a head that never empties. Entries this stream holds, and entries waiting out a
        retry backoff, do not use up `count`: a pass reads up to RECLAIM_PAGES pages to
        fill it, so a long run of them at the head cannot hide an abandoned entry.
        """
        now = time.monotonic()
        head = False
        if now - self._reclaim_round_at >= self._settings.processing_timeout_ms / 1000:
            head, self._reclaim_round_at = self._reclaim_cursor != "-", now
        cursor = "-" if head else self._reclaim_cursor
        owned, c = self._window.owned, self._calls
        # XPENDING cannot leave out what we hold: the page is that much longer, up to a bound
        # (a page that yields too little is followed by the next one, not stalled on).
        # At least RECLAIM_PAGE_MIN rows: a long run of entries waiting out retry backoffs is
        # crossed in a few calls, and a pass that fills its count early stops inside the page.
        page = max(RECLAIM_PAGE_MIN, count + min(len(owned), RECLAIM_OWNED_SLACK))
        limited = self._max_attempts() is not None
        found: dict[str, int] = {}
        for _ in range(RECLAIM_PAGES):
            rows: Any = await c.retrying(
                "XPENDING",
                functools.partial(
                    c.client.xpending_range,
                    c.topic,
                    c.group,
                    min=cursor,
                    max="+",
                    count=page,
                    idle=self._settings.processing_timeout_ms,
                ),
            )
            ids = [text(row["message_id"]) for row in rows]
            listed = {
                i: int(row["times_delivered"])
                for i, row in zip(ids, rows, strict=True)
                if i not in owned or (limited and self._taken_from_us(i, row))
            }
            wanted = count - len(found)
            if self._retry is not None and listed:
                # Entries waiting out a retry backoff are not abandoned: not yet.
                free, seen = await self._retry.hold_back(list(listed), wanted)
            else:
                free = list(listed)[:wanted]
                seen = len(free)
            found.update((i, listed[i]) for i in free)
            short = len(rows) < page
            if len(found) >= count and seen < len(listed):
                # Stopped inside the page: the next pass goes on after the last id used.
                cursor = f"({list(listed)[seen - 1]}"
                short = False
            elif ids:
                cursor = f"({ids[-1]}"
            if short:
                cursor = "-"
            if short or len(found) >= count:
                break
        if not head or cursor == "-":
            # A head pass leaves the cursor for the next pass, unless it went round the PEL.
            self._reclaim_cursor = cursor
            if cursor == "-":
                self._reclaim_round_at = now
        return found

    def _max_attempts(self) -> int | None:
        """maxDeliveryAttempts of this subscription's retry policy (None: unlimited)."""
        return None if self._retry is None else self._retry.policy.max_attempts

    def _taken_from_us(self, entry_id: str, row: Any) -> bool:
        """Whether our subscriber holds an earlier delivery of `entry_id` that another stream
        has taken over since (the PEL names another consumer), the entry now idle there.

        With maxDeliveryAttempts such an entry is abandoned like any other: every takeover
        counts, so an app that never answers on any stream still uses its attempts up and
        the entry reaches the dead-letter topic. Without a limit it stays with the streams
        that hold it (slow is not dead), rather than going round them for ever.
        """
        return (
            entry_id in self._window.unacked
            and entry_id not in self._window.ready_at
            and text(row["consumer"]) != self._calls.consumer
        )
