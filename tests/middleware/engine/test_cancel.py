"""CANCEL against a real Redis: batched removals that leave nothing behind, ids counted once
per call however they are named (scheduleId, stream id, a recurring schedule's stream id after
it fired, an id out of range), markers on the topic when asked, and history records that
describe the cancelled message exactly (the script reads the envelope with a lean decoder of
its own)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import redis
import redis.asyncio as aioredis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from delayed_middleware import lua_scripts
from delayed_middleware.clock import ManualClock
from delayed_middleware.engine import DelayEngine, EngineConfig
from delayed_middleware.entry import decode_entry
from delayed_middleware.envelope import RECURRING, RETRY, BulkEntry, Envelope
from delayed_pubsub_pb.delayedpubsub.v1 import delayed_pb2
from tests.middleware.engine.helpers import (
    KEYS,
    T0,
    drain,
    env,
    every,
    history,
    payloads,
    recurring,
    target,
)
from tests.redis_server import stream_entries
from tests.wire import bytes_field, varint, varint_field


def engine_keys_left(client: redis.Redis) -> list[str]:
    """Engine state still holding something (index, ids, marks, envelopes), beyond the
    history (and its by-id index), the call tokens and the bucket sequence: nothing, once all is
    cancelled or fired."""
    keep = {KEYS.history, KEYS.history_index, KEYS.calls, KEYS.seq}
    left = sorted(
        k.decode()
        for k in client.scan_iter(match="{app-delayed}*")
        if k.decode() not in keep and not (k.decode() == KEYS.count and client.get(k) == b"0")
    )
    return left + ([KEYS.stream] if client.xlen(KEYS.stream) else [])


_text = st.text(alphabet=st.characters(exclude_categories=["Cs"]), max_size=30)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    message=st.binary(max_size=2000),
    metadata=st.dictionaries(_text, _text, max_size=5),
    content_type=_text,
    bulk=st.lists(
        st.tuples(_text, st.binary(max_size=300), _text, st.dictionaries(_text, _text, max_size=3)),
        max_size=4,
    ),
    topic=_text.filter(bool),
    sid=st.sampled_from(["", "s-1", "0-1"]),
    kind=st.sampled_from(["oneshot", "recurring", "retry"]),
    by_stream_id=st.booleans(),
)
async def test_the_cancelled_record_describes_the_message_as_its_scheduled_record_does(
    aredis: Callable[[], aioredis.Redis],
    redis_client: redis.Redis,
    message: bytes,
    metadata: dict[str, str],
    content_type: str,
    bulk: list[tuple[str, bytes, str, dict[str, str]]],
    topic: str,
    sid: str,
    kind: str,
    by_stream_id: bool,
) -> None:
    redis_client.flushall()
    engine = DelayEngine(aredis(), KEYS, ManualClock(T0), recurrence=every)
    e = Envelope(
        id=sid,
        topic=topic,
        due_ms=T0 + 1_000,
        published_at_ms=T0,
        message=message,
        content_type=content_type,
        metadata=metadata,
        schedule_id=sid,
        bulk_entries=tuple(BulkEntry(*b) for b in bulk),
        kind={"oneshot": 0, "recurring": RECURRING, "retry": RETRY}[kind],
        schedule="@test 1000" if kind == "recurring" else "",
    )
    [id] = await engine.schedule([e])
    [(stream_id, _)] = stream_entries(redis_client, KEYS.stream)
    assert await engine.cancel_many([stream_id if by_stream_id else id]) == [(True, topic)]
    [scheduled] = history(redis_client, "scheduled")
    [cancelled] = history(redis_client, "cancelled")
    assert (cancelled.schedule_id, cancelled.topic, cancelled.kind, cancelled.size_bytes) == (
        scheduled.schedule_id,
        scheduled.topic,
        scheduled.kind,
        e.size,
    )
    assert (cancelled.schedule, cancelled.due_ms, cancelled.reason) == (e.schedule, T0 + 1_000, "Remove")
    assert engine_keys_left(redis_client) == []


def _entry(*fields: bytes) -> bytes:
    """A DelayedBulk's `entries` field holding a DelayedBulkEntry of these fields."""
    return bytes_field(1, b"".join(fields))


_LONG_VARINT = b"\xff" * 10 + b"\x01"  # 11 bytes: past protobuf's 10


@pytest.mark.parametrize(
    ("body", "size"),
    [
        (_entry(bytes_field(2, b"abc")) + _entry(bytes_field(1, b"e2"), bytes_field(2, b"defgh")), 8),
        # An entry's event given twice: the last one counts.
        (_entry(bytes_field(2, b"abcd"), bytes_field(2, b"ef")), 2),
        # ...and an event given as a varint reads as empty.
        (_entry(bytes_field(2, b"abcd"), varint_field(2, 7)) + _entry(bytes_field(2, b"xyz")), 3),
        # A fixed32 event is passed over.
        (_entry(bytes_field(2, b"abcd"), varint(2 << 3 | 5) + b"\x00" * 4), 4),
        # Fields of the DelayedBulk other than its entries (and entries that are not bytes) are skipped.
        (
            _entry(bytes_field(2, b"abc"))
            + varint_field(2, 5)
            + varint_field(1, 9)
            + _entry(bytes_field(2, b"de")),
            5,
        ),
        (bytes_field(9, b"junk") + _entry(bytes_field(2, b"abc")), 3),
        # The DelayedBulk's own framing is checked as the full decoder does: unreadable, no size.
        (_entry(bytes_field(2, b"abc")) + varint(2 << 3) + _LONG_VARINT, 0),
        (_entry(bytes_field(2, b"abc"))[:-1], 0),
        (_entry(bytes_field(2, b"abc")) + varint(2 << 3 | 3), 0),
    ],
    ids=[
        "two-entries",
        "event-twice",
        "varint-event",
        "fixed32-event",
        "bulk-level-varints",
        "bulk-level-other-field",
        "bulk-level-long-varint",
        "bulk-truncated",
        "bulk-group-wire-type",
    ],
)
async def test_the_cancelled_record_sizes_a_hand_written_bulk_body_by_its_entries_events(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis, body: bytes, size: int
) -> None:
    """A bulk body written by hand on the delayed topic (repeated, mistyped, over-long and
    truncated fields): CANCEL's lean reader counts the events as the table says, or, where the
    body's own framing is broken, cancels the message with a record that names nothing of it."""
    raw = delayed_pb2.DelayedMessage(
        topic="orders", bulkPublish=True, message=body, scheduleId="b1"
    ).SerializeToString()
    redis_client.eval(
        lua_scripts.SCHEDULE, len(KEYS.script_keys), *KEYS.script_keys,
        *(KEYS.buckets, "nowake", T0, 100, 120_000, 1, "", 1),
        *(raw, T0 + 1_000, "b1", 0, "orders", 1, "", "-", "-"),
    )  # fmt: skip
    engine = DelayEngine(aredis(), KEYS, ManualClock(T0))
    readable = size > 0
    assert await engine.cancel_many(["b1"]) == [(True, "orders" if readable else "")]
    [cancelled] = history(redis_client, "cancelled")
    assert (cancelled.topic, cancelled.size_bytes) == ("orders" if readable else "", size)
    assert engine_keys_left(redis_client) == []


async def test_one_call_counts_each_message_once_however_it_is_named(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    """Twice the same id, a scheduleId and its envelope's stream id, a stream id between
    scheduleIds (cancelled on the spot while the rest is queued): each message once."""
    clock = ManualClock(T0)
    engine = DelayEngine(aredis(), KEYS, clock)
    await engine.schedule([env(i, T0 + 100 + i % 7, sid=f"s{i}") for i in range(10)])
    [anon] = await engine.schedule([env(100, T0 + 100)])
    [(s3_stream_id, _)] = stream_entries(redis_client, KEYS.stream)[3:4]
    ids = ["s1", "s1", "s3", s3_stream_id, anon, "s5", anon, "nope", "1-1", "99999999999999999999-1", "s6"]
    got = await engine.cancel_many(ids)
    assert [found for found, _ in got] == [
        True,
        False,
        True,
        False,
        True,
        True,
        False,
        False,
        False,
        False,
        True,
    ]
    assert len(history(redis_client, "cancelled")) == 5
    assert await engine.pending() == 6
    clock.set(T0 + 200)
    await drain(engine)
    assert sorted(payloads(redis_client)) == [0, 2, 4, 7, 8, 9]
    assert engine_keys_left(redis_client) == []


async def test_a_stream_id_cancels_its_scheduled_message_even_after_queued_cancels_of_others(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    """The stream-id path runs after the queued removals are applied: the index it edits
    is the real one, and the queued ones are not applied twice."""
    clock = ManualClock(T0)
    engine = DelayEngine(aredis(), KEYS, clock)
    # All in one bucket (same due), so both paths edit the same sorted set.
    await engine.schedule([env(i, T0 + 100, sid=f"s{i}") for i in range(5)])
    stream_ids = [i for i, _ in stream_entries(redis_client, KEYS.stream)]
    got = await engine.cancel_many(["s0", "s1", stream_ids[2], "s3", stream_ids[3]])
    assert [found for found, _ in got] == [True, True, True, True, False]
    assert await engine.pending() == 1
    clock.set(T0 + 100)
    await drain(engine)
    assert payloads(redis_client) == [4]
    assert engine_keys_left(redis_client) == []


async def test_cancels_spread_over_many_buckets_leave_the_index_exact(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    clock = ManualClock(T0)
    engine = DelayEngine(aredis(), KEYS, clock)
    n = 3_000
    await engine.schedule([env(i, T0 + 1 + (i * 7919) % n, sid=f"s{i}") for i in range(n)])
    assert redis_client.zcard(KEYS.due) > 20  # many buckets
    cancelled = [i for i in range(n) if i % 3]
    got = await engine.cancel_many([f"s{i}" for i in cancelled])
    assert got == [(True, "orders")] * len(cancelled)
    assert await engine.pending() == n - len(cancelled)
    assert redis_client.hlen(KEYS.ids) == n - len(cancelled)
    assert redis_client.xlen(KEYS.stream) == n - len(cancelled)
    clock.set(T0 + n + 1)
    await drain(engine)
    assert sorted(payloads(redis_client)) == [i for i in range(n) if not i % 3]
    assert engine_keys_left(redis_client) == []


async def test_parked_and_refill_waiting_messages_cancel_clean(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    """A parked envelope (its target is not a stream) and a recurring one waiting for
    its REFILL are withdrawn with their marks, in the same call as plain ones."""
    redis_client.hset("a-hash", "f", "v")
    clock = ManualClock(T0)
    engine = DelayEngine(aredis(), KEYS, clock)  # no recurrence: the refill stays pending
    await engine.schedule([env(1, T0 + 10, topic="a-hash", sid="parked"), env(2, T0 + 500, sid="plain")])
    clock.set(T0 + 10)
    await engine.fire_due()
    assert redis_client.hlen(KEYS.parked) == 1
    every_engine = DelayEngine(aredis(), KEYS, clock, recurrence=every)
    await every_engine.schedule([recurring(3, 100, sid="tick")])
    clock.set(T0 + 100)
    await engine.fire_due()  # fires `tick` once; no recurrence here, so it waits for REFILL
    assert redis_client.zcard(KEYS.refill) == 1
    got = await engine.cancel_many(["parked", "tick", "plain"])
    assert [found for found, _ in got] == [True, True, True]
    assert (redis_client.hlen(KEYS.parked), redis_client.zcard(KEYS.refill)) == (0, 0)
    assert [r.id for r in history(redis_client, "cancelled")] == ["parked", "tick", "plain"]
    clock.set(T0 + 10_000)
    await every_engine.refill_pending()
    await drain(every_engine)
    assert len(target(redis_client, "orders")) == 1  # tick's one fire before its cancel
    assert engine_keys_left(redis_client) == []


@pytest.mark.both_fire_paths
async def test_cancel_many_in_one_call_reports_each_id(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    engine = DelayEngine(aredis(), KEYS, ManualClock(T0))
    await engine.schedule([env(i, T0 + 100, sid=f"s{i}") for i in range(1_200)])
    [anon] = await engine.schedule([env(9_999, T0 + 100, topic="billing")])
    ids = [f"s{i}" for i in range(0, 1_200, 2)] + ["nope", anon, "s0"]
    results = await engine.cancel_many(ids)
    assert results[:600] == [(True, "orders")] * 600
    assert results[600:] == [(False, ""), (True, "billing"), (False, "")]  # s0 once only
    assert await engine.pending() == 600
    assert sum(1 for h in history(redis_client) if h.event == "cancelled") == 601
    assert redis_client.exists("orders") == 0  # no markers unless asked for


@pytest.mark.both_fire_paths
async def test_cancel_of_a_stream_id_out_of_range_is_a_clean_no(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    engine = DelayEngine(aredis(), KEYS, ManualClock(T0))
    await engine.schedule([env(1, T0 + 10)])
    assert await engine.cancel("99999999999999999999999-1") is False
    assert await engine.cancel("1-99999999999999999999999") is False
    assert await engine.pending() == 1


@pytest.mark.both_fire_paths
async def test_cancel_by_stream_id_of_a_named_recurring_leaves_no_index_entry(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    """The stream-id path removed the index entry at the envelope's first due time; a
    recurring envelope that fired since waits at a later one. Its index entry stayed,
    counted as pending, until that time came."""
    clock = ManualClock(T0)
    engine = DelayEngine(aredis(), KEYS, clock, recurrence=every)
    await engine.schedule([recurring(1, 1_000, sid="job")])
    clock.set(T0 + 1_000)
    await drain(engine)
    assert payloads(redis_client) == [1]
    stream_id = redis_client.hget(KEYS.ids, "job").split()[0].decode()  # type: ignore[union-attr]
    assert await engine.cancel(stream_id)
    assert await engine.pending() == 0
    assert redis_client.exists(KEYS.due, KEYS.ids, KEYS.refill) == 0
    clock.set(T0 + 60_000)
    await drain(engine)
    assert payloads(redis_client) == [1]


@pytest.mark.both_fire_paths
async def test_markers_go_on_the_topic_when_a_cancel_or_an_expiry_removes_a_message(
    aredis: Callable[[], aioredis.Redis], redis_client: redis.Redis
) -> None:
    clock = ManualClock(T0)
    engine = DelayEngine(aredis(), KEYS, clock, config=EngineConfig(marker_ttl_ms=60_000))
    await engine.schedule(
        [env(1, T0 + 100, sid="c"), env(2, T0 + 100, topic="billing", expires_at_ms=T0 + 10)]
    )
    assert await engine.cancel("c")
    clock.set(T0 + 100)
    await drain(engine)
    [(_, removed)] = target(redis_client, "orders")
    [(_, aged)] = target(redis_client, "billing")
    for fields, reason in ((removed, "Remove"), (aged, "MaxAge")):
        marker = decode_entry(fields)
        assert marker.data == b""
        assert marker.metadata["markerReason"] == reason
        assert marker.expires_at_ms in (T0 + 60_000, T0 + 100 + 60_000)
    assert decode_entry(removed).metadata["scheduler"] == "c"
