"""Executes the control requests of a publish: schedulePause and scheduleIdPrefix cancels.

Planning (delayed_middleware.control) has validated the request; the engine
(delayed_middleware.engine.pause) does the work. As with scheduleCancel, an id with
nothing pending is not an error (it may have fired or been cancelled already):
it is logged and counted (`delayed_pubsub_pauses{result="unknown"}`).
"""

from __future__ import annotations

import logging

from delayed_middleware.control import CancelPrefix, Control, Pause, Reschedule, Trigger
from delayed_middleware.engine import ShardedEngine
from delayed_middleware.engine import pause as pausing
from delayed_pubsub.metrics import InstanceMetrics
from delayed_pubsub.timecontrols import time_control_request

# The history `reason` of a publisher's pause and resume (the CLI writes its own).
PAUSE_REASON = "schedulePause"
# A prefix cancel's records carry scheduleCancel's reason: markers and readers treat them alike.
CANCEL_REASON = "Remove"


async def control_request(
    engine: ShardedEngine, request: Control, metrics: InstanceMetrics, log: logging.Logger, data: bytes = b""
) -> None:
    """Pause, resume, cancel by prefix, trigger or reschedule; logs and counts the outcome."""
    stream = engine.keys.stream
    if isinstance(request, (Trigger, Reschedule)):
        await time_control_request(engine, request, metrics, log, data)
        return
    if isinstance(request, Pause):
        result = await engine.set_paused(request.schedule_id, pause=request.pause, reason=PAUSE_REASON)
        # Parked: held for a bad target, nothing to pause or resume, as for an unknown id.
        if result.status in (pausing.UNKNOWN, pausing.PARKED):
            label = pausing.UNKNOWN
        else:
            label = result.status if result.changed else "unchanged"
        if metrics.pauses is not None:
            metrics.pauses.labels(metrics.name, label).inc()
        what = "pause" if request.pause else "resume"
        if result.changed:
            log.info("%s %r on %s", result.status, request.schedule_id, stream)
        elif result.status == pausing.ALREADY:
            log.info(
                "schedulePause=%s of %r on %s: %sd already",
                str(request.pause).lower(),
                request.schedule_id,
                stream,
                what,
            )
        else:
            log.info(
                "schedulePause=%s of %r on %s: nothing pending under that id (%s)",
                str(request.pause).lower(),
                request.schedule_id,
                stream,
                "held for a bad target (parked)"
                if result.status == pausing.PARKED
                else "fired, cancelled or never there",
            )
        return
    assert isinstance(request, CancelPrefix)
    cancelled = await engine.cancel_prefix(request.prefix, reason=CANCEL_REASON)
    log.info("scheduleCancel with scheduleIdPrefix %r on %s: cancelled %d", request.prefix, stream, cancelled)
    if cancelled:
        metrics.cancelled.inc(cancelled)
    if metrics.prefix_cancelled is not None:
        metrics.prefix_cancelled.inc(cancelled)
