"""What an instance runs besides its calls: the delay engine's fire loops, the forwarders,
the pending gauge and the retry due scan, built here from the settings; and the Init check
that Redis will not evict the engine's keys.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable

from redis.exceptions import RedisError

from delayed_middleware import storage_format
from delayed_middleware.aio import text
from delayed_middleware.clock import Clock
from delayed_middleware.engine import FireReport, ShardedEngine
from delayed_middleware.keys import EngineKeys, shard_topics
from delayed_middleware.liveness import Supervised
from delayed_middleware.schedules import EnvelopeRecurrence
from delayed_pubsub.broker import Broker
from delayed_pubsub.connection import Connection, call_timeout
from delayed_pubsub.engines import build_engine, engine_config
from delayed_pubsub.forwarder import Forwarder
from delayed_pubsub.gauges import PendingByTopic
from delayed_pubsub.metrics import InstanceMetrics
from delayed_pubsub.retry_notices import DueScan
from delayed_pubsub.settings import Settings

# The name logs have always carried (log queries and alerts key on it), whichever file of the package writes.
log = logging.getLogger("delayed_pubsub.instance")

# Beyond a fire loop's longest pass and sleep, how long it may go without a pass before it counts as stalled.
STALL_SLACK_S = 10.0


def stall_after_s(engine: ShardedEngine) -> float:
    """How long a fire loop may go without a pass before it counts as stalled."""
    cfg = engine.engines[0].config
    # A pass takes at most op_timeout_s and a sleep at most max_sleep_s
    # (or a backoff, at most retry_max_s): longer without one is a stall.
    return cfg.op_timeout_s + max(cfg.max_sleep_s, cfg.retry_max_s) + STALL_SLACK_S


def forwarders(
    connection: Connection, settings: Settings, clock: Clock, metrics: InstanceMetrics, name: str
) -> list[Forwarder]:
    """One forwarder per shard: shard 0's reads the delayed topic's outbox, each other shard
    fires into its own outbox (its own hash slot) and gets one each, same settings."""
    first = Forwarder.from_settings(
        connection.client,
        settings,
        clock,
        metrics.forwarder,
        name=name,
        read_client=connection.blocking_client,
        on_state=metrics.loop_state("forwarder"),
    )
    return [
        first,
        *(
            Forwarder(
                connection.client,
                EngineKeys.for_topic(topic),
                clock,
                first.config,
                metrics.forwarder,
                name=f"{name}~{n}",
                read_client=connection.blocking_client,
                on_state=metrics.loop_state("forwarder"),
            )
            for n, topic in enumerate(shard_topics(settings.consumer_id, settings.shards))
            if n
        ),
    ]


def due_scan(
    connection: Connection, settings: Settings, clock: Clock, metrics: InstanceMetrics, name: str
) -> Supervised:
    """The retry due scan (retry_notices.DueScan) of this app, announcing due retry records; unstarted."""
    scan = DueScan(
        connection.client, settings.consumer_id, clock, metrics, call_timeout=call_timeout(settings)
    )
    return Supervised(f"retry due scan of {name!r}", scan.run, on_state=metrics.loop_state("retry"))


def pending_gauge(
    connection: Connection, settings: Settings, clock: Clock, metrics: InstanceMetrics, name: str
) -> Supervised:
    """The pending-per-topic gauge (gauges.py), for apps with delayed messaging on; unstarted."""
    gauge = PendingByTopic(
        connection.client,
        settings.consumer_id,
        metrics,
        clock,
        call_timeout=call_timeout(settings),
        shards=settings.shards,
    )
    return Supervised(f"pending gauge of {name!r}", gauge.run, on_state=metrics.loop_state("gauge"))


async def warn_if_evicting(connection: Connection, settings: Settings, name: str) -> None:
    """Log an error when Redis may evict the delay engine's keys.

    An allkeys-* maxmemory-policy drops any key under memory pressure: an
    index bucket, the ids hash or the delayed topic itself, and with them
    pending messages, silently. (volatile-* policies evict only keys with a
    TTL, which the engine's keys never have.) Managed Redis may refuse
    CONFIG: then nothing can be said.
    """
    try:
        async with asyncio.timeout(call_timeout(settings)):
            got = await connection.client.config_get("maxmemory-policy")
    except (RedisError, TimeoutError):
        return
    value = next(iter(dict(got).values()), b"")
    policy = text(value)
    if policy.startswith("allkeys"):
        log.error(
            "instance %r: Redis maxmemory-policy is %s: under memory pressure Redis may evict the delay "
            "engine's keys and pending delayed messages with them; use noeviction (or a volatile-* "
            "policy) for this Redis",
            name,
            policy,
        )


def sharded_engine(
    connection: Connection,
    settings: Settings,
    clock: Clock,
    broker: Broker,
    metrics: InstanceMetrics,
    name: str,
    fmt: int,
) -> ShardedEngine:
    """The delay engine over the delayed topic's shard streams (keys.shard_topics).

    On Redis Cluster the fire is two-phase (target topics live in other hash
    slots than the shard); on a single node or Sentinel it is one script.
    Below storage format 2 compaction is off: the envelopes it re-homes are
    lost to release 0.1.0. From format 2 on, each shard's
    fire loop starts with a sweep that re-indexes the envelopes such a release
    left out of the due index (engine/recovery.py).
    """
    topics = shard_topics(settings.consumer_id, settings.shards)
    pending = [0] * len(topics)

    def on_batch(shard: int) -> Callable[[FireReport], None]:
        # The pending gauge is the instance's total over its shards.
        def hook(report: FireReport) -> None:
            pending[shard] = report.pending
            metrics.on_fire(dataclasses.replace(report, pending=sum(pending)))

        return hook

    pinned = fmt < storage_format.COMPACTION
    return build_engine(
        settings,
        connection.client,
        clock,
        # In the window nothing is moved, so no release can have orphaned a moved copy either.
        config=engine_config(settings, compact_check_every=0, recover_orphans=False) if pinned else None,
        trim=broker.trim,
        pubsub_name=name,
        on_batch=on_batch,
        listen_client=connection.blocking_client,
        recurrence=EnvelopeRecurrence(),
        on_listener_state=metrics.loop_state("wake"),
    )
