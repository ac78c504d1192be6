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
        self.can_send = asyncio.Event()
        self.can_fetch = asyncio.Event()
        # Read when at least half the window is free (or nothing is in flight),
        # so one XREADGROUP fills many slots instead of one read per ack.
        self.low_water = max(1, min(concurrency // 2, queue_depth))

    def room(self) -> int:
        """Deliveries the window takes now: neither sent and unacked nor waiting in the buffer."""
        return self.concurrency - len(self.unacked) - len(self.ready)

    def disown(self, entry_id: str) -> None:
        """Forget `entry_id` as ours, unless a later delivery of it is in our buffer or with the
        subscriber (we took it over again while the subscriber still held an earlier one)."""
        if entry_id not in self.unacked and entry_id not in self.ready_at:
            self.owned.discard(entry_id)


def expired(entry: StreamEntry, clock: Clock) -> bool:
    """True once the entry's expiry (0 = never) has come: the instant itself counts as expired."""
    return entry.expires_at_ms > 0 and clock.now_ms() >= entry.expires_at_ms
