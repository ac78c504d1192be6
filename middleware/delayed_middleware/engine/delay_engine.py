"""DelayEngine: one shard's engine, the facade over the parts engine.builder puts together.

The class adds nothing of its own: each concern lives in its part (schedule,
cancel, fire, two_phase, refill, compaction, retention, recovery, loop,
pause), built over the shard's state (engine.core.ShardState) by
engine.builder. The facade keeps callers (the component, the operator CLI,
tests and benches) unchanged.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from delayed_middleware.aio import text
from delayed_middleware.client import RedisClient
from delayed_middleware.clock import Clock
from delayed_middleware.engine.builder import EngineOptions, build_engine
from delayed_middleware.engine.config import EngineConfig
from delayed_middleware.engine.pause import PauseResult
from delayed_middleware.engine.timecontrol import TimeResult
from delayed_middleware.keys import EngineKeys
from delayed_middleware.liveness import Supervised

if TYPE_CHECKING:
    from typing_extensions import Unpack


class DelayEngine:
    """Schedules envelopes on one delayed topic and fires them when due.

    DelayEngine(client, keys, clock, *, trim=None, config=EngineConfig(),
    on_batch=None, recurrence=None, listen_client=None, pubsub_name="",
    fault=None, on_listener_state=None, fire_path=None):

    - client: a RedisClient (a node's or a Cluster's redis.asyncio client);
    - keys: the shard's EngineKeys; clock: the injected Clock;
    - trim: the target topics' trim (maxLenApprox / streamTTL), none by default;
    - config: EngineConfig (batch bounds, sleeps, history, two_phase...);
    - on_batch: hears a FireReport per fire call that fired or parked;
    - recurrence: the next fire time of a cron envelope (needed to schedule one);
    - listen_client: the client the wake listener parks a connection on (default: client);
    - pubsub_name: the component whose trim applies ('' = to every message);
    - fault: test hook awaited at each two-phase step; on_listener_state: the listener's state hook;
    - fire_path: makes the fire path from the shard's state (fire.SingleNodeFire,
      two_phase.TwoPhaseFire); None: the one config.two_phase names.
    """

    def __init__(
        self, client: RedisClient, keys: EngineKeys, clock: Clock, **options: Unpack[EngineOptions]
    ) -> None:
        self.parts = build_engine(client, keys, clock, **options)
        self.state = self.parts.state
        # Store envelopes durably; returns their ids (schedule.Scheduler.schedule). The
        # scheduler's own method, not a wrapper: every delayed publish goes through it.
        self.schedule = self.parts.scheduler.schedule

    @property
    def keys(self) -> EngineKeys:
        """This shard's keys."""
        return self.state.keys

    @property
    def config(self) -> EngineConfig:
        """The engine's settings."""
        return self.state.config

    @property
    def redis(self) -> RedisClient:
        """The client this engine writes with."""
        return self.state.redis

    @property
    def listener(self) -> Supervised | None:
        """The wake listener of the running loop (supervised), once run has started it."""
        return self.parts.loop.listener

    @property
    def compacting(self) -> bool:
        """True while a compaction pass is under way (fire steps go on with it)."""
        return self.parts.compactor.compacting

    async def cancel(self, id: str, *, reason: str = "Remove") -> bool:
        """Withdraw a pending message or schedule by scheduleId or envelope id; True if one was there."""
        return await self.parts.canceller.cancel(id, reason=reason)

    async def cancel_many(self, ids: Sequence[str], *, reason: str = "Remove") -> list[tuple[bool, str]]:
        """Withdraw many by id; (cancelled?, topic or '') per id (see cancel.Canceller.cancel_many)."""
        return await self.parts.canceller.cancel_many(ids, reason=reason)

    async def set_paused(self, id: str, *, pause: bool, reason: str = "") -> PauseResult:
        """Pause (True) or resume (False) one pending message or schedule by id (see engine.pause)."""
        return await self.parts.pauser.set_paused(id, pause=pause, reason=reason)

    async def trigger(self, id: str, *, reason: str = "", request: str = "") -> TimeResult:
        """Deliver one pending message, or one extra occurrence of a schedule, now (see engine.timecontrol);
        `request`: the request's identity, a retry of which delivers nothing more."""
        return await self.parts.timecontrol.trigger(id, reason=reason, request=request)

    async def reschedule(self, id: str, due_ms: int, *, reason: str = "") -> TimeResult:
        """Move one pending one-shot to `due_ms` (see engine.timecontrol)."""
        return await self.parts.timecontrol.reschedule(id, due_ms, reason=reason)

    async def cancel_prefix(self, prefix: str, *, reason: str = "Remove") -> int:
        """Cancel every pending message and schedule whose id starts with `prefix`; how many."""
        return await self.parts.pauser.cancel_prefix(prefix, reason=reason)

    async def fire_due(self) -> tuple[int, int | None]:
        """Fire one bounded batch of what is due now: (fired, earliest due time left or None)."""
        return await self.parts.firer.fire_due()

    async def refill_pending(self, limit: int = 10_000) -> int:
        """Give recurring envelopes waiting for it their next due time; returns how many."""
        return await self.parts.refiller.refill_pending(limit)

    async def compact(self) -> bool:
        """A whole compaction pass if the stream is sparse (see compaction.Compactor.compact)."""
        return await self.parts.compactor.compact()

    async def recover_orphans(self) -> tuple[int, int]:
        """One orphan sweep: (put back in the index, copies deleted) (see recovery.Recoverer)."""
        return await self.parts.recoverer.recover_orphans()

    async def run(self, stop: asyncio.Event | None = None, beat: Callable[[], None] | None = None) -> None:
        """Fire due messages until `stop` is set; survives Redis outages (see loop.FireLoop.run)."""
        await self.parts.loop.run(stop, beat)

    def wake(self) -> None:
        """Re-check the index now (used by this process after it schedules)."""
        self.parts.loop.wake()

    async def has_key(self, key: str) -> bool:
        """True if `key` is a pending scheduleId (or recurring envelope id) here."""
        return bool(await self.state.redis.hexists(self.keys.ids, key))

    async def holds(self, stream_id: str) -> bool:
        """True if this delayed topic holds the envelope whose id is `stream_id` (wherever compaction put it)."""
        at = await self.state.redis.hget(self.keys.moved, stream_id)
        stored = stream_id if at is None else text(at)
        return bool(await self.state.redis.xrange(self.keys.stream, stored, stored))

    async def pending(self) -> int:
        """How many messages wait in the index of this delayed topic."""
        return int(await self.state.redis.get(self.keys.count) or 0)
