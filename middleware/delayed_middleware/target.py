"""Publish metadata `targetPubsub`: deliver a delayed message through another Dapr pub/sub.

A delayed publish with `targetPubsub: kafka` waits in our Redis like any delayed
message; when due, the forwarder publishes it through the sidecar to the
component named `kafka` (Kafka, RabbitMQ, Service Bus, a built-in pubsub.redis…)
instead of appending it to our own topic. A component-wide default comes from
the component metadata `defaultTargetPubsub`.

Pure functions, called by the planning step before anything is stored, so a
refused publish stores nothing.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Mapping
from typing import Final

from delayed_middleware.errors import InvalidArgumentError
from delayed_middleware.publish_keys import REQUEST_KEYS, TARGET_PUBSUB

DEFAULT_TARGET_PUBSUB: Final = "defaultTargetPubsub"

__all__ = [
    "DEFAULT_TARGET_PUBSUB",
    "MAX_TARGET_LENGTH",
    "NOT_FORWARDED",
    "TARGET_PUBSUB",
    "check_target_name",
    "forwarded_metadata",
    "target_pubsub",
]

# Dapr component names are Kubernetes object names (<= 253 characters).
MAX_TARGET_LENGTH: Final = 253

# Keys that concern us, not the target: they never reach it. TTL keys are
# dropped too because the forwarder passes on the *remaining* TTL (expiresAt).
# They are the keys planning reads of a message's own metadata (REQUEST_KEYS).
NOT_FORWARDED: Final = frozenset(REQUEST_KEYS)


def check_target_name(key: str, name: str) -> str:
    """A pub/sub component name as given under `key`, or InvalidArgumentError."""
    if not name.strip():
        raise InvalidArgumentError(key, name, "must name a Dapr pub/sub component")
    if len(name) > MAX_TARGET_LENGTH:
        raise InvalidArgumentError(key, name, f"longer than {MAX_TARGET_LENGTH} characters")
    if name != name.strip() or any(unicodedata.category(c).startswith(("C", "Z")) for c in name):
        raise InvalidArgumentError(key, name, "must not contain spaces or control characters")
    return name


def target_pubsub(metadata: Mapping[str, str], *, delayed: bool, default: str = "") -> str | None:
    """The pub/sub a delayed message is handed to when due, or None for our own topic.

    `delayed` says whether the metadata asked for a delay (parse_delay found
    one). `targetPubsub` without a delay is refused: an immediate message
    should be published to that pub/sub directly, and silently storing it on
    ours would deliver it to the wrong subscribers. `default`
    (defaultTargetPubsub) applies to delayed messages only.
    """
    if TARGET_PUBSUB in metadata:
        name = metadata[TARGET_PUBSUB]
        if not delayed:
            raise InvalidArgumentError(
                TARGET_PUBSUB,
                name,
                "needs delay metadata (scheduledSendTime, scheduledSendDelay, deliverAt or deliverAfter); "
                "without a delay, publish to that pub/sub directly",
            )
        return check_target_name(TARGET_PUBSUB, name)
    if delayed and default:
        return default
    return None


def forwarded_metadata(metadata: Mapping[str, str]) -> dict[str, str]:
    """The metadata handed to the target: the user's, minus our delay, target and TTL keys."""
    return {k: v for k, v in metadata.items() if k not in NOT_FORWARDED}
