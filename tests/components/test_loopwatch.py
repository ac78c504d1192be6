"""The event-loop lag and GC-pause metrics, on a real event loop and a real serve with a worker."""

from __future__ import annotations

import gc
import time
from pathlib import Path

from prometheus_client import CollectorRegistry

from delayed_pubsub.loopwatch import LoopWatch
from tests.components.serve import Serve
from tests.components.test_serve_workers import sample, scrape
from tests.redis_server import free_port
from tests.waiting import wait_until


def lag_count(registry: CollectorRegistry, at_least_s: str | None = None) -> float:
    """How many probes ran (late by more than `at_least_s`, a bucket bound, if given)."""
    labels = {"process": "serve"}
    total = registry.get_sample_value("delayed_pubsub_event_loop_lag_seconds_count", labels) or 0.0
    if at_least_s is None:
        return total
    within = registry.get_sample_value(
        "delayed_pubsub_event_loop_lag_seconds_bucket", {**labels, "le": at_least_s}
    )
    return total - (within or 0.0)


async def test_a_loop_blocked_for_200_ms_shows_as_a_late_probe() -> None:
    registry = CollectorRegistry()
    watch = LoopWatch(registry, "serve")
    watch.start()
    try:
        await wait_until(lambda: lag_count(registry) >= 3, "the probe running", 5, every_s=0.05)
        late_before = lag_count(registry, "0.1")
        time.sleep(0.2)  # noqa: ASYNC251 (the stall under test)
        await wait_until(
            lambda: lag_count(registry, "0.1") > late_before,
            "a probe late by more than 0.1 s",
            5,
            every_s=0.05,
        )
    finally:
        await watch.stop()


async def test_a_full_collection_shows_as_a_gc_pause_until_the_watch_stops() -> None:
    registry = CollectorRegistry()
    watch = LoopWatch(registry, "serve")

    def full_collections() -> float:
        value = registry.get_sample_value(
            "delayed_pubsub_gc_pause_seconds_count", {"process": "serve", "generation": "2"}
        )
        return value or 0.0

    watch.start()
    try:
        before = full_collections()
        gc.collect()
        assert full_collections() == before + 1
    finally:
        await watch.stop()
    stopped_at = full_collections()
    gc.collect()
    assert full_collections() == stopped_at


async def test_serve_and_its_worker_report_their_loop_lag_on_the_metrics_endpoint(folder: Path) -> None:
    port = free_port()
    serve = Serve(folder, "a", "--workers", "1", "--metrics-port", str(port))
    try:

        def probes(process: str) -> float:
            return (
                sample(scrape(port), "delayed_pubsub_event_loop_lag_seconds_count", f'process="{process}"')
                or 0.0
            )

        await wait_until(lambda: probes("serve") > 0, "serve's loop lag on the endpoint", 20, every_s=0.05)
        await wait_until(
            lambda: probes("worker-0") > 0, "the worker's loop lag on the endpoint", 20, every_s=0.05
        )
    finally:
        serve.stop()
