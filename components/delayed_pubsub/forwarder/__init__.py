"""The forwarder: hands due messages bound for another Dapr pub/sub to the sidecar, at least once.

- core.py: `Forwarder`, its loop (reads, retries, one task per hand-off) and its delivery guarantees;
- holding.py: hand-off holding: what it holds, the keeper's renewals, the ownership check, claims;
- settles.py: the settle batcher (hand-offs ending together settled in one MULTI);
- sidecar.py: the sidecar connection and the publish call;
- outcomes.py: a hand-off's ending (handed off, left for its retry, dead-lettered) and its record;
- config.py: `ForwarderConfig`, from settings and the environment.
"""

from delayed_middleware.outbox import HandOffPolicy
from delayed_pubsub.forwarder.config import (
    DEFAULT_DAPR_GRPC_ADDRESS,
    ForwarderConfig,
    forwarder_config,
    resolve_dapr_address,
)
from delayed_pubsub.forwarder.core import Forwarder

__all__ = [
    "DEFAULT_DAPR_GRPC_ADDRESS",
    "Forwarder",
    "ForwarderConfig",
    "HandOffPolicy",
    "forwarder_config",
    "resolve_dapr_address",
]
