"""Sharded: one app's delayed topic over several shard streams, one DelayEngine each.

Where a shard id is made: `keys.shard_index` (a scheduleId's home shard, a
CRC16 of the id) and `ShardedEngine.schedule` (envelopes without one go to one
shard per call, in turn, and their ids come back as `<stream id>@<shard>`);
`ShardedEngine._locate` reads an id back to its shard for cancel.

Invariants: a scheduleId always lives on its home shard, so a replace or a
cancel finds it; a call's envelopes without a scheduleId land on one shard,
so a bulk publish stays one atomic SCHEDULE per shard, and a retry with the
same token lands on the same shards (stores nothing twice). Every replica
fires every shard: shards need no owner and replicas no coordination. One
shard's loop failing never stops the others (each is supervised on its own).
"""

from __future__ import annotations

import asyncio
import collections
import functools
import secrets
from collections.abc import Callable, Sequence

from redis.exceptions import RedisError

from delayed_middleware.backoff import SHARD_LOOP
from delayed_middleware.engine.config import SPREAD_MEMORY
from delayed_middleware.engine.delay_engine import DelayEngine
from delayed_middleware.engine.pause import PauseResult
from delayed_middleware.engine.timecontrol import TimeResult
from delayed_middleware.envelope import Envelope
from delayed_middleware.errors import InvalidArgumentError, PartiallyStoredError
from delayed_middleware.keys import EngineKeys, is_stream_id, shard_id, shard_index, split_shard_id
from delayed_middleware.liveness import Supervised, run_until_cancelled
from delayed_middleware.redis_errors import describe


class ShardedEngine:
    """One app's delayed topic over several shard streams (keys.shard_topics), one DelayEngine each.

    On Redis Cluster each shard's keys share one hash slot and the shards
    spread over the masters; on a single node one shard is the plain engine.
    A publish with a scheduleId goes to the shard its id hashes to, so a
    replace or a cancel finds it; the rest go to one shard per call, in turn,
    so a bulk publish without ids is still one atomic SCHEDULE. Every replica
    fires every shard: the shards need no owner and replicas no coordination.
    """

    def __init__(self, engines: Sequence[DelayEngine]) -> None:
        if not engines:
            raise ValueError("a sharded engine needs at least one shard")
        self.engines = list(engines)
        self._turn = secrets.randbelow(len(self.engines))
        # The shard each recent call token's envelopes without a scheduleId
        # went to, so the caller's retry with that token lands there again
        # (its chunks are then recognised as stored); oldest forgotten first.
        self._spread: collections.OrderedDict[str, int] = collections.OrderedDict()
        # The supervised fire loop of each shard, once started.
        self.loops: list[Supervised] = []

    @property
    def keys(self) -> EngineKeys:
        """Shard 0's keys (`<consumerID>-delayed`, the single-node layout)."""
        return self.engines[0].keys

    def shard_of(self, schedule_id: str) -> DelayEngine:
        """The shard a scheduleId lives on."""
        return self.engines[shard_index(schedule_id, len(self.engines))]

    async def schedule(
        self, envelopes: Sequence[Envelope], *, token: str | None = None, timeout_s: float | None = None
    ) -> list[str]:
        """As DelayEngine.schedule; ids in the order given.

        Envelope stream ids are unique per shard stream only (each master
        makes its own), so with several shards an id that is not a scheduleId
        comes back as `<stream id>@<shard>`, which cancel understands.

        Retries: each shard's part carries the token `<token>:<shard>` (and
        DelayEngine adds `/<offset>` per chunk), and envelopes without a
        scheduleId go to the shard this engine picked for that token (one per
        call, in turn), so the same call repeated after a lost reply lands on
        the same shards and stores nothing twice.

        Partial failure: PartiallyStoredError(n) means the first n envelopes are
        stored. The shard without scheduleIds is stored last, so whatever is
        stored beyond n carries a scheduleId (a retry replaces it, never
        doubles it).
        """
        n = len(self.engines)
        if n == 1:
            return await self.engines[0].schedule(envelopes, token=token, timeout_s=timeout_s)
        spread = self._spread.get(token) if token else None
        if spread is None:
            self._turn = (self._turn + 1) % n
            spread = self._turn
            if token:
                self._spread[token] = spread
                if len(self._spread) > SPREAD_MEMORY:
                    self._spread.popitem(last=False)
        groups: dict[int, list[int]] = {}
        for i, e in enumerate(envelopes):
            shard = shard_index(e.schedule_id, n) if e.schedule_id else spread
            groups.setdefault(shard, []).append(i)
        order = sorted(groups, key=lambda sh: (sh == spread, sh))
        ids: list[str] = [""] * len(envelopes)
        stored: set[int] = set()
        for shard in order:
            positions = groups[shard]
            try:
                got = await self.engines[shard].schedule(
                    [envelopes[i] for i in positions],
                    token=f"{token}:{shard}" if token else None,
                    timeout_s=timeout_s,
                )
            except (PartiallyStoredError, RedisError, TimeoutError) as exc:
                done = exc.stored if isinstance(exc, PartiallyStoredError) else 0
                stored.update(positions[:done])
                prefix = next((i for i in range(len(envelopes)) if i not in stored), len(envelopes))
                if not stored:
                    raise
                cause = exc.__cause__ if isinstance(exc, PartiallyStoredError) else exc
                raise PartiallyStoredError(
                    prefix,
                    f"scheduling on {self.keys.stream!r} (shard {shard}): {len(stored)} of "
                    f"{len(envelopes)} stored, then {describe(cause)}",
                ) from cause
            stored.update(positions)
            for i, id in zip(positions, got, strict=False):
                ids[i] = id if envelopes[i].schedule_id else shard_id(id, shard)
        return ids

    async def _locate(self, id: str) -> tuple[int, str]:
        """(shard, id on that shard) for a scheduleId or an envelope id (see cancel)."""
        named = split_shard_id(id, len(self.engines))
        if named is not None:
            return named
        home = shard_index(id, len(self.engines))
        if len(self.engines) == 1 or not is_stream_id(id) or await self.engines[home].has_key(id):
            return home, id
        # Stream ids are per shard stream, so two shards may both hold one (two
        # publishes in the same millisecond). A recurring schedule without a
        # scheduleId is keyed by its stream id in its shard's ids hash, and its
        # messages carry that bare id as `scheduler`: the shard that has the
        # key is the one meant.
        keyed = [i for i, e in enumerate(self.engines) if i != home and await e.has_key(id)]
        if len(keyed) == 1:
            return keyed[0], id
        holders = [i for i, e in enumerate(self.engines) if await e.holds(id)]
        if len(holders) > 1:
            raise InvalidArgumentError(
                "id", id, f"on {len(holders)} shards; name one as {id}@<shard> (see keys.shard_topics)"
            )
        return (holders[0] if holders else home), id

    async def cancel(self, id: str, *, reason: str = "Remove") -> bool:
        """As DelayEngine.cancel: a scheduleId on its shard; an envelope id
        (`<stream id>@<shard>`, or a bare stream id held by one shard only) on its shard.

        InvalidArgumentError when a bare stream id names envelopes on several shards.
        """
        [(found, _)] = await self.cancel_many([id], reason=reason)
        return found

    async def cancel_many(self, ids: Sequence[str], *, reason: str = "Remove") -> list[tuple[bool, str]]:
        """As DelayEngine.cancel_many (markers included), each id on its shard (see cancel)."""
        if len(self.engines) == 1:
            return await self.engines[0].cancel_many(ids, reason=reason)
        groups: dict[int, list[tuple[int, str]]] = {}
        for pos, id in enumerate(ids):
            shard, local = await self._locate(id)
            groups.setdefault(shard, []).append((pos, local))
        out: list[tuple[bool, str]] = [(False, "")] * len(ids)
        for shard, items in groups.items():
            got = await self.engines[shard].cancel_many([local for _, local in items], reason=reason)
            for (pos, _), result in zip(items, got, strict=True):
                out[pos] = result
        return out

    async def set_paused(self, id: str, *, pause: bool, reason: str = "") -> PauseResult:
        """As DelayEngine.set_paused, on the shard that holds `id` (see cancel)."""
        shard, local = await self._locate(id)
        return await self.engines[shard].set_paused(local, pause=pause, reason=reason)

    async def trigger(self, id: str, *, reason: str = "", request: str = "") -> TimeResult:
        """As DelayEngine.trigger, on the shard that holds `id` (see cancel)."""
        shard, local = await self._locate(id)
        return await self.engines[shard].trigger(local, reason=reason, request=request)

    async def reschedule(self, id: str, due_ms: int, *, reason: str = "") -> TimeResult:
        """As DelayEngine.reschedule, on the shard that holds `id` (see cancel)."""
        shard, local = await self._locate(id)
        return await self.engines[shard].reschedule(local, due_ms, reason=reason)

    async def cancel_prefix(self, prefix: str, *, reason: str = "Remove") -> int:
        """As DelayEngine.cancel_prefix, over every shard; the total cancelled."""
        return sum([await e.cancel_prefix(prefix, reason=reason) for e in self.engines])

    async def pending(self) -> int:
        """Messages waiting over every shard."""
        return sum([await e.pending() for e in self.engines])

    async def fire_due(self) -> tuple[int, int | None]:
        """One fire_due on every shard: (fired in all, earliest due time left)."""
        fired, head = 0, None
        for e in self.engines:
            n, h = await e.fire_due()
            fired += n
            if h is not None and (head is None or h < head):
                head = h
        return fired, head

    def start(
        self,
        on_state: Callable[[int, bool, BaseException | None], None] | None = None,
        stall_after_s: float | None = None,
    ) -> list[Supervised]:
        """Start one supervised fire loop per shard (liveness.Supervised); returns them, by shard.

        Each shard's loop is restarted with backoff on its own if it ends for
        any reason but close(): one shard's failure never stops the others.
        `on_state(shard, up, error)` hears each loop start and end; a loop
        without a pass for `stall_after_s` shows as `stalled`.
        """
        if not self.loops:
            for n, e in enumerate(self.engines):
                hook = None if on_state is None else functools.partial(on_state, n)
                loop = Supervised(
                    f"fire loop of {e.keys.stream}",
                    functools.partial(self._run_shard, n),
                    backoff=SHARD_LOOP.backoff(),
                    on_state=hook,
                    stall_after_s=stall_after_s,
                )
                self.loops.append(loop)
            for loop in self.loops:
                loop.start()
        return self.loops

    async def _run_shard(self, n: int, stop: asyncio.Event) -> None:
        await self.engines[n].run(stop, beat=self.loops[n].beat)

    async def close(self, timeout_s: float = 5.0) -> None:
        """Stop every shard's fire loop (nothing pending is lost: it waits in Redis)."""
        loops, self.loops = self.loops, []
        await asyncio.gather(*(loop.stop(timeout_s) for loop in loops))

    async def run(self) -> None:
        """Fire every shard until cancelled: start(), then close() when cancelled."""
        self.start()
        try:
            await run_until_cancelled([])
        finally:
            await self.close()

    def wake(self) -> None:
        """Re-check every shard's index now."""
        for e in self.engines:
            e.wake()
