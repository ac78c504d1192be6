"""A subscription's delivery window: what it holds of a topic, shared by its parts.

One plain object, reached by each part of a Subscription through the SubscriptionCalls
it is given (calls.py): the fetch loop (fetch.py), the ack batcher (acks.py), nacks and
give-ups (nacks.py). What it holds:

  - `ready`: entries read or claimed, not yet handed to the subscriber, and
    `ready_at`, when each was (one that waited long is checked before it goes out);
  - `unacked`: sent to the subscriber and not yet acked or nacked, with the attempt
    each was sent as: each holds one of `concurrency` slots;
  - `owned`: every id the stream is responsible for, so a reclaim pass never hands
    one out a second time;
  - the two wake-ups (`can_send` for deliveries(), `can_fetch` for the fetch loop)
    and the pause and stop flags.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass

from delayed_middleware.clock import Clock
from delayed_middleware.entry import StreamEntry

DELIVERY_ATTEMPT = "deliveryAttempt"
# A subscriber that acks a whole window within this long gets more windows read ahead.
READ_AHEAD_PACE_S = 0.04
# How many windows ahead of the slots in use the fetch loop reads for such a subscriber
# (at most one queueDepth).
READ_AHEAD_WINDOWS = 3


@dataclass(frozen=True)
class Delivery:
    """One message handed to a subscriber; `id` is the stream entry id, used to ack it."""

    id: str
    topic: str
    entry: StreamEntry
    attempt: int

    @property
    def metadata(self) -> dict[str, str]:
        """The publish metadata plus `deliveryAttempt` (1 on first delivery)."""
        return {**self.entry.metadata, DELIVERY_ATTEMPT: str(self.attempt)}


class Window:
    """The delivery window's state (see the module docstring); its parts change it in place."""

    def __init__(self, concurrency: int, queue_depth: int, paused: bool = False) -> None:
        self.concurrency = concurrency
        self.paused = paused
        # Set by Subscription.stop(): every loop and every retried call ends on it.
        self.closed = False
        self.ready: deque[Delivery] = deque()
        # When each buffered delivery was claimed or read (loop time): one that waited long
        # is checked before it is handed out (Subscription._still_ours).
        self.ready_at: dict[str, float] = {}
        # Sent to the subscriber and not yet acked or nacked, with the attempt
        # it was sent as: each holds a slot, and only these may be acked.
        self.unacked: dict[str, int] = {}
        # Every id this stream is responsible for (ready, unacked, waiting to be
        # redelivered, or acked and not yet XACKed): a reclaim pass must not hand
        # these out a second time.
        self.owned: set[str] = set()
        # Read or claimed after the stream closed, never buffered: (id, attempt), given back
        # with what the buffer holds when the stream closes (Subscription.close).
        self.unsent: list[tuple[str, int]] = []
        self.can_send = asyncio.Event()
        self.can_fetch = asyncio.Event()
        # Read when at least half the window is free (or nothing is in flight),
        # so one XREADGROUP fills many slots instead of one read per ack.
        self.low_water = max(1, min(concurrency // 2, queue_depth))
        # While the subscriber acks a whole window within READ_AHEAD_PACE_S, the fetch loop
        # reads up to READ_AHEAD_WINDOWS more windows ahead (at most one queueDepth): each read
        # then brings two windows, not the half window that acks freed, and a busy stream makes
        # a quarter of the Redis round trips per message (each ~150-250 us of CPU). What it
        # reads ahead waits a few ms at that pace, so other streams of the group wait no longer
        # for it; a slower subscriber (or one that stops acking) reads no further than its free
        # slots, as before.
        self.read_ahead = min(READ_AHEAD_WINDOWS * concurrency, queue_depth)
        # Then a read waits until all but a window of that is free, and the buffer still holds
        # up to a window while it is on the wire: the stream is never left waiting for it.
        self.read_low_water = max(self.low_water, min((READ_AHEAD_WINDOWS - 1) * concurrency, queue_depth))
        self.acked_in_turn = 0
        self._turn_started = 0.0
        self._fast_until = 0.0

    def room(self) -> int:
        """Deliveries the window takes now: neither sent and unacked nor waiting in the buffer."""
        return self.concurrency - len(self.unacked) - len(self.ready)

    def read_room(self, now: float, ahead: bool = True) -> tuple[int, int]:
        """Entries the fetch loop may read now (`now`: loop time), and how many make a read
        worth it: room() and low_water, or, while the subscriber keeps pace, READ_AHEAD_WINDOWS
        windows more and all of them but one. Not `ahead` (due retries wait for room): room() alone, so the
        retries get the slots acks free, as before read-ahead."""
        room = self.concurrency - len(self.unacked) - len(self.ready)
        if ahead and now < self._fast_until:
            return room + self.read_ahead, self.read_low_water
        return room, self.low_water

    def turned(self, now: float) -> None:
        """A whole window was acked since the last turn (`now`: loop time)."""
        self.acked_in_turn = 0
        if now - self._turn_started < READ_AHEAD_PACE_S:
            self._fast_until = now + READ_AHEAD_PACE_S
        self._turn_started = now

    def disown(self, entry_id: str) -> None:
        """Forget `entry_id` as ours, unless a later delivery of it is in our buffer or with the
        subscriber (we took it over again while the subscriber still held an earlier one)."""
        if entry_id not in self.unacked and entry_id not in self.ready_at:
            self.owned.discard(entry_id)


def expired(entry: StreamEntry, clock: Clock) -> bool:
    """True once the entry's expiry (0 = never) has come: the instant itself counts as expired."""
    return entry.expires_at_ms > 0 and clock.now_ms() >= entry.expires_at_ms
