"""The read-only inspector against a real Redis populated by the real engine."""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis

import delayed_middleware.pending_reader
from delayed_middleware.clock import ManualClock
from delayed_middleware.engine import DelayEngine, ShardedEngine
from delayed_middleware.entry import StreamEntry, encode_entry
from delayed_middleware.envelope import BulkEntry, Envelope, encode_envelope
from delayed_middleware.errors import InvalidArgumentError
from delayed_middleware.inspector import Inspector, payload_preview
from delayed_middleware.keys import EngineKeys, delayed_topic, is_stream_id, shard_topics
from delayed_middleware.outbox import OutboxEntry, encode_outbox_entry
from delayed_middleware.retry import retry_key, retry_topics_key

T0 = 1_800_000_000_000
KEYS = EngineKeys.for_topic(delayed_topic("app"))


def env(n: int, due: int, topic: str = "orders", sid: str = "", message: bytes | None = None) -> Envelope:
    return Envelope(
        id=sid,
        topic=topic,
        due_ms=due,
        published_at_ms=T0,
        message=message if message is not None else f'{{"n":{n}}}'.encode(),
        metadata={"k": f"v{n}"},
        schedule_id=sid,
    )


@pytest.fixture
async def client(redis_client: redis.Redis) -> AsyncIterator[aioredis.Redis]:
    port = redis_client.connection_pool.connection_kwargs["port"]
    c = aioredis.Redis(port=port)
    yield c
    await c.aclose()


@pytest.fixture
def engine(client: aioredis.Redis) -> DelayEngine:
    return DelayEngine(client, KEYS, ManualClock(T0))


async def test_pending_pages_through_the_stream_with_exact_counts(
    client: aioredis.Redis, engine: DelayEngine
) -> None:
    # 23 on orders and 14 on billing, due in reverse publish order; page size 5
    # forces eight XRANGE pages, with a page boundary inside every kind of run.
    await engine.schedule([env(i, T0 + 100_000 - i, "orders") for i in range(23)])
    await engine.schedule([env(i, T0 + 50_000 + i, "billing") for i in range(14)])
    inspector = Inspector(client, "app", page_size=5)
    seen: list[tuple[int, int]] = []
    report = await inspector.pending(progress=lambda done, total: seen.append((done, total)))
    assert report.counts == {"orders": 23, "billing": 14}
    assert report.matched == len(report.messages) == 37
    assert report.scanned == 37
    assert [m.due_ms for m in report.messages] == sorted(m.due_ms for m in report.messages)
    assert seen[-1] == (37, 37)
    assert len(seen) == 8

    only = await inspector.pending(topic="billing", due_before_ms=T0 + 50_005)
    assert [m.due_ms for m in only.messages] == [T0 + 50_000 + i for i in range(5)]

    earliest = await inspector.pending(limit=3)
    assert [m.due_ms for m in earliest.messages] == [T0 + 50_000, T0 + 50_001, T0 + 50_002]
    assert earliest.matched == 37

    counts, complete = await inspector.counts_by_topic(max_entries=10)
    assert sum(counts.values()) == 10
    assert not complete
    assert await inspector.counts_by_topic() == ({"orders": 23, "billing": 14}, True)


async def test_the_filters_and_the_paging_hold_alike_for_delayed_retry_and_hand_off_messages(
    client: aioredis.Redis, engine: DelayEngine, redis_client: redis.Redis
) -> None:
    """One topic and due-time filter for all three kinds a listing merges, and every read
    goes on past its first page (page size 2): the outbox, the dead letters, and the scan
    that finds an envelope by the id it carries."""
    await engine.schedule([env(i, T0 + 1_000 * i, "orders" if i % 2 else "billing") for i in range(6)])
    # Retries: entries the subscriber took (in the group's PEL) and waits to deliver again.
    for topic in ("orders", "billing"):
        redis_client.xgroup_create(topic, "app", id="0", mkstream=True)
        for i in range(3):
            entry_id: Any = redis_client.xadd(topic, encode_entry(StreamEntry(b"r")))  # type: ignore[arg-type]
            redis_client.zadd(retry_key("app", topic), {entry_id: T0 + 500 + 1_000 * i})
        redis_client.sadd(retry_topics_key("app"), topic)
        redis_client.xreadgroup("app", "c1", {topic: ">"})
    # Hand-offs never tried: due when they were fired, their outbox id's time.
    for i in range(5):
        handoff = OutboxEntry("kafka", "orders" if i % 2 else "billing", b"h", id=f"h{i}")
        redis_client.xadd(KEYS.outbox, encode_outbox_entry(handoff), id=f"{T0 + 250 + 1_000 * i}-0")  # type: ignore[arg-type]
    inspector = Inspector(client, "app", page_size=2)

    everything = await inspector.pending()
    assert Counter(m.kind for m in everything.messages) == {"oneshot": 6, "retry": 6, "handoff": 5}
    cut = T0 + 2_600
    only = await inspector.pending(topic="orders", due_before_ms=cut)
    # Orders due before the cut: one-shot 1 (T0+1000), retries at +500, +1500, +2500, hand-off h1 (+1250).
    assert Counter(m.kind for m in only.messages) == {"oneshot": 1, "retry": 3, "handoff": 1}
    assert (only.counts, only.matched) == ({"orders": 5}, 5)
    assert sorted(m.id for m in only.messages) == sorted(
        m.id for m in everything.messages if m.topic == "orders" and m.due_ms < cut
    )
    assert [m.id for m in only.messages if m.kind == "handoff"] == ["h1"]

    # An envelope known only by the id it carries, on the stream's fourth page.
    redis_client.xadd(KEYS.stream, {"data": encode_envelope(env(9, T0 + 9_000, sid="legacy-9"))})
    redis_client.hdel(KEYS.ids, "legacy-9")
    found = await inspector.get("legacy-9")
    assert found is not None
    assert (found.envelope.id, found.message.due_ms) == ("legacy-9", T0 + 9_000)


async def test_get_by_schedule_id_and_by_envelope_id(client: aioredis.Redis, engine: DelayEngine) -> None:
    [with_sid, plain] = await engine.schedule(
        [env(1, T0 + 1000, sid="invoice-7"), env(2, T0 + 2000, message=b"\xff\x00binary")]
    )
    # The engine's schedule returns the scheduleId when there is one, else the stream id.
    assert with_sid == "invoice-7"
    inspector = Inspector(client, "app")
    info = await inspector.get("invoice-7")
    assert info is not None
    assert is_stream_id(info.message.stream_id)
    assert info.message.id == "invoice-7"
    assert info.state == "pending"
    assert info.preview() == '{"n":1}'
    assert info.envelope.metadata == {"k": "v1"}
    by_stream_id = await inspector.get(info.message.stream_id)
    assert by_stream_id is not None
    assert by_stream_id.message.id == "invoice-7"

    info = await inspector.get(plain)
    assert info is not None
    assert info.message.id == plain
    assert info.message.due_ms == T0 + 2000
    assert info.preview() == "0xff0062696e617279"

    assert await inspector.get("nope") is None
    assert await inspector.get("0-1") is None


async def test_replaced_schedule_shows_only_the_new_one(client: aioredis.Redis, engine: DelayEngine) -> None:
    await engine.schedule([env(1, T0 + 1000, sid="s")])
    await engine.schedule([env(2, T0 + 9000, sid="s")])
    report = await Inspector(client, "app").pending()
    assert [(m.id, m.due_ms) for m in report.messages] == [("s", T0 + 9000)]


async def test_parked_and_undecodable_are_counted_not_listed(
    client: aioredis.Redis, engine: DelayEngine, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    [a, b] = await engine.schedule([env(1, T0 + 1000), env(2, T0 + 2000)])
    redis_client.hset(KEYS.parked, a, "target topic is a hash")
    redis_client.xadd(KEYS.stream, {"data": b"\x0a\xff\xff"})  # truncated protobuf
    inspector = Inspector(client, "app")
    report = await inspector.pending()
    assert [m.stream_id for m in report.messages] == [b]
    assert (report.parked, report.undecodable) == (1, 1)
    assert await inspector.counts_by_topic() == ({"orders": 1}, True)
    # Many parked: looked up per page instead of loaded at once, same answer.
    monkeypatch.setattr(delayed_middleware.pending_reader, "PARKED_IN_MEMORY", 0)
    assert await inspector.counts_by_topic() == ({"orders": 1}, True)
    info = await inspector.get(a)
    assert info is not None
    assert info.state == "parked"
    assert info.parked_reason == "target topic is a hash"


async def test_recurring_due_comes_from_the_ids_hash(
    client: aioredis.Redis, engine: DelayEngine, redis_client: redis.Redis
) -> None:
    # The engine keeps a recurring envelope's current occurrence in the ids hash:
    # "<stream id> <due ms> <next ms>".
    await engine.schedule([env(1, T0 + 1000, sid="every-minute")])
    ref: Any = redis_client.hget(KEYS.ids, "every-minute")
    stream_id = ref.decode().split()[0]
    redis_client.hset(KEYS.ids, "every-minute", f"{stream_id} {T0 + 60_000} {T0 + 120_000} - i")
    [m] = (await Inspector(client, "app").pending()).messages
    assert (m.kind, m.due_ms) == ("recurring", T0 + 60_000)


async def test_bulk_envelope_size_and_preview(client: aioredis.Redis, engine: DelayEngine) -> None:
    bulk = Envelope(
        id="",
        topic="orders",
        due_ms=T0 + 1,
        published_at_ms=T0,
        bulk_entries=(BulkEntry("1", b"abc"), BulkEntry("2", b"defg")),
    )
    [sid] = await engine.schedule([bulk])
    info = await Inspector(client, "app").get(sid)
    assert info is not None
    assert info.message.size == 7
    assert info.preview() == "[bulk of 2] abc"


async def test_history_filters_by_id_and_since(client: aioredis.Redis, redis_client: redis.Redis) -> None:
    for i, (event, id) in enumerate(
        [("scheduled", "a"), ("scheduled", "b"), ("fired", "a"), ("retried", "a")]
    ):
        redis_client.xadd(
            KEYS.history, {"event": event, "at": str(T0 + i), "id": id, "topic": "t"}, id=f"{T0 + i}-0"
        )
    inspector = Inspector(client, "app", page_size=2)
    assert [r.event for r in await inspector.history(id="a")] == ["scheduled", "fired", "retried"]
    assert [r.id for r in await inspector.history(since_ms=T0 + 1)] == ["b", "a", "a"]
    assert len(await inspector.history()) == 4


async def test_dead_letters_of_this_app_only(client: aioredis.Redis, redis_client: redis.Redis) -> None:
    from delayed_middleware.deadletters import dead_letter_topics_key

    def dead(app: str, source: str) -> dict[str, bytes]:
        md = {
            "deadLetterConsumer": app,
            "deadLetterSourceTopic": source,
            "deadLetterReason": "boom",
            "deadLetterAttempts": "3",
            "deadLetterAt": str(T0),
        }
        return encode_entry(StreamEntry(b"x", md))

    redis_client.sadd(dead_letter_topics_key("app"), "dlq")
    redis_client.xadd("dlq", dead("app", "orders"))  # type: ignore[arg-type]
    redis_client.xadd("dlq", dead("other-app", "orders"))  # type: ignore[arg-type]
    redis_client.xadd("dlq", dead("app", "billing"))  # type: ignore[arg-type]
    inspector = Inspector(client, "app")
    assert [(d.source_topic, d.reason, d.attempts) for d in await inspector.dead_letters()] == [
        ("orders", "boom", 3),
        ("billing", "boom", 3),
    ]
    assert len(await inspector.dead_letters(source_topic="billing")) == 1
    # Read page by page: a page of 2 ends between this app's letters and another's.
    for _ in range(3):
        redis_client.xadd("dlq", dead("app", "billing"))  # type: ignore[arg-type]
    paged = await Inspector(client, "app", page_size=2).dead_letters()
    assert [d.source_topic for d in paged] == ["orders", "billing", "billing", "billing", "billing"]


def test_payload_preview_cuts_and_hexes() -> None:
    assert payload_preview(b"hello", 3) == "hel… (5 bytes)"
    assert payload_preview(b"\x80", 3) == "0x80"


# --- several shard streams (delayShards) ------------------------------------------------


def sharded(client: aioredis.Redis, clock: ManualClock, n: int = 3) -> ShardedEngine:
    return ShardedEngine(
        [DelayEngine(client, EngineKeys.for_topic(t), clock) for t in shard_topics("app", n)]
    )


async def test_every_shard_is_listed_merged_by_due_time_with_shard_labelled_ids(
    client: aioredis.Redis,
) -> None:
    clock = ManualClock(T0)
    engine = sharded(client, clock)
    ids: list[str] = []
    # Three calls without scheduleIds (one shard each), due times interleaved across them.
    for call in range(3):
        ids += await engine.schedule([env(i, T0 + 10_000 + i * 3 + call, f"t{call}") for i in range(7)])
    ids += await engine.schedule([env(100 + i, T0 + 5_000 + i, "named", sid=f"s{i}") for i in range(5)])
    inspector = Inspector(client, "app", page_size=4, shards=3)
    report = await inspector.pending()
    assert report.matched == len(report.messages) == 26
    assert report.counts == {"t0": 7, "t1": 7, "t2": 7, "named": 5}
    assert [m.due_ms for m in report.messages] == sorted(m.due_ms for m in report.messages)
    # The ids operators see are the ones the engine handed out (<stream id>@<shard>, scheduleIds).
    assert sorted(m.id for m in report.messages) == sorted(ids)
    assert {m.id.rpartition("@")[2] for m in report.messages if not m.schedule_id} == {"0", "1", "2"}
    assert await inspector.stream_length() == 26
    assert [m.id for m in (await inspector.pending(limit=3)).messages] == [m.id for m in report.messages[:3]]
    # Each found again by its id, on its shard, with its own history.
    for m in report.messages:
        info = await inspector.get(m.id)
        assert info is not None
        assert (info.message.id, info.message.shard, info.state) == (m.id, m.shard, "pending")
        assert [r.event for r in info.history] == ["scheduled"]
        assert [r.id for r in info.history] == [m.id]
    assert await inspector.get("1-1@2") is None
    assert await inspector.get(ids[0].partition("@")[0] + "@9") is None  # no shard 9


async def test_a_schedule_id_spelled_like_a_padded_shard_id_is_found_by_its_schedule_id(
    client: aioredis.Redis,
) -> None:
    # `1-1@01` is no id shard_id writes (it would be `1-1@1`): the operator means the scheduleId.
    clock = ManualClock(T0)
    engine = sharded(client, clock)
    await engine.schedule([env(1, T0 + 60_000, "orders", sid="1-1@01")])
    await engine.schedule([env(2, T0 + 60_000, "orders")])
    info = await Inspector(client, "app", shards=3).get("1-1@01")
    assert info is not None
    assert (info.message.id, info.message.schedule_id, info.state) == ("1-1@01", "1-1@01", "pending")


async def test_counts_over_shards_respect_the_scan_bound(client: aioredis.Redis) -> None:
    clock = ManualClock(T0)
    engine = sharded(client, clock)
    for _ in range(3):
        await engine.schedule([env(i, T0 + 60_000, "t") for i in range(10)])
    inspector = Inspector(client, "app", page_size=4, shards=3)
    assert await inspector.counts_by_topic() == ({"t": 30}, True)
    assert await inspector.counts_by_topic(max_entries=30) == ({"t": 30}, True)
    counts, complete = await inspector.counts_by_topic(max_entries=25)
    assert (counts, complete) == ({"t": 25}, False)
    counts, complete = await inspector.counts_by_topic(max_entries=10)
    assert (counts, complete) == ({"t": 10}, False)


async def test_a_bare_stream_id_on_two_shards_is_refused_naming_the_way_out(
    client: aioredis.Redis, redis_client: redis.Redis
) -> None:
    data = encode_envelope(env(1, T0 + 1_000))
    for topic in shard_topics("app", 3)[1:]:
        redis_client.xadd(topic, {"data": data}, id="5-1")
    inspector = Inspector(client, "app", shards=3)
    with pytest.raises(InvalidArgumentError, match="5-1@<shard>"):
        await inspector.get("5-1")
    info = await inspector.get("5-1@2")
    assert info is not None
    assert inspector.stream_of(info.message) == shard_topics("app", 3)[2]


async def test_one_shard_is_the_single_node_layout_unchanged(
    client: aioredis.Redis, engine: DelayEngine
) -> None:
    [sid] = await engine.schedule([env(1, T0 + 1_000)])
    inspector = Inspector(client, "app", shards=1)
    [m] = (await inspector.pending()).messages
    assert (m.id, m.shard) == (sid, None)
    assert inspector.stream_of(m) == "app-delayed"
    assert [r.id for r in await inspector.history()] == [sid]
