"""Refill: give recurring envelopes their next due time, computed here (cron has no place in Lua).

An @every envelope carries its interval and FIRE computes each successor on
the grid `publishedAt + k * interval` itself. A cron envelope's ids-hash ref
holds its current due time and the NEXT one, precomputed: FIRE delivers the
occurrence, re-indexes the envelope at the next time, marks it for refill and
returns what the recurrence needs (expression, acceptance time); `advance`
computes the time after that with the injected `recurrence` and stores it
with REFILL (a compare-and-set on the ref) in the same fire_due, reading
nothing back.

Crash point: between FIRE and REFILL. Nothing is lost: the refill mark is in
Redis and any replica's `refill_pending` completes it before that envelope
can fire again (FIRE never fires an occurrence whose successor is unknown).
An occurrence whose successor has passed too (the component or Redis was
down across several fire times) is refilled from the current time: it fires
once on recovery and continues on its schedule. A schedule that cannot be
advanced (undecodable, no later time) is withdrawn by REFILL's 'end', a
compare-and-set too, so a replace that landed meanwhile stands.

Catch-up (scheduleCatchup, catchup.py): an occurrence whose successor has
passed too was missed; REFILL applies the envelope's policy to it (`one` fires
it, `all` fires every missed one in turn, paced, `none` skips to the next after
now) and records what it skipped. Each occurrence's nominal time (before jitter
and pacing) rides beside its due time in the ids ref, so FIRE stamps
`scheduleOccurrence` without computing anything.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace

from delayed_middleware.aio import text
from delayed_middleware.catchup import Plan, Skip, plan_advance, plan_wait
from delayed_middleware.engine.config import REFILL_BATCH
from delayed_middleware.engine.core import ShardState
from delayed_middleware.engine.pause import is_paused_ref
from delayed_middleware.engine.replies import Refill, RefillItem
from delayed_middleware.envelope import Envelope, EnvelopeDecodeError, decode_envelope
from delayed_middleware.instants import format_instant
from delayed_middleware.kinds import Kind
from delayed_middleware.lua_scripts import PURGE
from delayed_middleware.schedules import EnvelopeRecurrence, Occurrences

log = logging.getLogger(__name__)


class Refiller:
    """refill_pending (the sweep) and advance (a fire step's own cron envelopes)."""

    def __init__(self, state: ShardState) -> None:
        self._state = state

    async def advance(self, quads: Sequence[Refill]) -> None:
        """REFILL the cron envelopes a fire step just advanced (common.lua's REFILLS).

        Each quad is (ids key, the ref the script wrote, schedule expression,
        acceptance ms): enough for the recurrence function, so nothing is read
        back. REFILL's compare-and-set makes a race with a replace, a cancel or
        another replica a no-op. One that cannot be computed stays in the refill
        set, where refill_pending (which cancels unschedulable ones) finds it.
        """
        st = self._state
        if not quads or st.recurrence is None:
            return
        now = st.shard_now()
        items: list[RefillItem] = []
        for q in quads:
            # All inside the guard: a hand-written envelope's fields (not UTF-8, say)
            # must not stop the rest of the batch's refills.
            try:
                key, ref, expr, published = text(q.key), text(q.ref), text(q.expression), text(q.published)
                stream_id, due_text = ref.split()[:2]
                due = int(due_text)
                sid = "" if key == stream_id else key
                probe = Envelope(
                    id=sid,
                    topic="",
                    due_ms=due,
                    published_at_ms=int(published),
                    schedule_id=sid,
                    kind=int(Kind.RECURRING),
                    schedule=expr,
                    catchup=int(text(q.catchup) or 0),
                    catchup_window_ms=int(text(q.catchup_window) or 0),
                )
                items.append(self._advanced(key, ref, probe, due, now))
            except Exception as exc:
                log.warning("recurring %r on %s: successor not computed now: %r", q.key, st.keys.stream, exc)
                continue
        if items:
            await st.scripts.refill(items, history=(st.history_len, now))

    def _occurrences(self, env: Envelope, now: int) -> Occurrences | None:
        """The envelope's occurrences by nominal time, when the recurrence can walk them (the engine's
        own, EnvelopeRecurrence); None: one injected by a test, which knows due times only."""
        recurrence = self._state.recurrence
        if isinstance(recurrence, EnvelopeRecurrence):
            return recurrence.occurrences(env, now)
        return None

    def _advanced(self, key: str, ref: str, env: Envelope, due: int, now: int) -> RefillItem:
        """The REFILL of an envelope a fire step advanced to its occurrence due at `due` (flag i)."""
        occ = self._occurrences(env, now)
        if occ is None:
            nxt, iso = self._state.next_after(env, max(due, now))
            return RefillItem(key, ref, nxt, iso)
        plan = plan_advance(occ, env.catchup, env.catchup_window_ms, (ref_nominal(ref, due), due), now)
        return _item(key, ref, plan)

    def _waited(self, key: str, ref: str, env: Envelope, due: int, now: int) -> RefillItem:
        """The REFILL of an envelope whose occurrence due at `due` waits (flag u): catch-up applies."""
        occ = self._occurrences(env, now)
        if occ is None:
            nxt, iso = self._state.next_after(env, max(due, now))
            return RefillItem(key, ref, nxt, iso)
        nominal = ref_nominal(ref, due, occ)
        plan = plan_wait(occ, env.catchup, env.catchup_window_ms, (nominal, due), now)
        if plan is None:
            return RefillItem(key, ref, "end", "catch-up: no occurrence left within the schedule's bounds")
        item = _item(key, ref, plan)
        if plan.current is None and nominal != due:
            # The nominal time nominal_of found (a ref written without one): kept beside the due time.
            item = replace(item, current_nominal=str(nominal))
        return item

    async def refill_pending(self, limit: int = 10_000) -> int:
        """Give recurring envelopes waiting for it their next due time; returns how many.

        Soonest needed first (the refill set is scored by when each envelope
        needs its successor known). In batches of REFILL_BATCH: one read of the refill set, one pipelined
        read of the refs and envelopes, one REFILL script call. (One envelope at
        a time, 10,000 schedules firing each second could not keep up.)
        """
        st = self._state
        if st.recurrence is None:
            # This replica cannot compute one (e.g. an older version in a rolling
            # upgrade): leave them, untouched, to a replica that can.
            return 0
        done = 0
        while done < limit:
            members = [text(m) for m in await st.redis.zrange(st.keys.refill, 0, REFILL_BATCH - 1)]
            if not members:
                break
            applied = await self._refill_batch(members)
            done += applied
            if not applied:
                break
        return done

    async def _refill_batch(self, keys: Sequence[str]) -> int:
        st = self._state
        pipe = st.redis.pipeline(transaction=False)
        for key in keys:
            pipe.hget(st.keys.ids, key)
        refs = [None if r is None else text(r) for r in await pipe.execute()]
        gone = [k for k, r in zip(keys, refs, strict=True) if r is None]
        if gone:
            await st.redis.zrem(st.keys.refill, *gone)
        # A paused envelope waits for its resume, not for a refill (engine/pause.py).
        live = [(k, r) for k, r in zip(keys, refs, strict=True) if r is not None and not is_paused_ref(r)]
        if not live:
            return len(gone)
        # Where each envelope is stored now (compaction may have re-homed it).
        moved = await st.redis.hmget(st.keys.moved, [ref.split()[0] for _, ref in live])
        pipe = st.redis.pipeline(transaction=False)
        for (_, ref), at in zip(live, moved, strict=True):
            stream_id = ref.split()[0] if at is None else text(at)
            pipe.xrange(st.keys.stream, stream_id, stream_id)
        rows_of = await pipe.execute()
        now = st.shard_now()
        items: list[RefillItem] = []
        ending: dict[str, str] = {}  # key -> its topic ('' unknown), for markers
        for (key, ref), rows in zip(live, rows_of, strict=True):
            topic = ""
            try:
                due = int(ref.split()[1])
                if not rows:
                    raise EnvelopeDecodeError(f"envelope {ref.split()[0]} is gone")
                raw = dict(rows[0][1] or {}).get(b"data")
                if not isinstance(raw, bytes):
                    raise EnvelopeDecodeError(f"envelope {ref.split()[0]} has no data")
                env = decode_envelope(raw)
                topic = env.topic
                waiting = len(ref.split()) >= 5 and ref.split()[4] == "u"
                item = (self._waited if waiting else self._advanced)(key, ref, env, due, now)
                if item.next_due == "end":
                    ending[key] = topic
            except Exception as exc:
                # EnvelopeDecodeError, ValueError (no later time), or whatever else the
                # recurrence raises: one schedule the engine cannot advance must not
                # stop firing for the whole app. It is withdrawn, with its history
                # record, by REFILL's compare-and-set on the ref read above (not by
                # cancel(key): a replace that landed since then must stand).
                log.error(
                    "recurring %r on %s cannot be refilled: %r; cancelling it", key, st.keys.stream, exc
                )
                item = RefillItem(key, ref, "end", f"unschedulable: {exc}")
                ending[key] = topic
            items.append(item)
        if not items:
            return len(gone)
        results = await st.scripts.refill(items, history=(st.history_len, now))
        ended = [
            (i.key, ending[i.key])
            for i, r in zip(items, results, strict=True)
            if r == 2 and ending.get(i.key)
        ]
        if ended:
            await st.markers("Remove", ended)
        return len(gone) + sum(1 for r in results if r != 0)


def ref_nominal(ref: str, due: int, occ: Occurrences | None = None) -> int:
    """The nominal time of the occurrence an ids ref names at `due`: the ref's own (its sixth part),
    else computed from the schedule (`occ`: a ref written without one), else the due time itself."""
    parts = ref.split()
    if len(parts) >= 6 and parts[5].isdigit():
        return int(parts[5])
    return occ.nominal_of(due) if occ is not None else due


def _item(key: str, ref: str, plan: Plan) -> RefillItem:
    """The REFILL item of a catch-up plan."""
    nxt, iso, nnom = PURGE, "-", "-"
    if plan.following is not None:
        nominal, due = plan.following
        nxt, iso, nnom = str(due), format_instant(due), str(nominal)
    cur, cur_nom = "-", "-"
    if plan.current is not None:
        cur_nom, cur = str(plan.current[0]), str(plan.current[1])
    skip: Skip | None = plan.skip
    if skip is None or skip.count <= 0:
        return RefillItem(key, ref, nxt, iso, cur, cur_nom, nnom)
    return RefillItem(key, ref, nxt, iso, cur, cur_nom, nnom, str(skip.first_ms), skip.describe())
