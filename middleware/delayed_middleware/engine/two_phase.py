"""The two-phase fire of Redis Cluster: CLAIM, APPEND, RELEASE, with scheduleSource sampling.

A script may only touch keys of one hash slot, and target topics live in
other slots than the delayed topic. So on Cluster (EngineConfig.two_phase)
FIRE's steps run as three scripts, with the same decisions at each step:
  1. CLAIM (the shard's slot) takes a bounded due batch, handles what FIRE
     handles without appending (gone, expired, reserved target, recurring
     waiting for REFILL) and moves the rest from the due index to an in-flight
     sorted set, scored by a lease end (now + lease_ms), recording each
     occurrence's due time in a claims hash; it returns the entries to append.
  2. APPEND (the target's slot), one call per target key: for each envelope,
     `SET <marker> 1 NX PX fire_marker_ttl_ms` and, only if that set it, the
     XADDs, in one script. The marker `{<target's tag>}:<shard stream>}fired:
     <envelope id>:<occurrence due ms>` (keys.fire_marker_prefix) hashes to
     the target's slot and is an engine key, so no user can write it.
  3. RELEASE (the shard's slot) finalizes what was appended exactly as FIRE
     does and parks what APPEND could not write; it acts only on envelopes it
     removes from the in-flight set (ZREM returns 1 once).
CLAIM also takes back in-flight entries whose lease ended, with a new lease,
so a replica that died or stalled is replaced by whichever replica claims next.

Why no crash point loses a message: an occurrence leaves the due index only
into the in-flight set, and leaves that only in RELEASE, after APPEND wrote it
(or parks it). Why none doubles one: its entries are appended only by the
APPEND call that set its marker (SET NX and XADD are one atomic script).
Crash points, each tested in tests/middleware/engine/test_cluster.py: after
CLAIM; after APPEND of some targets; after every APPEND, before RELEASE; after
RELEASE; a replica stalled past its lease while another takes over.
The bound: a marker lives fire_marker_ttl_ms (15 min by default); a replica
does not start an APPEND for a claim older than half that. A claim left in
flight longer after its APPEND may be appended again: at least once, never lost.
A cancel or replace while in flight: see engine.cancel.

Replication: a lost CLAIM or RELEASE whose APPEND survived a failover is
handed out again and the surviving marker stops a second append; a lost
APPEND whose RELEASE survived (target and shard on different masters) loses
that message. The window is the replication lag (WAIT is not used).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Sequence
from typing import Any

from redis.exceptions import ResponseError

from delayed_middleware.engine.core import ShardState
from delayed_middleware.engine.fire import FireStep
from delayed_middleware.engine.replies import AppendItem, Claim, Refill
from delayed_middleware.keys import fire_marker_prefix, is_delayed_topic, is_engine_key
from delayed_middleware.lua_scripts import SCHEDULE_NEXT, SCHEDULER
from delayed_middleware.publish_keys import SCHEDULE_OCCURRENCE
from delayed_middleware.redis_errors import is_wrong_type


class TwoPhaseFire:
    """The fire path of Redis Cluster: one CLAIM, the APPENDs per target (concurrently), one RELEASE."""

    def __init__(self, state: ShardState) -> None:
        self._state = state

    async def fire_once(self) -> FireStep:
        """FIRE's steps split where the target topics leave the shard's slot.

        CLAIM moves a bounded due batch (and any claim whose lease ended) to
        the in-flight set; APPEND writes each target's envelopes, one call per
        target, guarded by fire markers; RELEASE finalizes what was appended
        and parks what could not be. See the module docstring for why no crash
        point loses or doubles a message.
        """
        st = self._state
        now, now_arg = st.decide_at()
        cfg = st.config
        got = await st.scripts.claim(
            now=now_arg,
            budget=st.budget,
            history_len=st.history_len,
            lease_ms=cfg.lease_ms,
            pubsub_name=st.pubsub_name,
        )
        head, parked, claims = got.head, got.parked, got.claims
        await st.unfired(got.expired, got.gone)
        fired = entries = 0
        quads: Sequence[Refill] = ()
        if claims:
            await st.at("claimed")
            outcomes = await self._append_claims(claims, now)
            done = await st.scripts.release(
                [(c.id, outcomes[c.id]) for c in claims],
                now=st.decide_at()[1],
                history_len=st.history_len,
            )
            await st.at("released")
            parked += done.parked
            fired = done.fired
            head = done.head
            quads = done.refills
            entries = sum(len(c.entries) for c in claims if outcomes[c.id] == "ok")
        st.report(got.decided, fired, got.first, got.pending, parked, entries, lost=got.gone)
        # A batch cut short by its budget leaves more due: say so, so the loop goes on.
        more = len(claims)
        return FireStep(more, st.measured(now, got.decided, head), got.refill, quads)

    async def _append_claims(self, claims: Sequence[Claim], claimed_at: int) -> dict[str, str]:
        """APPEND every claimed envelope, one call per target; outcome per envelope id."""
        st = self._state
        cfg = st.config
        outcomes: dict[str, str] = {}
        groups: dict[str, list[Claim]] = {}
        for c in claims:
            if c.bad:
                outcomes[c.id] = c.bad
            elif c.target:
                groups.setdefault(c.target, []).append(c)
            else:
                outcomes[c.id] = "withdrawn"  # cancelled or replaced while in flight
        mode, threshold = st.trim_args(st.clock.now_ms())
        done = 0

        async def append(target: str, group: list[Claim]) -> None:
            nonlocal done
            prefix = fire_marker_prefix(target, st.keys.stream)
            outbox = bool(group[0].target_pubsub)
            payloads = [c.entries if not c.source else await self._sampled(c.source, c) for c in group]
            # CLAIM cannot size a scheduleSource's sample (it lives in another
            # slot), so the bytes bound FIRE keeps per call is kept here per
            # APPEND call: a target's claims go in runs of at most batch_bytes
            # (at least one claim each). Each run is atomic on its own markers.
            runs: list[list[int]] = [[]]
            size = 0
            for i, entries in enumerate(payloads):
                n = sum(len(v) for fields in entries for v in fields)
                if runs[-1] and size + n > cfg.batch_bytes:
                    runs.append([])
                    size = 0
                runs[-1].append(i)
                size += n
            for run in runs:
                # A replica that stalled this long may find its markers expired:
                # it must leave the claim to the replica that took its lease over.
                if st.clock.now_ms() - claimed_at > cfg.fire_marker_ttl_ms // 2:
                    raise TimeoutError(
                        f"claim on {st.keys.stream} is {cfg.fire_marker_ttl_ms // 2} ms old; abandoned"
                    )
                items = [
                    AppendItem(f"{prefix}{group[i].id}:{group[i].due}", group[i].trim, payloads[i])
                    for i in run
                ]
                statuses = await st.scripts.append(
                    target,
                    items,
                    marker_ttl_ms=cfg.fire_marker_ttl_ms,
                    trim=("" if outbox else mode, threshold),
                )
                for i, status in zip(run, statuses, strict=True):
                    outcomes[group[i].id] = status
                done += 1
                await st.at(f"appended:{done}")

        # Targets are independent (other slots, often other masters): append
        # to them concurrently, each to its end. A failed APPEND is that
        # target's failed write: what the others wrote stands (their markers
        # keep a takeover from writing it twice), the whole claim stays in
        # flight, and the caller's loop handles the error like any failed
        # write (the lease ends, the claim is taken over). Not a TaskGroup: on
        # Python 3.11 a child's failure leaves a cancellation request on this
        # task, which read as a stop ended firing for good.
        results = await asyncio.gather(
            *(append(target, group) for target, group in groups.items()), return_exceptions=True
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        for error in errors:
            if isinstance(error, Exception):
                raise error
        if errors:
            # A child cancelled while this task was not: a swallowed cancellation
            # inside the client. Still that write's failure, not a stop.
            raise TimeoutError(f"an APPEND of {st.keys.stream} was cancelled")
        return outcomes

    async def sample(self, source: str, c: Claim) -> list[list[str | bytes]]:
        """scheduleSource's latest entry as claim `c` delivers it (a triggered occurrence's too)."""
        return await self._sampled(source, c)

    async def _sampled(self, source: str, c: Claim) -> list[list[str | bytes]]:
        """scheduleSource: the source topic's latest entry, read now (it lives in another slot)."""
        if is_delayed_topic(source) or is_engine_key(source):
            return []
        try:
            rows = await self._state.redis.xrevrange(source, "+", "-", count=1)
        except ResponseError as exc:
            # A source whose key is not a stream gives nothing, as in FIRE. Raised,
            # the claim was taken over at each lease end and raised again: the
            # shard (and every claim beside it) stopped firing.
            if not is_wrong_type(exc):
                raise
            return []
        if not rows:
            return []
        # Anyone writes the source (FIRE compares its field names as bytes): a name
        # that is not UTF-8, or JSON nested past Python's recursion limit, must not
        # raise here, after CLAIM, any more than a WRONGTYPE.
        f = {
            k.decode(errors="replace") if isinstance(k, bytes) else str(k): v
            for k, v in (rows[0][1] or {}).items()
        }
        md: dict[str, Any] = {}
        with contextlib.suppress(ValueError, TypeError, RecursionError):
            loaded = json.loads(f.get("metadata", b"{}"))
            # As FIRE: keep the source's metadata only if it encodes again as
            # strict JSON (1e400 loads as inf), else drop it; the data still goes out.
            if isinstance(loaded, dict) and _strict_json(loaded):
                md = loaded
        md[SCHEDULER], md[SCHEDULE_NEXT] = c.scheduler, c.schedule_next
        if c.schedule_occurrence:
            md[SCHEDULE_OCCURRENCE] = c.schedule_occurrence
        ct = f.get("contentType", b"")
        return [c.fields(f.get("data", b""), json.dumps(md, separators=(",", ":")), ct)]


def _strict_json(value: object) -> bool:
    try:
        json.dumps(value, allow_nan=False)
    except (ValueError, TypeError, RecursionError):
        return False
    return True
