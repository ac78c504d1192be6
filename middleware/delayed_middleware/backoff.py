"""One backoff for every retry loop, and the named retry policies of the component's own loops.

`compute_backoff` is a pure function of the attempt number, so the retry
policy a user configures (retryInitialInterval, retryMultiplier,
retryMaxInterval, retryJitter) and the internal loops compute delays the same
way, and tests can table it.

The internal loops do not write their numbers where they retry: each takes a
named `BackoffProfile` below (`REDIS_RECONNECT.backoff()`), whose comment says why
those numbers. A loop whose numbers come from a setting builds its policy from
that setting (`BackoffProfile(config.retry_min_s, config.retry_max_s)`).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from redis.backoff import ExponentialWithJitterBackoff


def compute_backoff(
    attempt: int,
    *,
    base_s: float,
    cap_s: float,
    multiplier: float = 2.0,
    jitter: float = 0.0,
    rand: Callable[[], float] = random.random,
) -> float:
    """Seconds to wait before retry number `attempt` (1 = the first retry).

    base * multiplier^(attempt-1), capped at cap; with jitter j in [0, 1] the
    result is spread uniformly over [d * (1 - j), d] so replicas retrying the
    same failure do not stampede together. Never negative, never above cap.
    """
    if attempt < 1:
        raise ValueError(f"attempt must be >= 1, got {attempt}")
    if not 0.0 <= jitter <= 1.0:
        raise ValueError(f"jitter must be within [0, 1], got {jitter}")
    if base_s < 0 or cap_s < 0 or multiplier < 1:
        raise ValueError("base and cap must be >= 0 and multiplier >= 1")
    delay = base_s
    # Multiply step by step and stop at the cap: multiplier ** attempt would
    # overflow a float for attempts in the thousands.
    for _ in range(attempt - 1):
        if delay >= cap_s:
            break
        delay *= multiplier
    delay = min(delay, cap_s)
    if jitter:
        delay -= delay * jitter * rand()
    return max(0.0, delay)


@dataclass
class Backoff:
    """Stateful wrapper for a loop: next() grows the delay, reset() after a success."""

    base_s: float = 0.05
    cap_s: float = 2.0
    multiplier: float = 2.0
    jitter: float = 0.0
    failures: int = 0

    def next(self) -> float:
        self.failures += 1
        return compute_backoff(
            self.failures,
            base_s=self.base_s,
            cap_s=self.cap_s,
            multiplier=self.multiplier,
            jitter=self.jitter,
        )

    def reset(self) -> None:
        self.failures = 0


@dataclass(frozen=True)
class BackoffProfile:
    """How one kind of retry loop waits: `base_s` after the first failure,
    times `multiplier` after each next one, never more than `cap_s`; `jitter`
    spreads each delay as compute_backoff says."""

    base_s: float
    cap_s: float
    multiplier: float = 2.0
    jitter: float = 0.0

    def __post_init__(self) -> None:
        # Refused when the policy is made (at import for the named ones), not at a loop's first failure.
        compute_backoff(
            1, base_s=self.base_s, cap_s=self.cap_s, multiplier=self.multiplier, jitter=self.jitter
        )

    def backoff(self) -> Backoff:
        """A fresh Backoff for one loop (its own failure count)."""
        return Backoff(base_s=self.base_s, cap_s=self.cap_s, multiplier=self.multiplier, jitter=self.jitter)

    def delay(self, attempt: int) -> float:
        """Seconds before retry number `attempt` (1 = the first), as compute_backoff."""
        return compute_backoff(
            attempt, base_s=self.base_s, cap_s=self.cap_s, multiplier=self.multiplier, jitter=self.jitter
        )

    def redis_py(self) -> ExponentialWithJitterBackoff:
        """This base and cap as redis-py's own backoff, for its `Retry` (redis-py
        doubles from base * 2 and spreads each delay over [0, delay])."""
        return ExponentialWithJitterBackoff(base=self.base_s, cap=self.cap_s)


# A loop that reads or writes Redis and lost it (subscription fetch, ack and
# retry loops, the forwarder's reads, the delay engine's fire loop): 50 ms
# catches a blip (a failover, a dropped connection) before anyone notices;
# the 2 s cap brings delivery back within ~2 s of Redis returning while a
# Redis that stays down sees at most one attempt per loop every 2 s.
REDIS_RECONNECT: Final = BackoffProfile(base_s=0.05, cap_s=2.0)

# The delay engine's loop, by default (its config's retry_min_s/retry_max_s):
# the same reasons as REDIS_RECONNECT, whose numbers it takes.
ENGINE_LOOP: Final = REDIS_RECONNECT

# Storing a publish again after Redis dropped the connection (at most
# redisMaxRetries times): a caller (daprd) waits for the answer, so the waits
# stay short, 20 ms doubling to 0.5 s, well inside the call's own bound.
PUBLISH_RETRY: Final = BackoffProfile(base_s=0.02, cap_s=0.5)

# An instance that fails to start (restored from its Init record, or opened by
# a worker): the cause is rarely brief (Redis down, a setting refused), and
# each failure logs an error, so 0.5 s first, and a retry at least every 10 s
# so the instance comes back soon after its cause is gone.
RESTART: Final = BackoffProfile(base_s=0.5, cap_s=10.0)

# A worker process (serve --workers) that died: the next one starts after
# 0.2 s (a fresh interpreter takes longer than that to import), doubling to
# 10 s for a worker that dies at every start, so it does not spin a core.
WORKER_RESTART: Final = BackoffProfile(base_s=0.2, cap_s=10.0)

# One delay shard's fire loop that ended unexpectedly (restarted by its
# Supervised): 0.1 s, as the loop has its own Redis backoff inside, and 5 s
# at most so one failing shard is retried often while the others fire on.
SHARD_LOOP: Final = BackoffProfile(base_s=0.1, cap_s=5.0)

# Any other supervised loop that ended without a stop (liveness.supervise's
# default): back at once, 50 ms, for a stray cancellation; 5 s at most for a
# loop that fails at each start (each end is logged at ERROR).
LIVENESS: Final = BackoffProfile(base_s=0.05, cap_s=5.0)

# The forwarder's calls to the app's sidecar that failed (by default; its
# config's sidecar_backoff_base_s/cap_s): an app restarting or overloaded gets
# 0.1 s, then less and less load, a retry at least every 5 s.
SIDECAR: Final = BackoffProfile(base_s=0.1, cap_s=5.0)

# redis-py's own Retry, dialing a connection (connection.py; at most
# redisMaxRetries times): 50 ms doubling to 1 s, spread over [0, delay]
# (redis-py's full jitter) so replicas redialing one Redis do not dial together.
REDIS_DIAL: Final = BackoffProfile(base_s=0.05, cap_s=1.0, jitter=1.0)
