"""The delay engine attacked through the component, driven over gRPC as daprd drives it."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

import grpc
import pytest
import redis

from delayed_middleware.entry import decode_entry
from delayed_middleware.envelope import decode_envelope
from delayed_pubsub_pb.dapr.proto.components.v1 import pubsub_pb2
from tests.components.driver import Component
from tests.redis_server import stream_entries


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
    """1000 entries with delays of their own are 1000 envelopes, stored in bounded chunks.
    When Redis refuses a later chunk (here: out of memory), the earlier ones are stored:
    reporting all 1000 as failed made daprd's (or the app's) retry store those twice."""
    c = component("delayed")
    await c.init(delayed_props)
    await c.ping()
    entries = [
        pubsub_pb2.BulkMessageEntry(
            entry_id=f"e{i}", event=b"x" * 30_000, metadata={"scheduledSendDelay": "1h"}
        )
        for i in range(1000)
    ]
    # Room for about two thirds of the 30 MB (and for a first chunk of 500, 15 MB).
    limited_memory(22_000_000)
    reply = await c.bulk_publish("orders", entries)
    stored = redis_client.xlen("app1-delayed")
    assert 0 < stored < 1000
    # Exactly the entries not stored are reported, each saying why.
    assert [f.entry_id for f in reply.failed_entries] == [f"e{i}" for i in range(stored, 1000)]
    assert all("memory" in f.error and f"{stored} of 1000 stored" in f.error for f in reply.failed_entries)
    assert int(redis_client.get("{app1-delayed}:pending") or 0) == stored


async def test_delayed_messages_too_costly_to_fire_are_refused_naming_what(
    component: Callable[[str], Component], delayed_props: dict[str, str], redis_client: redis.Redis
) -> None:
    """One envelope fires in one script call, whatever it costs: a delayed publish with
    100,000 metadata keys (1.3 MB) blocked Redis for over a second when it fell due (SLOWLOG,
    shared 2-core machine), a 16 MiB one
    for ~0.4 s. Refused at publish now; without a delay they are ordinary messages."""
    c = component("delayed")
    await c.init(delayed_props)
    many = {f"k{i}": "v" for i in range(100_000)}
    cases = [
        (b"x", {**many, "scheduledSendDelay": "1h"}, "metadata", "100001 keys"),
        (b"x" * (16 << 20), {"scheduledSendDelay": "1h"}, "data=", "at most 4194304 bytes"),
    ]
    for data, md, key, value in cases:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await c.publish("orders", data, md)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        details = err.value.details() or ""
        assert key in details
        assert value in details
    assert redis_client.exists("app1-delayed") == 0
    await c.publish("orders", b"x", many)
    await c.publish("orders", b"x" * (16 << 20))
    assert redis_client.xlen("orders") == 2


async def test_delayed_bulk_is_split_by_cost_not_only_by_entries(
    component: Callable[[str], Component], delayed_props: dict[str, str], redis_client: redis.Redis
) -> None:
    """1,000 entries with 40 metadata keys each made one envelope of 40,000 pairs (~50 ms of
    Redis to fire). Now envelopes hold 2,000 units of work; an entry too costly alone fails."""
    c = component("delayed")
    await c.init(delayed_props)
    md = {f"k{j}": "v" for j in range(40)}
    entries = [pubsub_pb2.BulkMessageEntry(entry_id=f"e{i}", event=b"x", metadata=md) for i in range(1000)]
    entries.append(
        pubsub_pb2.BulkMessageEntry(entry_id="huge", event=b"x", metadata={f"k{j}": "v" for j in range(9000)})
    )
    reply = await c.bulk_publish("orders", entries, {"scheduledSendDelay": "1h"})
    assert [(f.entry_id, "metadata" in f.error) for f in reply.failed_entries] == [("huge", True)]
    envelopes = [
        decode_envelope(decode_entry(f).data) for _, f in stream_entries(redis_client, "app1-delayed")
    ]
    # 40 pairs are 10 units, and the entry 1: 181 entries per envelope.
    assert [len(e.bulk_entries) for e in envelopes] == [181] * 5 + [95]
    assert [b.entry_id for e in envelopes for b in e.bulk_entries] == [f"e{i}" for i in range(1000)]


async def test_init_says_when_redis_may_evict_pending_delayed_messages(
    component: Callable[[str], Component],
    delayed_props: dict[str, str],
    redis_client: redis.Redis,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """With maxmemory-policy allkeys-lru Redis evicts any key under memory pressure: an index
    bucket, the ids hash, the delayed topic. Pending messages vanished without a word."""
    redis_client.config_set("maxmemory-policy", "allkeys-lru")
    try:
        with caplog.at_level(logging.ERROR, logger="delayed_pubsub.instance"):
            await component("delayed").init(delayed_props)
    finally:
        redis_client.config_set("maxmemory-policy", "noeviction")
    [record] = [r for r in caplog.records if "maxmemory-policy" in r.getMessage()]
    assert "allkeys-lru" in record.getMessage()
    assert "noeviction" in record.getMessage()
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="delayed_pubsub.instance"):
        await component("again").init(delayed_props)
    assert not [r for r in caplog.records if "maxmemory-policy" in r.getMessage()]


async def test_a_named_bulk_of_1000_with_everyday_metadata_is_still_one_envelope(
    component: Callable[[str], Component], delayed_props: dict[str, str], redis_client: redis.Redis
) -> None:
    """The cost bound must not refuse what firing handles well: 1,000 entries, each with the
    request's keys merged in (here 6), fire in ~10 ms."""
    c = component("delayed")
    await c.init(delayed_props)
    entries = [
        pubsub_pb2.BulkMessageEntry(entry_id=f"e{i}", event=b"{}", metadata={"k": "v"}) for i in range(1000)
    ]
    md = {"scheduleId": "batch", "scheduledSendDelay": "1h", "a": "1", "b": "2", "c": "3"}
    reply = await c.bulk_publish("orders", entries, md)
    assert list(reply.failed_entries) == []
    [(_, fields)] = stream_entries(redis_client, "app1-delayed")
    assert len(decode_envelope(decode_entry(fields).data).bulk_entries) == 1000
