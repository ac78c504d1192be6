"""The publish metadata keys: one table, and everything derived from it.

Each row names a key a publisher may give (with its other spellings), what it
belongs to, the key it needs beside it, the keys it refuses beside it, and how
the docs describe it. The key sets planning works with (``TIME_KEYS``,
``DELAY_KEYS``, ``TTL_KEYS``, ``CONTROL_KEYS``, ...) are read off the table, in
its order, which is also the order a refusal picks the key it names by; the key
tables of README.md and docs/publish-metadata.md are rendered from it; and so
is ``unknown_key_warnings``. Each row names its parser (publish_values.py).
Adding a key is one row here with its parser: request.read_publish then checks
it by its row (the key it needs, the keys it excludes) and puts its typed value
in ``Request.options``, for planning (plan.py) to act on; a rule over several
keys, if it needs one, goes in request.py.

Regenerate the docs' tables after editing the table::

    python -m delayed_middleware.publish_keys --write

(``--check`` exits 1 when a committed table differs from what it would write.)

It imports only the value grammars (publish_values.py, a leaf), so that every
module that reads a key can take its name and its parser from here.
"""

from __future__ import annotations

import argparse
import difflib
import enum
import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from delayed_middleware import publish_values as values
from delayed_middleware.generated import write_or_check
from delayed_middleware.publish_values import Parser

SCHEDULED_SEND_TIME: Final = "scheduledSendTime"
SCHEDULED_SEND_DELAY: Final = "scheduledSendDelay"
# pubsub.pulsar's publish keys (components-contrib pubsub/pulsar: time.Parse(time.RFC3339)
# and time.ParseDuration), read as aliases of scheduledSendTime and scheduledSendDelay.
DELIVER_AT: Final = "deliverAt"
DELIVER_AFTER: Final = "deliverAfter"
SCHEDULE: Final = "schedule"
SCHEDULE_ID: Final = "scheduleId"
SCHEDULE_CANCEL: Final = "scheduleCancel"
SCHEDULE_PAUSE: Final = "schedulePause"
SCHEDULE_ID_PREFIX: Final = "scheduleIdPrefix"
SCHEDULE_TRIGGER: Final = "scheduleTrigger"
SCHEDULE_RESCHEDULE: Final = "scheduleReschedule"
SCHEDULE_SOURCE: Final = "scheduleSource"
SCHEDULE_TTL: Final = "scheduleTTL"
# A recurring schedule's zone, bounds and jitter (schedules.py, zones.py).
SCHEDULE_TIME_ZONE: Final = "scheduleTimeZone"
SCHEDULE_START: Final = "scheduleStart"
SCHEDULE_END: Final = "scheduleEnd"
SCHEDULE_LIMIT: Final = "scheduleLimit"
SCHEDULE_JITTER: Final = "scheduleJitter"
SCHEDULE_CATCHUP: Final = "scheduleCatchup"
SCHEDULE_CATCHUP_WINDOW: Final = "scheduleCatchupWindow"
TTL_IN_SECONDS: Final = "ttlInSeconds"
TTL: Final = "ttl"
TARGET_PUBSUB: Final = "targetPubsub"

# The metadata key of a delivered message that names its occurrence: the nominal
# time (RFC 3339 UTC, ms; before jitter) of the occurrence it delivers, the same
# for every redelivery of that occurrence. Every writer of it imports this name.
SCHEDULE_OCCURRENCE: Final = "scheduleOccurrence"
# Keys the component writes on the messages it delivers (not publish keys): a
# message republished as received carries them, so they are never "unknown".
DELIVERED_KEYS: Final[tuple[str, ...]] = ("scheduler", "scheduleNext", SCHEDULE_OCCURRENCE, "deliveryAttempt")


class Group(enum.Enum):
    """What a key belongs to: planning reads each group by its own rule (plan.py)."""

    TIME = "when a one-shot is due"
    SCHEDULE = "the schedule expression"
    IDENTITY = "the id of a message or schedule"
    CANCEL = "cancel by id"
    CONTROL = "pause, resume, cancel by prefix: a request that stores no message"
    PER_SCHEDULE = "what each fire of a schedule delivers"
    BOUND = "a recurring schedule's zone, bounds and jitter"
    TTL = "the message's own TTL"
    TARGET = "the pub/sub a due message is handed to"


@dataclass(frozen=True)
class PublishKey:
    """One row of the table.

    Attributes:
        name: the key as publishers write it.
        group: what it belongs to (Group).
        aliases: other spellings of the same setting (given together: refused).
        needs_delays: refused while the component's enableDelayedMessaging is off.
        empty_is_absent: an empty value counts as the key left out (pubsub.pulsar's keys).
        needs: the key it only applies with ('' = none).
        excludes: the keys refused beside it, in the order a refusal names the first present.
        value, meaning: its row of docs/publish-metadata.md.
        example, does: its row of README.md ('' = not in README's short table).
        readme_joins: the key whose README row it shares ('' = a row of its own).
        parser: (key, text) -> its typed value, or InvalidArgumentError naming both
            (publish_values.py; ``text`` when a rule over several keys reads it).
    """

    name: str
    group: Group
    value: str
    meaning: str
    aliases: tuple[str, ...] = ()
    needs_delays: bool = True
    empty_is_absent: bool = False
    needs: str = ""
    excludes: tuple[str, ...] = ()
    example: str = ""
    does: str = ""
    readme_joins: str = ""
    parser: Parser = values.text

    @property
    def names(self) -> tuple[str, ...]:
        """The key and its aliases."""
        return (self.name, *self.aliases)


_TIME: Final = (SCHEDULED_SEND_TIME, SCHEDULED_SEND_DELAY, DELIVER_AT, DELIVER_AFTER)
_BOUNDS: Final = (
    SCHEDULE_TIME_ZONE,
    SCHEDULE_START,
    SCHEDULE_END,
    SCHEDULE_LIMIT,
    SCHEDULE_JITTER,
    SCHEDULE_CATCHUP,
    SCHEDULE_CATCHUP_WINDOW,
)
# A control request schedules and times nothing.
_CONTROL_EXCLUDES: Final = (SCHEDULE, *_TIME, *_BOUNDS, SCHEDULE_SOURCE, SCHEDULE_TTL, TTL, TTL_IN_SECONDS)

# The order matters: the key sets below keep it, and a refusal that several
# keys could cause names the first (delay.delay_keys_in, check_one_time_key).
TABLE: Final[tuple[PublishKey, ...]] = (
    PublishKey(
        SCHEDULED_SEND_TIME,
        Group.TIME,
        parser=values.instant,
        value="ISO-8601 / RFC3339 instant with offset or `Z`",
        meaning="deliver at that instant; past ⇒ at once",
        example="`2045-11-05T08:15:30-05:00`",
        does="deliver at that instant (past: at once)",
    ),
    PublishKey(
        SCHEDULED_SEND_DELAY,
        Group.TIME,
        parser=values.delay_ms,
        value="Go duration (`90s`, `1h30m`) or whole seconds",
        meaning="deliver that long after receipt (server clock)",
        example="`90s`, `1h30m`, `90`",
        does="deliver that long after receipt",
    ),
    PublishKey(
        DELIVER_AT,
        Group.TIME,
        parser=values.instant,
        empty_is_absent=True,
        readme_joins=DELIVER_AFTER,
        value="RFC 3339 instant, as `pubsub.pulsar` takes it",
        meaning=(
            "the same as `scheduledSendTime`. Given together with one of our delay or schedule keys, "
            "the publish is refused (`INVALID_ARGUMENT` naming both keys)"
        ),
    ),
    PublishKey(
        DELIVER_AFTER,
        Group.TIME,
        parser=values.go_delay_ms,
        empty_is_absent=True,
        value="Go duration, as `pubsub.pulsar` takes it",
        meaning="the same as `scheduledSendDelay`: an app moving from Pulsar changes no code",
        example="`90s` / `2045-11-05T13:15:30Z`",
        does="the same, under the names `pubsub.pulsar` uses",
    ),
    PublishKey(
        SCHEDULE,
        Group.SCHEDULE,
        excludes=_TIME,
        value=(
            "`@at <RFC3339>`, `@every <Go duration>` (≥ 1 s), `@yearly` `@annually` `@monthly` "
            "`@weekly` `@daily` `@midnight` `@hourly`, or 6-field cron (sec min hour dom month dow); "
            "cron and the predefined ones may start with `CRON_TZ=<zone> `"
        ),
        meaning=(
            "one-shot or recurring delivery, NATS ADR-51 semantics, UTC unless `scheduleTimeZone`: "
            # The docs' own typography (a multiplication sign):
            "`@at` = `scheduledSendTime`; `@every` fires at acceptance + k × interval (no drift); "  # noqa: RUF001
            "cron: `*`, `?`, ranges, lists, steps (`*/2`, `0-23/2`, `5/15`), month and weekday names "
            "(any case), Sunday = 0 or 7, both day fields restricted ⇒ either matching fires. Missed "
            "fires (component or Redis down) fire **once** on recovery, then the schedule continues"
        ),
        example="`@every 5m`, `0 0 9 * * mon-fri`, `@daily`, `@at <RFC 3339>`",
        does="a one-shot or recurring schedule (UTC unless `scheduleTimeZone`; cron has seconds first)",
    ),
    PublishKey(
        SCHEDULE_ID,
        Group.IDENTITY,
        parser=values.schedule_id,
        value="string (≤ 256 characters)",
        meaning=(
            "identity within the app: publishing again with the same id replaces (atomically); "
            "cancel by it. A `schedule` without one gets its envelope id, delivered as `scheduler`"
        ),
        example="`invoice-42`",
        does="its identity: publishing again with the same id replaces it",
    ),
    PublishKey(
        SCHEDULE_CANCEL,
        Group.CANCEL,
        parser=values.cancel_flag,
        needs=SCHEDULE_ID,
        excludes=(SCHEDULE, *_TIME, SCHEDULE_SOURCE, SCHEDULE_TTL, *_BOUNDS),
        value="`true`",
        meaning=(
            "with `scheduleId`: cancel that pending message or schedule; nothing more is delivered. "
            "An unknown id is not an error (logged and counted)"
        ),
        example="`true`",
        does="with `scheduleId`: cancel it; nothing more is delivered",
    ),
    PublishKey(
        SCHEDULE_PAUSE,
        Group.CONTROL,
        parser=values.pause_flag,
        needs=SCHEDULE_ID,
        excludes=_CONTROL_EXCLUDES,
        value="`true` or `false`",
        meaning=(
            "with `scheduleId`: hold (`true`) or resume (`false`) that pending message or schedule; "
            "no body needed ([below](#pause-resume-and-cancel-by-prefix))"
        ),
        example="`true` / `false`",
        does=(
            "with `scheduleId` (no body needed): hold the schedule or message, or resume it; missed "
            "fires are skipped"
        ),
    ),
    PublishKey(
        SCHEDULE_ID_PREFIX,
        Group.CONTROL,
        parser=values.schedule_id,
        needs=SCHEDULE_CANCEL,
        excludes=_CONTROL_EXCLUDES,
        value="string (≤ 256 characters, not empty)",
        meaning=(
            "with `scheduleCancel: true`, instead of `scheduleId`: cancel every pending message and "
            "schedule whose id starts with it ([below](#pause-resume-and-cancel-by-prefix))"
        ),
        example="`tenant-7:`",
        does=(
            "with `scheduleCancel: true` (instead of `scheduleId`): cancel every pending message and "
            "schedule whose id starts with it"
        ),
    ),
    PublishKey(
        SCHEDULE_TRIGGER,
        Group.CONTROL,
        parser=values.trigger_flag,
        needs=SCHEDULE_ID,
        excludes=(
            *_CONTROL_EXCLUDES,
            SCHEDULE_CANCEL,
            SCHEDULE_PAUSE,
            SCHEDULE_ID_PREFIX,
            SCHEDULE_RESCHEDULE,
        ),
        value="`true`",
        meaning=(
            "with `scheduleId`: deliver that pending message now (it is then gone), or one extra "
            "occurrence of that schedule now (its next occurrence stays); no body needed "
            "([below](#trigger-now-and-reschedule))"
        ),
        example="`true`",
        does="with `scheduleId` (no body needed): deliver it now; a schedule keeps its next occurrence",
    ),
    PublishKey(
        SCHEDULE_RESCHEDULE,
        Group.CONTROL,
        parser=values.reschedule_to,
        needs=SCHEDULE_ID,
        # With scheduleTrigger: refused by its row (a request is read by scheduleTrigger first).
        excludes=(*_CONTROL_EXCLUDES, SCHEDULE_CANCEL, SCHEDULE_PAUSE, SCHEDULE_ID_PREFIX),
        value="RFC 3339 instant, or Go duration from now",
        meaning=(
            "with `scheduleId`: move that pending one-shot message to this time without sending its "
            "body again; `FAILED_PRECONDITION` when it already fired ([below](#trigger-now-and-reschedule))"
        ),
        example="`2045-11-05T08:15:30Z` / `2h`",
        does="with `scheduleId` (no body needed): move the pending message to another time",
    ),
    PublishKey(
        SCHEDULE_SOURCE,
        Group.PER_SCHEDULE,
        needs=SCHEDULE,
        value="topic",
        meaning=(
            "at each fire deliver the latest message of that topic (its data and metadata) instead "
            "of the body; nothing if that topic is empty"
        ),
        example="`sensor`",
        does="each fire delivers the latest message of that topic instead of the body",
    ),
    PublishKey(
        SCHEDULE_TTL,
        Group.PER_SCHEDULE,
        parser=values.schedule_ttl_ms,
        needs=SCHEDULE,
        value="Go duration or seconds; `never`",
        meaning=(
            "the TTL put on each produced message (`ttl`/`ttlInSeconds` on a schedule end the "
            "schedule itself instead)"
        ),
    ),
    PublishKey(
        SCHEDULE_TIME_ZONE,
        Group.BOUND,
        needs=SCHEDULE,
        value=(
            "a zone or link name of the IANA time zone database as the `tzdata` package ships it "
            "(`America/New_York`, `Europe/London`, `UTC`, `Etc/GMT+5`, `US/Eastern`)"
        ),
        meaning=(
            "a cron or predefined (`@daily` …) schedule matches wall-clock times in that zone "
            "instead of UTC. The expression may carry it too, as Dapr Jobs writes it: "
            "`CRON_TZ=America/New_York 0 0 9 * * *`; given both ways, the two must name the same "
            "zone. Refused with `@every` and `@at` (an interval or an instant is the same in every "
            "zone), except `UTC`, which changes nothing there and is accepted. `localtime`, "
            "`posixrules`, `Factory`, `posix/…` and `right/…` are refused in either form (see "
            "below). Daylight-saving rules below"
        ),
        example="`America/New_York`",
        does=(
            "cron and `@daily`-style schedules in that IANA zone's wall-clock time (also "
            "`CRON_TZ=<zone> ` before the expression)"
        ),
    ),
    PublishKey(
        SCHEDULE_START,
        Group.BOUND,
        parser=values.instant,
        needs=SCHEDULE,
        value="RFC 3339 instant",
        meaning=(
            "no fire before it. `@every` counts its grid from the start: it fires at the start "
            "itself, then every interval (without a start: one interval after acceptance, then every "
            "interval). A start in the past keeps its grid: the next point of it"
        ),
        example="`2026-12-01T09:00:00Z`",
        does="no fire before the start (`@every` counts its grid from it) or after the end",
    ),
    PublishKey(
        SCHEDULE_END,
        Group.BOUND,
        parser=values.instant,
        needs=SCHEDULE,
        readme_joins=SCHEDULE_START,
        value="RFC 3339 instant",
        meaning=(
            "no fire after it (jitter included). Not after the start, or already past, or no "
            "occurrence between now and the end ⇒ refused"
        ),
    ),
    PublishKey(
        SCHEDULE_LIMIT,
        Group.BOUND,
        needs=SCHEDULE,
        # The docs' own typography (en dashes for ranges):
        value="whole number, 1–1,000,000 with `@every`, 1–10,000 with cron",  # noqa: RUF001
        meaning=(
            "at most that many fires, counted from the first occurrence after acceptance. "
            "Occurrences skipped after an outage (fired once, see `schedule`) count too: the limit "
            "fixes the last occurrence, so every replica agrees on it. Replacing the schedule (same "
            "`scheduleId`) starts the count again. A limit that would run past the end of year 9999 "
            "is accepted: the schedule ends there, as every schedule does"
        ),
        example="`3`",
        does="at most that many fires; then the schedule is removed (history: `completed`)",
    ),
    PublishKey(
        SCHEDULE_JITTER,
        Group.BOUND,
        needs=SCHEDULE,
        value=(
            "Go duration, less than the interval (cron: than the shortest wall-clock time between "
            "two of its next 64 fires, the same in every zone)"
        ),
        meaning=(
            "each occurrence fires at its time plus an offset in [0, jitter), and always before the "
            "next occurrence's time, so occurrences never swap order (see daylight saving below). "
            "The offset is a hash of the `scheduleId` (without one: of the publish itself, stored "
            "with the schedule) and the occurrence's time: every replica and every retry computes "
            "the same one, the grid does not drift, and the due time listed by `delayed-pubsub "
            "pending` (and `scheduleNext`) is the jittered one"
        ),
        example="`5s`",
        does="delay each fire by a fixed offset in [0, jitter), so many schedules do not fire at once",
    ),
    PublishKey(
        SCHEDULE_CATCHUP,
        Group.BOUND,
        needs=SCHEDULE,
        parser=values.catchup,
        value="`one` (default), `all` or `none`",
        meaning=(
            "what a recurring schedule delivers of the occurrences it missed while nothing ran (the "
            "component or Redis down across at least one whole interval; a merely late occurrence "
            "always fires): `one` delivers one message for all of them (the oldest within "
            "`scheduleCatchupWindow`), then goes on from now; `all` delivers each missed occurrence "
            "once, in order, each with its own `scheduleOccurrence`, paced at 20 a second per "
            "schedule; `none` delivers none of them and waits for the next occurrence. Skipped "
            "occurrences are counted in the history (`skipped`). What is missed while paused is "
            "skipped whatever the policy (`schedulePause`)"
        ),
        example="`all`",
        does="catch-up after an outage: one delivery, every missed occurrence, or none",
    ),
    PublishKey(
        SCHEDULE_CATCHUP_WINDOW,
        Group.BOUND,
        needs=SCHEDULE,
        parser=values.catchup_window_ms,
        value="Go duration, positive (default `24h`)",
        meaning=(
            "missed occurrences older than this (at the time the schedule catches up) are skipped, "
            "counted and recorded in the history (`skipped`, reason `CatchupWindow`), under `one` and `all`"
        ),
        example="`1h`",
        readme_joins=SCHEDULE_CATCHUP,
    ),
    PublishKey(
        TTL_IN_SECONDS,
        Group.TTL,
        parser=values.ttl_ms,
        aliases=(TTL,),
        needs_delays=False,
        value="Go duration or whole seconds (under either key, as in Dapr); `never`; empty = absent",
        meaning=(
            "per-message TTL, enforced by the component (it advertises `MESSAGE_TTL`): never "
            "delivered after it expires, not from a stream, not from the delay index (a delayed "
            "message whose TTL ends first never fires), not after a redelivery; CloudEvent and raw "
            "payloads alike. Both keys at once, zero, negative or past year 9999 ⇒ refused. Fired "
            "onto a topic someone else delivers (the fast path, another pub/sub), it goes with the "
            "time left (`ttlInSeconds`, and the CloudEvent `expiration`)"
        ),
        example="`60` / `10m`",
        does="never delivered after it expires; on a schedule: the schedule ends",
    ),
    PublishKey(
        TARGET_PUBSUB,
        Group.TARGET,
        parser=values.target_name,
        needs_delays=False,
        value="a Dapr pub/sub component name",
        meaning=(
            "with a delay key: when due, publish through the sidecar to that pub/sub instead of our "
            "topic "
            "([targets.md](targets.md#delaying-messages-for-your-existing-kafka-rabbitmq-or-redis-pubsub)); "
            "without one: refused (a delayed bulk publish: `targetPubsub` in the request's metadata, "
            "or per entry with the entry's own delay keys)"
        ),
        example="`kafka`",
        does=("when due, publish through the sidecar to that pub/sub ([docs/targets.md](docs/targets.md))"),
    ),
)

BY_NAME: Final[Mapping[str, PublishKey]] = {name: key for key in TABLE for name in key.names}


def _names(keys: Iterable[PublishKey]) -> tuple[str, ...]:
    return tuple(name for key in keys for name in key.names)


# The keys that say when a one-shot is due: a message gives at most one of them.
TIME_KEYS: Final = _names(k for k in TABLE if k.group is Group.TIME)
SCHEDULE_OPTION_KEYS: Final = _names(k for k in TABLE if k.group is Group.BOUND)
# Keys that need enableDelayedMessaging (the control keys too, read apart: control.py).
# The TTL keys are absent on purpose: per-message TTL is ordinary pub/sub behaviour.
DELAY_KEYS: Final = _names(k for k in TABLE if k.needs_delays and k.group is not Group.CONTROL)
# The Pulsar aliases: an empty value means "no delay" there, so it does here.
PULSAR_KEYS: Final = _names(k for k in TABLE if k.empty_is_absent)
TTL_KEYS: Final = _names(k for k in TABLE if k.group is Group.TTL)
CONTROL_KEYS: Final = _names(k for k in TABLE if k.group is Group.CONTROL)
# Keys that only apply to a schedule, in the order their refusal names them.
SCHEDULE_ONLY_KEYS: Final = _names(k for k in TABLE if k.needs == SCHEDULE)
# The delay keys a one-shot delay (delay.parse_delay) does not read: a schedule, its cancel and options.
NOT_ONE_SHOT_KEYS: Final = tuple(k for k in DELAY_KEYS if k not in (*TIME_KEYS, SCHEDULE_ID))
# Every key plan.read_request reads.
REQUEST_KEYS: Final = _names(k for k in TABLE if k.group is not Group.CONTROL)
# Every key planning reads: the rest of a publish's metadata is the user's, passed on verbatim.
ALL_KEYS: Final = frozenset(BY_NAME)


def excludes(name: str) -> tuple[str, ...]:
    """The keys refused beside `name`, in the order a refusal names the first present."""
    return BY_NAME[name].excludes


# --- the unknown-key warning ------------------------------------------------------------


def resembles(key: str) -> str | None:
    """The publish key `key` is a near miss of, or None (a key of ours, or the user's own).

    Publish metadata also carries the user's own keys, passed on verbatim, so
    only a near miss counts: a known key spelt in another case (keys are
    case-sensitive), or one a letter or two away (``scheduleDelay``).
    """
    if key in QUIET_KEYS:
        return None
    meant = _BY_LOWER.get(key.lower())
    if meant is not None:
        return meant
    close = difflib.get_close_matches(key.lower(), list(_BY_LOWER), n=1, cutoff=0.8)
    return _BY_LOWER[close[0]] if close else None


def _warning(key: str, meant: str) -> str:
    if key.lower() == meant.lower():
        return f"publish metadata key {key!r} is not read: keys are case-sensitive, did you mean {meant}?"
    return f"publish metadata key {key!r} is not read: did you mean {meant}?"


def unknown_key_warnings(metadata: Iterable[str]) -> list[str]:
    """One warning per key of `metadata` that looks like a publish key and is not one (resembles).

    Names only, never values.
    """
    return [_warning(key, meant) for key in sorted(set(metadata)) if (meant := resembles(key)) is not None]


# Keys daprd and apps commonly send beside ours (trace context, the CloudEvent
# fields daprd passes on, Dapr's own publish keys): never a near miss, so they
# are answered by the one lookup in QUIET_KEYS, like ours.
COMMON_KEYS: Final[frozenset[str]] = frozenset(
    {
        "traceparent",
        "tracestate",
        "traceid",
        "grpc-trace-bin",
        "rawPayload",
        "contentType",
        "content-type",
        "cloudevent.id",
        "cloudevent.source",
        "cloudevent.type",
        "cloudevent.traceparent",
        "cloudevent.tracestate",
        "cloudevent.pubsub",
        "cloudevent.topic",
        "id",
        "source",
        "type",
        "specversion",
        "datacontenttype",
        "subject",
        "time",
        "partitionKey",
        "queueName",
        "priority",
    }
)
_BY_LOWER: Final[Mapping[str, str]] = {name.lower(): name for name in BY_NAME}
# Keys that are never a near miss, whatever else is in the metadata.
QUIET_KEYS: Final[frozenset[str]] = ALL_KEYS | frozenset(DELIVERED_KEYS) | COMMON_KEYS
# QUIET_KEYS and every key judged since (not a near miss, or one warned about
# already): the hot path asks ``SEEN_KEYS.issuperset(metadata)``, one set
# lookup per key, and calls new_near_misses only for a key it has not seen.
# Bounded, as metadata keys come from publishers and a stream of new ones must
# grow neither the process nor the time a publish takes: past MAX_SEEN keys
# judged, a new key is no longer remembered and only checked for another case
# of one of ours (no typo match). The keys warned about are remembered apart (at
# most MAX_WARNED), so each is warned about once per process; past that bound
# there are no more warnings.
MAX_SEEN: Final = 512
MAX_WARNED: Final = 256
SEEN_KEYS: Final[set[str]] = set(QUIET_KEYS)
_warned: set[str] = set()


def new_near_misses(metadata: Iterable[str]) -> list[str]:
    """The warnings for the near misses in `metadata` not warned about before in this process.

    Each key is judged (resembles) once and remembered in SEEN_KEYS; a near
    miss is warned about once.
    """
    out: list[str] = []
    for key in metadata:
        if key in SEEN_KEYS:
            continue
        if len(SEEN_KEYS) < len(QUIET_KEYS) + MAX_SEEN:
            SEEN_KEYS.add(key)
            meant = resembles(key)
        else:
            # Full: a stream of new keys (ids in key names, or a hostile
            # publisher's) must not cost a fuzzy match (~36 us) each. Another
            # case of one of ours is still caught, by one lookup.
            meant = _BY_LOWER.get(key.lower())
        if meant is None or key in _warned or len(_warned) >= MAX_WARNED:
            continue
        _warned.add(key)
        out.append(_warning(key, meant))
    return out


def forget_near_misses() -> None:
    """Forget every key judged and warned about, as a new process would (tests)."""
    SEEN_KEYS.intersection_update(QUIET_KEYS)
    _warned.clear()


def remembered_keys() -> int:
    """How many keys new_near_misses remembers beside QUIET_KEYS (at most MAX_SEEN + MAX_WARNED)."""
    return len(SEEN_KEYS) - len(QUIET_KEYS) + len(_warned)


# --- the docs' key tables -----------------------------------------------------------------

REFERENCE_PATH: Final = Path("docs") / "publish-metadata.md"
README_PATH: Final = Path("README.md")
_BEGIN: Final = (
    "<!-- The key table is generated from middleware/delayed_middleware/publish_keys.py by "
    "`python -m delayed_middleware.publish_keys --write`: edit it there. -->"
)
_END: Final = "<!-- end of the generated key table -->"
_GENERATED: Final = re.compile(re.escape(_BEGIN) + r"\n.*?" + re.escape(_END), re.DOTALL)


def _keys_cell(names: Sequence[str]) -> str:
    return " / ".join(f"`{name}`" for name in names)


def render_reference() -> str:
    """docs/publish-metadata.md's key table: every key, its value and its meaning."""
    lines = ["| key | value | meaning |", "|---|---|---|"]
    lines += [f"| {_keys_cell(k.names)} | {k.value} | {k.meaning} |" for k in TABLE]
    return "\n".join(lines)


def render_readme() -> str:
    """README.md's short key table: a key (with the keys that join its row), an example, what it does."""
    lines = ["| key | example | does |", "|---|---|---|"]
    for k in TABLE:
        if not k.example or k.readme_joins:
            continue
        joined = [j.name for j in TABLE if j.readme_joins == k.name]
        lines.append(f"| {_keys_cell([*k.names, *joined])} | {k.example} | {k.does} |")
    return "\n".join(lines)


def with_table(text: str, table: str) -> str:
    """`text` with its generated key table replaced by `table` (ValueError: no markers)."""
    if _GENERATED.search(text) is None:
        raise ValueError(f"no generated key table: the table must sit between {_BEGIN!r} and {_END!r}")
    return _GENERATED.sub(lambda _: f"{_BEGIN}\n{table}\n{_END}", text, count=1)


def generated_files(root: Path) -> dict[Path, str]:
    """Each file holding a generated key table, by its path from `root`, as it should read."""
    return {
        REFERENCE_PATH: with_table((root / REFERENCE_PATH).read_text(encoding="utf-8"), render_reference()),
        README_PATH: with_table((root / README_PATH).read_text(encoding="utf-8"), render_readme()),
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Write (or --check) the key tables of the docs under --root."""
    parser = argparse.ArgumentParser(prog="python -m delayed_middleware.publish_keys", description=__doc__)
    parser.add_argument("--root", type=Path, default=Path.cwd(), help="the source tree (default: here)")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help="write the generated tables")
    mode.add_argument("--check", action="store_true", help="exit 1 if a generated table is out of date")
    args = parser.parse_args(argv)
    return write_or_check(args.root, generated_files(args.root), write=args.write)


if __name__ == "__main__":
    sys.exit(main())
