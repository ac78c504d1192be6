"""The known workload the Spark tests check figures against.

Pending: 100 messages on topic `a` delayed 300 ms (they fire), 50 on topic `b`
delayed 1 h (they wait), published through the real component's gRPC socket.
History: the engine writes `scheduled` and `fired` records itself as the
workload runs (real_fired reads them back, for figures to compare with);
write_history is a hand-written history of the same shape with exactly known
figures (lateness 0..99 ms, 60 fires in one minute and 40 in the next) for
tests without the component; write_other_events adds the rarer events (3
cancelled, 2 expired, 4 retried, 1 dead-lettered on `b`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from typing import Any

import redis

from delayed_middleware.history import HistoryRecord, decode_record
from tests.components.driver import Component
from tests.components.spark.conftest import add_history, fired
from tests.redis_server import stream_entries

FIRE_TOPIC, WAIT_TOPIC = "a", "b"
FIRED, WAITING = 100, 50
WAIT_MS = 3_600_000
# Exact percentiles of 0..99 with linear interpolation: rank = q * 99.
P50, P95, P99, MAX = 49.5, 94.05, 98.01, 99
COUNTS = {"cancelled": 3, "expired": 2, "retried": 4, "deadlettered": 1, "completed": 2}
MINUTE0 = 1_795_000_020_000 // 60_000 * 60_000  # a whole UTC minute
PER_MINUTE = [60, 40]


async def publish_workload(
    component: Callable[[str], Component], props: dict[str, str], r: redis.Redis
) -> None:
    c = component("delayed")
    await c.init({**props, "enableDelayedMessaging": "true"})
    for i in range(FIRED):
        await c.publish(FIRE_TOPIC, b'{"n": %d}' % i, {"scheduledSendDelay": "300ms"})
    for i in range(WAITING):
        await c.publish(WAIT_TOPIC, b'{"n": %d}' % i, {"scheduledSendDelay": "1h"})
    deadline = time.monotonic() + 30
    while r.xlen(FIRE_TOPIC) < FIRED:
        assert time.monotonic() < deadline, f"only {r.xlen(FIRE_TOPIC)} of {FIRED} fired in 30 s"
        await asyncio.sleep(0.1)


def write_other_events(r: redis.Redis) -> None:
    add_history(
        r,
        [
            {"event": event, "topic": WAIT_TOPIC, "at": MINUTE0, "reason": "test"}
            for event, n in COUNTS.items()
            for _ in range(n)
        ],
    )


def real_fired(r: redis.Redis) -> list[HistoryRecord]:
    """The `fired` records the engine wrote for the workload."""
    rows = stream_entries(r, "{app1-delayed}:history")
    return [rec for rec in (decode_record(i, f) for i, f in rows) if rec.event == "fired"]


def write_history(r: redis.Redis) -> None:
    records: list[Mapping[str, Any]] = []
    records += [{"event": "scheduled", "topic": FIRE_TOPIC, "at": MINUTE0 - 1000} for _ in range(FIRED)]
    records += [{"event": "scheduled", "topic": WAIT_TOPIC, "at": MINUTE0 - 1000} for _ in range(WAITING)]
    for late in range(FIRED):
        # The first 60 fire in MINUTE0, the other 40 in the minute after.
        due = MINUTE0 + (0 if late < PER_MINUTE[0] else 60_000) + 100
        records.append(fired(FIRE_TOPIC, due, late, id=f"a-{late}"))
    for event, n in COUNTS.items():
        records += [{"event": event, "topic": WAIT_TOPIC, "at": MINUTE0, "reason": "test"} for _ in range(n)]
    add_history(r, records)
