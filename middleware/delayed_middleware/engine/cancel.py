"""Cancel: withdraw pending messages and schedules, and stop an occurrence already in flight.

A cancel is one CANCEL script per CANCEL_BATCH ids: the index entry, the
envelope, its ids-hash ref and refill/parked marks go, and the `cancelled`
history record is written, in one atomic step. On a single node that is all:
FIRE has no window in which a withdrawn envelope can still go out.

The two-phase fire (Redis Cluster) has one: an occurrence CLAIM moved in
flight but APPEND has not yet written. CANCEL (given the in-flight keys:
EngineConfig.two_phase) names such occurrences, and `stop_in_flight` sets
each one's fire marker, the key APPEND sets with NX in the target's slot, so
the APPEND writes nothing and RELEASE records nothing more. Found set
already, APPEND got there first: the one-shot went out, the cancel answers
False and UNCANCEL turns its `cancelled` record into the `fired` one. A
replace (SCHEDULE of a pending scheduleId) stops the old envelope's
occurrence the same way, best effort. A schedule's extra occurrence that a
trigger decided but has not appended (engine/timecontrol.py; registered in
keys.EngineKeys.triggers) is named and stopped the same way, its due being
the end of its own marker, `t<trigger ms>:<token>`; CANCEL removes its
registration.

Crash point left open: the canceller dying between its CANCEL and its SET
while the claiming replica lives; that one occurrence may go out, and the
cancel never answered OK.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from redis.exceptions import RedisError

from delayed_middleware.engine.config import CANCEL_BATCH
from delayed_middleware.engine.core import ShardState
from delayed_middleware.engine.replies import InFlight
from delayed_middleware.keys import fire_marker_prefix
from delayed_middleware.kinds import Kind

log = logging.getLogger(__name__)


class Canceller:
    """cancel / cancel_many, and the fire markers that stop an in-flight occurrence."""

    def __init__(self, state: ShardState) -> None:
        self._state = state

    async def cancel(self, id: str, *, reason: str = "Remove") -> bool:
        """Withdraw a pending message or schedule by scheduleId or envelope id; True if one was there."""
        [(found, _)] = await self.cancel_many([id], reason=reason)
        return found

    async def cancel_many(self, ids: Sequence[str], *, reason: str = "Remove") -> list[tuple[bool, str]]:
        """Withdraw many by scheduleId or envelope id, CANCEL_BATCH per script call.

        Returns (cancelled?, the message's topic or '') per id, in order; with
        deleteMarkerTTL set, a `Remove` marker goes on each cancelled topic.

        Two-phase fire (Redis Cluster): an occurrence claimed but not yet
        appended when the cancel lands is stopped too: CANCEL names it, and
        this sets its fire marker (see stop_in_flight) before returning. One
        that was appended first went out before the cancel: a one-shot is then
        reported not cancelled (False).
        """
        st = self._state
        out: list[tuple[bool, str]] = []
        in_flight: list[InFlight] = []
        for start in range(0, len(ids), CANCEL_BATCH):
            part = list(ids[start : start + CANCEL_BATCH])
            got = await st.scripts.cancel(
                part, now=st.clock.now_ms(), history_len=st.history_len, reason=reason
            )
            out += got.results
            # Cancelled envelopes left the stream: the next fire step's compaction check counts them.
            st.left_since_check += sum(1 for found, _ in got.results if found)
            in_flight += [
                InFlight(f.id, f.due, f.target, start + f.position, f.kind, f.history_id)
                for f in got.in_flight
            ]
        if in_flight:
            await self.stop_in_flight(in_flight, out)
        await st.markers("Remove", [(i, t) for i, (found, t) in zip(ids, out, strict=True) if found and t])
        return out

    async def stop_in_flight(self, in_flight: Sequence[InFlight], out: list[tuple[bool, str]]) -> None:
        """Set the fire marker of each cancelled occurrence still in flight, so no APPEND writes it.

        The marker is the one APPEND sets with NX in the target's slot (keys.
        fire_marker_prefix): set here first, APPEND finds it and appends
        nothing, and RELEASE, finding the envelope withdrawn, records nothing
        more (its `cancelled` record stands). Found already set, APPEND got
        there first: the occurrence was delivered before this cancel returned;
        a one-shot's result becomes False, and its `cancelled` history record
        becomes the `fired` one RELEASE can no longer write (UNCANCEL; a
        recurring schedule stays cancelled: its later occurrences are).
        """
        # Every marker is tried, even after one fails (its target's master may be
        # down): the first error is raised at the end, so the cancel is not
        # answered OK while some occurrence may still go out.
        failure: BaseException | None = None
        for f in in_flight:
            try:
                if await self._set_fire_marker(f.id, f.due, f.target, "cancelled"):
                    continue
            except (RedisError, TimeoutError) as exc:
                failure = failure or exc
                continue
            log.warning(
                "cancel of %s on %s came after its occurrence due %s was appended to %s: delivered once",
                f.id,
                self._state.keys.stream,
                f.due,
                f.target,
            )
            if f.kind != Kind.RECURRING:
                out[f.position] = (False, out[f.position][1])
                if f.history_id:
                    try:
                        await self._state.scripts.uncancel(
                            f.history_id, now=self._state.clock.now_ms(), history_len=self._state.history_len
                        )
                    except (RedisError, TimeoutError) as exc:
                        failure = failure or exc
        if failure is not None:
            raise failure

    async def stop_replaced_in_flight(self, old: InFlight) -> None:
        """Two-phase fire: a replaced envelope's occurrence was in flight; stop its APPEND.

        As stop_in_flight for a cancel, but best effort: the replace is
        stored whatever happens here (failing the publish would make its
        caller retry a stored replace), so a failure is logged, and that one
        occurrence of the old message may still go out, as before this step.
        """
        try:
            if await self._set_fire_marker(old.id, old.due, old.target, "replaced"):
                return
        except RedisError as exc:
            log.warning(
                "replace on %s: the in-flight occurrence of %s may still go out: %s",
                self._state.keys.stream,
                old.id,
                exc,
            )
            return
        log.info(
            "replace on %s came after the old envelope %s's occurrence due %s was appended to %s",
            self._state.keys.stream,
            old.id,
            old.due,
            old.target,
        )

    async def _set_fire_marker(self, id: str, due: str, target: str, why: str) -> bool:
        """SET NX the fire marker APPEND would set for envelope `id`'s occurrence `due` on
        `target` (keys.fire_marker_prefix); False when it was set already (appended)."""
        st = self._state
        marker = f"{fire_marker_prefix(target, st.keys.stream)}{id}:{due}"
        return bool(await st.redis.set(marker, why, nx=True, px=st.config.fire_marker_ttl_ms))
