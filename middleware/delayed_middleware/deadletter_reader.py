"""The Inspector's reader of one app's dead letters, over every dead-letter topic it has written to."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from delayed_middleware.deadletters import (
    DL_AT,
    DL_ATTEMPTS,
    DL_CONSUMER,
    DL_PUBSUB,
    DL_REASON,
    DL_SOURCE_TOPIC,
    dead_letter_topics_key,
)
from delayed_middleware.entry import StreamEntry, decode_entry
from delayed_middleware.inspection import Progress, Scope, shown


@dataclass(frozen=True)
class DeadLetterInfo:
    """A message that used up its delivery attempts, as it sits on a dead-letter topic."""

    dead_letter_topic: str
    stream_id: str
    source_topic: str
    reason: str
    attempts: int
    at_ms: int
    entry: StreamEntry = field(repr=False)
    # A hand-off's dead letter: the targetPubsub it was bound for ('' for a subscriber's).
    target_pubsub: str = ""

    @property
    def size(self) -> int:
        return len(self.entry.data)


@dataclass(eq=False)
class DeadLetterReader:
    """Dead letters of one app (its consumer group's and its hand-offs')."""

    scope: Scope

    async def dead_letter_topics(self) -> list[str]:
        """The dead-letter topics this app's subscriptions and hand-offs have written to."""
        members: Any = await self.scope.redis.smembers(dead_letter_topics_key(self.scope.consumer_id))
        return sorted(shown(m) for m in members)

    async def dead_letters(
        self, *, source_topic: str | None = None, progress: Progress | None = None
    ) -> list[DeadLetterInfo]:
        """Dead letters of this app (its consumer group's and its hand-offs'), optionally of one source
        topic (a hand-off's target topic)."""
        out: list[DeadLetterInfo] = []
        for dlt in await self.dead_letter_topics():
            async for rows in self.scope.pages(dlt):
                for raw_id, fields in rows:
                    entry = decode_entry(fields)
                    md = entry.metadata
                    if md.get(DL_CONSUMER) != self.scope.consumer_id:
                        continue  # a dead-letter topic may be shared by several apps
                    if source_topic is not None and md.get(DL_SOURCE_TOPIC) != source_topic:
                        continue
                    out.append(
                        DeadLetterInfo(
                            dead_letter_topic=dlt,
                            stream_id=shown(raw_id),
                            source_topic=md.get(DL_SOURCE_TOPIC, ""),
                            reason=md.get(DL_REASON, ""),
                            attempts=int(md.get(DL_ATTEMPTS, "0") or 0)
                            if md.get(DL_ATTEMPTS, "").isdigit()
                            else 0,
                            at_ms=int(md[DL_AT]) if md.get(DL_AT, "").isdigit() else 0,
                            entry=entry,
                            target_pubsub=md.get(DL_PUBSUB, ""),
                        )
                    )
                if progress is not None:
                    progress(len(out), len(out))
        return out
