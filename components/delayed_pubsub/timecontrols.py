"""Executes scheduleTrigger and scheduleReschedule requests of a publish.

Planning (delayed_middleware.control) has validated the request; the engine
(delayed_middleware.engine.timecontrol) does the work. As with scheduleCancel,
an id with nothing pending is not an error: it is logged and counted
(`delayed_pubsub_time_controls{op, result="unknown"}`). A reschedule that lost
the race to its own fire is refused (FAILED_PRECONDITION: the publisher asked to
move something that already went out), and so is one of a recurring schedule
(INVALID_ARGUMENT: publish it again to replace it).
"""

from __future__ import annotations

import hashlib
import json
import logging

from delayed_middleware.control import Reschedule, Trigger
from delayed_middleware.engine import ShardedEngine
from delayed_middleware.engine import timecontrol as tc
from delayed_middleware.errors import FailedPreconditionError, InvalidArgumentError
from delayed_middleware.instants import format_instant
from delayed_middleware.publish_keys import SCHEDULE_RESCHEDULE
from delayed_pubsub.metrics import InstanceMetrics

# The history `reason` of a publisher's trigger and reschedule (the CLI and dashboard write their own).
TRIGGER_REASON = "scheduleTrigger"
RESCHEDULE_REASON = "scheduleReschedule"


def request_identity(data: bytes) -> str:
    """A trigger publish's identity: its CloudEvent id (daprd's envelope keeps it across
    daprd's own retries of one publish), hashed to a bounded size; '' when the data is not a
    CloudEvent (a raw payload): then every publish is a new trigger."""
    if not data.startswith(b"{"):
        return ""
    try:
        event = json.loads(data)
    except ValueError:
        return ""
    id = event.get("id") if isinstance(event, dict) and "specversion" in event else None
    if not isinstance(id, str) or not id:
        return ""
    return hashlib.sha256(id.encode()).hexdigest()[:32]


async def time_control_request(
    engine: ShardedEngine,
    request: Trigger | Reschedule,
    metrics: InstanceMetrics,
    log: logging.Logger,
    data: bytes = b"",
) -> None:
    """Trigger or reschedule one id; logs and counts the outcome, raises the refusals.
    `data`: the publish's data, whose CloudEvent id makes a retried trigger deliver once."""
    stream = engine.keys.stream
    id = request.schedule_id
    if isinstance(request, Trigger):
        op, result = "trigger", await engine.trigger(id, reason=TRIGGER_REASON, request=request_identity(data))
    else:
        op = "reschedule"
        result = await engine.reschedule(id, request.due_ms, reason=RESCHEDULE_REASON)
    label = result.status if result.status in (tc.TRIGGERED, tc.RESCHEDULED, tc.FIRED) else tc.UNKNOWN
    if result.status in (tc.RECURRING, tc.FAILED) or (op == "reschedule" and result.status == tc.FIRED):
        label = "refused"
    if metrics.time_controls is not None:
        metrics.time_controls.labels(metrics.name, op, label).inc()
    if result.done:
        when = format_instant(result.at_ms)
        log.info("%s %r on %s (%s)", result.status, id, stream, when)
        return
    if isinstance(request, Reschedule):
        if result.status == tc.RECURRING:
            raise InvalidArgumentError(
                SCHEDULE_RESCHEDULE,
                request.value,
                f"scheduleId {id!r} is a recurring schedule: publish it again with that scheduleId to replace it",
            )
        if result.status == tc.FIRED:
            raise FailedPreconditionError(f"scheduleReschedule of scheduleId {id!r}: already fired")
    if result.status == tc.FAILED:
        raise FailedPreconditionError(f"scheduleTrigger of scheduleId {id!r}: not delivered: {result.detail}")
    log.info(
        "%s of %r on %s: nothing pending under that id (%s)",
        op,
        id,
        stream,
        {
            tc.FIRED: "already fired",
            tc.PARKED: "held for a bad target (parked)",
            tc.EXPIRED: "its TTL ended",
        }.get(result.status, "fired, cancelled or never there"),
    )
