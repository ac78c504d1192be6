"""Every Redis key and channel name the delay engine uses, in one place.

The delayed topic itself is a plain stream named `<consumerID>-delayed`, so
daprd subscribers and the Spark job read it like any topic. The engine's own
keys wrap that name in a hash tag, `{<consumerID>-delayed}:...`: Redis Cluster
hashes only the tag, and the tag equals the stream's whole name, so the stream
and its index always share a slot and one script may touch them together.

Reserved namespace (public contract, enforced for publish and subscribe):
  - a topic ending in `-delayed` is some app's delayed topic: only the engine
    writes it (a plain XADD with trimming could drop pending envelopes);
    subscribing to it is allowed (operators and the Spark pipeline read it);
  - a key containing `-delayed}` is an engine key (index, ids, history, ...):
    neither published to nor subscribed to, whatever consumerID the caller has.
"""

from __future__ import annotations

from dataclasses import dataclass

from delayed_middleware.errors import InvalidArgumentError

DELAYED_SUFFIX = "-delayed"
# Every engine-owned key contains this: the closing brace of the hash tag.
ENGINE_KEY_MARK = DELAYED_SUFFIX + "}"


def delayed_topic(consumer_id: str) -> str:
    """The topic on which delayed envelopes wait for one app (consumer group).

    Namespaced consumer groups need nothing here: daprd resolves a
    `{namespace}` template in consumerID before Init, so it is in the name.
    """
    return f"{consumer_id}{DELAYED_SUFFIX}"


# --- Isolation between apps ---------------------------------------------------
#
# Every key of an app derives from its consumerID (delayed_topic, shard_topics,
# EngineKeys.for_topic, claim_memo_key, fire_marker_prefix). Three characters
# would let one consumerID derive another's key, so a consumerID holding one is
# refused wherever it enters (Init, the CLI, the Spark reader):
#   `~` builds shard names: shard 1 of `tenant` is `tenant~1-delayed`, which is
#       shard 0 of consumerID `tenant~1`;
#   `{` `}` build the hash tag `{<shard stream>}:...`: with a brace in the
#       consumerID the tag no longer ends where the stream's name does, so a
#       key no longer tells whose it is, and on Redis Cluster the stream and
#       its own index hash to different slots (every script would fail there).
# With none of the three, a key's stream is the text between its first `{` and
# first `}` (or the key itself, ending in `-delayed`), and a stream names exactly
# one (consumerID, shard): the ids of distinct apps share no key, whatever their
# shard counts. Every other character is safe (`:`, `*`, `?`, `[`, a `-delayed`
# ending, one id a prefix of another): no key is read through a pattern built
# from a consumerID, and tests/middleware/test_keys.py enumerates the keys.
# A Dapr app-id on Kubernetes is a DNS label (lowercase letters, digits, `-`)
# and never holds one of them, nor do the values daprd's `{namespace}` and
# `{podName}` templates resolve to; self-hosted daprd refuses only dots in an
# app-id, so such an app sets the component's consumerID to another id.
RESERVED_ID_CHARS = "~{}"


def consumer_id_problem(consumer_id: str) -> str | None:
    """Why `consumer_id` cannot name an app's keys (see RESERVED_ID_CHARS), or None when it can."""
    found = sorted({c for c in consumer_id if c in RESERVED_ID_CHARS}, key=RESERVED_ID_CHARS.index)
    if not found:
        return None
    shown = " ".join(repr(c) for c in found)
    return (
        f"contains {shown}: with ~, {{ or }} a consumerID could name keys of another app on the same "
        "Redis (shard n of app X is the stream X~n-delayed) or split its own over Redis Cluster slots "
        "({...} is the engine's hash tag); set the component's consumerID to an id without them "
        "(daprd uses the app id when consumerID is left out)"
    )


def check_consumer_id(consumer_id: str, key: str = "consumerID") -> None:
    """Refuse a consumerID whose keys another app could reach (InvalidArgumentError naming `key`)."""
    problem = consumer_id_problem(consumer_id)
    if problem is not None:
        raise InvalidArgumentError(key, consumer_id, problem)


def is_delayed_topic(topic: str) -> bool:
    """True for any app's delayed topic (the engine alone writes it)."""
    return topic.endswith(DELAYED_SUFFIX)


def is_engine_key(topic: str) -> bool:
    """True for a key the delay engine owns (never a topic)."""
    return ENGINE_KEY_MARK in topic


@dataclass(frozen=True)
class EngineKeys:
    """The keys of one delayed topic.

    stream:  the envelopes (field `data` = DelayedMessage bytes), one per pending
             (or parked) message.
    due:     the due index's top: sorted set of bucket ids scored by their lower bound.
    buckets: prefix of the index buckets, `<prefix><id>`: sorted sets, member =
             envelope stream id, score = due time in epoch ms (see the index Lua).
    seq:     the bucket id sequence.
    count:   how many messages are pending in the index.
    ids:     hash, scheduleId (or envelope id of a recurring envelope) ->
             "<envelope stream id> <due ms> <next due ms or ''>", for replace,
             cancel and the recurring fire path.
    wake:    pub/sub channel announcing a new earliest due time to every replica.
    history: the lifecycle history stream (see delayed_middleware.history).
    parked:  hash, envelope stream id -> reason: envelopes that could not be
             delivered (bad target) and were kept for an operator.
    calls:   sorted set of recent schedule-call tokens (member) by time (score):
             makes a retried schedule call a no-op (idempotency records).
    refill:  sorted set of recurring envelope ids whose next-next due time the
             firing replica still has to compute (see engine.DelayEngine).
    outbox:  stream of fired messages bound for another Dapr pub/sub (targetPubsub),
             handed to the sidecar at least once by the forwarder.
    moved:   hash, envelope id -> the stream id it is stored at now, for the
             envelopes compaction re-homed to the stream's tail (see lua/compact.lua);
             always the last key a script gets.
    inflight: Redis Cluster's two-phase fire: sorted set of claimed envelope ids by
             lease end (ms).
    claims:  hash, claimed envelope id -> "<due ms> <next due | -> <scheduleNext> <scheduler>".
    retrying: set of the topics that have (or had) a subscriber retry schedule
             (delayed_pubsub.redelivery; see retry()): found without KEYS.
    dead_letters: set of the dead-letter topics the retry policy and the
             hand-offs have written to.
    format:  the storage format this shard's data is written in (see
             delayed_middleware.storage_format); not passed to the engine's scripts.
    """

    stream: str
    due: str
    buckets: str
    seq: str
    count: str
    ids: str
    wake: str
    history: str
    parked: str
    calls: str
    refill: str
    outbox: str
    moved: str
    inflight: str
    claims: str
    retrying: str
    dead_letters: str
    format: str

    @classmethod
    def for_topic(cls, topic: str) -> EngineKeys:
        tag = "{" + topic + "}"
        return cls(
            stream=topic,
            due=f"{tag}:due",
            buckets=f"{tag}:due:",
            seq=f"{tag}:due-seq",
            count=f"{tag}:pending",
            ids=f"{tag}:ids",
            wake=f"{tag}:wake",
            history=f"{tag}:history",
            parked=f"{tag}:parked",
            calls=f"{tag}:calls",
            refill=f"{tag}:refill",
            outbox=f"{tag}:outbox",
            moved=f"{tag}:moved",
            inflight=f"{tag}:inflight",
            claims=f"{tag}:claims",
            retrying=f"{tag}:retrying",
            dead_letters=f"{tag}:deadletters",
            format=f"{tag}:format",
        )

    # Subscriber retries (delayed_pubsub.redelivery): not touched by the engine's scripts.
    def retry(self, topic: str) -> str:
        """Sorted set: entry ids of `topic` waiting out a retry backoff, scored by their next delivery (ms)."""
        return "{" + self.stream + "}:retry:" + topic

    def retry_counts(self, topic: str) -> str:
        """Hash beside `retry(topic)`, entry id -> the delivery count its retry record is about
        (lua/retry_record.lua): a record whose entry was delivered again since is stale."""
        return "{" + self.stream + "}:retry-n:" + topic

    @property
    def history_index(self) -> str:
        """Hash, id (not a stream id) -> its newest history record's entry id: the history's by-id
        index (see delayed_middleware.history). Derived from the history's name, never passed as
        a key: lua/history.lua appends `-ids`, in the history's slot."""
        return self.history + "-ids"

    @property
    def triggers(self) -> str:
        """Redis Cluster's two-phase fire: sorted set of the extra occurrences a trigger decided and
        has not yet appended, member `<envelope id> t<trigger ms>:<token>` (the end of its fire
        marker), score its Redis time (ms), so a cancel stops them (lua/timecontrol.lua, lua/cancel.lua).
        Derived from the claims hash's name, never passed as a key: the scripts append `-triggers`,
        in its slot. Short-lived: swept by age and expiring when idle; release 0.2.0 never reads it."""
        return self.claims + "-triggers"

    @property
    def two_phase_keys(self) -> list[str]:
        """KEYS of CLAIM and RELEASE (and of SCHEDULE and CANCEL on Cluster): the engine's
        keys, then in-flight and claims, then the moved hash (always the last key)."""
        return [*self._base_keys, self.inflight, self.claims, self.moved]

    @property
    def script_keys(self) -> list[str]:
        """KEYS of every engine script, in their order (see the .lua headers); the moved hash last."""
        return [*self._base_keys, self.moved]

    @property
    def _base_keys(self) -> list[str]:
        return [
            self.stream,
            self.due,
            self.ids,
            self.seq,
            self.count,
            self.history,
            self.parked,
            self.calls,
            self.refill,
            self.outbox,
        ]


# --- Stream ids and shard-qualified envelope ids -----------------------------
#
# A Redis stream entry id is `<ms>-<seq>`, both unsigned 64-bit decimals. An
# envelope id on a delayed topic split into shards (below) is only unique
# within its shard stream, so operators name it `<stream id>@<shard>`.

# 2**64 - 1: the largest part of a stream id Redis accepts.
_U64_MAX = 18_446_744_073_709_551_615
_SHARD_SEP = "@"


def _u64(text: str) -> bool:
    # ASCII digits only: str.isdigit() and the regex \d also accept other
    # scripts' digits (Arabic-Indic, superscripts), which are no stream id Redis would give.
    return text.isascii() and text.isdigit() and int(text) <= _U64_MAX


def is_stream_id(text: str) -> bool:
    """True when `text` is a complete stream entry id, `<ms>-<seq>` (not `<ms>` alone, not `-`/`+`)."""
    ms, dash, seq = text.partition("-")
    return bool(dash) and _u64(ms) and _u64(seq)


def shard_id(stream_id: str, shard: int) -> str:
    """How an envelope on shard `shard` is named: `<stream id>@<shard>` (split_shard_id reads it)."""
    return f"{stream_id}{_SHARD_SEP}{shard}"


def split_shard_id(id: str, shards: int) -> tuple[int, str] | None:
    """(shard, stream id) of an id written as shard_id writes it, for a delayed topic of `shards`
    shards; None for anything else (a scheduleId, a bare stream id, a shard out of range).

    Only shard_id's own form is read: a shard in plain decimal without a sign or
    leading zero (`@01` is not shard 1: it may be part of a scheduleId), below `shards`.
    """
    local, sep, shard = id.rpartition(_SHARD_SEP)
    if not sep or not is_stream_id(local) or not (shard.isascii() and shard.isdigit()):
        return None
    if shard != str(int(shard)):
        return None
    n = int(shard)
    return (n, local) if n < shards else None


# --- Redis Cluster: shards and fire markers ----------------------------------
#
# On Redis Cluster the delayed topic is split into shards, each a complete
# engine key set (EngineKeys.for_topic of its stream) in its own hash slot.
# Shard 0 keeps the single-node name, so a single node (one shard) is
# unchanged; shard n > 0 is `<consumerID>~<n>-delayed`: it still ends in
# `-delayed` (the engine alone writes it), and no other app's stream has this
# name because no consumerID may hold a `~` (check_consumer_id).

SHARD_MARK = "~"
# Redis Cluster's slot count (CRC16 mod 16384).
CLUSTER_SLOTS = 16384


def shard_topics(consumer_id: str, shards: int) -> list[str]:
    """The shard streams of one app's delayed topic, shard 0 first.

    The CLI and the Spark reader list pending envelopes from every one of them.
    """
    if shards < 1:
        raise ValueError(f"shards must be at least 1, not {shards}")
    base = delayed_topic(consumer_id)
    return [base] + [f"{consumer_id}{SHARD_MARK}{n}{DELAYED_SUFFIX}" for n in range(1, shards)]


def shard_index(key: str, shards: int) -> int:
    """The shard that holds scheduleId `key` (stable across processes and restarts)."""
    return crc16(key.encode()) % shards


def crc16(data: bytes) -> int:
    """CRC16-CCITT (XMODEM), the checksum Redis Cluster hashes keys with."""
    crc = 0
    for b in data:
        crc ^= b << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021) if crc & 0x8000 else crc << 1
            crc &= 0xFFFF
    return crc


def hash_tag(key: str) -> str | None:
    """The part of `key` Redis Cluster hashes when it is not the whole key, else None."""
    start = key.find("{")
    if start < 0:
        return None
    end = key.find("}", start + 1)
    if end <= start + 1:
        return None
    return key[start + 1 : end]


def key_slot(key: str) -> int:
    """The cluster slot of `key` (Redis's own rule: the hash tag if any, else the whole key)."""
    tag = hash_tag(key)
    return crc16((key if tag is None else tag).encode()) % CLUSTER_SLOTS


def slot_tag(slot: int) -> str:
    """A short string that hashes to `slot` (found by counting; cached)."""
    return _slot_tags()[slot]


_SLOT_TAGS: list[str] = []


def _slot_tags() -> list[str]:
    if not _SLOT_TAGS:
        # Every slot is hit within ~200k decimal strings; the table is built
        # once per process, on the first odd topic name only.
        table: list[str | None] = [None] * CLUSTER_SLOTS
        missing, i = CLUSTER_SLOTS, 0
        while missing:
            s = str(i)
            slot = crc16(s.encode()) % CLUSTER_SLOTS
            if table[slot] is None:
                table[slot] = s
                missing -= 1
            i += 1
        _SLOT_TAGS.extend(t for t in table if t is not None)
    return _SLOT_TAGS


def target_tag(topic: str) -> str:
    """A hash tag whose keys land in `topic`'s slot.

    A topic with its own `{tag}` hashes by that tag; any other topic by its
    whole name, which can be the tag itself unless it holds a `}`; the odd
    rest get a short tag found for their slot.
    """
    tag = hash_tag(topic)
    if tag is not None:
        return tag
    if "}" not in topic:
        return topic
    return slot_tag(key_slot(topic))


def claim_memo_key(topic: str, group: str, nonce: str) -> str:
    """The memo of one conditional claim on `topic` (lua/claim_unchanged.lua): in the topic's
    slot, so the claim script writes it beside the stream, and inside the engine's reserved
    namespace (it contains `-delayed}`)."""
    return "{" + target_tag(topic) + "}:" + group + DELAYED_SUFFIX + "}claim:" + nonce


def dead_retry_marker(destination: str, consumer_id: str, dead_letter_topic: str, stream_id: str) -> str:
    """The marker that a dead letter was moved back to `destination` (lua/retry_dead_append.lua,
    Redis Cluster only): in the destination's slot, so one script sets it and appends; inside
    the engine's reserved namespace (it contains `-delayed}`); named by the letter's topic
    and stream id, which no other dead letter shares."""
    return (
        "{"
        + target_tag(destination)
        + "}:"
        + delayed_topic(consumer_id)
        + "}retried:"
        + dead_letter_topic
        + "@"
        + stream_id
    )


def fire_marker_prefix(topic: str, shard_stream: str) -> str:
    """The prefix of the fire markers of envelopes of `shard_stream` appended to `topic`.

    `{<topic's tag>}:<shard stream>}fired:` + `<envelope id>:<occurrence due ms>`
    is the full marker (the APPEND script adds the rest): in the target's
    slot, so one script sets it and appends; and, containing `-delayed}`,
    inside the engine's reserved namespace (is_engine_key), so no user can
    publish to it or subscribe to it.
    """
    return "{" + target_tag(topic) + "}:" + shard_stream + "}fired:"


def backfill_record(target: str, shard_stream: str, schedule_key: str) -> str:
    """The record of the occurrences of schedule `schedule_key` (its ids-hash key) that a backfill
    delivered to `target` (lua/backfill.lua): a sorted set of nominal times, in the target's slot,
    so one script records an occurrence and appends it; inside the engine's reserved namespace
    (it contains `-delayed}`). `{<target's tag>}:<shard stream>}backfilled:<schedule key>`."""
    return "{" + target_tag(target) + "}:" + shard_stream + "}backfilled:" + schedule_key
