"""Schedule: store envelopes durably, in bounded chunks, each call made safe to retry by a token.

Invariants: when `schedule` returns, Redis holds the envelopes (the stream
entry, the due index, the ids-hash ref and the `scheduled` record come in one
SCHEDULE script). A huge bulk publish is stored in chunks of at most
schedule_chunk envelopes and schedule_chunk_bytes, so no call holds Redis
long. Each chunk carries a token (`<token>/<offset>`) SCHEDULE remembers for
token_window_ms on the Redis clock: a client's retry after a lost reply finds
it and stores nothing twice. A scheduleId already pending is replaced in the
same step (its old envelope leaves the index and the stream).

Concurrent calls are coalesced (coalesce.py): the chunks of publishes that
arrive in one event-loop pass go to Redis in one SCHEDULE script call, each
with its own token and its own answer.

Crash points: before a chunk's script, nothing of it is stored; after it, all
of it is. A failure after some chunks raises PartiallyStoredError(n): the
first n envelopes are stored, the caller knows exactly what to retry.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Sequence

from redis.exceptions import RedisError, ResponseError

from delayed_middleware.engine.cancel import Canceller
from delayed_middleware.engine.coalesce import ScheduleCoalescer
from delayed_middleware.engine.core import ShardState
from delayed_middleware.engine.replies import ScheduleCall, ScheduleItem, ScheduleResult
from delayed_middleware.envelope import Envelope, encode_envelope
from delayed_middleware.errors import PartiallyStoredError
from delayed_middleware.kinds import Catchup
from delayed_middleware.redis_errors import describe
from delayed_middleware.schedules import is_jittered


class Scheduler:
    """schedule: SCHEDULE in chunks; a replace stops the old envelope's in-flight occurrence (the Canceller)."""

    def __init__(self, state: ShardState, canceller: Canceller) -> None:
        self._state = state
        self._canceller = canceller
        config = state.config
        self._coalescer = ScheduleCoalescer(
            self._send,
            max_items=config.schedule_chunk,
            max_bytes=config.schedule_chunk_bytes,
            linger_s=config.schedule_linger_ms / 1000,
        )

    async def _send(self, calls: Sequence[ScheduleCall]) -> list[ScheduleResult | ResponseError]:
        """One SCHEDULE script call for the coalesced calls (engine/coalesce.py)."""
        st = self._state
        return await st.scripts.schedule_calls(
            calls,
            now=st.clock.now_ms(),
            history_len=st.history_len,
            token_window_ms=st.config.token_window_ms,
        )

    async def schedule(
        self, envelopes: Sequence[Envelope], *, token: str | None = None, timeout_s: float | None = None
    ) -> list[str]:
        """Store envelopes durably; returns their ids (scheduleId, else their stream id).

        When this returns, Redis holds them: a crash of this process from here
        on loses nothing. Each SCHEDULE call carries a token the script
        remembers (`<token>/<offset>` per chunk): calling again with the same
        `token` after a lost reply stores nothing twice, so the caller may
        retry. Recurring cron envelopes need a `recurrence` (@every ones, with
        every_ms, are advanced by the fire step alone).

        Many envelopes are stored in chunks, each bounded by `timeout_s`. When
        a chunk fails after earlier ones were stored, PartiallyStoredError says
        how many envelopes (in order) are stored; a failure before any chunk
        was stored raises the Redis error (or TimeoutError) itself.
        """
        ids: list[str] = []
        encoded = [encode_envelope(env) for env in envelopes]
        if len(encoded) == 1:
            # A unary publish: one chunk, nothing to split or slice.
            return await self._schedule_chunk(envelopes, encoded, token, timeout_s)
        for start, end in self._chunks(encoded):
            # A caller's token names each chunk (a retry of the call repeats them all).
            chunk_token = token if token is None or not start else f"{token}/{start}"
            try:
                # Bounded by `timeout_s` in the coalescer (one timer per batch, not per call).
                ids += await self._schedule_chunk(
                    envelopes[start:end], encoded[start:end], chunk_token, timeout_s
                )
            except (RedisError, TimeoutError) as exc:
                if not start:
                    raise
                raise PartiallyStoredError(
                    start,
                    f"scheduling on {self._state.keys.stream!r}: {start} of {len(envelopes)} stored, then "
                    f"{describe(exc)}",
                ) from exc
        return ids

    def _chunks(self, encoded: Sequence[bytes]) -> list[tuple[int, int]]:
        """[start, end) runs of at most schedule_chunk envelopes and schedule_chunk_bytes
        (one envelope above that is a run of its own)."""
        runs: list[tuple[int, int]] = []
        start, size = 0, 0
        for i, raw in enumerate(encoded):
            full = (
                i - start >= self._state.config.schedule_chunk
                or size + len(raw) > self._state.config.schedule_chunk_bytes
            )
            if i > start and full:
                runs.append((start, i))
                start, size = i, 0
            size += len(raw)
        if start < len(encoded):
            runs.append((start, len(encoded)))
        return runs

    async def _schedule_chunk(
        self,
        envelopes: Sequence[Envelope],
        encoded: Sequence[bytes],
        token: str | None,
        timeout_s: float | None = None,
    ) -> list[str]:
        if not envelopes:
            return []
        items = []
        for env, raw in zip(envelopes, encoded, strict=True):
            nxt, iso = "-", "-"
            # An @every envelope's successors come from the fire step itself (catching up
            # `all`, from REFILL, as a cron's). A jittered one's first occurrence waits for
            # REFILL to learn its nominal time too (its scheduleOccurrence).
            if env.is_recurring and (not env.every_ms or env.catchup == Catchup.ALL) and not is_jittered(env):
                nxt, iso = self._state.next_after(env, env.due_ms)
            items.append(
                ScheduleItem(
                    raw, env.due_ms, env.schedule_id, env.kind, env.topic, env.size, env.schedule, nxt, iso
                )
            )
        # Concurrent calls share one script call; this call keeps its own token
        # (a retry after a lost reply finds it whatever batch it joins).
        got = await self._coalescer.schedule(
            ScheduleCall(items, token or secrets.token_hex(8)), timeout_s=timeout_s
        )
        # A dup: stored by an earlier attempt of this very call.
        if got.replaced_in_flight:
            async with asyncio.timeout(timeout_s):
                for old in got.replaced_in_flight:
                    await self._canceller.stop_replaced_in_flight(old)
        return got.ids
