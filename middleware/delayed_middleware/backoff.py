"""One backoff for every retry loop: Redis reconnects, the delay engine, subscriber retries.

A pure function of the attempt number, so the retry policy a user configures
(retryInitialInterval, retryMultiplier, retryMaxInterval, retryJitter) and the
internal reconnect loops compute delays the same way, and tests can table it.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass


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
