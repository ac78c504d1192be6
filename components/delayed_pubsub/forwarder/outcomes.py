"""How a hand-off ends once daprd answered: settled as handed off, left pending for its retry,
or dead-lettered; and the history record of each ending.

Dead letters are written as the subscriber retries write theirs (one writer,
delayed_middleware.deadletters.write_dead_letter), first the dead letter (its own
slots), then the settle: a crash in between dead-letters it twice, never zero times.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import KW_ONLY, dataclass
from typing import Any

from delayed_middleware import history
from delayed_middleware.clock import Clock
from delayed_middleware.deadletters import GaveUp, write_dead_letter
from delayed_middleware.entry import StreamEntry
from delayed_middleware.outbox import OutboxEntry
from delayed_middleware.target import forwarded_metadata
from delayed_pubsub.connection import RedisPyClient
from delayed_pubsub.forwarder.config import ForwarderConfig
from delayed_pubsub.forwarder.holding import Job
from delayed_pubsub.forwarder.sidecar import failure_reason
from delayed_pubsub.metrics import ForwarderMetrics

# The name logs have always carried (log queries and alerts key on it), whichever file of the package writes.
log = logging.getLogger("delayed_pubsub.forwarder")

Settle = Callable[[Sequence[str], Mapping[str, str] | None], Awaitable[None]]


@dataclass(eq=False, repr=False)
class Outcomes:
    """The endings of one forwarder's hand-offs; settles through `settle` (Forwarder._settle)."""

    client: RedisPyClient
    config: ForwarderConfig
    clock: Clock
    metrics: ForwarderMetrics | None
    _: KW_ONLY
    name: str
    consumer_id: str
    settle: Settle
    hold: Callable[[Sequence[tuple[str, int]]], Awaitable[Any]]
    bounded: Callable[[Awaitable[Any]], Awaitable[Any]]

    def record(self, event: str, job: Job, ids: Sequence[str], reason: str = "") -> dict[str, str]:
        head = job.head
        entries = [e for i, e in zip(job.ids, job.entries, strict=True) if i in ids]
        return {
            "event": event,
            "at": str(self.clock.now_ms()),
            "id": head.bulk or head.id,
            "sid": "",
            "topic": head.topic,
            "kind": "",
            "due": "",
            "late": "",
            "size": str(sum(len(e.data) for e in entries)),
            "attempt": str(job.attempt),
            "reason": reason,
            "schedule": "",
            # Beyond history.FIELDS (readers ignore unknown fields): where it went.
            "pubsub": head.pubsub,
        }

    async def after_publish(self, job: Job) -> None:
        failed = dict(job.failed)
        ok = [i for i in job.ids if i not in failed]
        if ok:
            await self.settle(ok, self.record(history.HANDED_OFF, job, ok))
            if self.metrics is not None:
                self.metrics.handed_off.labels(self.name).inc(len(ok))
        if not failed:
            return
        why = next(iter(failed.values()))
        reason = failure_reason(why)
        if self.metrics is not None:
            self.metrics.failures.labels(self.name, reason).inc(len(failed))
        policy = self.config.policy
        if job.attempt >= policy.max_attempts and policy.dead_letter_topic:
            for i, e in zip(job.ids, job.entries, strict=True):
                if i in failed:
                    await self._dead_letter(i, e, job, failed[i])
            return
        log.warning(
            "forwarder %s: %s/%s did not take %d message(s) (attempt %d of %d%s): %s",
            self.name,
            job.head.pubsub,
            job.head.topic,
            len(failed),
            job.attempt,
            policy.max_attempts,
            "" if policy.dead_letter_topic else ", no deadLetterTopic: retried until it works",
            why,
        )
        # Restart the idle clock now, so the backoff counts from this failure, not
        # from when the entry was read; only where it is still ours (a plain XCLAIM
        # would take back an entry another replica has taken over meanwhile).
        await self.hold([(i, job.attempt) for i in failed])

    async def _dead_letter(self, entry_id: str, entry: OutboxEntry, job: Job, why: str) -> None:
        topic = self.config.policy.dead_letter_topic
        log.error(
            "forwarder %s: %s/%s refused %s after %d attempts, dead-lettered to %r: %s",
            self.name,
            entry.pubsub,
            entry.topic,
            entry.id or entry_id,
            job.attempt,
            topic,
            why,
        )
        message = StreamEntry(
            entry.data, forwarded_metadata(entry.metadata), entry.content_type, entry.expires_at_ms
        )
        gave_up = GaveUp(why, job.attempt, entry.topic, self.consumer_id, self.clock.now_ms(), entry.pubsub)
        # First the dead letter (its own slots), then the settle: a crash in
        # between leaves the entry pending, dead-lettered again on its next try.
        await self.bounded(write_dead_letter(self.client, self.consumer_id, topic, message, gave_up))
        await self.settle([entry_id], self.record(history.DEAD_LETTERED, job, [entry_id], why[:500]))
        if self.metrics is not None:
            self.metrics.dead_lettered.labels(self.name).inc()

    async def dead_letter_raw(self, entry_id: str, fields: Mapping[Any, Any], why: str) -> None:
        """A malformed entry: dead-letter its bytes as they are when a topic is set; else drop it, loudly."""
        topic = self.config.policy.dead_letter_topic
        data = bytes(fields.get(b"data", fields.get("data", b"")) or b"")
        now = self.clock.now_ms()
        record = {
            "event": history.DEAD_LETTERED,
            "at": str(now),
            "id": entry_id,
            "reason": why,
        }
        if topic:
            # No target to put it back to: listed by `dead`, skipped by `retry-dead`.
            gave_up = GaveUp(why, 1, "", self.consumer_id, now)
            await self.bounded(
                write_dead_letter(self.client, self.consumer_id, topic, StreamEntry(data), gave_up)
            )
        await self.settle([entry_id], record)
        if self.metrics is not None:
            self.metrics.dead_lettered.labels(self.name).inc()
