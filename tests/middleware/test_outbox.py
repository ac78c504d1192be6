"""The outbox entry format: what the engine writes and the forwarder reads."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
import redis
from hypothesis import given
from hypothesis import strategies as st

from delayed_middleware import lua_scripts
from delayed_middleware.errors import MalformedEntryError
from delayed_middleware.outbox import OutboxEntry, decode_outbox_entry, encode_outbox_entry


def test_round_trip_keeps_every_field_byte_exact() -> None:
    entry = OutboxEntry(
        pubsub="kafka",
        topic="orders",
        data=b'{"specversion":"1.0","id":"x"}\xff',
        id="1700000000000-0",
        metadata={"customer": "acme", "scheduler": "s1", "scheduleNext": "purge"},
        content_type="application/cloudevents+json",
        bulk="env-1",
        expires_at_ms=1_700_000_123_456,
    )
    assert decode_outbox_entry(encode_outbox_entry(entry)) == entry


def test_optional_fields_are_absent_when_unset() -> None:
    fields = encode_outbox_entry(OutboxEntry(pubsub="p", topic="t", data=b"x", id="i"))
    assert set(fields) == {"data", "metadata", "pubsub", "topic", "id"}


def test_reads_the_fields_as_redis_returns_them_bytes_keys() -> None:
    fields = {
        b"data": b"payload",
        b"metadata": json.dumps({"a": "1", "n": 2}).encode(),
        b"pubsub": b"rabbit",
        b"topic": b"jobs",
        b"id": b"sched-7",
        b"unknownLater": b"ignored",
    }
    entry = decode_outbox_entry(fields)
    assert entry.pubsub == "rabbit"
    assert entry.topic == "jobs"
    assert entry.data == b"payload"
    assert entry.metadata == {"a": "1", "n": "2"}
    assert entry.bulk == ""
    assert entry.expires_at_ms == 0


@pytest.mark.parametrize(
    "fields",
    [
        {b"data": b"x", b"topic": b"t"},
        {b"data": b"x", b"pubsub": b"p"},
        {b"data": b"x", b"pubsub": b"", b"topic": b"t"},
    ],
    ids=["no-pubsub", "no-topic", "empty-pubsub"],
)
def test_an_entry_without_a_target_is_malformed(fields: dict[bytes, bytes]) -> None:
    with pytest.raises(MalformedEntryError, match="without a target"):
        decode_outbox_entry(fields)


@pytest.mark.parametrize("metadata", [b"not json", b"[1,2]", b"[" * 100_000], ids=["junk", "list", "deep"])
def test_unreadable_metadata_is_dropped_but_the_data_kept(metadata: bytes) -> None:
    entry = decode_outbox_entry({b"data": b"keep me", b"metadata": metadata, b"pubsub": b"p", b"topic": b"t"})
    assert entry.data == b"keep me"
    assert entry.metadata == {}


@pytest.mark.parametrize(("raw", "ms"), [(b"soon", 0), (b"-5", 0), (b"9223372036854775807", 2**63 - 1)])
def test_expiry_values(raw: bytes, ms: int) -> None:
    entry = decode_outbox_entry({b"data": b"", b"pubsub": b"p", b"topic": b"t", b"expiresAt": raw})
    assert entry.expires_at_ms == ms


@given(
    data=st.binary(max_size=200),
    metadata=st.dictionaries(st.text(max_size=10), st.text(max_size=10), max_size=5),
    pubsub=st.text(min_size=1, max_size=20),
    topic=st.text(min_size=1, max_size=20),
)
def test_round_trip_property(data: bytes, metadata: dict[str, str], pubsub: str, topic: str) -> None:
    # Surrogates cannot be encoded as UTF-8; Redis fields are bytes, so only valid text round-trips.
    for text in (pubsub, topic, *metadata, *metadata.values()):
        try:
            text.encode()
        except UnicodeEncodeError:
            return
    entry = OutboxEntry(pubsub=pubsub, topic=topic, data=data, metadata=metadata)
    assert decode_outbox_entry(encode_outbox_entry(entry)) == entry


# --- lua/outbox_hold.lua: a forwarder's hold on what it hands off -----------------


def test_hold_keeps_only_what_is_still_pending_under_the_holder_at_its_count(
    redis_client: redis.Redis,
) -> None:
    """Held: reset idle, count unchanged. Not held: taken over (count went up), another
    consumer's, acked, deleted while pending (acked away, so it cannot linger)."""
    db: Any = redis_client
    key, group = "{app-delayed}:outbox", "forwarder"
    db.xgroup_create(key, group, id="0", mkstream=True)
    ids = [db.xadd(key, {"data": b"x", "pubsub": b"p", "topic": b"t"}).decode() for _ in range(5)]
    mine, taken, acked, deleted, other = ids
    db.xreadgroup(group, "a", {key: ">"}, count=4)
    db.xreadgroup(group, "b", {key: ">"}, count=1)  # `other`: b's from the start
    db.xclaim(key, group, "b", 0, [taken])  # count 2: b took it over
    db.xack(key, group, acked)
    db.xdel(key, deleted)
    time.sleep(0.2)
    args = [x for i in ids for x in (i, 1)]
    held = db.eval(lua_scripts.OUTBOX_HOLD, 1, key, group, "a", *args)
    assert [h.decode() for h in held] == [mine]
    pending = {p["message_id"].decode(): p for p in db.xpending_range(key, group, "-", "+", 10)}
    # Its idle time restarted; `other`, read just as long ago and not held, kept its own.
    assert pending[mine]["time_since_delivered"] < pending[other]["time_since_delivered"]
    assert pending[mine]["times_delivered"] == 1
    assert (pending[taken]["consumer"], pending[taken]["times_delivered"]) == (b"b", 2)
    assert deleted not in pending
    assert acked not in pending
    assert pending[other]["consumer"] == b"b"
