"""The Inspector's reader of failed messages waiting for their next delivery (the retry policy's schedule)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from delayed_middleware.entry import StreamEntry, decode_entry
from delayed_middleware.envelope import Envelope
from delayed_middleware.inspection import MessageInfo, PendingMessage, Scope, shown
from delayed_middleware.keys import is_stream_id
from delayed_middleware.kinds import Kind
from delayed_middleware.retry import retry_key, retry_topics_key


def retry_message(topic: str, entry_id: str, due: float, entry: StreamEntry, pel: Any) -> PendingMessage:
    """A failed message waiting for its next delivery, kind "retry", as RetryReader.read_retry read it:
    its id the entry's id on `topic`, `due` the earliest redelivery, `attempts` the
    deliveries so far (the consumer group's PEL count)."""
    return PendingMessage(
        stream_id=entry_id,
        schedule_id="",
        topic=topic,
        due_ms=int(due),
        kind=Kind.RETRY.label,
        size=len(entry.data),
        attempts=int(pel[0]["times_delivered"]) if pel else 0,
        published_at_ms=int(entry_id.split("-")[0]) if is_stream_id(entry_id) else 0,
    )


@dataclass(eq=False)
class RetryReader:
    """Failed messages of one app waiting for redelivery: one sorted set by due time per topic."""

    scope: Scope

    async def retries(
        self, *, topic: str | None = None, due_before_ms: int | None = None
    ) -> AsyncIterator[PendingMessage]:
        """Failed messages waiting for their next delivery (retry policy), kind "retry".

        Their id is the entry's id on its topic, `due` the earliest redelivery,
        `attempts` the deliveries so far (the consumer group's PEL count).
        """
        page_size = self.scope.page
        topics: Any = await self.scope.redis.smembers(retry_topics_key(self.scope.consumer_id))
        for name in sorted(shown(t) for t in topics):
            if topic is not None and name != topic:
                continue
            key = retry_key(self.scope.consumer_id, name)
            high = "+inf" if due_before_ms is None else f"({due_before_ms}"
            offset = 0
            while True:
                page: Any = await self.scope.redis.zrangebyscore(
                    key, "-inf", high, start=offset, num=page_size, withscores=True
                )
                if not page:
                    break
                offset += len(page)
                pipe = self.scope.redis.pipeline(transaction=False)
                for member, _ in page:
                    self.read_retry(pipe, name, shown(member))
                replies = await pipe.execute(raise_on_error=False)
                for i, (member, score) in enumerate(page):
                    rows, pel = replies[2 * i], replies[2 * i + 1]
                    if isinstance(rows, Exception) or isinstance(pel, Exception) or not rows:
                        continue  # gone (acked, trimmed): the poller drops its record
                    yield retry_message(name, shown(member), score, decode_entry(rows[0][1]), pel)
                if len(page) < page_size:
                    break

    def read_retry(self, pipe: Any, topic: str, entry_id: str) -> None:
        """Queues on `pipe` what retry_message reads of a retry: its entry on `topic`, then its
        record in this app's pending entries list (the deliveries so far)."""
        pipe.xrange(topic, entry_id, entry_id)
        pipe.xpending_range(topic, self.scope.consumer_id, min=entry_id, max=entry_id, count=1)

    async def info(self, entry_id: str) -> MessageInfo | None:
        """A failed message waiting for redelivery, by its entry id on its topic."""
        topics: Any = await self.scope.redis.smembers(retry_topics_key(self.scope.consumer_id))
        for name in sorted(shown(t) for t in topics):
            score = await self.scope.redis.zscore(retry_key(self.scope.consumer_id, name), entry_id)
            if score is None:
                continue
            pipe = self.scope.redis.pipeline(transaction=False)
            self.read_retry(pipe, name, entry_id)
            rows, pel = await pipe.execute()
            if not rows:
                return None
            entry = decode_entry(rows[0][1])
            message = retry_message(name, entry_id, score, entry, pel)
            env = Envelope(
                id=entry_id,
                topic=name,
                due_ms=message.due_ms,
                published_at_ms=message.published_at_ms,
                message=entry.data,
                content_type=entry.content_type,
                metadata=dict(entry.metadata),
            )
            return MessageInfo(message, env, "retry")
        return None
