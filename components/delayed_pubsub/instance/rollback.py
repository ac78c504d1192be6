"""The storage format an instance keeps, and what the rollback window refuses.

Below the newest format (storage_format.settle_format, once per Init) the app is
in the rollback window: publishes needing a newer format than the app's are
refused, checked by a string and two ints per envelope (storage_format.needs_format)
so the window costs the publish path no Redis call.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from redis.exceptions import RedisError

from delayed_middleware import envelope as env
from delayed_middleware import plan, storage_format
from delayed_middleware.control import Control, Pause
from delayed_middleware.keys import EngineKeys, shard_topics
from delayed_pubsub.broker import FailedEntry
from delayed_pubsub.connection import Connection, call_timeout
from delayed_pubsub.instance.unavailable import redis_unavailable
from delayed_pubsub.settings import Settings

# The name logs have always carried (log queries and alerts key on it), whichever file of the package writes.
log = logging.getLogger("delayed_pubsub.instance")


def newer_need(
    fmt: int, envelopes: Sequence[env.Envelope], control: Control | None
) -> tuple[int, str] | None:
    """The format a planned publish needs beyond `fmt`, and why, if any (storage_format.needs_format)."""
    if isinstance(control, Pause) and control.pause and fmt < storage_format.PAUSE:
        return storage_format.PAUSE, "schedulePause: true (a paused message)"
    for e in envelopes:
        need = storage_format.needs_format(e)
        if need is not None and need[0] > fmt:
            return need
    return None


def refuse_if_pinned(fmt: int, delayed: Sequence[plan.Delayed], control: Control | None) -> None:
    """In the rollback window, the refusal of a publish that needs a newer format."""
    if fmt < storage_format.CURRENT:
        need = newer_need(fmt, [d.envelope for d in delayed], control)
        if need is not None:
            raise storage_format.pinned_refusal(fmt, need[1], need[0])


def withhold_pinned(
    fmt: int, delayed: Sequence[plan.Delayed]
) -> tuple[tuple[plan.Delayed, ...], list[FailedEntry]]:
    """A bulk's delayed part split into what may be stored and the failed entries of what
    needs a newer format (each entry fails alone); all of it outside the rollback window."""
    if fmt >= storage_format.CURRENT:
        return tuple(delayed), []
    keep: list[plan.Delayed] = []
    failed: list[FailedEntry] = []
    for d in delayed:
        need = newer_need(fmt, [d.envelope], None)
        if need is None:
            keep.append(d)
        else:
            refusal = str(storage_format.pinned_refusal(fmt, need[1], need[0]))
            failed += [FailedEntry(i, refusal) for i in d.entry_ids]
    return tuple(keep), failed


async def settle_format(connection: Connection, settings: Settings) -> int:
    """The app's storage format, settled on every shard (storage_format.settle_format): once per
    Init, so the publish path only reads the instance's copy."""
    keys = [EngineKeys.for_topic(t) for t in shard_topics(settings.consumer_id, settings.shards)]
    try:
        fmt = await storage_format.settle_format(
            connection.client,
            keys,
            settings.storage_format,
            consumer_id=settings.consumer_id,
            timeout_s=call_timeout(settings),
        )
    except (RedisError, TimeoutError) as e:
        raise redis_unavailable(f"reading the storage format of {keys[0].stream!r}", e) from e
    if fmt < storage_format.CURRENT:
        log.warning(
            "%r: delayed data kept in storage %s (the rollback window):%s publishes needing a newer "
            "format are refused; set %s: %d once no replica runs an older release",
            keys[0].stream,
            storage_format.describe(fmt),
            " compaction is off and" if fmt < storage_format.COMPACTION else "",
            storage_format.SETTING,
            storage_format.CURRENT,
        )
    return fmt
