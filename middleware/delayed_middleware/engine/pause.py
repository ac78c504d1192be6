"""Pause and resume of one pending message or schedule, and cancel by id prefix.

The engine's part of `schedulePause` and `scheduleIdPrefix` (control.py reads
the request). One Lua script (lua/pause.lua) pauses or resumes, atomically
against the fire step: a paused envelope leaves the due index (and the refill
set), so no FIRE or CLAIM takes it, and its ids-hash ref carries the flag `p`
and when it was paused; resuming puts it back at the due time computed here (a
one-shot: its own due, at once if past; a recurring one: its first occurrence
after the resume, so missed fires are skipped), after checking that its
ids-hash ref did not change since it was read. Both leave a history record
(`paused`, `resumed`).

Redis Cluster (two-phase fire): an occurrence claimed but not yet released is
in flight; the script answers `busy` and Pauser waits until RELEASE (or a
takeover after the claimer died) finishes it, so the occurrence is either
fired or paused, never both and never lost.

A prefix cancel walks the ids hash with HSCAN MATCH (the prefix's glob
characters escaped), never loading it whole, and cancels what it finds in
batches of the engine's cancel (CANCEL_BATCH ids per script call).
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, Final

from delayed_middleware.aio import text
from delayed_middleware.engine.cancel import Canceller
from delayed_middleware.engine.core import ShardState
from delayed_middleware.engine.replies import PauseReply
from delayed_middleware.envelope import RECURRING, EnvelopeDecodeError, decode_envelope
from delayed_middleware.schedules import is_jittered

log = logging.getLogger(__name__)

PAUSED: Final = "paused"
RESUMED: Final = "resumed"
UNKNOWN: Final = "unknown"
ALREADY: Final = "already"
PARKED: Final = "parked"
# A recurring schedule resumed after its last fire (its end): it is withdrawn.
ENDED: Final = "ended"
# The ids-hash ref flag of a paused envelope (lua/pause.lua).
PAUSED_FLAG: Final = "p"

# How often a pause retries while an occurrence of its envelope is in flight (Cluster).
BUSY_RETRY_S = 0.05
# HSCAN COUNT of a prefix cancel (entries Redis looks at per call), and ids per cancel_many.
SCAN_COUNT = 1000
CANCEL_CHUNK = 2000

_GLOB = re.compile(r"([*?\[\]\\])")


@dataclass(frozen=True)
class PauseResult:
    """What a pause or resume did: status (PAUSED, RESUMED, UNKNOWN, ALREADY, PARKED, ENDED) and the topic."""

    status: str
    topic: str = ""

    @property
    def changed(self) -> bool:
        return self.status in (PAUSED, RESUMED, ENDED)


def is_paused_ref(ref: str) -> bool:
    """True for the ids-hash ref of a paused envelope."""
    parts = ref.split()
    return len(parts) >= 5 and parts[4] == PAUSED_FLAG


def paused_at_ms(ref: str) -> int | None:
    """When a paused ref was paused (epoch ms), else None."""
    parts = ref.split()
    if len(parts) >= 5 and parts[4] == PAUSED_FLAG and parts[3].isdigit():
        return int(parts[3])
    return None


def glob_escape(prefix: str) -> str:
    """`prefix` as a Redis MATCH pattern matching exactly the keys that start with it."""
    return _GLOB.sub(r"\\\1", prefix) + "*"


async def scan_prefix(client: Any, ids_key: str, prefix: str) -> AsyncIterator[list[str]]:
    """The ids-hash keys that start with `prefix`, page by page (an async iterator of lists)."""
    cursor: Any = 0
    pattern = glob_escape(prefix)
    while True:
        cursor, found = await client.hscan(ids_key, cursor, match=pattern, count=SCAN_COUNT)
        keys = [text(k) for k in found]
        # MATCH is a glob: keep only true prefixes (belt and braces over the escaping).
        keys = [k for k in keys if k.startswith(prefix)]
        if keys:
            yield keys
        if int(cursor) == 0:
            return


class Pauser:
    """set_paused and cancel_prefix on one shard."""

    def __init__(self, state: ShardState, canceller: Canceller) -> None:
        self._state = state
        self._canceller = canceller

    async def set_paused(self, id: str, *, pause: bool, reason: str = "") -> PauseResult:
        """Pause (`pause` True) or resume one id on this shard; see the module docstring.

        Waits while an occurrence is in flight (Cluster), at most about two leases
        (a takeover after the claimer died), then raises TimeoutError.
        """
        st = self._state
        deadline = asyncio.get_running_loop().time() + 2 * st.config.lease_ms / 1000 + 5
        while True:
            if pause:
                got = await self._run("pause", id, reason, [])
            else:
                got = await self._resume_once(id, reason)
            if got.status not in ("busy", "stale"):
                if got.status == RESUMED:
                    st.wake.set()
                return PauseResult(got.status, got.topic)
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"{id!r} on {st.keys.stream}: an occurrence stayed in flight")
            if got.status == "busy":
                await asyncio.sleep(BUSY_RETRY_S)

    async def _run(self, op: str, id: str, reason: str, extra: Sequence[str]) -> PauseReply:
        """One PAUSE call (lua/pause.lua) with this shard's keys."""
        st = self._state
        return await st.scripts.pause(
            op, id, reason, extra, now=st.clock.now_ms(), history_len=st.history_len
        )

    async def _resume_once(self, id: str, reason: str) -> PauseReply:
        """One resume attempt: read the ref and envelope, compute where it goes back, compare-and-set."""
        st = self._state
        client: Any = st.redis
        keys = st.keys
        ref_raw = await client.hget(keys.ids, id)
        if ref_raw is None:
            return PauseReply(UNKNOWN, "")
        ref = text(ref_raw)
        if not is_paused_ref(ref):
            # The script answers (already, parked or busy) from the same ref.
            return await self._run("resume", id, reason, [ref, "0", "-", "-"])
        parts = ref.split()
        stream_id, due = parts[0], parts[1]
        at = await client.hget(keys.moved, stream_id)
        stored = stream_id if at is None else text(at)
        rows = await client.xrange(keys.stream, stored, stored)
        env = None
        if rows:
            data = dict(rows[0][1] or {}).get(b"data")
            if isinstance(data, bytes):
                try:
                    env = decode_envelope(data)
                except EnvelopeDecodeError:
                    env = None
        if env is None or env.kind != RECURRING:
            # A one-shot goes back at its own due: past due, it fires at once.
            return await self._run("resume", id, reason, [ref, due, "-", "-"])
        now = st.shard_now()
        nxt = st.next_fire(env, now)
        if nxt is None:
            # No occurrence left after the resume (its schedule ended while paused).
            await self._canceller.cancel(id, reason="resumed after its last fire")
            return PauseReply(ENDED, env.topic)
        after, iso = "-", "-"
        if not env.every_ms and not is_jittered(env):
            # A cron ref holds the occurrence after this one too (as SCHEDULE writes it); a
            # jittered one's waits for REFILL, which learns its nominal time (scheduleOccurrence).
            after, iso = st.next_after(env, nxt)
        return await self._run("resume", id, reason, [ref, str(nxt), after, iso])

    async def cancel_prefix(self, prefix: str, *, reason: str = "Remove") -> int:
        """Cancel every pending message and schedule on this shard whose id starts with `prefix`.

        Returns how many were cancelled. HSCAN may return a key twice; the second
        cancel finds nothing and is not counted.
        """
        if not prefix:
            raise ValueError("an empty prefix would cancel everything")
        cancelled = 0
        batch: list[str] = []
        async for keys in scan_prefix(self._state.redis, self._state.keys.ids, prefix):
            batch += keys
            if len(batch) >= CANCEL_CHUNK:
                cancelled += await self._cancel(batch, reason)
                batch = []
        if batch:
            cancelled += await self._cancel(batch, reason)
        return cancelled

    async def _cancel(self, ids: Sequence[str], reason: str) -> int:
        # cancel_many splits these into script calls of CANCEL_BATCH ids.
        results = await self._canceller.cancel_many(ids, reason=reason)
        return sum(1 for found, _ in results if found)
