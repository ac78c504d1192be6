"""History retention: the lifecycle history stream is trimmed by length and by age.

The length bound (history_max_len, approximate) rides on every record's XADD
inside the scripts. The age bound (history_max_age_ms) is applied here, at
most once a minute per shard, by the fire loop. Record ids come from Redis's
clock, so the age is measured on the shard's time, not this replica's: a
replica whose clock runs ahead must not age records out early.

The history's by-id index (delayed_middleware.history) follows the trimming:
each pass sweeps a page of it while a sweep is under way (IndexSweep), so the
scheduleIds whose records were all trimmed leave it within about a minute.
"""

from __future__ import annotations

from delayed_middleware.engine.core import ShardState
from delayed_middleware.history import IndexSweep


class HistoryTrimmer:
    """trim: the age bound of the lifecycle history, and its by-id index's sweep."""

    def __init__(self, state: ShardState) -> None:
        self._state = state
        self._last_trim = 0
        self._index_sweep = IndexSweep(state.keys.history, state.keys.history_index)

    async def trim(self) -> None:
        """Age-based history retention (the length bound rides on every XADD).

        Also with the history off (historyMaxLen 0): records written before it
        was turned off still age out.
        """
        st = self._state
        max_age = st.config.history_max_age_ms
        # Record ids come from Redis's clock: the shard's time, not this replica's.
        now = st.shard_now()
        await self._index_sweep.step(st.redis, now)
        if not max_age or now - self._last_trim < 60_000:
            return
        self._last_trim = now
        await st.redis.xtrim(st.keys.history, minid=f"{now - max_age}-0", approximate=True)
