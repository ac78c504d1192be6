"""Subscriber retry policy: when a nacked message comes back, and when it gives up.

Pure: `RetryPolicy.on_nack(attempt, error)` says `Redeliver(after_s)` or
`DeadLetter(reason)`; the Redis side (components/delayed_pubsub/redelivery.py)
carries the decision out. Delays come from the one backoff,
`delayed_middleware.backoff.compute_backoff`.

Metadata (component YAML, overridable per subscription through the metadata
daprd sends in PullMessages): `maxDeliveryAttempts` (deliveries before the
message is dead-lettered or dropped), `retryInitialInterval` (wait before the
2nd delivery), `retryMaxInterval` (cap on any wait), `retryMultiplier` (growth
per attempt), `retryJitter` (fraction of each wait taken off at random) and
`deadLetterTopic` (where exhausted messages go). Their defaults are stated
once, in the component's metadata.yaml (docs/component-metadata.md); each key
is read by its reader in READERS, on the component and per subscription alike.

When none of these keys is set anywhere, the policy is inactive and a nack
behaves as before this module existed: redelivery after `redeliverInterval`,
forever, held in memory by the stream that got the nack.

Why the retry stays in this consumer group's PEL (not a re-publish)
--------------------------------------------------------------------
Several apps (consumer groups) read one topic. Re-publishing a failed message
to its topic, or firing it back through the delay engine, would deliver it
again to every group, though only one failed it. So a retried entry never
leaves its stream: it stays in THIS group's pending entries list, and the
retry schedule is a durable record beside it, a sorted set per (group, topic)
`{<consumerID>-delayed}:retry:<topic>` (member = stream entry id, score = the
epoch ms from which it may be redelivered). Then:

- a restart honours the backoff: the record is in Redis, not in a timer;
- another stream of the group whose reclaim pass finds the entry idle past
  processingTimeout finds the record and does not deliver it early;
- redelivery is an XCLAIM by whichever stream of the group first removes the
  record (ZREM returning 1 is the token), which bumps the PEL delivery count,
  so `deliveryAttempt` = the PEL's times-delivered, crashes included;
- the record keeps the delivery count the nack was about, in a hash beside it
  (`{<consumerID>-delayed}:retry-n:<topic>`, "count:due ms": trusted only beside
  the record of that due time), and the poller claims under that
  count: if the entry was delivered again since (a reclaim pass got there while
  the record was held up on its way), that delivery was the retry, and the
  stale record is dropped instead of delivering the entry a second time;
- every such claim (and a reclaim pass's) is made only if the delivery count
  is still the one the claimer read before, in one script on the topic key:
  a reclaim pass that finds no record because a poller has just taken it
  cannot deliver the entry a second time, on Redis Cluster too;
- the key sits in the reserved `-delayed}` namespace: no topic can collide with it
  (once publish/subscribe refuse engine keys, see keys.is_engine_key);
- the topics having such a schedule are listed in the set `{<consumerID>-delayed}:retrying`,
  so operators (delayed_middleware.inspector) find the waiting retries without KEYS.

The rejected alternative, scheduling a retry envelope through the delay
engine, would need a per-group target the broker does not have, and would
copy the payload once per retry.

Dead letters: after the last attempt the entry is appended to `deadLetterTopic`
by the one dead-letter writer (delayed_middleware.deadletters: its data,
content type and metadata, plus `deadLetterReason`, `deadLetterAttempts`,
`deadLetterSourceTopic`, `deadLetterConsumer`, `deadLetterAt`), then XACKed: at least once (a crash between the two writes
a second dead letter, never loses one). The dead-letter topic's name is added
to the set `{<consumerID>-delayed}:deadletters`, so operators find dead
letters knowing only the app id. Hand-offs that exhaust their attempts are
dead-lettered the same way (delayed_pubsub.forwarder), with `deadLetterPubsub`
and `deadLetterTargetTopic` added.

A subscription to the component's dead-letter topic itself (an app reading
its dead letters) never dead-letters into it: see RetryPolicy.for_subscription.

Interplay with daprd (facts from dapr/dapr pkg/runtime/subscription):
- daprd calls the app under the component's *inbound resiliency policy*
  first; only when that policy gives up does it ack us with `ack_error`. Our
  attempts therefore count daprd's failed *rounds*, each of which may be
  several HTTP calls. Keep one of the two small (e.g. no inbound retries).
- A Dapr *subscription* `deadLetterTopic` wins over ours: daprd then
  publishes the failed message to that topic itself and acks us with success,
  so this policy never sees a failure (and `maxDeliveryAttempts` never counts).
  Use one or the other: daprd's for the first failure, ours for backoff and
  attempts.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Final

from delayed_middleware.backoff import compute_backoff
from delayed_middleware.deadletters import clip_reason
from delayed_middleware.durations import parse_go_duration
from delayed_middleware.errors import InvalidArgumentError
from delayed_middleware.keys import EngineKeys, delayed_topic, is_delayed_topic, is_engine_key

MAX_DELIVERY_ATTEMPTS: Final = "maxDeliveryAttempts"
RETRY_INITIAL_INTERVAL: Final = "retryInitialInterval"
RETRY_MAX_INTERVAL: Final = "retryMaxInterval"
RETRY_MULTIPLIER: Final = "retryMultiplier"
RETRY_JITTER: Final = "retryJitter"
DEAD_LETTER_TOPIC: Final = "deadLetterTopic"


def retry_key(consumer_id: str, topic: str) -> str:
    """The durable retry schedule of one consumer group on one topic (EngineKeys.retry)."""
    return EngineKeys.for_topic(delayed_topic(consumer_id)).retry(topic)


def retry_counts_key(consumer_id: str, topic: str) -> str:
    """The delivery count each retry record of `retry_key` is about (EngineKeys.retry_counts)."""
    return EngineKeys.for_topic(delayed_topic(consumer_id)).retry_counts(topic)


def retry_topics_key(consumer_id: str) -> str:
    """Set of the topics that have (or had) a retry schedule for this app (EngineKeys.retrying)."""
    return EngineKeys.for_topic(delayed_topic(consumer_id)).retrying


@dataclass(frozen=True)
class Redeliver:
    """Deliver again, no sooner than `after_s` seconds from now."""

    after_s: float
    next_attempt: int


@dataclass(frozen=True)
class DeadLetter:
    """Give up: publish to `topic` (or drop when it is empty), with `reason`."""

    reason: str
    attempts: int
    topic: str


@dataclass(frozen=True)
class RetryPolicy:
    """A subscription's retry policy. `active` is False when nothing was configured."""

    # The backoff's shape has no default here: the component's are declared once, in its
    # metadata.yaml (delayed_pubsub.settings builds the policy from them).
    initial_ms: int
    max_ms: int
    multiplier: float
    jitter: float
    max_attempts: int | None = None
    dead_letter_topic: str = ""
    active: bool = False

    def delay_s(self, attempt: int, rand: Callable[[], float] = random.random) -> float:
        """Seconds to wait after failed delivery `attempt` (1 = the first delivery failed)."""
        # compute_backoff steps once per attempt until the cap: with unlimited
        # attempts a message failing for weeks must not make each nack O(attempts).
        # Past 10,000 steps any multiplier > 1.001 is long capped; 1 never grows.
        steps = 1 if self.multiplier == 1 else min(attempt, 10_000)
        return compute_backoff(
            steps,
            base_s=self.initial_ms / 1000,
            cap_s=self.max_ms / 1000,
            multiplier=self.multiplier,
            jitter=self.jitter,
            rand=rand,
        )

    def on_nack(
        self, attempt: int, error: str, rand: Callable[[], float] = random.random
    ) -> Redeliver | DeadLetter:
        """What to do after delivery number `attempt` (1, 2, ...) failed with `error`."""
        attempt = max(1, attempt)
        if self.max_attempts is not None and attempt >= self.max_attempts:
            return DeadLetter(reason=clip_reason(error), attempts=attempt, topic=self.dead_letter_topic)
        return Redeliver(after_s=self.delay_s(attempt, rand), next_attempt=attempt + 1)

    def overridden(self, props: Mapping[str, str]) -> RetryPolicy:
        """This policy with a subscription's metadata on top (same keys, same checks)."""
        return parse_retry_policy(props, base=self)

    def for_subscription(self, topic: str, props: Mapping[str, str]) -> RetryPolicy:
        """The policy of one subscription to `topic`: this one with the subscription's metadata on top.

        A subscription whose own metadata names `topic` as its dead-letter
        topic is refused (InvalidArgumentError): it would feed itself. The
        component's dead-letter topic subscribed to (an app reading its dead
        letters) is not: there a failed message is kept, redelivered with the
        same backoff, capped at retryMaxInterval, for as long as it fails (as
        Dapr's pubsub.redis does without a dead-letter topic), never appended
        to the topic it came from nor dropped.
        """
        own = props.get(DEAD_LETTER_TOPIC, "").strip()
        if own and own == topic:
            raise InvalidArgumentError(DEAD_LETTER_TOPIC, own, "must differ from the subscribed topic")
        policy = self.overridden(props)
        if not policy.dead_letter_topic or policy.dead_letter_topic != topic:
            return policy
        return replace(policy, max_attempts=None, dead_letter_topic="")


def parse_retry_policy(
    props: Mapping[str, str], base: RetryPolicy, *, component: bool = False
) -> RetryPolicy:
    """Read the retry keys from metadata over `base`: for a subscription, the component's policy;
    for the component (`component=True`), its declared defaults.

    Raises InvalidArgumentError naming the first bad key and value.
    """
    policy = base
    given = {k: props[k].strip() for k in KEYS if k in props and props[k].strip() != ""}
    if not given:
        return policy
    # On the component, deadLetterTopic alone is also the forwarder's (hand-offs that failed
    # their last attempt): it must not turn subscriber retries on. On a subscription it does.
    changes: dict[str, object] = {"active": not component or given.keys() != {DEAD_LETTER_TOPIC}}
    for key, text in given.items():
        attribute, read = READERS[key]
        changes[attribute] = read(key, text)
    result = replace(policy, **changes)  # type: ignore[arg-type]
    if result.max_ms < result.initial_ms:
        key = RETRY_MAX_INTERVAL if RETRY_MAX_INTERVAL in given else RETRY_INITIAL_INTERVAL
        raise InvalidArgumentError(
            key,
            given[key],
            f"retryMaxInterval ({result.max_ms}ms) must not be below retryInitialInterval ({result.initial_ms}ms)",
        )
    return result


# Ten years: anything longer is a typo, and keeps due times far from 2^63 ms.
_MAX_INTERVAL_MS = 10 * 365 * 86_400_000


def read_max_attempts(key: str, raw: str) -> int:
    """maxDeliveryAttempts: an integer from 1 to 2^31."""
    # Length first: int() of thousands of digits raises ValueError (and costs time).
    if not (raw.isascii() and raw.isdigit()) or len(raw.lstrip("0")) > 10 or not 1 <= int(raw) <= 2**31:
        raise InvalidArgumentError(key, raw, "must be an integer from 1 to 2^31")
    return int(raw)


def read_interval(key: str, raw: str) -> int:
    """retryInitialInterval, retryMaxInterval: a Go duration or integer milliseconds, at most ten years."""
    if raw.isascii() and raw.isdigit():
        # Past 19 digits it is beyond any bound below; int() of thousands of digits raises.
        ms = int(raw) if len(raw.lstrip("0")) <= 19 else _MAX_INTERVAL_MS + 1
    else:
        try:
            ms = parse_go_duration(raw)
        except ValueError:
            raise InvalidArgumentError(key, raw, "not a Go duration (e.g. 500ms, 30s, 1h)") from None
    if ms < 0 or ms > _MAX_INTERVAL_MS:
        raise InvalidArgumentError(key, raw, "must be between 0 and 10 years")
    return ms


def read_multiplier(key: str, raw: str) -> float:
    """retryMultiplier: from 1 (constant) to 1000."""
    return _float(key, raw, 1.0, 1000.0)


def read_jitter(key: str, raw: str) -> float:
    """retryJitter: the fraction (0 to 1) of each wait taken off at random."""
    return _float(key, raw, 0.0, 1.0)


def read_dead_letter_topic(key: str, topic: str) -> str:
    """deadLetterTopic: any topic but the delay engine's."""
    if is_engine_key(topic) or is_delayed_topic(topic):
        raise InvalidArgumentError(key, topic, "is reserved for the delay engine (ends with -delayed)")
    return topic


# Each retry key: the RetryPolicy attribute it sets and its reader (key, stripped text) → value.
# The component reads its declared defaults (metadata.yaml) through these same readers.
READERS: Final[Mapping[str, tuple[str, Callable[[str, str], object]]]] = {
    MAX_DELIVERY_ATTEMPTS: ("max_attempts", read_max_attempts),
    RETRY_INITIAL_INTERVAL: ("initial_ms", read_interval),
    RETRY_MAX_INTERVAL: ("max_ms", read_interval),
    RETRY_MULTIPLIER: ("multiplier", read_multiplier),
    RETRY_JITTER: ("jitter", read_jitter),
    DEAD_LETTER_TOPIC: ("dead_letter_topic", read_dead_letter_topic),
}
# The retry keys, in the table's order.
KEYS: Final = tuple(READERS)


def _float(key: str, raw: str, low: float, high: float) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise InvalidArgumentError(key, raw, "not a number") from None
    if not math.isfinite(value) or not low <= value <= high:
        raise InvalidArgumentError(key, raw, f"must be between {low:g} and {high:g}")
    return value
