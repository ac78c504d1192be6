"""How a hand-off ends once daprd answered: settled as handed off, left pending for its retry,
or dead-lettered; and the history record of each ending.

Dead letters are written as the subscriber retries write theirs (one writer,
delayed_middleware.deadletters.write_dead_letter), first the dead letter (its own
slots), then the settle: a crash in between dead-letters it twice, never zero times.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
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

log = logging.getLogger(__name__)

Settle = Callable[[Sequence[str], Mapping[str, str] | None], Awaitable[None]]


class Outcomes:
    """The endings of one forwarder's hand-offs; settles through `settle` (Forwarder._settle)."""

    def __init__(
        self,
        client: RedisPyClient,
        config: ForwarderConfig,
        clock: Clock,
        metrics: ForwarderMetrics | None,
        *,
        name: str,
        consumer_id: str,
        settle: Settle,
        hold: Callable[[Sequence[tuple[str, int]]], Awaitable[Any]],
        bounded: Callable[[Awaitable[Any]], Awaitable[Any]],
    ) -> None:
        self._redis = client
        self._config = config
        self._clock = clock
        self._metrics = metrics
        self._name = name
        self._consumer_id = consumer_id
        self._settle = settle
        self._hold = hold
        self._bounded = bounded

    def record(self, event: str, job: Job, ids: Sequence[str], reason: str = "") -> dict[str, str]:
        head = job.head
        entries = [e for i, e in zip(job.ids, job.entries, strict=True) if i in ids]
        return {
            "event": event,
            "at": str(self._clock.now_ms()),
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
            await self._settle(ok, self.record(history.HANDED_OFF, job, ok))
            if self._metrics is not None:
                self._metrics.handed_off.labels(self._name).inc(len(ok))
        if not failed:
            return
        why = next(iter(failed.values()))
        reason = failure_reason(why)
        if self._metrics is not None:
            self._metrics.failures.labels(self._name, reason).inc(len(failed))
        policy = self._config.policy
        if job.attempt >= policy.max_attempts and policy.dead_letter_topic:
            for i, e in zip(job.ids, job.entries, strict=True):
                if i in failed:
                    await self._dead_letter(i, e, job, failed[i])
            return
        log.warning(
            "forwarder %s: %s/%s did not take %d message(s) (attempt %d of %d%s): %s",
            self._name,
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
        await self._hold([(i, job.attempt) for i in failed])

    async def _dead_letter(self, entry_id: str, entry: OutboxEntry, job: Job, why: str) -> None:
        topic = self._config.policy.dead_letter_topic
        log.error(
            "forwarder %s: %s/%s refused %s after %d attempts, dead-lettered to %r: %s",
            self._name,
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
        gave_up = GaveUp(why, job.attempt, entry.topic, self._consumer_id, self._clock.now_ms(), entry.pubsub)
        # First the dead letter (its own slots), then the settle: a crash in
        # between leaves the entry pending, dead-lettered again on its next try.
        await self._bounded(write_dead_letter(self._redis, self._consumer_id, topic, message, gave_up))
        await self._settle([entry_id], self.record(history.DEAD_LETTERED, job, [entry_id], why[:500]))
        if self._metrics is not None:
            self._metrics.dead_lettered.labels(self._name).inc()

    async def dead_letter_raw(self, entry_id: str, fields: Mapping[Any, Any], why: str) -> None:
        """A malformed entry: dead-letter its bytes as they are when a topic is set; else drop it, loudly."""
        topic = self._config.policy.dead_letter_topic
        data = bytes(fields.get(b"data", fields.get("data", b"")) or b"")
        now = self._clock.now_ms()
        record = {
            "event": history.DEAD_LETTERED,
            "at": str(now),
            "id": entry_id,
            "reason": why,
        }
        if topic:
            # No target to put it back to: listed by `dead`, skipped by `retry-dead`.
            gave_up = GaveUp(why, 1, "", self._consumer_id, now)
            await self._bounded(
                write_dead_letter(self._redis, self._consumer_id, topic, StreamEntry(data), gave_up)
            )
        await self._settle([entry_id], record)
        if self._metrics is not None:
            self._metrics.dead_lettered.labels(self._name).inc()
