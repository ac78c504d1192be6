"""Stream ids and shard-qualified envelope ids: the one rule every reader of an operator's id uses."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from delayed_middleware.keys import (
    EngineKeys,
    claim_memo_key,
    is_engine_key,
    is_stream_id,
    key_slot,
    shard_id,
    split_shard_id,
)

U64_MAX = 2**64 - 1


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0-0", True),
        ("1700000000000-0", True),
        ("1700000000000-17", True),
        (f"{U64_MAX}-{U64_MAX}", True),
        # Leading zeros are digits Redis reads as the same number.
        ("007-1", True),
        # Not complete ids: XRANGE shorthands and halves.
        ("1700000000000", False),
        ("1700000000000-", False),
        ("-5", False),
        ("-", False),
        ("+", False),
        ("", False),
        ("1-2-3", False),
        ("1-*", False),
        (" 1-2", False),
        ("1-2 ", False),
        ("+1-2", False),
        ("1-+2", False),
        # Past 64 bits: no id Redis ever gives.
        (f"{U64_MAX + 1}-0", False),
        (f"0-{U64_MAX + 1}", False),
        # Digits of other scripts (str.isdigit and \d accept them; Redis does not).
        ("\u0661\u0662-\u0663", False),
        ("1\u00b2-3", False),
        ("12-\uff13", False),
        ("order-1", False),
        ("1-1@0", False),
    ],
)
def test_is_stream_id_accepts_only_what_redis_writes(text: str, expected: bool) -> None:
    assert is_stream_id(text) is expected


@pytest.mark.parametrize(
    ("text", "shards", "expected"),
    [
        ("1-1@0", 1, (0, "1-1")),
        ("1-1@0", 3, (0, "1-1")),
        ("1700000000000-5@2", 3, (2, "1700000000000-5")),
        ("1-1@10", 11, (10, "1-1")),
        # A shard the delayed topic does not have.
        ("1-1@3", 3, None),
        ("1-1@9", 3, None),
        # Not shard_id's form: leading zero, sign, space, empty, other digits.
        ("1-1@01", 3, None),
        ("1-1@00", 3, None),
        ("1-1@+1", 3, None),
        ("1-1@-1", 3, None),
        ("1-1@ 1", 3, None),
        ("1-1@", 3, None),
        ("1-1@\u0661", 3, None),
        ("1-1@\u00b2", 3, None),
        # The part before the last `@` must be a stream id: else it is a scheduleId.
        ("order@1", 3, None),
        ("a@b@1", 3, None),
        ("1-1@1@1", 3, None),
        ("\u0661-1@1", 3, None),
        ("@1", 3, None),
        ("1-1", 3, None),
        ("", 3, None),
    ],
)
def test_split_shard_id_reads_only_shard_ids_of_an_existing_shard(
    text: str, shards: int, expected: tuple[int, str] | None
) -> None:
    assert split_shard_id(text, shards) == expected


_ids = st.tuples(st.integers(0, U64_MAX), st.integers(0, U64_MAX)).map(lambda t: f"{t[0]}-{t[1]}")


@given(_ids, st.integers(0, 1000), st.integers(1, 1001))
def test_split_shard_id_reads_back_what_shard_id_writes(stream_id: str, shard: int, shards: int) -> None:
    written = shard_id(stream_id, shard)
    assert split_shard_id(written, shards) == ((shard, stream_id) if shard < shards else None)
    assert not is_stream_id(written)


@given(st.text(max_size=30), st.integers(1, 20))
def test_whatever_split_shard_id_accepts_is_written_back_the_same(text: str, shards: int) -> None:
    # One form per envelope: an id that parses is exactly the one shard_id writes,
    # so two spellings never name one envelope (nor a scheduleId an envelope).
    named = split_shard_id(text, shards)
    if named is not None:
        assert shard_id(named[1], named[0]) == text


def test_engine_keys_keep_the_names_a_deployment_has_stored() -> None:
    # The names are data already in Redis: a renamed key would orphan what waits under the old one.
    keys = EngineKeys.for_topic("app-delayed")
    assert {f.name: getattr(keys, f.name) for f in dataclasses.fields(keys)} == {
        "stream": "app-delayed",
        "due": "{app-delayed}:due",
        "buckets": "{app-delayed}:due:",
        "seq": "{app-delayed}:due-seq",
        "count": "{app-delayed}:pending",
        "ids": "{app-delayed}:ids",
        "wake": "{app-delayed}:wake",
        "history": "{app-delayed}:history",
        "parked": "{app-delayed}:parked",
        "calls": "{app-delayed}:calls",
        "refill": "{app-delayed}:refill",
        "outbox": "{app-delayed}:outbox",
        "moved": "{app-delayed}:moved",
        "inflight": "{app-delayed}:inflight",
        "claims": "{app-delayed}:claims",
        "retrying": "{app-delayed}:retrying",
        "dead_letters": "{app-delayed}:deadletters",
    }
    assert keys.retry("orders") == "{app-delayed}:retry:orders"
    assert keys.retry_counts("orders") == "{app-delayed}:retry-n:orders"
    assert keys.history_index == "{app-delayed}:history-ids"
    # One slot: a script may touch any of them together on Redis Cluster.
    names = [
        *dataclasses.astuple(keys),
        keys.retry("orders"),
        keys.retry_counts("orders"),
        keys.history_index,
    ]
    assert {key_slot(k) for k in names} == {key_slot("app-delayed")}
    assert keys.script_keys == [
        *(getattr(keys, n) for n in ("stream", "due", "ids", "seq", "count", "history", "parked")),
        *(getattr(keys, n) for n in ("calls", "refill", "outbox", "moved")),
    ]
    assert keys.two_phase_keys == [*keys.script_keys[:-1], keys.inflight, keys.claims, keys.moved]


@pytest.mark.parametrize("topic", ["orders", "{tenant}orders", "a}b", "{}z", "a{b", "}{", "x{y}z{w}"])
def test_a_claim_memo_sits_in_its_topics_slot_among_the_engine_keys(topic: str) -> None:
    # The claim script writes the memo beside the stream: on Redis Cluster, in the same slot.
    memo = claim_memo_key(topic, "app", "0f" * 16)
    assert key_slot(memo) == key_slot(topic)
    assert is_engine_key(memo), "a user could publish to it, or subscribe"
