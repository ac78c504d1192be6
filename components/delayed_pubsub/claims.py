"""The conditional claims every redelivery of a subscription goes through.

Every delivery is a claim that bumps the entry's delivery count in the group's PEL, and
every claim here names the count its caller read: of two streams racing for one entry
(a reclaim pass, a retry poller, a nack's redelivery), exactly one wins. The scripts are
in delayed_pubsub/lua (CLAIM_UNCHANGED, NACK_HOLD, and GIVE_BACK, which undoes the bump
of what a closing stream read and never sent).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from delayed_middleware.aio import text
from delayed_middleware.keys import claim_memo_key
from delayed_pubsub.lua import CLAIM_UNCHANGED, GIVE_BACK, NACK_HOLD

# How many entries one GIVE_BACK call gives back: one script must not hold Redis long.
GIVE_BACK_BATCH = 100

# How long a conditional claim's memo lives (lua/claim_unchanged.lua): a repeat of the
# call after a lost reply comes within the call timeout and a few backoff steps.
CLAIM_MEMO_MS = 60_000


class Claimed(NamedTuple):
    """An entry claim_unchanged took: to deliver as `attempt`, or, `given_up`, to dead-letter
    (its deliveries were used up; `attempt` - 1 of them were made)."""

    id: str
    fields: dict[Any, Any]
    attempt: int
    given_up: bool = False


async def nack_hold(
    client: Any, topic: str, group: str, consumer: str, entry_id: str, sent: int
) -> tuple[int, dict[Any, Any] | None]:
    """Hold a nacked (or long-buffered) entry for `consumer`, its idle time reset so that no
    reclaim pass takes it meanwhile, only if its delivery count is still `sent` (NACK_HOLD;
    0: any count). Returns (delivery count, fields); fields None when it is no longer
    pending, is gone from the stream, or was delivered again since."""
    reply: Any = await client.eval(NACK_HOLD, 1, topic, group, consumer, entry_id, sent)
    count, fields = int(reply[0]), reply[1]
    if not fields:
        return count, None
    # A script hands the fields back flat, as Redis does.
    return count, dict(zip(fields[::2], fields[1::2], strict=True))


async def claim_unchanged(
    client: Any,
    topic: str,
    group: str,
    consumer: str,
    counts: Mapping[str, int],
    min_idle_ms: int = 0,
    *,
    nonce: str,
    max_attempts: int | None = None,
) -> list[Claimed]:
    """Claim for `consumer` each entry whose delivery count is still the one in `counts`
    (and idle `min_idle_ms` or more), in one atomic script on the topic key; returns
    those claimed, the attempt being their new delivery count.

    An entry another stream delivered since its count was read is left to that stream:
    claiming it as well would deliver it twice. An entry already delivered `max_attempts`
    times (None: no limit) is claimed `given_up` instead: the caller dead-letters it, and
    no stream delivers it again (the claim bumped its count past the maximum), so of two
    streams racing for it one gives it up. `nonce` names this claim: a repeat of the call
    with the same nonce (its reply was lost) returns what the first run claimed, so each
    caller makes one per claim and keeps it across its retries.
    """
    if not counts:
        return []
    args = [a for entry_id, n in counts.items() for a in (entry_id, n)]
    memo = claim_memo_key(topic, group, nonce)
    reply: Any = await client.eval(
        CLAIM_UNCHANGED,
        2,
        topic,
        memo,
        group,
        consumer,
        min_idle_ms,
        CLAIM_MEMO_MS,
        max_attempts or 0,
        *args,
    )
    # A script hands the fields back flat, as Redis does: paired as redis-py's XCLAIM pairs them.
    return [
        Claimed(text(i), dict(zip(f[::2], f[1::2], strict=True)), int(n), bool(int(up)))
        for i, f, n, up in reply
    ]


async def delivery_counts(client: Any, topic: str, group: str, ids: Sequence[str]) -> dict[str, int]:
    """Each entry's delivery count in `group`'s PEL on `topic`, in one round trip: the attempt
    number a redelivery carries (an id no longer pending is left out)."""
    if not ids:
        return {}
    pipe = client.pipeline(transaction=False)
    for entry_id in ids:
        pipe.xpending_range(topic, group, min=entry_id, max=entry_id, count=1)
    counts: dict[str, int] = {}
    for rows in await pipe.execute():
        for row in rows:
            counts[text(row["message_id"])] = int(row["times_delivered"])
    return counts


async def give_back(
    client: Any, topic: str, group: str, consumer: str, counts: Sequence[tuple[str, int]], idle_ms: int
) -> int:
    """Give back entries `consumer` read or claimed and never sent, each at the delivery count
    in `counts` minus one (the one our read or claim added) and idle `idle_ms`, so that any
    stream's next reclaim pass delivers them as the attempt they were; only those still ours
    under that count (GIVE_BACK). One call per GIVE_BACK_BATCH entries; returns how many."""
    given = 0
    for start in range(0, len(counts), GIVE_BACK_BATCH):
        args = [a for entry_id, n in counts[start : start + GIVE_BACK_BATCH] for a in (entry_id, n)]
        given += int(await client.eval(GIVE_BACK, 1, topic, group, consumer, idle_ms, *args))
    return given
