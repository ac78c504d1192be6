"""One way to build an app's delay engine from its settings: the instance and the operator CLI share it.

Built in two places, the engines had drifted apart: the operator's cancel
built its EngineConfig without `two_phase`, so on Redis Cluster it did not
stop an occurrence in flight. Everything the settings decide (history,
marker messages, the two-phase fire on Cluster, the shard streams) is decided
here once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from delayed_middleware.client import RedisClient
from delayed_middleware.clock import Clock
from delayed_middleware.engine import DelayEngine, EngineConfig, FireReport, Recurrence, ShardedEngine
from delayed_middleware.entry import Trim
from delayed_middleware.keys import EngineKeys, shard_topics
from delayed_middleware.liveness import StateHook
from delayed_pubsub.settings import Settings


def engine_config(settings: Settings, **overrides: Any) -> EngineConfig:
    """The EngineConfig the settings make (history, deleteMarkerTTL, two-phase on Cluster), then `overrides`."""
    fields: dict[str, Any] = {
        "history_max_len": settings.history_max_len,
        "history_max_age_ms": settings.history_max_age_ms,
        "marker_ttl_ms": settings.delete_marker_ttl_ms,
        # Target topics live in other hash slots than the shard: fire in three steps.
        "two_phase": settings.redis_type == "cluster",
    }
    fields.update(overrides)
    return EngineConfig(**fields)


def build_engine(
    settings: Settings,
    client: RedisClient,
    clock: Clock,
    *,
    config: EngineConfig | None = None,
    trim: Trim | None = None,
    pubsub_name: str = "",
    on_batch: Callable[[int], Callable[[FireReport], None] | None] | None = None,
    listen_client: RedisClient | None = None,
    recurrence: Recurrence | None = None,
    on_listener_state: StateHook | None = None,
) -> ShardedEngine:
    """The app's engine over its delayed topic's shard streams (keys.shard_topics).

    `config` defaults to engine_config(settings); `on_batch(shard)` gives each
    shard's FireReport hook. The rest is handed to every shard's DelayEngine.
    """
    cfg = config if config is not None else engine_config(settings)
    return ShardedEngine(
        [
            DelayEngine(
                client,
                EngineKeys.for_topic(topic),
                clock,
                trim=trim,
                pubsub_name=pubsub_name,
                on_batch=None if on_batch is None else on_batch(n),
                config=cfg,
                listen_client=listen_client,
                recurrence=recurrence,
                on_listener_state=on_listener_state,
            )
            for n, topic in enumerate(shard_topics(settings.consumer_id, settings.shards))
        ]
    )
