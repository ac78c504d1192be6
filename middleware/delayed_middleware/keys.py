"""Every Redis key and channel name the delay engine uses, in one place.

The delayed topic itself is a plain stream named `<consumerID>-delayed`, so
daprd subscribers and the Spark job read it like any topic. The engine's own
keys wrap that name in a hash tag, `{<consumerID>-delayed}:...`: Redis Cluster
hashes only the tag, and the tag equals the stream's whole name, so the stream
and its index always share a slot and one script may touch them together.
"""

from __future__ import annotations

from dataclasses import dataclass

DELAYED_SUFFIX = "-delayed"


def delayed_topic(consumer_id: str) -> str:
    """The topic on which delayed envelopes wait for one app (consumer group).

    Namespaced consumer groups need nothing here: daprd resolves a
    `{namespace}` template in consumerID before Init, so it is in the name.
    """
    return f"{consumer_id}{DELAYED_SUFFIX}"


@dataclass(frozen=True)
class EngineKeys:
    """The keys of one delayed topic.

    stream:  the envelopes (field `data` = DelayedMessage bytes), one per pending message.
    due:     the due index's top: sorted set of bucket ids scored by their lower bound.
    buckets: prefix of the index buckets, `<prefix><id>`: sorted sets, member =
             envelope stream id, score = due time in epoch ms (see scripts._INDEX).
    seq:     the bucket id sequence.
    count:   how many messages are pending.
    ids:     hash, scheduleId -> "<envelope stream id> <due ms>", for replace and cancel by id.
    wake:    pub/sub channel announcing a new earliest due time to every replica.
    """

    stream: str
    due: str
    buckets: str
    seq: str
    count: str
    ids: str
    wake: str

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
        )

    @property
    def script_keys(self) -> list[str]:
        """KEYS of every engine script, in their order (see scripts.py)."""
        return [self.stream, self.due, self.ids, self.seq, self.count]
