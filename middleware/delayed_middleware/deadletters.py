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

Moving letters back (`move_back`) is exactly once per letter, however many
operators (or double clicks) move the same letters at once: where the
dead-letter topic and the destination share a slot (always on a single node),
one script deletes each letter and appends it only if the delete removed it;
on Redis Cluster across slots, a marker set with the append in the
destination's slot lets only one mover append, and the letter is deleted after.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from delayed_middleware import lua_scripts
from delayed_middleware.entry import StreamEntry, encode_entry
from delayed_middleware.keys import EngineKeys, dead_retry_marker, delayed_topic, key_slot
from delayed_middleware.redis_errors import DUP, script_status

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


# Moving letters back: how many one script call moves (a letter is a handful of fields;
# one call must not hold Redis long), and what became of each.
MOVE_CHUNK: Final = 100
MOVED: Final = "moved"
# Not on its dead-letter topic any more: another operator moved it back or deleted it.
GONE: Final = "gone"
# Redis Cluster, a destination in another slot than the dead-letter topic: how long the
# mark that a letter was appended lives. A mover that died between the append and the
# delete leaves the letter listed; moved again within this time it is only deleted.
RETRY_MARKER_MS: Final = 7 * 24 * 3600 * 1000


@dataclass(frozen=True)
class MoveBack:
    """One dead letter to move back: where it sits, and the entry to append where it goes."""

    dead_letter_topic: str
    stream_id: str
    # A topic, or the outbox (a hand-off's).
    destination: str
    fields: Mapping[str, bytes]


async def move_back(client: Any, consumer_id: str, moves: Sequence[MoveBack], *, cluster: bool) -> list[str]:
    """Move each letter of `moves` back, exactly once whoever else moves it at the same time;
    one status per move: MOVED (by this call), GONE (moved or deleted by someone else), or
    the error text that kept its destination from taking it (the letter then stays).

    `cluster`: `client` is a RedisCluster, where the dead-letter topic and the destination
    may live in different slots.
    """
    out = [""] * len(moves)
    groups: dict[tuple[str, str], list[int]] = {}
    for i, m in enumerate(moves):
        groups.setdefault((m.dead_letter_topic, m.destination), []).append(i)
    for (dead, destination), indexes in groups.items():
        one_slot = not cluster or key_slot(dead) == key_slot(destination)
        for start in range(0, len(indexes), MOVE_CHUNK):
            chunk = indexes[start : start + MOVE_CHUNK]
            batch = [moves[i] for i in chunk]
            if one_slot:
                statuses = await _move_in_one_slot(client, dead, destination, batch)
            else:
                statuses = await _move_across_slots(client, consumer_id, dead, destination, batch)
            for i, status in zip(chunk, statuses, strict=True):
                out[i] = status
    return out


def _entry_args(move: MoveBack) -> list[Any]:
    return [len(move.fields), *(x for kv in move.fields.items() for x in kv)]


async def _move_in_one_slot(client: Any, dead: str, destination: str, batch: Sequence[MoveBack]) -> list[str]:
    args = [a for m in batch for a in (m.stream_id, *_entry_args(m))]
    reply = await client.eval(lua_scripts.RETRY_DEAD, 2, dead, destination, *args)
    return [script_status(s) for s in reply]


async def _move_across_slots(
    client: Any, consumer_id: str, dead: str, destination: str, batch: Sequence[MoveBack]
) -> list[str]:
    # Only letters still listed: one that another mover deleted long ago (its marker
    # expired since) is not appended again. One still listed whose marker is set is
    # between another mover's two phases, or left by a mover that died there.
    pipe = client.pipeline(transaction=False)
    for m in batch:
        pipe.xrange(dead, m.stream_id, m.stream_id)
    present = [bool(rows) for rows in await pipe.execute()]
    live = [m for m, here in zip(batch, present, strict=True) if here]
    appended: dict[str, str] = {}
    if live:
        markers = [dead_retry_marker(destination, consumer_id, dead, m.stream_id) for m in live]
        args = [a for m in live for a in _entry_args(m)]
        reply = await client.eval(
            lua_scripts.RETRY_DEAD_APPEND, 1 + len(live), destination, *markers, RETRY_MARKER_MS, *args
        )
        appended = {m.stream_id: script_status(s) for m, s in zip(live, reply, strict=True)}
        done = [m.stream_id for m in live if appended[m.stream_id] in (MOVED, DUP)]
        if done:
            await client.xdel(dead, *done)
    out: list[str] = []
    for m in batch:
        status = appended.get(m.stream_id, GONE)
        out.append(GONE if status == DUP else status)
    return out
