"""The delay engine attacked through the component, driven over gRPC as daprd drives it."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import redis

from delayed_pubsub_pb.dapr.proto.components.v1 import pubsub_pb2
from tests.components.driver import Component


@pytest.fixture
def delayed_props(props: dict[str, str]) -> dict[str, str]:
    return {**props, "enableDelayedMessaging": "true"}


@pytest.fixture
def limited_memory(redis_client: redis.Redis) -> Iterator[Callable[[int], None]]:
    """Sets Redis maxmemory (noeviction) to what it uses now plus `headroom` bytes; undone after."""

    def limit(headroom: int) -> None:
        used = int(redis_client.info("memory")["used_memory"])
        redis_client.config_set("maxmemory-policy", "noeviction")
        redis_client.config_set("maxmemory", used + headroom)

    yield limit
    redis_client.config_set("maxmemory", 0)


async def test_bulk_publish_failing_part_way_reports_only_what_was_not_stored(
    component: Callable[[str], Component],
    delayed_props: dict[str, str],
    redis_client: redis.Redis,
    limited_memory: Callable[[int], None],
) -> None:
    """1000 entries with delays of their own are 1000 envelopes, stored in chunks of 500. When
    Redis refuses the second chunk (out of memory), the first is stored: reporting all 1000
    as failed made daprd's (or the app's) retry store those 500 twice."""
    c = component("delayed")
    await c.init(delayed_props)
    await c.ping()
    entries = [
        pubsub_pb2.BulkMessageEntry(
            entry_id=f"e{i}", event=b"x" * 30_000, metadata={"scheduledSendDelay": "1h"}
        )
        for i in range(1000)
    ]
    # Room for the first chunk's 15 MB request (+7 MB), not for it stored plus the second's.
    limited_memory(22_000_000)
    reply = await c.bulk_publish("orders", entries)
    stored = redis_client.xlen("app1-delayed")
    assert stored == 500
    failed = [f.entry_id for f in reply.failed_entries]
    assert failed == [f"e{i}" for i in range(500, 1000)]
    assert all("OOM" in f.error or "memory" in f.error for f in reply.failed_entries)
    assert int(redis_client.get("{app1-delayed}:pending") or 0) == 500
