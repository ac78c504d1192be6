"""Pause, resume and cancel by prefix: the engine's side (the logic is in delayed_middleware.pausing).

A paused entry leaves the due index (and the refill set) in one PAUSE call
(lua/pause.lua), so neither FIRE nor CLAIM can take it; its ids-hash entry
records when it was paused. Resuming puts it back at its own due time (a
one-shot) or at its first grid point after the resume (a schedule), after
checking that its ids-hash entry did not change since it was read. On Redis
Cluster a pause that lands while an occurrence is claimed answers "busy" and
pausing.py waits for RELEASE or a takeover: each occurrence is fired or held,
never both.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

from delayed_middleware import pausing
from delayed_middleware.client import RedisClient
from delayed_middleware.engine.core import EngineCore
from delayed_middleware.envelope import Envelope

if TYPE_CHECKING:
    from delayed_middleware.engine.delay_engine import DelayEngine


class Pausing(EngineCore):
    """set_paused and cancel_prefix, and what pausing.py reads of the engine."""

    async def set_paused(self, id: str, *, pause: bool, reason: str = "") -> pausing.PauseResult:
        """Pause (True) or resume (False) one pending message or schedule by id (see pausing)."""
        return await pausing.set_paused(cast("DelayEngine", self), id, pause=pause, reason=reason)

    async def cancel_prefix(self, prefix: str, *, reason: str = "Remove") -> int:
        """Cancel every pending message and schedule whose id starts with `prefix`; how many."""
        return await pausing.cancel_prefix(cast("DelayEngine", self), prefix, reason=reason)

    async def run_pause_script(self, op: str, id: str, reason: str, extra: Sequence[str]) -> list[Any]:
        """One PAUSE call (lua/pause.lua) with this engine's keys; its raw reply."""
        return await self._scripts.pause(
            op, id, reason, extra, now=self._clock.now_ms(), history_len=self._history_len()
        )

    @property
    def redis(self) -> RedisClient:
        """The client this engine writes with."""
        return self._redis

    def shard_now(self) -> int:
        """This shard's time as of the last fire step's measurement."""
        return self._shard_now()

    def next_fire(self, env: Envelope, after_ms: int) -> int | None:
        """A recurring envelope's first fire strictly after `after_ms` (None: none left)."""
        if self._recurrence is None:
            raise ValueError("a recurring envelope needs the engine's recurrence function")
        return self._recurrence(env, after_ms)

    def next_after(self, env: Envelope, after_ms: int) -> tuple[str, str]:
        """As next_fire, as the ref's (ms, RFC 3339) strings, ('purge', '-') when none."""
        return self._next_after(env, after_ms)
