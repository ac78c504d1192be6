"""What every reader of the Inspector shares: the records it returns, the scope it reads, paging.

The Inspector (inspector.py) is a facade over readers of their own: pending
(pending_reader.py), retries (retry_reader.py), hand-offs
(handoff_reader.py), one message (message_lookup.py), history
(history_reader.py) and dead letters (deadletter_reader.py). Each receives
the `Scope` (client, consumerID, every shard's keys, page size) explicitly.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

from delayed_middleware.aio import text
from delayed_middleware.envelope import Envelope
from delayed_middleware.history import HistoryRecord
from delayed_middleware.keys import EngineKeys, shard_id, shard_topics

PAGE_SIZE = 500
# A node's client or a Cluster's: the inspector reads every shard through either.
AnyRedis = aioredis.Redis | RedisCluster
# The kind of a fired message waiting in the outbox for its hand-off to a targetPubsub.
HANDOFF = "handoff"
DELIVERY_ATTEMPT = "deliveryAttempt"

# (entries scanned so far, entries on the stream when the scan began)
Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class PendingMessage:
    """One delayed message waiting for its due time."""

    stream_id: str
    schedule_id: str
    topic: str
    due_ms: int
    kind: str
    size: int
    attempts: int
    published_at_ms: int
    # The shard stream holding it when the delayed topic has several (keys.shard_topics), else None.
    shard: int | None = None
    # A hand-off (kind "handoff"): the Dapr pub/sub it waits to be handed to.
    pubsub: str = ""
    # A recurring one's stored schedule expression (with its zone, bounds and jitter).
    schedule: str = ""
    # Paused (schedulePause): when, epoch ms; None while it runs.
    paused_at_ms: int | None = None

    @property
    def paused(self) -> bool:
        """True while held by schedulePause: it does not fire until resumed."""
        return self.paused_at_ms is not None

    @property
    def id(self) -> str:
        """How operators name it: the scheduleId when one was given, else the envelope id
        (`<stream id>@<shard>` when the delayed topic has several shards)."""
        if self.schedule_id:
            return self.schedule_id
        return self.stream_id if self.shard is None else shard_id(self.stream_id, self.shard)


@dataclass(frozen=True)
class PendingReport:
    """A listing: the earliest `limit` matches by due time, and counts over every match."""

    messages: tuple[PendingMessage, ...]
    counts: Mapping[str, int]
    matched: int
    scanned: int
    parked: int
    undecodable: int


def matches(m: PendingMessage, topic: str | None, due_before_ms: int | None) -> bool:
    """The listings' one filter: on `topic` (None: any) and due before `due_before_ms` (None: any time)."""
    return (topic is None or m.topic == topic) and (due_before_ms is None or m.due_ms < due_before_ms)


@dataclass(frozen=True)
class MessageInfo:
    """One envelope decoded, with its state and its history."""

    message: PendingMessage
    envelope: Envelope
    # pending | paused (schedulePause) | parked | retry (a failed message waiting for its next delivery)
    # | handoff (fired, waiting in the outbox for the sidecar to accept it)
    state: str
    parked_reason: str = ""
    history: tuple[HistoryRecord, ...] = ()

    def preview(self, limit: int = 256) -> str:
        """The payload as text when it is UTF-8, else as hex; cut at `limit` bytes."""
        if self.envelope.is_bulk:
            first = self.envelope.bulk_entries[0].event if self.envelope.bulk_entries else b""
            return f"[bulk of {len(self.envelope.bulk_entries)}] " + payload_preview(first, limit)
        return payload_preview(self.envelope.message, limit)


def payload_preview(data: bytes, limit: int = 256) -> str:
    """Printable view of a payload's first `limit` bytes."""
    head = data[:limit]
    suffix = f"… ({len(data)} bytes)" if len(data) > limit else ""
    try:
        return head.decode("utf-8") + suffix
    except UnicodeDecodeError:
        return "0x" + head.hex() + suffix


def shown(value: bytes | str | None) -> str:
    """A stored value as text: an operator's listing shows undecodable bytes replaced rather than failing."""
    return text(value, errors="replace")


@dataclass(frozen=True)
class Scope:
    """What every reader reads: one app's (consumerID's) keys on every shard, through one client."""

    redis: AnyRedis
    consumer_id: str
    # Every shard's keys, shard 0 (the single-node `<consumerID>-delayed`) first.
    shards: tuple[EngineKeys, ...]
    page: int = PAGE_SIZE

    @classmethod
    def of(cls, client: AnyRedis, consumer_id: str, page_size: int = PAGE_SIZE, shards: int = 1) -> Scope:
        keys = tuple(EngineKeys.for_topic(t) for t in shard_topics(consumer_id, shards))
        return cls(client, consumer_id, keys, page_size)

    def label(self, shard: int) -> int | None:
        """The shard an id carries: only when there is more than one (single node unchanged)."""
        return None if len(self.shards) == 1 else shard

    async def pages(self, stream: str) -> AsyncIterator[Any]:
        """`stream`'s entries, oldest first, a page (at most `page` rows) at a time."""
        start = "-"
        while True:
            rows: Any = await self.redis.xrange(stream, start, "+", count=self.page)
            if not rows:
                return
            yield rows
            if len(rows) < self.page:
                return
            start = "(" + shown(rows[-1][0])
