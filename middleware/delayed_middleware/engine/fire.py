"""Fire: deliver what is due, exactly once and failure-atomic (the single-node FIRE, and fire_due).

Where a fire decision is made: `lua/batch.lua`'s `decide` (due? expired?
gone? reserved target? recurring successor known?), run inside FIRE on a
single node and inside CLAIM on Cluster; `Firing._fire_once` picks which.

Invariants: an occurrence leaves the due index (or, recurring, moves to its
next due time) in the same atomic step that appends it to its target, so a
second replica, a retry after a crash, or a replay of the batch finds nothing
to do. A target that cannot take a message parks that one envelope (kept,
listed, recorded); the rest fire. A batch is bounded by envelopes, entries,
bytes and Redis time (EngineConfig), so no call holds Redis for long.
Decisions use the shard's Redis TIME unless the clock is authoritative.

Crash points: before FIRE nothing changed; after it, the batch is delivered
and the cron refills it asked for are marked in Redis (engine.refill); a crash
before `_advance` leaves them to any replica's next fire step.
Replication (Sentinel failover): a FIRE the new master never received is
undone whole, target entry and index change together, so it fires again.
"""

from __future__ import annotations

from collections.abc import Sequence

from delayed_middleware.engine.compaction import Compacting
from delayed_middleware.engine.config import REFILL_BATCH
from delayed_middleware.engine.refill import Refilling
from delayed_middleware.engine.replies import Refill
from delayed_middleware.engine.two_phase import TwoPhaseFiring


class Firing(TwoPhaseFiring, Refilling, Compacting):
    """fire_due: one bounded batch (FIRE, or the two-phase fire), its refills, a compaction slice."""

    async def fire_due(self) -> tuple[int, int | None]:
        """Fire one bounded batch of what is due now, in one atomic script, then
        complete the refills it asked for (and fire again once if that made
        something due: a recurring envelope whose refill was still pending).

        Returns (envelopes fired by this call, earliest due time left or None).
        """
        fired, head, refill, quads = await self._fire_once()
        # This batch's cron envelopes: their successors computed here from
        # what the script returned, stored in one REFILL call (no reads).
        await self._advance(quads)
        # Refills overdue (a replica died between its FIRE and its REFILL, or
        # an occurrence whose successor had passed waits for one), soonest first.
        if refill and await self.refill_pending(limit=max(refill, REFILL_BATCH)) and not fired:
            fired, head, _, quads = await self._fire_once()
            await self._advance(quads)
        # Compaction runs only when nothing is due: it never delays a fire batch,
        # and never re-homes envelopes about to fire.
        await self._compact_step(fired, idle=head is None or head > self._clock.now_ms())
        return fired, head

    async def _fire_once(self) -> tuple[int, int | None, int, Sequence[Refill]]:
        """One batch: (fired, head in this clock's frame, overdue refills, this batch's cron refills)."""
        if self._config.two_phase:
            return await self._fire_two_phase()
        local, now_arg = self._decide_at()
        got = await self._scripts.fire(
            now=now_arg,
            budget=self._budget,
            trim=self._trim_args(local),
            history_len=self._history_len(),
            pubsub_name=self._pubsub_name,
        )
        if got.expired:
            await self._markers("MaxAge", got.expired)
        if got.gone:
            self._log_gone(got.gone)
        self._report(got.decided, got.fired, got.first, got.pending, got.parked, got.entries, lost=got.gone)
        return got.fired, self._measured(local, got.decided, got.head), got.refill, got.refills
