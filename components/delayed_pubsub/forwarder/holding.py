"""Hand-off holding: what a forwarder holds of the outbox, and keeping it its own.

An entry read or claimed is held until its hand-off ends. While it is held, the
keeper renews its idle time every claim_idle_ms / 3 (lua/outbox_hold.lua), so no
other replica takes a live holder's entries over; before each attempt the holder
checks the entry is still its own. Claims take over what is due for a retry: our
own refused entries after their backoff, another replica's after claim_idle_ms.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import KW_ONLY, dataclass, field
from typing import Any, Final

from delayed_middleware import lua_scripts
from delayed_middleware.aio import text
from delayed_middleware.keys import EngineKeys
from delayed_middleware.outbox import OutboxEntry
from delayed_pubsub.connection import RedisPyClient
from delayed_pubsub.forwarder.config import ForwarderConfig

# The name logs have always carried (log queries and alerts key on it), whichever file of the package writes.
log = logging.getLogger("delayed_pubsub.forwarder")

# Entries per OUTBOX_HOLD call: a script must not block Redis for long.
_HOLD_CHUNK: Final = 100


@dataclass
class Job:
    """Consecutive outbox entries that go out in one publish call (one entry, or one bulk).

    Held by this forwarder from its read (or claim) until settled or released:
    `confirmed` is the loop time just before the Redis call that last showed
    every entry pending under our name at `attempt`, so Redis's idle time for
    them is at most `now - confirmed`.
    """

    ids: list[str]
    entries: list[OutboxEntry]
    attempt: int
    confirmed: float = 0.0
    # Every id the job was read with (ids shrinks as entries expire or are lost).
    read: list[str] = field(default_factory=list)
    failed: list[tuple[str, str]] = field(default_factory=list)  # (stream id, why)
    # Entries the keeper found taken over (or gone): never published from here.
    lost: set[str] = field(default_factory=set)

    @property
    def head(self) -> OutboxEntry:
        return self.entries[0]

    def keep_only(self, ids: Sequence[str]) -> list[str]:
        """Drop every entry not in `ids`; returns the dropped ids."""
        keep = set(ids)
        dropped = [i for i in self.ids if i not in keep]
        if dropped:
            pairs = [(i, e) for i, e in zip(self.ids, self.entries, strict=True) if i in keep]
            self.ids[:] = [i for i, _ in pairs]
            self.entries[:] = [e for _, e in pairs]
        return dropped


@dataclass(eq=False, repr=False)
class Holdings:
    """The entries one forwarder (`consumer`) holds, by id, and the Redis calls that keep,
    check and claim them."""

    client: RedisPyClient
    keys: EngineKeys
    config: ForwarderConfig
    _: KW_ONLY
    consumer: str
    name: str
    bounded: Callable[[Awaitable[Any]], Awaitable[Any]]
    # What this forwarder holds: entry id -> the hand-off it is in. Each hand-off
    # runs as its own task; the keeper keeps their entries ours meanwhile.
    held: dict[str, Job] = field(default_factory=dict, init=False)

    async def claim_retries(self, room: int) -> tuple[list[tuple[tuple[bytes, Any], int]], float]:
        """Pending entries whose next attempt is due, at most `room`: our own refused ones
        after their backoff, another replica's after claim_idle_ms; never one we hold.
        Returns (row, attempt) pairs and the loop time the claim was asked at."""
        # XPENDING + XCLAIM rather than XAUTOCLAIM: the delivery count is the
        # attempt number (it survives restarts and replicas), and XAUTOCLAIM
        # does not return it. Only the oldest batch_size*4 pending entries are
        # looked at per round; they are retried (or dead-lettered) in id order.
        policy, cfg = self.config.policy, self.config
        floor = min(policy.delay_ms(1), cfg.claim_idle_ms)
        pending: list[dict[str, Any]] = await self.bounded(
            self.client.xpending_range(
                self.keys.outbox, cfg.group, min="-", max="+", count=cfg.batch_size * 4, idle=floor
            )
        )
        claims: list[tuple[str, int, int]] = []  # (id, min idle, attempt it will be)
        for p in pending:
            entry_id = text(p["message_id"])
            if entry_id in self.held:
                # In our hands (the keeper refreshes it): claiming it again would publish it twice.
                continue
            deliveries = int(p["times_delivered"])
            wait = policy.delay_ms(min(deliveries, policy.max_attempts))
            consumer = text(p["consumer"])
            if consumer != self.consumer:
                wait = max(wait, cfg.claim_idle_ms)
            if int(p["time_since_delivered"]) >= wait:
                claims.append((entry_id, max(1, wait), deliveries + 1))
                if len(claims) >= room:
                    break
        asked = asyncio.get_running_loop().time()
        if not claims:
            return [], asked
        pipe = self.client.pipeline(transaction=False)
        for entry_id, min_idle, _ in claims:
            # A min idle time per entry: whoever claims first resets it, so a
            # second replica racing for the same entry gets nothing.
            pipe.xclaim(self.keys.outbox, cfg.group, self.consumer, min_idle, [entry_id])
        results: list[Any] = await self.bounded(pipe.execute())
        out: list[tuple[tuple[bytes, Any], int]] = []
        for (_, _, attempt), rows in zip(claims, results, strict=True):
            out += [(row, attempt) for row in rows or ()]
        return out, asked

    async def hold(self, held: Sequence[tuple[str, int]]) -> tuple[set[str], float]:
        """Reset the idle time of (entry id, attempt) pairs still pending under our name at
        that attempt (lua/outbox_hold.lua); returns those ids and the loop time asked at."""
        asked = asyncio.get_running_loop().time()
        kept: set[str] = set()
        for at in range(0, len(held), _HOLD_CHUNK):
            args = [x for i, n in held[at : at + _HOLD_CHUNK] for x in (i, n)]
            reply: Any = await self.bounded(
                self.client.eval(
                    lua_scripts.OUTBOX_HOLD, 1, self.keys.outbox, self.config.group, self.consumer, *args
                )
            )
            kept.update(text(i) for i in reply or ())
        return kept, asked

    async def keep(self, stopping: Callable[[], bool]) -> None:
        """The keeper: every claim_idle_ms / 3, reset the idle time of everything this
        forwarder holds, so no other replica takes a live holder's entries over; marks
        what was taken over after all (we stalled past claim_idle_ms) as lost."""
        # Loop time, not the injected clock: it is measured against Redis's own idle time.
        every = self.config.claim_idle_ms / 3000
        while not stopping():
            await asyncio.sleep(every)
            jobs = list({id(j): j for j in self.held.values()}.values())
            if not jobs:
                continue
            try:
                kept, asked = await self.hold([(i, j.attempt) for j in jobs for i in j.ids])
            except Exception as e:
                # Never the keeper's end: each hand-off asks again itself before its next attempt.
                log.warning("forwarder %s: cannot keep its hand-offs: %s", self.name, e or type(e).__name__)
                continue
            for j in jobs:
                j.lost.update(i for i in j.ids if i not in kept)
                if not j.lost:
                    j.confirmed = max(j.confirmed, asked)

    async def still_ours(self, job: Job) -> bool:
        """Whether anything of `job` is still ours to publish; drops what is not.

        Trusted without asking when confirmed less than claim_idle_ms / 2 ago:
        nobody takes an entry over before it is claim_idle_ms idle. Otherwise
        asked of Redis now (which also resets the idle time)."""
        if asyncio.get_running_loop().time() - job.confirmed >= self.config.claim_idle_ms / 2000:
            kept, asked = await self.hold([(i, job.attempt) for i in job.ids])
            job.lost.update(i for i in job.ids if i not in kept)
            job.confirmed = asked
        if job.lost:
            lost = job.keep_only([i for i in job.ids if i not in job.lost])
            if lost:
                log.warning(
                    "forwarder %s: %d hand-off(s) taken over by another replica (%s): not published here",
                    self.name,
                    len(lost),
                    ", ".join(lost[:5]),
                )
        return bool(job.ids)
