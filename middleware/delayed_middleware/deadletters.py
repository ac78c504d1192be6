"""Dead letters: one vocabulary and one writer for subscriber retries and hand-offs.

Two things give up on a message: a subscription's retry policy after its last
delivery (delayed_pubsub.redelivery), and the forwarder after the last refused
hand-off to a `targetPubsub` (delayed_pubsub.forwarder). Both name the topic
with the one component setting `deadLetterTopic`, and both write through
`write_dead_letter`, so a dead letter reads the same whoever wrote it:

- on the dead-letter topic, an entry in the topic entry format
  (delayed_middleware.entry) with the message's data, content type, expiry
  and metadata, plus the `deadLetter*` keys below (public contract);
- the topic's name in the app's set `{<consumerID>-delayed}:deadletters`, so
  `delayed-pubsub dead` finds every dead letter knowing only the app id, and
  `retry-dead` moves each back where it came from: a subscriber's to its
  topic, a hand-off's (it has `deadLetterPubsub`) to the outbox.

The two writes are one pipeline, not a transaction: on Redis Cluster the topic
and the set live in other slots than each other and than whatever the caller
settles. Callers write the dead letter first and settle the source after, so a
crash in between dead-letters twice, never zero times.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from delayed_middleware.entry import StreamEntry, encode_entry
from delayed_middleware.keys import EngineKeys, delayed_topic

# Metadata added to a dead letter (public contract), by subscriber retries and
# hand-offs alike: `delayed-pubsub dead` lists both by it.
DL_REASON: Final = "deadLetterReason"
DL_ATTEMPTS: Final = "deadLetterAttempts"
# Where the message came from: the subscribed topic, or a hand-off's target topic.
DL_SOURCE_TOPIC: Final = "deadLetterSourceTopic"
DL_CONSUMER: Final = "deadLetterConsumer"
DL_AT: Final = "deadLetterAt"
# A hand-off's only (targetPubsub): the pub/sub and topic it was bound for.
DL_PUBSUB: Final = "deadLetterPubsub"
DL_TARGET_TOPIC: Final = "deadLetterTargetTopic"
DL_KEYS: Final = (DL_REASON, DL_ATTEMPTS, DL_SOURCE_TOPIC, DL_CONSUMER, DL_AT, DL_PUBSUB, DL_TARGET_TOPIC)

# An app's error text can be anything; a dead letter's metadata must stay small.
MAX_REASON_CHARS: Final = 1024


def clip_reason(reason: str) -> str:
    """`reason` cut to MAX_REASON_CHARS (with an ellipsis when cut)."""
    return reason if len(reason) <= MAX_REASON_CHARS else reason[:MAX_REASON_CHARS] + "…"


@dataclass(frozen=True)
class GaveUp:
    """Who gave up on a message, when, and why: what a dead letter's `deadLetter*` keys say."""

    reason: str
    attempts: int
    # The subscribed topic, or a hand-off's target topic.
    source_topic: str
    # The app (consumer group) that gave up.
    consumer: str
    at_ms: int
    # A hand-off's targetPubsub; '' for a subscriber's dead letter.
    pubsub: str = ""


def dead_letter_metadata(metadata: Mapping[str, str], why: GaveUp) -> dict[str, str]:
    """A dead letter's metadata: the message's own, plus the `deadLetter*` keys.

    `why.pubsub` is set for a hand-off (the targetPubsub it was bound for): then
    `delayed-pubsub retry-dead` hands it off again instead of appending it to
    `source_topic` of ours.
    """
    out = {k: v for k, v in metadata.items() if k not in DL_KEYS}
    out.update(
        {
            DL_REASON: clip_reason(why.reason),
            DL_ATTEMPTS: str(why.attempts),
            DL_SOURCE_TOPIC: why.source_topic,
            DL_CONSUMER: why.consumer,
            DL_AT: str(why.at_ms),
        }
    )
    if why.pubsub:
        out[DL_PUBSUB] = why.pubsub
        out[DL_TARGET_TOPIC] = why.source_topic
    return out


def dead_letter_topics_key(consumer_id: str) -> str:
    """Set of the dead-letter topics this app has written to (EngineKeys.dead_letters)."""
    return EngineKeys.for_topic(delayed_topic(consumer_id)).dead_letters


async def write_dead_letter(
    client: Any, consumer_id: str, topic: str, entry: StreamEntry, why: GaveUp
) -> None:
    """The one dead-letter writer: `entry` on `topic` with the `deadLetter*` metadata `why`
    gives it, and `topic` in app `consumer_id`'s dead-letter set.

    `client` is a redis.asyncio Redis or RedisCluster. Retrying a failed write
    may add a second dead letter, never lose one.
    """
    dead = StreamEntry(
        entry.data, dead_letter_metadata(entry.metadata, why), entry.content_type, entry.expires_at_ms
    )
    pipe = client.pipeline(transaction=False)
    pipe.xadd(topic, encode_entry(dead))
    pipe.sadd(dead_letter_topics_key(consumer_id), topic)
    await pipe.execute()
