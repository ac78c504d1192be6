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

DELAYED_SUFFIX = "-delayed"
# Every engine-owned key contains this: the closing brace of the hash tag.
ENGINE_KEY_MARK = DELAYED_SUFFIX + "}"


def delayed_topic(consumer_id: str) -> str:
    """The topic on which delayed envelopes wait for one app (consumer group).

    Namespaced consumer groups need nothing here: daprd resolves a
    `{namespace}` template in consumerID before Init, so it is in the name.
    """
    return f"{consumer_id}{DELAYED_SUFFIX}"


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
        )

    # Subscriber retries (delayed_pubsub.retry): not touched by the engine's scripts.
    def retry(self, topic: str) -> str:
        """Sorted set: entry ids of `topic` waiting out a retry backoff, scored by their next delivery (ms)."""
        return "{" + self.stream + "}:retry:" + topic

    @property
    def retrying(self) -> str:
        """Set of the topics that have (or had) a retry schedule: found without KEYS."""
        return "{" + self.stream + "}:retrying"

    @property
    def dead_letters(self) -> str:
        """Set of the dead-letter topics the retry policy has written to."""
        return "{" + self.stream + "}:deadletters"

    @property
    def script_keys(self) -> list[str]:
        """KEYS of every engine script, in their order (see the .lua headers)."""
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
