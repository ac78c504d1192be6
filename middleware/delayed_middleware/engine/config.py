"""The engine's settings and what it reports: EngineConfig, FireReport, and the batch sizes.

Nothing here touches Redis. EngineConfig's defaults suit most deployments;
components build it from their settings with delayed_pubsub.engines.engine_config.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from delayed_middleware.backoff import ENGINE_LOOP, BackoffProfile
from delayed_middleware.envelope import Envelope
from delayed_middleware.history import HISTORY_MAX_AGE_MS, HISTORY_MAX_LEN

# The next fire time of a recurring envelope strictly after `after_ms`, or None
# when its schedule has no further fire.
Recurrence = Callable[[Envelope, int], "int | None"]


# Recurring envelopes refilled per round trip, and ids cancelled per script call.
REFILL_BATCH = 200
CANCEL_BATCH = 500
# Call tokens a ShardedEngine remembers the spread shard of (retries come within seconds).
SPREAD_MEMORY = 4096
# The metadata key of a marker message (deleteMarkerTTL): why the message will not come.
MARKER_REASON = "markerReason"
# deleteMarkerTTL when none is configured: no markers. The component's metadata.yaml declares
# the same default (tests/components/test_settings_defaults.py holds them together).
MARKER_TTL_MS: Final = 0


@dataclass(frozen=True)
class EngineConfig:
    """Tuning knobs; the defaults suit most deployments."""

    # One fire call's budget: envelopes, work (appended entries, plus one per
    # four metadata pairs: see fire.lua) and envelope bytes (metadata included). Sized
    # so a call stays within ~20 ms of Redis time (bench/delay.py, SLOWLOG).
    batch_size: int = 500
    batch_entries: int = 2000
    batch_bytes: int = 4 << 20
    # ...and Redis time: a batch stops after this long (checked with Redis TIME),
    # so no call holds Redis for more than ~this, however loaded the machine.
    fire_budget_us: int = 10_000
    # Envelopes and bytes per SCHEDULE call: a huge bulk publish is stored in
    # bounded steps (64 MiB in one call held Redis ~200 ms; SLOWLOG).
    schedule_chunk: int = 500
    schedule_chunk_bytes: int = 1 << 20
    # Coalescing (coalesce.py): under load (a schedule call within 5 lingers of
    # the previous one) a call waits this long for others to join its script
    # call; a lone call goes out at the end of its loop pass, with no wait.
    # grpc.aio hands concurrent publishes over one loop pass each, in bursts
    # ~1 ms apart on a loaded box: without a wait nearly each went alone. 0 = none.
    schedule_linger_ms: float = 2.0
    # A cap on any one sleep, so a lost wake message (a dropped pub/sub
    # connection) or a stepped clock delays a fire by at most this much.
    max_sleep_s: float = 5.0
    # The fire loop's Redis backoff (backoff.ENGINE_LOOP, by default).
    retry_min_s: float = ENGINE_LOOP.base_s
    retry_max_s: float = ENGINE_LOOP.cap_s
    # Bound on one script round trip: a connection that died without a FIN
    # (a partitioned Redis) must not stall the loop forever.
    op_timeout_s: float = 30.0
    # Lifecycle history retention: entries (approximate, 0 = no history) and age.
    history_max_len: int = HISTORY_MAX_LEN
    history_max_age_ms: int = HISTORY_MAX_AGE_MS
    # How long a schedule call's token is remembered (a client's retry after a
    # lost reply must come within it).
    token_window_ms: int = 120_000
    # deleteMarkerTTL: when a cancel or an expiry removes a message, a marker
    # (markerReason Remove / MaxAge) goes on its topic, living this long; 0 = none.
    marker_ttl_ms: int = MARKER_TTL_MS
    # Redis Cluster: fire in three steps (CLAIM, APPEND, RELEASE; see
    # engine.two_phase), since target topics live in other hash slots.
    two_phase: bool = False
    # A claimed batch is this replica's for this long; then any replica takes it over.
    lease_ms: int = 5_000
    # How long a fire marker outlives its APPEND: the bound on how long a claim
    # may stay in flight (a stalled replica, or every replica down between
    # APPEND and RELEASE) and still not be appended twice. Costs ~100 B of
    # Redis memory per fired message for this long. (Not marker_ttl_ms above:
    # that is deleteMarkerTTL's marker *messages*; these are idempotency keys.)
    fire_marker_ttl_ms: int = 900_000
    # Compaction (lua/compact.lua): a stream node is freed only when all its
    # entries are deleted, so envelopes that wait long among ones that fired keep
    # whole nodes allocated. The stream's density (live entries per node) is
    # checked once this many envelopes have left it (fired, cancelled) since the
    # last check (0 = never compact); below half of what a pass last achieved (at
    # first: a full node's worth, from its entries' size and Redis's default node
    # size), over at least compact_min_nodes nodes, a pass re-homes the stream's
    # envelopes to its tail, compact_chunk per call within compact_budget_us of
    # Redis time, for up to compact_slice_s per fire step.
    compact_check_every: int = 1_000
    compact_min_nodes: int = 16
    compact_chunk: int = 200
    compact_budget_us: int = 5_000
    compact_slice_s: float = 0.02
    # Orphan recovery (engine/recovery.py): at the start of the run loop, a sweep over the
    # delayed stream puts back in the index the pending envelopes no index entry refers to
    # (left so by a release that did not know the moved hash), recover_chunk entries per
    # call within recover_budget_us of Redis time, paced by recover_duty. Off below storage format 2, where no
    # envelope was ever moved.
    recover_orphans: bool = True
    recover_chunk: int = 200
    recover_budget_us: int = 10_000
    # The share of the sweep's time spent in its calls (the rest it waits): 0.5 = half.
    recover_duty: float = 0.5

    def retry_profile(self) -> BackoffProfile:
        """The fire loop's backoff after a Redis error: retry_min_s doubling to retry_max_s."""
        return BackoffProfile(base_s=self.retry_min_s, cap_s=self.retry_max_s)


# The settings an engine gets when given none.
DEFAULT_CONFIG: Final = EngineConfig()


@dataclass(frozen=True)
class FireReport:
    """What one fire_due call did, for metrics: handed to the engine's on_batch hook."""

    fired: int
    # now - the earliest due time in the batch (0 when nothing fired).
    max_lateness_ms: int
    # Messages still waiting in the index after the batch.
    pending: int
    parked: int = 0
    entries: int = 0
    # Index entries whose envelope was gone (deleted outside the engine): reported and removed.
    lost: int = 0
