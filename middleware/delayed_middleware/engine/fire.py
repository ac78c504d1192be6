"""Fire: deliver what is due, exactly once and failure-atomic (the single-node FIRE, and fire_due).

Where a fire decision is made: `lua/batch.lua`'s `decide` (due? expired?
gone? reserved target? recurring successor known?), run inside FIRE on a
single node and inside CLAIM on Cluster; the fire path (SingleNodeFire here,
TwoPhaseFire in two_phase.py) is chosen once, by engine.builder.

Invariants: an occurrence leaves the due index (or, recurring, moves to its
next due time) in the same atomic step that appends it to its target, so a
second replica, a retry after a crash, or a replay of the batch finds nothing
to do. A target that cannot take a message parks that one envelope (kept,
listed, recorded); the rest fire. A batch is bounded by envelopes, entries,
bytes and Redis time (EngineConfig), so no call holds Redis for long.
Decisions use the shard's Redis TIME unless the clock is authoritative.

Crash points: before FIRE nothing changed; after it, the batch is delivered
and the cron refills it asked for are marked in Redis (engine.refill); a crash
before `Refiller.advance` leaves them to any replica's next fire step.
Replication (Sentinel failover): a FIRE the new master never received is
undone whole, target entry and index change together, so it fires again.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol

from delayed_middleware.engine.compaction import Compactor
from delayed_middleware.engine.config import REFILL_BATCH
from delayed_middleware.engine.core import ShardState
from delayed_middleware.engine.refill import Refiller
from delayed_middleware.engine.replies import Refill


class FireStep(NamedTuple):
    """What one fire batch did, whichever path fired it."""

    # Envelopes fired (two-phase: claimed; a batch cut short by its budget leaves more due).
    fired: int
    # The earliest due time left, in this replica's clock frame (None: nothing pending).
    head: int | None
    # Refills overdue (a replica died between its fire and its REFILL), as the script counted them.
    refill: int
    # This batch's cron envelopes, for Refiller.advance.
    refills: Sequence[Refill]


class FirePath(Protocol):
    """One bounded fire batch: SingleNodeFire (FIRE) or two_phase.TwoPhaseFire (CLAIM, APPEND, RELEASE)."""

    async def fire_once(self) -> FireStep: ...


class SingleNodeFire:
    """The fire path of a single node (or Sentinel): one FIRE script per batch."""

    def __init__(self, state: ShardState) -> None:
        self._state = state

    async def fire_once(self) -> FireStep:
        """One batch: (fired, head in this clock's frame, overdue refills, this batch's cron refills)."""
        st = self._state
        local, now_arg = st.decide_at()
        got = await st.scripts.fire(
            now=now_arg,
            budget=st.budget,
            trim=st.trim_args(local),
            history_len=st.history_len,
            pubsub_name=st.pubsub_name,
        )
        await st.unfired(got.expired, got.gone)
        st.report(got.decided, got.fired, got.first, got.pending, got.parked, got.entries, lost=got.gone)
        return FireStep(got.fired, st.measured(local, got.decided, got.head), got.refill, got.refills)


class Firer:
    """fire_due: one bounded batch through the fire path, its refills, a compaction slice."""

    def __init__(self, state: ShardState, path: FirePath, refiller: Refiller, compactor: Compactor) -> None:
        self._state = state
        self.path = path
        self._refiller = refiller
        self._compactor = compactor

    async def fire_due(self) -> tuple[int, int | None]:
        """Fire one bounded batch of what is due now, in one atomic script, then
        complete the refills it asked for (and fire again once if that made
        something due: a recurring envelope whose refill was still pending).

        Returns (envelopes fired by this call, earliest due time left or None).
        """
        fired, head, refill, quads = await self.path.fire_once()
        # This batch's cron envelopes: their successors computed here from
        # what the script returned, stored in one REFILL call (no reads).
        await self._refiller.advance(quads)
        # Refills overdue (a replica died between its FIRE and its REFILL, or
        # an occurrence whose successor had passed waits for one), soonest first.
        if refill and await self._refiller.refill_pending(limit=max(refill, REFILL_BATCH)) and not fired:
            fired, head, _, quads = await self.path.fire_once()
            await self._refiller.advance(quads)
        # Compaction runs only when nothing is due: it never delays a fire batch,
        # and never re-homes envelopes about to fire.
        await self._compactor.step(fired, idle=head is None or head > self._state.clock.now_ms())
        return fired, head
