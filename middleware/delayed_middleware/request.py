"""A publish's metadata, read once into a typed Request, by the rules of the table of keys.

planning (plan.py) works on the Request this returns, never on the keys: which
message is delayed or scheduled and when (Timing), which id it cancels, which
control request it is (pause, resume, cancel by prefix), its own TTL. Every
bad value raises InvalidArgumentError naming its key and value before anything
is stored. Each key's grammar is its row's parser (publish_values.py, called
by delay.py, ttl.py, target.py, control.py and here); which key needs or
excludes which is the table's (publish_keys.py); the rules between keys are
here. A row no rule here reads is an option, read by its row alone. Pure: time comes in
through the PlanContext.

Topic rules (the engine's reserved namespace, keys.py), for the topic and for
scheduleSource alike: a topic that is an engine key (`...-delayed}...`) is
refused for publish and subscribe; a delayed topic (`...-delayed`) only the
engine writes, whatever the caller's consumerID, because a plain XADD with
trimming (maxLenApprox, streamTTL) would drop pending envelopes; subscribing
to one is allowed.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from delayed_middleware import publish_values as values
from delayed_middleware.control import Control, read_control
from delayed_middleware.delay import DISABLED_REASON, Delay, delay_keys_in, parse_delay
from delayed_middleware.durations import format_go_duration
from delayed_middleware.errors import InvalidArgumentError
from delayed_middleware.keys import is_delayed_topic, is_engine_key
from delayed_middleware.publish_keys import (
    BY_NAME,
    NOT_ONE_SHOT_KEYS,
    SCHEDULE,
    SCHEDULE_CANCEL,
    SCHEDULE_CATCHUP,
    SCHEDULE_CATCHUP_WINDOW,
    SCHEDULE_END,
    SCHEDULE_ID,
    SCHEDULE_JITTER,
    SCHEDULE_LIMIT,
    SCHEDULE_ONLY_KEYS,
    SCHEDULE_SOURCE,
    SCHEDULE_START,
    SCHEDULE_TIME_ZONE,
    SCHEDULE_TTL,
    TABLE,
    TTL_KEYS,
    PublishKey,
    excludes,
)
from delayed_middleware.publish_values import MAX_SCHEDULE_ID_LENGTH
from delayed_middleware.schedules import Schedule, first_fire, parse_schedule, with_bounds
from delayed_middleware.target import target_pubsub
from delayed_middleware.ttl import parse_schedule_ttl, parse_ttl

MAX_TOPIC_LENGTH = 1024

_TTL_KEYS = frozenset(TTL_KEYS)
# The keys the rules below read, each by its own rule. A row of the table that is
# none of them is an option: read by its row alone (_read_options).
_RULED: frozenset[str] = frozenset(BY_NAME)

# The keys of the schedules contract that parse_delay (one-shot delays) does not read.
_SCHEDULE_KEYS = frozenset(NOT_ONE_SHOT_KEYS)


@dataclass(frozen=True)
class PlanContext:
    """What planning needs to know about the instance and the moment."""

    now_ms: int
    pubsub_name: str
    enabled: bool
    max_delay_ms: int | None = None
    default_target_pubsub: str = ""


@dataclass(frozen=True)
class Timing:
    """When (and how often) a message is to be delivered: what one envelope needs.

    Attributes:
        due_ms: the first (or only) due time, epoch ms, never before now.
        schedule_id: the publisher's scheduleId, or None.
        schedule: a recurring schedule (``@every``, cron), else None (one-shot).
        source: scheduleSource: deliver that topic's latest message at each fire.
        schedule_ttl_ms: scheduleTTL: the TTL of each produced message, 0 = none.
        target_pubsub: targetPubsub (or the component's defaultTargetPubsub): the
            Dapr pub/sub the due message is handed to, '' = our own topic.
    """

    due_ms: int
    schedule_id: str | None
    schedule: Schedule | None = None
    source: str = ""
    schedule_ttl_ms: int = 0
    target_pubsub: str = ""
    # scheduleCatchup (a kinds.Catchup number) and scheduleCatchupWindow (ms, 0 = the default).
    catchup: int = 0
    catchup_window_ms: int = 0


@dataclass(frozen=True)
class Request:
    """What one message's metadata asks for, validated.

    Attributes:
        timing: delay or schedule it (None: deliver now, unless a cancel).
        cancel: the scheduleId to cancel (scheduleCancel=true); nothing is stored then.
        expires_at_ms: its own TTL (ttlInSeconds / ttl) as an instant, 0 = never.
        control: a pause, resume or cancel by prefix (control.py; read_publish only):
            a request that changes pending state and stores no message.
        options: (name, typed value) of each option key given, in the table's
            order: a key of the table no rule here reads, parsed by its row's parser.
    """

    timing: Timing | None = None
    cancel: str | None = None
    expires_at_ms: int = 0
    control: Control | None = None
    options: tuple[tuple[str, object], ...] = ()


def read_request(
    metadata: Mapping[str, str], ctx: PlanContext, table: Sequence[PublishKey] = TABLE
) -> Request:
    """Read the delay, schedule, cancel, TTL and target keys of one message's metadata, and its options.

    ``targetPubsub`` (else the component's ``defaultTargetPubsub``) names the
    Dapr pub/sub a delayed message is handed to when due; without a delay it
    is refused (target.target_pubsub). `table` is the table of keys: a row no
    rule here reads is an option (_read_options).
    """
    request = _read_timing(metadata, ctx)
    target = target_pubsub(metadata, delayed=request.timing is not None, default=ctx.default_target_pubsub)
    if target is not None and request.timing is not None:
        request = replace(request, timing=replace(request.timing, target_pubsub=target))
    options = _OPTION_ROWS if table is TABLE else _option_rows(table)
    if not options or request.cancel is not None:
        return request
    return replace(request, options=tuple(_read_options(metadata, ctx, options).items()))


def _option_rows(table: Sequence[PublishKey]) -> tuple[PublishKey, ...]:
    return tuple(row for row in table if row.name not in _RULED)


# Every row of the table is read by a rule today: a key added as a row alone is an option.
_OPTION_ROWS = _option_rows(TABLE)


def _read_options(
    metadata: Mapping[str, str], ctx: PlanContext, rows: Sequence[PublishKey]
) -> Mapping[str, object]:
    """The option keys given, each checked by its row (delayed messaging, the key it needs, the
    keys it excludes, one spelling) and parsed by its row's parser, in the table's order."""
    options: dict[str, object] = {}
    for row in rows:
        given = [n for n in row.names if n in metadata and not (row.empty_is_absent and metadata[n] == "")]
        if not given:
            continue
        key, value = given[0], metadata[given[0]]
        if len(given) > 1:
            raise InvalidArgumentError(
                given[1],
                metadata[given[1]],
                f"given together with {key}={value!r}: give one of them, not both",
            )
        if row.needs_delays and not ctx.enabled:
            raise InvalidArgumentError(key, value, DISABLED_REASON)
        if row.needs and row.needs not in metadata:
            raise InvalidArgumentError(key, value, f"only applies with {row.needs}: give {row.needs} too")
        for other in row.excludes:
            if other in metadata:
                raise InvalidArgumentError(
                    other, metadata[other], f"given together with {key}={value!r}: give one of them, not both"
                )
        options[row.name] = row.parser(key, value)
    return options


def plain_cancel(metadata: Mapping[str, str], ctx: PlanContext) -> str | None:
    """The scheduleId when `metadata` is exactly a valid ``scheduleCancel: true`` +
    ``scheduleId``, else None (read_request then decides, errors included).

    A bulk of cancels is read at ~100k entries/s: this recognises the plain
    form in a few dictionary lookups. It accepts only what read_request reads
    as ``Request(cancel=<id>)``, so the two never disagree; anything else
    (other keys, a control character or an over-long id, disabled delays)
    takes the general path.
    """
    if len(metadata) != 2 or not ctx.enabled:
        return None
    schedule_id = metadata.get(SCHEDULE_ID)
    cancel = metadata.get(SCHEDULE_CANCEL)
    if not schedule_id or cancel is None or (cancel != "true" and cancel.lower() != "true"):
        return None
    # isprintable() is False for every control character and lone surrogate
    # (the ids _check_schedule_id refuses), and for a few more the general
    # path accepts: those take it.
    if len(schedule_id) > MAX_SCHEDULE_ID_LENGTH or not schedule_id.isprintable():
        return None
    return schedule_id


def _read_timing(metadata: Mapping[str, str], ctx: PlanContext) -> Request:
    """Read the delay, schedule, cancel and TTL keys of one message's metadata.

    Pure, and complete before anything is stored: every bad value raises
    InvalidArgumentError naming its key and value. The rules beyond each key's
    own grammar (delay.py, schedules.py, ttl.py; which key needs or excludes
    which is the table's, publish_keys.py):

    - TTL keys work with or without delayed messaging (plain pub/sub behaviour);
      every other key of DELAY_KEYS needs enableDelayedMessaging.
    - ``scheduleCancel``: ``true`` (or ``false``, = absent), with ``scheduleId``
      and without any timing key: the request cancels, it schedules nothing.
    - One timing per message: ``schedule``, ``scheduledSendTime``,
      ``scheduledSendDelay`` and pubsub.pulsar's ``deliverAt`` / ``deliverAfter``
      exclude each other (the refusal names both keys); an
      ``@at`` schedule is a one-shot (a past instant: at once), the others
      recur. ``maxDelay`` bounds the first fire.
    - ``scheduleSource`` and ``scheduleTTL`` need ``schedule``; the source must
      be a topic one may publish to.
    - ``ttl``/``ttlInSeconds`` on a recurring schedule end the schedule (its
      fires stop then); ``scheduleTTL`` is the TTL of each produced message.
    """
    expires_at_ms = 0 if _TTL_KEYS.isdisjoint(metadata) else parse_ttl(metadata, now_ms=ctx.now_ms) or 0
    if _SCHEDULE_KEYS.isdisjoint(metadata):
        # The common case (a one-shot delay, or nothing): parse_delay alone.
        return Request(timing=_one_shot(_delay(metadata, ctx)), expires_at_ms=expires_at_ms)
    present = delay_keys_in(metadata)
    # parse_delay refuses every delay key while disabled, and empty values, for
    # the schedule keys too: call it on the whole metadata first only for that.
    if not ctx.enabled or any(metadata[key] == "" for key in present):
        _delay(metadata, ctx)
    schedule_id = metadata.get(SCHEDULE_ID) or None
    if _is_cancel(metadata, present, schedule_id, ctx):
        return Request(cancel=schedule_id, expires_at_ms=expires_at_ms)
    delay = _delay({k: v for k, v in metadata.items() if k not in _SCHEDULE_KEYS}, ctx)
    expr = metadata.get(SCHEDULE)
    if expr is None:
        for key in SCHEDULE_ONLY_KEYS:
            if (value := metadata.get(key)) is not None:
                raise InvalidArgumentError(key, value, "only applies to a schedule: give schedule too")
        return Request(timing=_one_shot(delay), expires_at_ms=expires_at_ms)
    for key in excludes(SCHEDULE):
        if key in present:
            raise InvalidArgumentError(
                key, metadata[key], f"given together with schedule={expr!r}: give one of them, not both"
            )
    return Request(timing=_schedule_timing(metadata, expr, schedule_id, ctx), expires_at_ms=expires_at_ms)


def _one_shot(delay: Delay | None) -> Timing | None:
    return None if delay is None else Timing(delay.due_ms, delay.schedule_id)


def _is_cancel(
    metadata: Mapping[str, str], present: list[str], schedule_id: str | None, ctx: PlanContext
) -> bool:
    """True when `metadata` is a valid cancel (scheduleCancel=true); refuses a bad one.

    ``scheduleCancel: false`` is the key left out: False.
    """
    cancel = metadata.get(SCHEDULE_CANCEL)
    if cancel is None:
        return False
    if not values.cancel_flag(SCHEDULE_CANCEL, cancel):
        return False
    if schedule_id is None:
        raise InvalidArgumentError(
            SCHEDULE_CANCEL, cancel, "needs scheduleId: the id of the message or schedule to cancel"
        )
    # Validates the id (length, control characters).
    _delay({SCHEDULE_ID: schedule_id}, ctx)
    for key in excludes(SCHEDULE_CANCEL):
        if key in present:
            raise InvalidArgumentError(
                key, metadata[key], "a cancel (scheduleCancel=true) schedules nothing: leave it out"
            )
    return True


def _schedule_timing(
    metadata: Mapping[str, str], expr: str, schedule_id: str | None, ctx: PlanContext
) -> Timing:
    """The Timing of a ``schedule`` (its zone, bounds, jitter, source and scheduleTTL read too)."""
    schedule = parse_schedule(expr, now_ms=ctx.now_ms, time_zone=metadata.get(SCHEDULE_TIME_ZONE))
    schedule = with_bounds(
        schedule,
        now_ms=ctx.now_ms,
        key=schedule_id or "",
        seed=_seed(metadata, ctx) if schedule_id is None and SCHEDULE_JITTER in metadata else "",
        start=metadata.get(SCHEDULE_START),
        end=metadata.get(SCHEDULE_END),
        limit=metadata.get(SCHEDULE_LIMIT),
        jitter=metadata.get(SCHEDULE_JITTER),
    )
    due_ms = first_fire(schedule, now_ms=ctx.now_ms, key=schedule_id or "")
    if due_ms is None:
        raise InvalidArgumentError(SCHEDULE, expr, "never fires")
    if ctx.max_delay_ms is not None and due_ms - ctx.now_ms > ctx.max_delay_ms:
        raise InvalidArgumentError(
            SCHEDULE,
            expr,
            f"first fires {format_go_duration(due_ms - ctx.now_ms)} from now, "
            f"more than the maximum delay of {format_go_duration(ctx.max_delay_ms)}",
        )
    source = metadata.get(SCHEDULE_SOURCE)
    if source is not None:
        try:
            check_topic(source)
        except InvalidArgumentError as err:
            raise InvalidArgumentError(SCHEDULE_SOURCE, source, err.reason) from None
    schedule_ttl = metadata.get(SCHEDULE_TTL)
    catchup, window = _catchup(metadata, schedule)
    return Timing(
        due_ms,
        schedule_id,
        schedule=schedule if schedule.recurring else None,
        source=source or "",
        schedule_ttl_ms=0 if schedule_ttl is None else parse_schedule_ttl(schedule_ttl) or 0,
        catchup=catchup,
        catchup_window_ms=window,
    )


def _catchup(metadata: Mapping[str, str], schedule: Schedule) -> tuple[int, int]:
    """scheduleCatchup and scheduleCatchupWindow (catchup.py): a recurring schedule's only."""
    policy, window = metadata.get(SCHEDULE_CATCHUP), metadata.get(SCHEDULE_CATCHUP_WINDOW)
    for key, value in ((SCHEDULE_CATCHUP, policy), (SCHEDULE_CATCHUP_WINDOW, window)):
        if value is not None and not schedule.recurring:
            raise InvalidArgumentError(
                key,
                value,
                "applies to a recurring schedule (@every, cron, @daily, ...), not to a one-shot @at",
            )
    return (
        0 if policy is None else values.catchup(SCHEDULE_CATCHUP, policy),
        0 if window is None else values.catchup_window_ms(SCHEDULE_CATCHUP_WINDOW, window),
    )


def _seed(metadata: Mapping[str, str], ctx: PlanContext) -> str:
    """What a jittered schedule without a scheduleId hashes its offsets by.

    Derived from the request (its metadata and acceptance time), so planning
    stays pure; stored with the schedule, so every replica agrees on it. Two
    such schedules published with the same metadata in the same millisecond
    share their offsets: give them scheduleIds to spread them.
    """
    text = "\0".join(f"{k}={v}" for k, v in sorted(metadata.items()))
    return hashlib.blake2b(f"{ctx.now_ms}\0{text}".encode(), digest_size=6).hexdigest()


def check_topic(topic: str, *, subscribe: bool = False) -> None:
    """Refuse topics that are not the user's to write (or, for engine keys, to read)."""
    if not topic:
        raise InvalidArgumentError("topic", topic, "must not be empty")
    if len(topic) > MAX_TOPIC_LENGTH:
        raise InvalidArgumentError("topic", topic, f"longer than {MAX_TOPIC_LENGTH} characters")
    if is_engine_key(topic):
        raise InvalidArgumentError("topic", topic, "reserved: a key of the delay engine, not a topic")
    if not subscribe and is_delayed_topic(topic):
        raise InvalidArgumentError(
            "topic",
            topic,
            "reserved for pending delayed messages (topics ending in -delayed are written by the delay "
            "engine only); publish with a delay instead, or subscribe to read it",
        )


def _delay(metadata: Mapping[str, str], ctx: PlanContext) -> Delay | None:
    return parse_delay(metadata, now_ms=ctx.now_ms, enabled=ctx.enabled, max_delay_ms=ctx.max_delay_ms)


def read_publish(
    metadata: Mapping[str, str], ctx: PlanContext, table: Sequence[PublishKey] = TABLE
) -> Request:
    """Read one Publish's metadata: a cancel, a control request, or a message's timing and TTL.

    The control keys (schedulePause, scheduleIdPrefix, scheduleTrigger,
    scheduleReschedule) are read first: a
    control request stores no message, so no other key applies to it.
    (plain_cancel is a shortcut for the commonest cancel that planning takes
    before this; it answers as this does.)
    """
    if (
        control := read_control(
            metadata, enabled=ctx.enabled, now_ms=ctx.now_ms, max_delay_ms=ctx.max_delay_ms
        )
    ) is not None:
        return Request(control=control)
    return read_request(metadata, ctx, table)
