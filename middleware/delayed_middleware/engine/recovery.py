"""Orphan recovery: put back in the due index the pending envelopes no index entry refers to.

How they come about: release 0.1.0 does not know the moved hash. Run on data
whose envelopes compaction re-homed (storage format 2, outside the rollback
window), it finds no envelope at a due entry's id, reports it lost and drops
the index entry; the re-homed copy stays on the delayed topic, listed by
`pending` and never fired. lua/recover.lua defines an orphan precisely (a
live envelope: not parked, not claimed, its ids ref naming it and in the
index state; yet in the index neither at its ref's due nor at its own) and
re-indexes each at its own due time, with a `recovered` history record.

Invariants: each call re-checks every candidate in one atomic step, so nothing
fired, cancelled, replaced, paused or in flight is touched, and a second
sweep (another replica's, a restart's) finds nothing left to do: each orphan
is indexed once. A sweep walks the stream as it was when it began (entries
added later are indexed by their own SCHEDULE), recover_chunk entries per
call within recover_budget_us of Redis time, so it ends and never holds
Redis for long, and paced (recover_duty) so that it never takes Redis for
itself. It runs beside the fire loop, once per run: Init does not wait for it. Crash points: between calls; the next start sweeps again.
"""

from __future__ import annotations

import asyncio
import logging
import time

from redis.exceptions import RedisError

from delayed_middleware.aio import text
from delayed_middleware.engine.core import ShardState

log = logging.getLogger(__name__)


class Recoverer:
    """recover_orphans: one sweep over this shard's delayed stream."""

    def __init__(self, state: ShardState) -> None:
        self._state = state

    async def recover_orphans(self) -> tuple[int, int]:
        """Sweep the stream once: (envelopes put back in the index, copies of cancelled or
        replaced messages deleted). Logs what it found."""
        st = self._state
        cfg = st.config
        last = await st.redis.xrevrange(st.keys.stream, "+", "-", count=1)
        if not last:
            return 0, 0
        end = text(last[0][0])
        cursor, recovered, dropped = "-", 0, 0
        while cursor:
            _, now = st.decide_at()
            started = time.monotonic()
            async with asyncio.timeout(cfg.op_timeout_s):
                got = await st.scripts.recover(
                    cursor,
                    end,
                    chunk=cfg.recover_chunk,
                    budget_us=cfg.recover_budget_us,
                    now=now,
                    history_len=st.history_len,
                )
            cursor = got.cursor
            recovered += got.recovered
            dropped += got.dropped
            if got.recovered:
                # Some may be due already: the run loop looks again now.
                st.wake.set()
            if cursor and cfg.recover_duty < 1:
                # Paced: a sweep of a long stream at every replica's start takes at most this
                # share of the time (~13 us of Redis time per entry walked), fires the rest.
                took = time.monotonic() - started
                await asyncio.sleep(took * (1 - cfg.recover_duty) / cfg.recover_duty)
        if recovered:
            log.warning(
                "%d pending message(s) on %s were in the delayed topic but not in its due index (left so "
                "by a release that did not know the moved hash, e.g. a rollback to 0.1.0 after the "
                "storage format was raised): put back at their due time (overdue ones fire now), each "
                "with a 'recovered' history record",
                recovered,
                st.keys.stream,
            )
        if dropped:
            log.warning(
                "%d envelope copy(ies) on %s belonged to messages cancelled or replaced by a release "
                "that did not know the moved hash: deleted, not delivered",
                dropped,
                st.keys.stream,
            )
        return recovered, dropped

    async def recover_at_start(self, stop: asyncio.Event) -> None:
        """One sweep at the start of the run loop, retried after Redis errors until it ends or `stop`."""
        st = self._state
        backoff = st.config.retry_profile().backoff()
        while not stop.is_set():
            try:
                await self.recover_orphans()
                return
            except (RedisError, TimeoutError) as exc:
                delay = backoff.next()
                log.warning(
                    "orphan recovery on %s: redis error %s; retrying in %.2fs", st.keys.stream, exc, delay
                )
            except Exception:
                delay = backoff.next()
                log.exception("orphan recovery on %s failed; retrying in %.2fs", st.keys.stream, delay)
            try:
                async with asyncio.timeout(delay):
                    await stop.wait()
            except TimeoutError:
                pass
