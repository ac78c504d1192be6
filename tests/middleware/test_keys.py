"""Stream ids and shard-qualified envelope ids: the one rule every reader of an operator's id uses;
and the keys of one app, derived from its consumerID: no other accepted consumerID derives one."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from delayed_middleware.errors import InvalidArgumentError
from delayed_middleware.keys import (
    EngineKeys,
    check_consumer_id,
    claim_memo_key,
    consumer_id_problem,
    delayed_topic,
    fire_marker_prefix,
    hash_tag,
    is_delayed_topic,
    is_engine_key,
    is_stream_id,
    key_slot,
    shard_id,
    shard_topics,
    split_shard_id,
)
from delayed_middleware.plan import check_topic
from delayed_pubsub.retry_notices import retry_due_channel

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
        "format": "{app-delayed}:format",
    }
    assert keys.retry("orders") == "{app-delayed}:retry:orders"
    assert keys.retry_counts("orders") == "{app-delayed}:retry-n:orders"
    assert keys.history_index == "{app-delayed}:history-ids"
    assert keys.triggers == "{app-delayed}:claims-triggers"
    # One slot: a script may touch any of them together on Redis Cluster.
    names = [
        *dataclasses.astuple(keys),
        keys.retry("orders"),
        keys.retry_counts("orders"),
        keys.history_index,
        keys.triggers,
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


# --- Isolation: no two allowed consumerIDs derive the same key ---------------------

# Topics an app may subscribe to (retry records, claim memos), some of them adversarial: another
# app's delayed topic is readable; braces, colons and glob characters are plain topic text.
SUBSCRIBED = ["orders", "a-delayed", "tenant-delayed", "{a}", "a:x", "x}y", "*", "due:1", "retry-n:x", "{}"]
# Topics an app may publish to (fire markers of its deliveries).
PUBLISHED = [t for t in SUBSCRIBED if not is_delayed_topic(t)]
# scheduleIds and envelope ids in a fire marker; bucket ids of the due index.
MARKED_IDS = ["1700000000000-0", "job-1", "x}fired:1"]
BUCKET_IDS = ["0", "1", "4294967296"]
MAX_SHARDS = 8


def app_keys(consumer_id: str, shards: int) -> dict[str, set[str]]:
    """Every key (and channel) app `consumer_id` with `shards` shard streams writes or reads, by family.

    Built from the key functions themselves (a new EngineKeys field is in it without a change here):
    the shard streams and each one's engine keys, index buckets, history index, retry records and
    counts, the retry-due channel; fire markers of its deliveries; claim memos of its subscriptions.
    """
    families: dict[str, set[str]] = {}
    for stream in shard_topics(consumer_id, shards):
        keys = EngineKeys.for_topic(stream)
        for f in dataclasses.fields(keys):
            families.setdefault(f.name, set()).add(getattr(keys, f.name))
        families.setdefault("bucket", set()).update(keys.buckets + b for b in BUCKET_IDS)
        families.setdefault("history_index", set()).add(keys.history_index)
        families.setdefault("triggers", set()).add(keys.triggers)
        families.setdefault("retry_due", set()).add(retry_due_channel(consumer_id))
        for topic in SUBSCRIBED:
            families.setdefault("retry", set()).add(keys.retry(topic))
            families.setdefault("retry_counts", set()).add(keys.retry_counts(topic))
        for topic in PUBLISHED:
            prefix = fire_marker_prefix(topic, stream)
            families.setdefault("fire_marker", set()).update(f"{prefix}{i}:1700000000000" for i in MARKED_IDS)
    families["claim_memo"] = {claim_memo_key(t, consumer_id, "0f" * 16) for t in SUBSCRIBED}
    return families


def all_keys(consumer_id: str, shards: int = MAX_SHARDS) -> set[str]:
    return set().union(*app_keys(consumer_id, shards).values())


# Pairs a user could plausibly configure side by side: prefixes, `-delayed` endings, glob and
# colon characters, one id equal to the other's delayed topic or a shard-like name.
ALLOWED_PAIRS = [
    ("tenant", "tenant-1"),
    ("tenant", "tenant1"),
    ("a", "a-delayed"),
    ("a", "a-delayed-delayed"),
    ("a", "a:x"),
    ("a", "ab"),
    ("a:due", "a"),
    ("a*", "a"),
    ("a?", "ab"),
    ("[a]", "a"),
    ("app.default", "app"),
    ("orders", "orders@1"),
    ("x", "x-delayed:retry:y"),
    # Look-alikes of the reserved characters are other characters (keys are compared as bytes).
    ("tenant", "tenant\uff5e1"),
    ("tenant", "tenant\u223c1"),
    ("a", "\uff5ba\uff5d"),
    ("a", "a b"),
    ("a", "a\u200b"),
]
# Each refused id next to the allowed id whose keys it would reach (or whose slot it would split).
REFUSED_PAIRS = [("tenant", "tenant~1"), ("a", "a~1~2"), ("a", "{a}"), ("a", "a}"), ("a", "{a-delayed}:x")]


@pytest.mark.parametrize(("first", "second"), ALLOWED_PAIRS)
def test_two_allowed_consumer_ids_share_no_key_whatever_their_shard_counts(first: str, second: str) -> None:
    assert consumer_id_problem(first) is None
    assert consumer_id_problem(second) is None
    for shards in range(1, MAX_SHARDS + 1):
        # Fewer shards derive a subset of the keys of more (shard 0 keeps its name), so each
        # pair of shard counts up to MAX_SHARDS is covered by the comparison at MAX_SHARDS.
        assert all_keys(first, shards) <= all_keys(first)
    shared = all_keys(first) & all_keys(second)
    assert not shared, f"{first!r} and {second!r} both derive {sorted(shared)[:3]}"


@pytest.mark.parametrize(("allowed", "refused"), REFUSED_PAIRS)
def test_a_consumer_id_that_could_reach_another_apps_keys_is_refused(allowed: str, refused: str) -> None:
    assert consumer_id_problem(allowed) is None
    with pytest.raises(InvalidArgumentError) as e:
        check_consumer_id(refused)
    assert (e.value.key, e.value.value) == ("consumerID", refused)
    assert "another app" in e.value.reason


def test_the_refused_ids_would_share_keys_or_split_slots() -> None:
    # Why `~` is refused: shard 1 of `tenant` is shard 0 of `tenant~1`, with its index, ids and history.
    shared = all_keys("tenant", 2) & all_keys("tenant~1", 1)
    assert {"tenant~1-delayed", "{tenant~1-delayed}:ids", "{tenant~1-delayed}:history"} <= shared
    # Why `{` and `}` are: the hash tag no longer ends where the stream's name does, so on Redis
    # Cluster the stream and its own index hash to different slots (no script can take both).
    for refused in ("{a}", "a}", "x{y}"):
        keys = EngineKeys.for_topic(delayed_topic(refused))
        assert key_slot(keys.stream) != key_slot(keys.due) or key_slot(keys.ids) != key_slot(keys.stream)


# Fragments an adversary would combine: the shard mark, the tag's braces, the key separator, glob
# characters, the delayed suffix, shard-like and bucket-like tails.
FRAGMENTS = st.sampled_from(
    ["a", "b", "~", "{", "}", ":", "*", "?", "[", "]", "-", "1", "-delayed", "~1", ":due", "}fired", "@", "."]
)


# Two ids that share a beginning (one may be a prefix of the other): where collisions hide.
RELATED_IDS = st.tuples(
    st.lists(FRAGMENTS, max_size=4).map("".join),
    st.lists(FRAGMENTS, max_size=4).map("".join),
    st.lists(FRAGMENTS, max_size=4).map("".join),
).map(lambda t: (t[0] + t[1], t[0] + t[2]))


@given(RELATED_IDS)
@example(("tenant", "tenant~1"))
@example(("a", "{a}"))
def test_no_two_accepted_consumer_ids_derive_the_same_key(pair: tuple[str, str]) -> None:
    first, second = pair
    if not first or not second or first == second:
        return
    if consumer_id_problem(first) is not None or consumer_id_problem(second) is not None:
        # Refused exactly when it holds a reserved character.
        assert any(c in first + second for c in "~{}")
        return
    assert not all_keys(first) & all_keys(second)


@given(st.lists(FRAGMENTS, min_size=1, max_size=6).map("".join))
def test_every_key_of_an_accepted_id_hashes_with_its_shard_on_redis_cluster(consumer_id: str) -> None:
    if consumer_id_problem(consumer_id) is not None:
        return
    for stream in shard_topics(consumer_id, MAX_SHARDS):
        keys = EngineKeys.for_topic(stream)
        names = [
            *dataclasses.astuple(keys),
            keys.history_index,
            keys.triggers,
            keys.retry("x}y"),
            keys.retry_counts("{a}"),
        ]
        assert {key_slot(k) for k in names} == {key_slot(stream)}
        # The tag is the stream's whole name: what Redis hashes is what a reader derives.
        assert {hash_tag(k) for k in names[1:]} == {stream}


@pytest.mark.parametrize("consumer_id", ["other", "a-delayed", "a:x"])
def test_no_key_of_an_app_can_be_published_to_and_only_its_streams_subscribed_to(consumer_id: str) -> None:
    # Another app (any consumerID) names these keys as topics: a publish could trim or overwrite them,
    # a subscription would create a consumer group on a hash or a sorted set.
    streams = set(shard_topics(consumer_id, MAX_SHARDS))
    for family, keys in app_keys(consumer_id, MAX_SHARDS).items():
        for key in keys:
            with pytest.raises(InvalidArgumentError):
                check_topic(key)
            if key in streams:
                check_topic(key, subscribe=True)  # operators and the Spark job read what waits
            else:
                with pytest.raises(InvalidArgumentError, match="reserved"):
                    check_topic(key, subscribe=True)
                assert is_engine_key(key), family
