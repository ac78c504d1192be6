"""The pending-per-topic gauge, refreshed on a timer by a bounded scan.

Why a timer and a bound: the engine keeps one pending count per app, not one
per topic (a per-topic counter in its scripts would be the exact, O(1) way;
they keep none, so we count). Counting means walking the delayed topic
(`Inspector.counts_by_topic`, ~3.5 µs of CPU per pending message on the
2-core dev machine, see bench/RESULTS.md), which must not run per scrape nor over millions of entries: every
REFRESH_S seconds at most MAX_SCAN entries are read, over every shard stream of
the delayed topic (delayShards on Redis Cluster); past the bound, the messages not scanned are reported under topic="(other)" (computed from the
engine's exact total), so the series always sum to the pending count.
"""

from __future__ import annotations

import asyncio
import logging

from delayed_middleware.clock import Clock
from delayed_middleware.inspector import Inspector
from delayed_pubsub.connection import REDIS_ERRORS, RedisPyClient
from delayed_pubsub.metrics import OTHER_TOPICS, InstanceMetrics

log = logging.getLogger(__name__)

REFRESH_S = 30.0
MAX_SCAN = 100_000

_FAILURES: tuple[type[BaseException], ...] = (*REDIS_ERRORS, TimeoutError)


class PendingByTopic:
    """Keeps one instance's `delayed_pubsub_pending_by_topic_messages` current."""

    def __init__(
        self,
        client: RedisPyClient,
        consumer_id: str,
        metrics: InstanceMetrics,
        clock: Clock,
        *,
        max_scan: int | None = None,
        call_timeout: float | None = 30.0,
        shards: int = 1,
    ) -> None:
        # Every shard stream of the delayed topic (Redis Cluster's delayShards), counted together.
        self._inspector = Inspector(client, consumer_id, shards=shards)
        self._client = client
        self._metrics = metrics
        self._clock = clock
        self._max_scan = MAX_SCAN if max_scan is None else max_scan
        self._timeout = call_timeout

    async def refresh(self) -> dict[str, int]:
        """Count once and set the gauge; returns what was set (before the top-N cut)."""
        counts, complete = await self._inspector.counts_by_topic(self._max_scan)
        if not complete:
            total = sum([int(await self._client.get(k.count) or 0) for k in self._inspector.shards])
            rest = total - sum(counts.values())
            if rest > 0:
                counts[OTHER_TOPICS] = counts.get(OTHER_TOPICS, 0) + rest
        self._metrics.set_pending_by_topic(counts)
        return counts

    async def run(self, stop: asyncio.Event) -> None:
        """Refresh every REFRESH_S seconds until `stop` is set; Redis errors are counted and waited out.

        Meant to run under liveness.Supervised (only the stop flag ends it)."""
        while not stop.is_set():
            try:
                async with asyncio.timeout(self._timeout):
                    await self.refresh()
            except _FAILURES as e:
                self._metrics.redis_errors.inc()
                log.warning("pending-per-topic gauge of %s: %s", self._inspector.keys.stream, e)
            sleeper = asyncio.ensure_future(self._clock.sleep(REFRESH_S))
            stopper = asyncio.ensure_future(stop.wait())
            try:
                await asyncio.wait({sleeper, stopper}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                sleeper.cancel()
                stopper.cancel()
