"""The storage format of an app's delayed data, and the rollback window.

Each shard of an app's delayed topic records the format its data is written
in, under `{<shard stream>}:format` (EngineKeys.format). It is settled once, at
Init, by `settle_format`; nothing on the publish path reads Redis for it (the
instance keeps the answer in memory).

Formats (CHANGELOG.md names the releases):

- 1: release 0.1.0's. It wrote no format key: a shard without one but with
  engine data is format 1.
- 2: adds what 0.1.0 cannot read: envelopes re-homed by compaction (the
  `moved` hash and the `origin` field: 0.1.0 reports them lost), recurring
  schedules with a time zone or bounds (`scheduleTimeZone`, `CRON_TZ=`,
  `scheduleStart`, `scheduleEnd`, `scheduleLimit`, `scheduleJitter`: 0.1.0
  fires them twice, then drops them), and paused messages (`schedulePause`:
  0.1.0 never resumes them).

- 3: adds the catch-up policy and window of a recurring schedule
  (`scheduleCatchup` other than `one`, any `scheduleCatchupWindow`:
  DelayedMessage fields 19 and 20). Release 0.2.0's decoders skip them, so it
  would catch an `all` schedule up as `one` (missed occurrences never
  delivered) and a `none` schedule up with the one delivery the user said to
  skip. The default (`one`, 24h) stores neither field, so it stays format 1.

Added within format 2 (nothing an older release misreads, so no new format):
an occurrence's nominal time beside its due time in the ids ref (two more parts,
written only where they differ from the due times: jitter, a paced catch-up;
an older release reads the first five parts and fires the occurrence all the
same, and a ref it rewrites without them makes this release stamp that one
occurrence's `scheduleOccurrence` from its due time: the jittered one, for a jittered schedule),
and the `occ` field of a `fired` history record (the occurrence's nominal time, written only
where it differs from `due`): the history is a flat field set whose readers ignore fields they
do not know (release 0.1.0's history.decode_record and 0.2.0's decode_record / record_problem;
tests/middleware/test_backfill.py reads such records with both releases' readers), and
a release without it matches a backfill against the due time's window, as before.
Also within format 2: Redis Cluster's triggers set (keys.EngineKeys.triggers), the
registrations of triggers in flight, which expire within a fire marker's lifetime: release
0.2.0 never reads it (its cancel does not see them, as before it existed), and nothing lists it.

The rollback window: a version writes the format it finds (or the one the
`storageFormat` setting names), so an upgrade keeps writing the previous
release's format and a rollback reads all of it. While an app is at an older
format than the newest, what needs a newer one is refused
(FailedPreconditionError naming the setting and the format it needs:
`needs_format`) and, below format 2, compaction does not run.
Raising the setting raises the stored format; lowering it below the stored
one is refused. A version that finds a format newer than it knows refuses to
start, and changes nothing.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ResponseError

from delayed_middleware.client import RedisClient
from delayed_middleware.envelope import Envelope
from delayed_middleware.errors import FailedPreconditionError
from delayed_middleware.keys import EngineKeys
from delayed_middleware.lua_scripts import FORMAT
from delayed_middleware.schedules import CRON_TZ_PREFIX

# The component setting that pins (or raises) the format.
SETTING: Final = "storageFormat"
# The newest format this version writes, and the oldest it reads.
CURRENT: Final = 3
OLDEST: Final = 1
# The release that first wrote each format (CHANGELOG.md).
RELEASES: Final[dict[int, str]] = {1: "0.1.0", 2: "0.2.0", 3: "0.3.0"}
# The format each stored feature needs (the oldest format whose release reads it right):
# compaction's re-homed envelopes (the `moved` hash) and a paused message need 2; a schedule's
# time zone, bounds and jitter need 2 (needs_format); its catch-up policy and window need 3.
COMPACTION: Final = 2
PAUSE: Final = 2
ZONES_BOUNDS_JITTER: Final = 2
CATCHUP: Final = 3
# The name of every Redis connection of this release (CLIENT SETNAME), `<CLIENT_NAME>:<consumerID>`:
# it says which formats the process reads, so a replica about to raise the format finds the
# replicas that could not read it. Release 0.1.0 named its connections `delayed-pubsub:<consumerID>`.
CLIENT_NAME: Final = f"delayed-pubsub-f{CURRENT}"
_RELEASE_1_NAME: Final = "delayed-pubsub"
# A blocking connection's name carries this suffix (delayed_pubsub.connection).
_BLOCKING: Final = ":blocking"

log = logging.getLogger(__name__)


def client_name(consumer_id: str) -> str:
    """The CLIENT SETNAME of this release's connections for app `consumer_id`."""
    return f"{CLIENT_NAME}:{consumer_id}" if consumer_id else CLIENT_NAME


def reads_up_to(name: str, consumer_id: str) -> int | None:
    """The newest format a connection named `name` reads, if it is one of app `consumer_id`'s
    component connections (release 0.1.0's included), else None."""
    head, sep, rest = name.partition(":")
    if not sep or rest not in (consumer_id, consumer_id + _BLOCKING):
        return None
    if head == _RELEASE_1_NAME:
        return OLDEST
    digits = head.removeprefix(_RELEASE_1_NAME + "-f")
    if digits != head and digits.isascii() and digits.isdigit():
        return int(digits)
    return None


async def older_clients(client: RedisClient, consumer_id: str, fmt: int) -> list[tuple[str, int]] | None:
    """(address and name, newest format it reads) of each open connection of app `consumer_id`
    that cannot read `fmt`, on every node; None when Redis refuses CLIENT LIST (an ACL without it)."""
    redis: Any = client
    try:
        if isinstance(redis, RedisCluster):
            listing: Any = await redis.client_list(target_nodes=RedisCluster.ALL_NODES)
        else:
            listing = await redis.client_list()
    except ResponseError:
        return None
    rows = [r for rows in listing.values() for r in rows] if isinstance(listing, dict) else listing
    older = []
    for row in rows:
        name = row.get("name", "")
        reads = reads_up_to(name, consumer_id)
        if reads is not None and reads < fmt:
            older.append((f"{row.get('addr', '?')} ({name})", reads))
    return older


def describe(fmt: int) -> str:
    """`format 2 (release 0.2.0)`, or `format 99` for one this version does not know."""
    release = RELEASES.get(fmt)
    return f"format {fmt} (release {release})" if release else f"format {fmt}"


@dataclass(frozen=True)
class ShardFormat:
    """What one shard holds: its stored format (None: no format key) and whether it has engine data."""

    stream: str
    stored: str | None
    has_data: bool


async def read_formats(
    client: RedisClient, keys: Sequence[EngineKeys], *, timeout_s: float | None = None
) -> list[ShardFormat]:
    """The stored format of every shard, changing nothing."""
    return [await _call(client, k, 0, timeout_s) for k in keys]


async def stored_format(client: RedisClient, keys: Sequence[EngineKeys]) -> int | None:
    """The format an app's data is in (None: no data and no format key yet), changing nothing;
    FailedPreconditionError for a format this version cannot read (operator commands that write)."""
    return max(
        (f for f in (_known(s) for s in await read_formats(client, keys)) if f is not None), default=None
    )


async def settle_format(
    client: RedisClient,
    keys: Sequence[EngineKeys],
    requested: int | None,
    *,
    consumer_id: str,
    timeout_s: float | None,
) -> int:
    """Decide the format an app's data is written in, record it on every shard, and return it.

    `requested` is the storageFormat setting (None: keep the stored format; a
    fresh app starts at CURRENT, or at the format of the oldest release of the
    app still connected). Raises FailedPreconditionError, having written
    nothing, when a shard holds a format this version cannot read, when
    `requested` is below the stored format, or when it raises the format while
    a connection of app `consumer_id` from a release that cannot read it is
    open. `timeout_s` bounds each call.
    """
    shards = await read_formats(client, keys, timeout_s=timeout_s)
    found: list[int] = []
    for shard in shards:
        fmt = _known(shard)
        if fmt is not None:
            found.append(fmt)
    stored = max(found, default=None)
    if requested is None:
        target = stored if stored is not None else CURRENT
    elif stored is not None and requested < stored:
        raise FailedPreconditionError(
            f"{SETTING} {requested} is below the storage format of {keys[0].stream!r}, which is "
            f"{describe(stored)}: data in it may exist that {describe(requested)} cannot read, so the "
            f"format cannot be lowered. Set {SETTING} to {stored} (or remove it); to run an older "
            "release, see CHANGELOG.md for the formats it reads"
        )
    else:
        target = requested
    if target > (stored or 0):
        async with asyncio.timeout(timeout_s):
            older = await older_clients(client, consumer_id, target)
        if older is None:
            log.warning(
                "%r: Redis refused CLIENT LIST, so no check that every replica reads %s; make sure none "
                "runs an older release (docs/operations.md, Upgrading and rolling back)",
                keys[0].stream,
                describe(target),
            )
        elif older and requested is None and stored is None:
            # A new app while an older release of it runs (a mixed deploy): start in its format.
            target = min(reads for _, reads in older)
        elif older:
            shown = ", ".join(who for who, _ in older[:5]) + (" …" if len(older) > 5 else "")
            raise FailedPreconditionError(
                f"{SETTING} {target}: {len(older)} connection(s) of app {consumer_id!r} come from a release "
                f"that cannot read {describe(target)}: {shown}. Raise it once every replica (and operator "
                f"CLI) of the app runs a release that reads it. Nothing was changed"
            )
    settled = [await _call(client, k, target, timeout_s) for k in keys]
    # Another replica may have raised it meanwhile (the script never lowers it): adopt the highest,
    # unless the setting asked for less (then this replica must not run on data it was told not to write).
    now = max((f for f in (_known(s) for s in settled) if f is not None), default=target)
    if requested is not None and requested < now:
        raise FailedPreconditionError(
            f"{SETTING} {requested}: another replica raised the storage format of {keys[0].stream!r} "
            f"to {describe(now)} meanwhile; set {SETTING} to {now} (or remove it)"
        )
    return now


def _known(shard: ShardFormat) -> int | None:
    """The shard's format, None if it has neither a format key nor data; FailedPreconditionError
    for a format this version cannot read."""
    if shard.stored is None:
        return OLDEST if shard.has_data else None
    fmt = int(shard.stored) if shard.stored.isascii() and shard.stored.isdigit() else None
    if fmt is None or not OLDEST <= fmt <= CURRENT:
        shown = describe(fmt) if fmt is not None else f"{shard.stored!r} (not a format number)"
        raise FailedPreconditionError(
            f"the delayed data of {shard.stream!r} is in storage {shown}; this version reads "
            f"formats {OLDEST} to {CURRENT} ({describe(CURRENT)} is its newest): run the release that "
            "wrote it or a newer one (CHANGELOG.md lists each release's format). Nothing was changed"
        )
    return fmt


async def _call(client: RedisClient, keys: EngineKeys, want: int, timeout_s: float | None) -> ShardFormat:
    data_keys = [
        keys.stream,
        keys.due,
        keys.ids,
        keys.history,
        keys.parked,
        keys.outbox,
        keys.moved,
        keys.retrying,
        keys.dead_letters,
    ]
    async with asyncio.timeout(timeout_s):
        stored, data = await client.register_script(FORMAT)(keys=[keys.format, *data_keys], args=[want])
    text = stored.decode() if isinstance(stored, bytes) else str(stored)
    return ShardFormat(keys.stream, text or None, int(data) > 0)


def needs_format(envelope: Envelope) -> tuple[int, str] | None:
    """The newest format an envelope needs beyond format 1, and why; None when format 1 holds it.

    The one table of what needs which format on the publish path (a pause and compaction are
    PAUSE and COMPACTION). Strings and ints only: it costs the publish path no Redis call.
    """
    if envelope.catchup or envelope.catchup_window_ms:
        return CATCHUP, "a schedule with scheduleCatchup (all or none) or scheduleCatchupWindow"
    if envelope.schedule.startswith(CRON_TZ_PREFIX):
        return ZONES_BOUNDS_JITTER, "a schedule with a time zone (scheduleTimeZone or CRON_TZ=)"
    if ";" in envelope.schedule:
        return ZONES_BOUNDS_JITTER, "a schedule with scheduleStart, scheduleEnd, scheduleLimit or scheduleJitter"
    return None


def pinned_refusal(fmt: int, what: str, needs: int) -> FailedPreconditionError:
    """The refusal of `what`, which needs format `needs`, while an app's data is at the older format
    `fmt` (the rollback window)."""
    return FailedPreconditionError(
        f"{what} needs storage {describe(needs)} or newer, but this app's delayed data is kept in "
        f"{describe(fmt)} so that release {RELEASES.get(fmt, '?')} can still read it (the rollback window). "
        f"Once no replica runs an older release, set {SETTING}: {needs} on the component "
        "(docs/operations.md, Upgrading and rolling back)"
    )
