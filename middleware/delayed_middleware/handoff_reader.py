"""The Inspector's reader of fired messages waiting in an outbox for their hand-off to a targetPubsub."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

from redis.exceptions import ResponseError

from delayed_middleware.envelope import Envelope
from delayed_middleware.errors import MalformedEntryError
from delayed_middleware.inspection import HANDOFF, MessageInfo, PendingMessage, Scope, shown
from delayed_middleware.keys import EngineKeys, is_stream_id, split_shard_id
from delayed_middleware.outbox import OUTBOX_GROUP, HandOffPolicy, OutboxEntry, decode_outbox_entry


@dataclass(eq=False)
class HandoffReader:
    """Every shard's outbox of one app, read as pending messages of kind "handoff"."""

    scope: Scope

    async def handoffs(
        self, *, policy: HandOffPolicy | None = None, now_ms: int | None = None
    ) -> AsyncIterator[PendingMessage]:
        """Fired messages bound for a targetPubsub still waiting in an outbox (every shard's), kind "handoff".

        Their id is the scheduleId when one was given, else the outbox entry's
        id (`<id>@<shard>` with several shards); `due` is the next try:
        when it was fired for one not yet tried, else its last try plus the
        hand-off backoff (`policy`, the forwarder's defaults when None);
        `attempts` the tries so far (the outbox group's delivery count). An
        overdue next try means the forwarder is at it (a sidecar that does not
        answer is retried at once, without counting).
        """
        policy = policy or HandOffPolicy()
        now = int(time.time() * 1000) if now_ms is None else now_ms
        for shard, keys in enumerate(self.scope.shards):
            async for rows in self.scope.pages(keys.outbox):
                tries = await self._outbox_tries(keys, shown(rows[0][0]), shown(rows[-1][0]), len(rows))
                for raw_id, fields in rows:
                    message = self._handoff(shard, shown(raw_id), fields, tries, policy, now)
                    if message is not None:
                        yield message

    async def _outbox_tries(
        self, keys: EngineKeys, first: str, last: str, count: int
    ) -> dict[str, tuple[int, int]]:
        """outbox id -> (deliveries, ms since the last one) for the pending entries between two ids."""
        try:
            pel: Any = await self.scope.redis.xpending_range(
                keys.outbox, OUTBOX_GROUP, min=first, max=last, count=count
            )
        except ResponseError:
            # No group yet (nothing was tried), or a reader not allowed XPENDING (an ACL user):
            # the hand-offs are listed all the same, without their tries.
            return {}
        return {
            shown(p["message_id"]): (int(p["times_delivered"]), int(p["time_since_delivered"])) for p in pel
        }

    def _handoff(
        self,
        shard: int,
        outbox_id: str,
        fields: Any,
        tries: Mapping[str, tuple[int, int]],
        policy: HandOffPolicy,
        now_ms: int,
    ) -> PendingMessage | None:
        try:
            entry = decode_outbox_entry(fields)
        except MalformedEntryError:
            return None  # the forwarder dead-letters it on its next read
        deliveries, idle = tries.get(outbox_id, (0, 0))
        fired_ms = int(outbox_id.split("-")[0]) if is_stream_id(outbox_id) else now_ms
        due = fired_ms if deliveries == 0 else now_ms - idle + policy.delay_ms(deliveries)
        return PendingMessage(
            stream_id=outbox_id,
            # The publisher's scheduleId names it; an envelope id (the envelope is gone) does not.
            schedule_id="" if is_stream_id(entry.id) else entry.id,
            topic=entry.topic,
            due_ms=due,
            kind=HANDOFF,
            size=len(entry.data),
            attempts=deliveries,
            published_at_ms=fired_ms,
            shard=self.scope.label(shard),
            pubsub=entry.pubsub,
        )

    async def info(self, id: str) -> MessageInfo | None:
        """A hand-off waiting in an outbox, by scheduleId or outbox entry id (`<id>@<shard>`)."""
        named = split_shard_id(id, len(self.scope.shards))
        async for m in self.handoffs():
            if (
                id in (m.id, m.schedule_id)
                or (named is not None and (m.shard or 0, m.stream_id) == named)
                or (is_stream_id(id) and m.stream_id == id)
            ):
                outbox = self.scope.shards[m.shard or 0].outbox
                rows: Any = await self.scope.redis.xrange(outbox, m.stream_id, m.stream_id)
                if not rows:
                    return None
                entry: OutboxEntry = decode_outbox_entry(rows[0][1])
                env = Envelope(
                    id=entry.id or m.stream_id,
                    topic=entry.topic,
                    due_ms=m.due_ms,
                    published_at_ms=m.published_at_ms,
                    message=entry.data,
                    content_type=entry.content_type,
                    metadata=dict(entry.metadata),
                    schedule_id=m.schedule_id,
                    target_pubsub=entry.pubsub,
                    expires_at_ms=entry.expires_at_ms,
                )
                return MessageInfo(m, env, HANDOFF)
        return None
