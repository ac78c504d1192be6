"""Read-only inspection of one app's delayed messages: what waits, one message, its history, dead letters.

Shards (Redis Cluster, `delayShards`): an app's delayed topic may be split
into several shard streams (keys.shard_topics), each with its own index, ids
hash, parked hash and history. An Inspector made with `shards=N` reads all of
them: listings and counts cover every shard (merged in due order), a lookup by
scheduleId goes to the shard the id hashes to, and an envelope id is named
`<stream id>@<shard>` (as ShardedEngine.schedule returns it and
ShardedEngine.cancel takes it), since each shard stream numbers its entries on
its own. With one shard (a single node) nothing changes: plain stream ids.

What arq's `jobs.Job` is to arq, for operators: the CLI (`delayed-pubsub
pending|inspect|history|dead`), the metrics' pending-per-topic gauge and the
Spark job read the engine's state through here instead of its key layout.
Nothing here writes.

The Inspector is a facade: each concern is a reader of its own, built here
over one `Scope` (inspection.py) and passed to the readers that need it:
pending_reader.py (the delayed topic: scan, listing, counts, `pending`),
retry_reader.py, handoff_reader.py, message_lookup.py (`get`),
history_reader.py and deadletter_reader.py.
"""

from __future__ import annotations

from delayed_middleware.deadletter_reader import DeadLetterInfo, DeadLetterReader
from delayed_middleware.handoff_reader import HandoffReader
from delayed_middleware.history_reader import (
    HISTORY_SLACK_MS,
    INDEXED_FORWARD_MAX,
    INSPECT_HISTORY,
    HistoryPosition,
    HistoryReader,
)
from delayed_middleware.inspection import (
    DELIVERY_ATTEMPT,
    HANDOFF,
    PAGE_SIZE,
    AnyRedis,
    MessageInfo,
    PendingMessage,
    PendingReport,
    Progress,
    Scope,
    payload_preview,
)
from delayed_middleware.message_lookup import MessageLookup
from delayed_middleware.pending_reader import PendingReader
from delayed_middleware.retry_reader import RetryReader

__all__ = [
    "DELIVERY_ATTEMPT",
    "HANDOFF",
    "HISTORY_SLACK_MS",
    "INDEXED_FORWARD_MAX",
    "INSPECT_HISTORY",
    "PAGE_SIZE",
    "AnyRedis",
    "DeadLetterInfo",
    "HistoryPosition",
    "Inspector",
    "MessageInfo",
    "PendingMessage",
    "PendingReport",
    "Progress",
    "payload_preview",
]


class Inspector:
    """Reads one app's (consumerID's) delayed topic (every shard of it), history and dead letters.

    Each public method is its reader's (bound here once): the docstrings are there."""

    def __init__(
        self, client: AnyRedis, consumer_id: str, page_size: int = PAGE_SIZE, *, shards: int = 1
    ) -> None:
        scope = Scope.of(client, consumer_id, page_size, shards)
        self.consumer_id = consumer_id
        # Every shard's keys, shard 0 (the single-node `<consumerID>-delayed`) first.
        self.shards = scope.shards
        self.keys = scope.shards[0]
        retries = RetryReader(scope)
        handoffs = HandoffReader(scope)
        pending = PendingReader(scope, retries, handoffs)
        history = HistoryReader(scope)
        lookup = MessageLookup(scope, pending, retries, handoffs, history)
        dead = DeadLetterReader(scope)

        self.stream_length = pending.stream_length
        self.scan = pending.scan
        self.listing = pending.listing
        self.decode_page = pending.decode_page
        self.pending = pending.pending
        self.counts_by_topic = pending.counts_by_topic
        self.retries = retries.retries
        self.handoffs = handoffs.handoffs
        self.get = lookup.get
        self.get_bounded = lookup.get_bounded
        self.message_history = history.message_history
        self.history = history.history
        self.history_forward = history.history_forward
        self.history_newest = history.history_newest
        self.dead_letter_topics = dead.dead_letter_topics
        self.dead_letters = dead.dead_letters

    def stream_of(self, message: PendingMessage) -> str:
        """The delayed topic (shard stream) that holds `message`'s envelope, or the outbox of a hand-off."""
        keys = self.shards[message.shard or 0]
        return keys.outbox if message.kind == HANDOFF else keys.stream
