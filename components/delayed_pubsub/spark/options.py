"""Data source options -> ReaderOptions: the component's own metadata keys plus a few of Spark's.

A user passes what their component YAML says (``redisHost``, ``redisPassword``,
``enableTLS``, ``consumerID``, ...) and may add ``numPartitions``, ``batchSize``
and, when streaming, ``startingOffsets``. Spark lower-cases option names, so
they are matched case-insensitively; an unknown name or a malformed value fails
at once with a message that names it (a typo must not silently read Redis on
localhost).
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final, Literal

from delayed_middleware.errors import InvalidArgumentError
from delayed_middleware.keys import shard_topics
from delayed_pubsub.settings import KNOWN_KEYS, Settings, parse_settings

NUM_PARTITIONS: Final = "numPartitions"
BATCH_SIZE: Final = "batchSize"
STARTING_OFFSETS: Final = "startingOffsets"
CONSUMER_ID: Final = "consumerID"

SPARK_KEYS: Final = frozenset({NUM_PARTITIONS, BATCH_SIZE, STARTING_OFFSETS})
# Spark adds `path` when a user calls load("something"): refused below with a hint.
_ALL_KEYS: Final = {k.lower(): k for k in (*KNOWN_KEYS, *SPARK_KEYS)}

DEFAULT_BATCH_SIZE: Final = 10_000
MAX_BATCH_SIZE: Final = 1_000_000
MAX_PARTITIONS: Final = 10_000


class InvalidOptionError(InvalidArgumentError):
    """A data source option is unknown or malformed; the message names it and its value."""

    def __init__(self, key: str, value: str, reason: str) -> None:
        super().__init__(key, value, reason)
        # Same fields as InvalidArgumentError, worded for Spark users.
        self.args = (f"invalid option {key}={value!r}: {reason}",)

    def __str__(self) -> str:
        return str(self.args[0])

    def __reduce__(self) -> tuple[type[InvalidOptionError], tuple[str, str, str]]:
        # Spark pickles errors raised in its Python workers.
        return (type(self), (self.key, self.value, self.reason))


@dataclass(frozen=True)
class ReaderOptions:
    """What a reader needs: where Redis is, which app, how to split the read."""

    settings: Settings
    consumer_id: str
    num_partitions: int | None = None  # None: one per core Spark has (defaultParallelism)
    batch_size: int = DEFAULT_BATCH_SIZE
    starting_offsets: Literal["earliest", "latest"] = "earliest"

    @property
    def delayed_topics(self) -> tuple[str, ...]:
        """Every delayed topic (shard) of this app, in a fixed order.

        One on a single node; with delayShards (16 by default on Redis Cluster)
        the engine spreads an app over several, named by keys.shard_topics.
        Pass the component's delayShards if it sets one.
        """
        return tuple(shard_topics(self.consumer_id, self.settings.shards))


def parse_reader_options(options: Mapping[str, str]) -> ReaderOptions:
    """Validate data source options (any letter case); InvalidOptionError names the first bad one."""
    props: dict[str, str] = {}
    for raw_key, value in options.items():
        key = _ALL_KEYS.get(raw_key.lower())
        if key is None:
            raise InvalidOptionError(raw_key, str(value), _unknown_reason(raw_key))
        props[key] = str(value)

    consumer_id = props.get(CONSUMER_ID, "").strip()
    if not consumer_id:
        raise InvalidOptionError(
            CONSUMER_ID, props.get(CONSUMER_ID, ""), "required: the app id (or the component's consumerID)"
        )
    if "{" in consumer_id or "}" in consumer_id:
        # daprd resolves {appID}/{namespace} templates before Init; Spark cannot.
        raise InvalidOptionError(CONSUMER_ID, consumer_id, "give the resolved consumer id, not a template")
    try:
        settings = parse_settings({k: v for k, v in props.items() if k in KNOWN_KEYS})
    except InvalidArgumentError as e:
        raise InvalidOptionError(e.key, e.value, e.reason) from None

    num_partitions = None
    if NUM_PARTITIONS in props:
        num_partitions = _positive_int(props, NUM_PARTITIONS, MAX_PARTITIONS)
    batch_size = DEFAULT_BATCH_SIZE
    if BATCH_SIZE in props:
        batch_size = _positive_int(props, BATCH_SIZE, MAX_BATCH_SIZE)
    starting = props.get(STARTING_OFFSETS, "earliest").strip().lower() or "earliest"
    if starting not in ("earliest", "latest"):
        raise InvalidOptionError(STARTING_OFFSETS, props[STARTING_OFFSETS], "must be earliest or latest")
    return ReaderOptions(
        settings=settings,
        consumer_id=consumer_id,
        num_partitions=num_partitions,
        batch_size=batch_size,
        starting_offsets="latest" if starting == "latest" else "earliest",
    )


def _unknown_reason(key: str) -> str:
    if key.lower() == "path":
        return "these data sources take no path: call load() without arguments and set consumerID"
    close = difflib.get_close_matches(key.lower(), list(_ALL_KEYS), n=1)
    hint = f" (did you mean {_ALL_KEYS[close[0]]}?)" if close else ""
    return f"unknown option{hint}"


def _positive_int(props: Mapping[str, str], key: str, maximum: int) -> int:
    raw = props[key].strip()
    if not (raw.isascii() and raw.isdigit()) or not 1 <= int(raw) <= maximum:
        raise InvalidOptionError(key, props[key], f"must be an integer between 1 and {maximum}")
    return int(raw)
