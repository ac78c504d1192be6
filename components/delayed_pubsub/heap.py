"""The long-lived processes' garbage-collector settings.

`serve` and its workers import grpc, protobuf, redis-py and prometheus_client
before they handle a message: about 56,000 objects that live as long as the
process. CPython's full (generation 2) collection walks every tracked object,
and on a busy 2-core machine each one paused the event loop for 25-80 ms, with
nothing published, fired or delivered meanwhile: the tail of steady delivery
latency. Freezing the start-up heap moves those objects out of the collector's
reach: a full collection then walks only what was made since, and still finds
the cycles that become garbage later.
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> int:
    """Collect the garbage of start-up, then keep every object still alive out of later collections.

    Call it once the process has imported and built what it keeps for its
    whole life, before it starts work. Returns how many objects were frozen.
    """
    # Garbage made while importing would otherwise be frozen too (and never freed).
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
