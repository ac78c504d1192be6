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

from delayed_middleware.engine.core import EngineCore


class HistoryTrimming(EngineCore):
    """_trim_history: the age bound of the lifecycle history."""

    async def _trim_history(self) -> None:
        """Age-based history retention (the length bound rides on every XADD).

        Also with the history off (historyMaxLen 0): records written before it
        was turned off still age out.
        """
        max_age = self._config.history_max_age_ms
        # Record ids come from Redis's clock: the shard's time, not this replica's.
        now = self._shard_now()
        await self._index_sweep.step(self._redis, now)
        if not max_age or now - self._last_history_trim < 60_000:
            return
        self._last_history_trim = now
        await self._redis.xtrim(self._keys.history, minid=f"{now - max_age}-0", approximate=True)
