"""How late the event loop runs, and how long the garbage collector stops it, as metrics.

Everything a process does (answering calls, firing, delivering) waits while
its event loop is busy with something else or stopped by a collection: on a
shared or saturated machine those stalls, not any one call, make the tail of
the latency. A timer every PROBE_S measures how late the loop ran it, and a
gc callback times every collection, in serve and in each worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
from collections.abc import Awaitable
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry, Histogram

T = TypeVar("T")

# 40 wake-ups a second: a 5 ms probe cost 3 % of a core on a busy 2-core machine, this
# under 1 %; stalls long enough to matter for delivery (tens of ms) are still seen.
PROBE_S = 0.025
PAUSE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class LoopWatch:
    """The event-loop lag and GC-pause histograms of one process (`process`: serve, worker-N), in `registry`."""

    def __init__(self, registry: CollectorRegistry, process: str, probe_s: float = PROBE_S) -> None:
        self.lag = Histogram(
            "delayed_pubsub_event_loop_lag_seconds",
            "How late the event loop ran a timer due every 25 ms; process=serve or worker-N",
            ["process"],
            buckets=PAUSE_BUCKETS,
            registry=registry,
        ).labels(process)
        self._gc_pause = Histogram(
            "delayed_pubsub_gc_pause_seconds",
            "How long each garbage collection stopped the process; process=serve or worker-N",
            ["process", "generation"],
            buckets=PAUSE_BUCKETS,
            registry=registry,
        )
        self._process = process
        self._probe_s = probe_s
        self._gc_started = 0.0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start timing collections and probing the running loop."""
        gc.callbacks.append(self._on_gc)
        self._task = asyncio.get_running_loop().create_task(self._probe(), name="loop watch")

    async def stop(self) -> None:
        """Stop both (the gc callback is process-wide: it must not outlive its loop)."""
        with contextlib.suppress(ValueError):
            gc.callbacks.remove(self._on_gc)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
        else:
            self._gc_pause.labels(self._process, str(info["generation"])).observe(
                time.perf_counter() - self._gc_started
            )

    async def _probe(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + self._probe_s
            await asyncio.sleep(self._probe_s)
            self.lag.observe(max(0.0, loop.time() - due))


async def watched(main: Awaitable[T], registry: CollectorRegistry, process: str) -> T:
    """Await `main` with a LoopWatch of `process` running in `registry` meanwhile."""
    watch = LoopWatch(registry, process)
    watch.start()
    try:
        return await main
    finally:
        await watch.stop()
