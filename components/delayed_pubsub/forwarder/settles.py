"""The settle batcher: the hand-offs that end in the same moment are settled in one MULTI."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any, Final

from delayed_middleware.clock import Clock
from delayed_middleware.keys import EngineKeys
from delayed_pubsub.connection import RedisPyClient
from delayed_pubsub.forwarder.config import ForwarderConfig

# While other calls are in flight, a settle waits this long for theirs to share its MULTI
# (grpc.aio hands back about one answer per loop pass: without it most MULTIs held one or
# two settles). It only delays the XACK of an entry daprd already took.
_SETTLE_LINGER_S: Final = 0.002


class SettleBatcher:
    """Settles the hand-offs that end in the same moment in one MULTI.

    A settle is queued and a flush task started if none runs: it goes out once
    the loop has run what was ready, after _SETTLE_LINGER_S while other calls
    are in flight (the hand-offs whose calls come back meanwhile queue theirs).
    Settles queued while a MULTI is on the wire go out together right after it.
    One MULTI holds every record's history append, one age trim, one XACK and
    one XDEL of all the ids. When it fails (an error reply, the connection
    lost, the Redis timeout) every settle in it fails, as a single settle would
    have: the hand-off ends "interrupted" and its entries stay pending under
    our name, retried one attempt higher after their backoff.
    """

    def __init__(
        self,
        client: RedisPyClient,
        keys: EngineKeys,
        config: ForwarderConfig,
        clock: Clock,
        bounded: Callable[[Awaitable[Any]], Awaitable[Any]],
        calls_in_flight: Callable[[], int],
    ) -> None:
        self._redis = client
        self._keys = keys
        self._group = config.group
        self._history = config.history
        # Every record but the last of a MULTI is appended without the age trim: one does for all.
        self._untrimmed = replace(config.history, max_age_ms=0)
        self._linger_below = config.concurrency
        self._clock = clock
        self._bounded = bounded
        self._calls_in_flight = calls_in_flight
        self._queue: list[tuple[Sequence[str], Mapping[str, str] | None, asyncio.Future[None]]] = []
        self._flusher: asyncio.Task[None] | None = None

    @property
    def flusher(self) -> asyncio.Task[None] | None:
        """The flush under way, if any."""
        return self._flusher

    async def settle(self, ids: Sequence[str], record: Mapping[str, str] | None) -> None:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queue.append((ids, record, future))
        if self._flusher is None:
            self._flusher = asyncio.create_task(self._flush(), name="forwarder settles")
        # Cancelled (the forwarder closing): the settle still goes out with its batch;
        # an entry daprd took is better settled than handed off again.
        await future

    async def _flush(self) -> None:
        batch: list[tuple[Sequence[str], Mapping[str, str] | None, asyncio.Future[None]]] = []
        try:
            while self._queue:
                if self._calls_in_flight() and len(self._queue) < self._linger_below:
                    await asyncio.sleep(_SETTLE_LINGER_S)
                batch, self._queue = self._queue, []
                failed: Exception | None = None
                try:
                    await self._write(batch)
                except Exception as e:
                    failed = e
                for *_, future in batch:
                    if future.done():
                        continue
                    if failed is None:
                        future.set_result(None)
                    else:
                        future.set_exception(failed)
                batch = []
        except asyncio.CancelledError:
            # Stopped with settles on the wire or queued: whether they landed is not known;
            # their entries stay pending (at least once).
            for *_, future in [*batch, *self._queue]:
                future.cancel()
            self._queue = []
            raise
        finally:
            self._flusher = None

    async def _write(self, batch: Sequence[tuple[Sequence[str], Mapping[str, str] | None, Any]]) -> None:
        pipe: Any = self._redis.pipeline(transaction=True)
        records = [record for _, record, _ in batch if record is not None]
        now_ms = self._clock.now_ms()
        for n, record in enumerate(records):
            retention = self._history if n == len(records) - 1 else self._untrimmed
            retention.append(pipe, self._keys.history, record, now_ms)
        ids = [i for entry_ids, _, _ in batch for i in entry_ids]
        pipe.xack(self._keys.outbox, self._group, *ids)
        # Done: the history keeps the record, the outbox keeps only what waits.
        pipe.xdel(self._keys.outbox, *ids)
        await self._bounded(pipe.execute())
