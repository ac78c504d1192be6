"""Compaction: free the stream nodes that long-waiting envelopes keep allocated.

A stream node (a listpack of up to stream-node-max-entries / -bytes) is freed
only once all its entries are deleted: one envelope waiting a day among a
hundred that fired keeps its whole node. Once compact_check_every envelopes
have left the stream, its density (live entries per node) is checked; below
half of what the last pass achieved, a pass re-homes the stream's envelopes
to its tail (lua/compact.lua), compact_chunk per call within compact_budget_us
of Redis time, for up to compact_slice_s per fire step.

Invariants: a pass runs only when nothing is due (it never delays a fire
batch, never moves an envelope about to fire); it walks the stream as it was
when it began, so it ends; an envelope keeps its public id (the moved hash
maps it to where it lives now). Crash point: between chunks; each chunk is
atomic, and the next pass starts over from the stream's head.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from redis.exceptions import ResponseError

from delayed_middleware.aio import text
from delayed_middleware.engine.core import ShardState

log = logging.getLogger(__name__)


class Compactor:
    """compact (a whole pass, for operators) and step (a slice per fire step)."""

    def __init__(self, state: ShardState) -> None:
        self._state = state
        # Per shard, nothing per message: the live entries per node the last
        # pass achieved, and the pass under way: (cursor, end id).
        self._dense: float | None = None
        self._compact_pass: tuple[str, str] | None = None

    @property
    def compacting(self) -> bool:
        """True while a compaction pass is under way (fire steps go on with it)."""
        return self._compact_pass is not None

    async def compact(self) -> bool:
        """Check the stream's density now and, if it is sparse, run a whole compaction
        pass (for operators and tests; fire steps do the same in slices). True if a pass ran."""
        if self._compact_pass is None:
            end = await self.sparse_until()
            if end is None:
                return False
            self._compact_pass = ("-", end)
        while self._compact_pass is not None:
            await self._compact_chunk()
        return True

    async def _compact_chunk(self) -> None:
        assert self._compact_pass is not None
        cfg = self._state.config
        cursor, end = self._compact_pass
        after = await self._state.scripts.compact(
            cursor, end, chunk=cfg.compact_chunk, budget_us=cfg.compact_budget_us
        )
        if after:
            self._compact_pass = (after, end)
        else:
            self._compact_pass = None
            self._dense = await self._density()

    async def step(self, left: int, *, idle: bool) -> None:
        """Counts envelopes that left the stream; checks its density once enough did,
        and runs a slice of the compaction pass under way (lua/compact.lua).

        A pass walks the stream as it was when it began and re-homes every
        envelope to the tail, so it ends. Passes start only when the density fell
        to half of what the last one achieved: the envelopes re-homed per pass are
        at most about twice those that left the stream since the last pass.
        """
        st = self._state
        cfg = st.config
        if not cfg.compact_check_every:
            return
        st.left_since_check += left
        if not idle:
            return
        if self._compact_pass is None:
            if st.left_since_check < cfg.compact_check_every:
                return
            st.left_since_check = 0
            end = await self.sparse_until()
            if end is None:
                return
            self._compact_pass = ("-", end)
            log.info("compacting %s: re-homing envelopes up to %s", st.keys.stream, end)
        # A budget of this process's time, not of the (injected) clock's: the
        # slice bounds how long fires wait behind compaction.
        deadline = time.monotonic() + cfg.compact_slice_s
        while self._compact_pass is not None:
            await self._compact_chunk()
            if time.monotonic() >= deadline:
                break
        if self._compact_pass is not None:
            # More to do: the run loop comes straight back instead of sleeping.
            st.wake.set()

    async def _density(self) -> float | None:
        info = await self._stream_info()
        if info is None:
            return None
        length, nodes = int(info["length"]), int(info["radix-tree-keys"])
        return max(1.0, length / nodes) if nodes else None

    async def _stream_info(self) -> dict[str, Any] | None:
        try:
            info: dict[str, Any] = await self._state.redis.xinfo_stream(self._state.keys.stream)
        except ResponseError:
            return None  # no stream (nothing pending)
        return info

    async def sparse_until(self) -> str | None:
        """The stream's last id if it is sparse enough to compact, else None."""
        info = await self._stream_info()
        if info is None:
            return None
        length, nodes = int(info["length"]), int(info["radix-tree-keys"])
        if nodes < self._state.config.compact_min_nodes:
            return None
        dense = self._dense or _full_node(info.get("first-entry"))
        if length * 2 >= nodes * dense:
            return None
        return text(info["last-generated-id"])


# Redis's default stream-node-max-entries and stream-node-max-bytes.
_NODE_ENTRIES, _NODE_BYTES = 100, 4096


def _full_node(first: Any) -> float:
    """Entries a full stream node holds, estimated from one entry's size (an
    envelope's fields; a listpack entry adds a few bytes per field)."""
    if not first or not first[1]:
        return float(_NODE_ENTRIES)
    size = sum(len(k) + len(v) + 4 for k, v in first[1].items())
    return float(max(1, min(_NODE_ENTRIES, _NODE_BYTES // max(1, size))))
