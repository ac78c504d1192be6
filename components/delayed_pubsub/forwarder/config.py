"""Where a forwarder hands off and how hard it tries: ForwarderConfig, from settings and environment."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final

from delayed_middleware.backoff import SIDECAR, BackoffProfile
from delayed_middleware.history import Retention
from delayed_middleware.outbox import OUTBOX_GROUP, HandOffPolicy
from delayed_pubsub.settings import defaults

DEFAULT_DAPR_GRPC_ADDRESS: Final = "127.0.0.1:50001"


def resolve_dapr_address(configured: str, env: Mapping[str, str]) -> str:
    """The sidecar's gRPC address: `daprGrpcAddress`, else $DAPR_GRPC_PORT on loopback, else 127.0.0.1:50001.

    `http://host:port` (the SDKs' endpoint form) is accepted and means host:port.
    """
    address = configured.strip()
    if address:
        return address.removeprefix("http://")
    port = env.get("DAPR_GRPC_PORT", "").strip()
    if port:
        return f"127.0.0.1:{port}"
    return DEFAULT_DAPR_GRPC_ADDRESS


@dataclass(frozen=True)
class ForwarderConfig:
    """Where to hand off and how hard to try; defaults suit most deployments."""

    address: str = DEFAULT_DAPR_GRPC_ADDRESS
    api_token: str = ""
    policy: HandOffPolicy = field(default_factory=HandOffPolicy)
    # The outbox's consumer group: one per app, shared by every replica.
    group: str = OUTBOX_GROUP
    # Entries held (read or claimed, not yet settled) at once.
    batch_size: int = 100
    # Publish calls in flight at once.
    concurrency: int = 16
    block_ms: int = 1000
    # One publish call (handoffTimeout, default as metadata.yaml declares it); past it the call
    # counts as a failed attempt.
    call_timeout_s: float = field(default_factory=lambda: defaults()["handoff_timeout_ms"] / 1000)
    # Another replica's unacked entries are taken over after this long idle. A
    # live holder resets the idle time of what it holds every claim_idle_ms / 3,
    # so only a holder that is gone (or stalled that long) loses its entries.
    # (processingTimeout, default as metadata.yaml declares it.)
    claim_idle_ms: int = field(default_factory=lambda: defaults()["processing_timeout_ms"])
    # Redis calls are bounded as a whole (the client has no socket timeout).
    redis_timeout_s: float = 10.0
    # How long a failed call to the sidecar waits before the next (backoff.SIDECAR by default).
    sidecar_backoff_base_s: float = SIDECAR.base_s
    sidecar_backoff_cap_s: float = SIDECAR.cap_s
    # historyMaxLen / historyMaxAge for the `handedoff`, `expired`, `deadlettered` records.
    history: Retention = field(default_factory=Retention)
    # The app (consumerID) whose dead-letter set lists our dead letters; '' = read from the keys.
    consumer_id: str = ""

    def sidecar_profile(self) -> BackoffProfile:
        """The backoff between failed calls to the sidecar: base doubling to cap."""
        return BackoffProfile(base_s=self.sidecar_backoff_base_s, cap_s=self.sidecar_backoff_cap_s)


def forwarder_config(
    *,
    dapr_grpc_address: str,
    dead_letter_topic: str,
    claim_idle_ms: int,
    call_timeout_ms: int,
    env: Mapping[str, str] | None = None,
    history: Retention | None = None,
    consumer_id: str = "",
) -> ForwarderConfig:
    """A ForwarderConfig from component settings and the environment (DAPR_GRPC_PORT, DAPR_API_TOKEN)."""
    environ = os.environ if env is None else env
    return ForwarderConfig(
        address=resolve_dapr_address(dapr_grpc_address, environ),
        api_token=environ.get("DAPR_API_TOKEN", ""),
        policy=HandOffPolicy(dead_letter_topic=dead_letter_topic),
        claim_idle_ms=max(claim_idle_ms, 15_000),
        call_timeout_s=call_timeout_ms / 1000,
        history=history if history is not None else Retention(),
        consumer_id=consumer_id,
    )
