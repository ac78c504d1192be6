"""Time control under a real daprd (the session stack: no daprd of its own): trigger now, reschedule and
a schedule's catch-up after the component stood still, published the way a user does (HTTP publish with
`?metadata.`), checked the way a user checks them: what arrives, when, with which `scheduleoccurrence`."""

from __future__ import annotations

import itertools
import os
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from tests.e2e.conftest import PUBSUB
from tests.e2e.harness import LATENESS_TOLERANCE_MS, Stack, now_ms, unique
from tests.e2e.user import TOPIC, cancel, header, instant_ms, ok_arrivals

pytestmark = pytest.mark.e2e


def publish(stack: Stack, metadata: dict[str, str], body: dict[str, str] | None = None) -> tuple[int, int]:
    """An HTTP publish through daprd (body optional: a control needs none); (when it was sent, when
    daprd answered 204)."""
    sent = now_ms()
    response = stack.publish(PUBSUB, TOPIC, body if body is not None else b"", metadata=metadata)
    assert response.status_code == 204, response.text
    return sent, now_ms()


def test_http_trigger_delivers_a_one_shot_due_in_an_hour_now_and_once(stack: Stack) -> None:
    marker, id = unique("trig"), unique("sched")
    publish(stack, {"scheduledSendDelay": "1h", "scheduleId": id}, {"id": marker})
    sent, answered = publish(stack, {"scheduleId": id, "scheduleTrigger": "true"})
    [fire] = ok_arrivals(stack, marker, 1, timeout=5)
    assert fire["received_ms"] - answered <= LATENESS_TOLERANCE_MS
    # Its occurrence is the trigger's time: within the triggering publish's window.
    assert sent <= instant_ms(header(fire, "scheduleOccurrence")) <= answered
    assert header(fire, "scheduleNext") == "purge"
    time.sleep(1.5)
    assert len(ok_arrivals(stack, marker, 2, timeout=0)) == 1, "delivered twice"


def test_http_trigger_of_a_schedule_delivers_one_extra_and_keeps_its_grid(stack: Stack) -> None:
    marker, id = unique("trigs"), unique("sched")
    sent, answered = publish(stack, {"schedule": "@every 3s", "scheduleId": id}, {"id": marker})
    t_sent, t_answered = publish(stack, {"scheduleId": id, "scheduleTrigger": "true"}, {"ignored": "x"})
    extra, regular = ok_arrivals(stack, marker, 2, timeout=6)
    cancel(stack, TOPIC, id)
    assert t_sent <= instant_ms(header(extra, "scheduleOccurrence")) <= t_answered
    assert extra["received_ms"] < sent + 3000, "the trigger waited for the grid"
    # The grid did not move: the regular fire is the first @every 3s occurrence, the one the extra named.
    occurrence = instant_ms(header(regular, "scheduleOccurrence"))
    assert sent + 3000 <= occurrence <= answered + 3000
    assert header(extra, "scheduleNext") == header(regular, "scheduleOccurrence")
    assert header(extra, "scheduler") == header(regular, "scheduler") == id


def test_http_reschedule_moves_a_one_shot_and_refuses_a_fired_one(stack: Stack) -> None:
    marker, id = unique("resched"), unique("sched")
    publish(stack, {"scheduledSendDelay": "1h", "scheduleId": id}, {"id": marker})
    sent, answered = publish(stack, {"scheduleId": id, "scheduleReschedule": "2s"})
    [fire] = ok_arrivals(stack, marker, 1, timeout=6)
    assert sent + 2000 <= fire["received_ms"] <= answered + 2000 + LATENESS_TOLERANCE_MS
    # It already fired: gRPC FAILED_PRECONDITION from the component, which daprd answers as a 500.
    response = stack.publish(PUBSUB, TOPIC, b"", metadata={"scheduleId": id, "scheduleReschedule": "1h"})
    assert response.status_code == 500, response.text
    assert response.json()["errorCode"] == "ERR_PUBSUB_PUBLISH_MESSAGE"
    assert "FailedPrecondition" in response.text, response.text
    assert "already fired" in response.text, response.text
    assert id in response.text
    time.sleep(1)
    assert len(ok_arrivals(stack, marker, 2, timeout=0)) == 1


@contextmanager
def component_stopped(stack: Stack) -> Iterator[None]:
    """The component frozen (SIGSTOP to its process group) and then thawed: to its schedules, every
    replica down for that long; daprd's streams to it stay open, so nothing has to be restarted."""
    assert stack.component is not None
    assert stack.component.proc is not None
    group = os.getpgid(stack.component.proc.pid)
    os.killpg(group, signal.SIGSTOP)
    try:
        yield
    finally:
        os.killpg(group, signal.SIGCONT)


def test_catch_up_all_delivers_each_missed_occurrence_and_none_delivers_none(stack: Stack) -> None:
    assert stack.component is not None, "the session stack runs the component as its own process"
    every, skip = unique("cuall"), unique("cunone")
    ids = {every: unique("sched"), skip: unique("sched")}
    for marker, policy in ((every, "all"), (skip, "none")):
        publish(
            stack,
            {"schedule": "@every 1s", "scheduleId": ids[marker], "scheduleCatchup": policy},
            {"id": marker},
        )
    ok_arrivals(stack, every, 1, timeout=4)
    ok_arrivals(stack, skip, 1, timeout=4)
    stopped = now_ms()
    with component_stopped(stack):
        time.sleep(4)
    resumed = now_ms()
    time.sleep(2)
    for marker in ids:
        cancel(stack, TOPIC, ids[marker])

    def occurrences(marker: str) -> list[int]:
        return [instant_ms(header(a, "scheduleOccurrence")) for a in ok_arrivals(stack, marker, 1, 0)]

    caught = occurrences(every)
    # `all`: one second after another, none missing, none twice, across the four seconds it stood still.
    assert caught == sorted(set(caught)), caught
    assert [b - a for a, b in itertools.pairwise(caught)] == [1000] * (len(caught) - 1), caught
    assert sum(stopped + 1000 < ms < resumed - 1000 for ms in caught) >= 2, caught
    # `none`: after the last occurrence due before the stop, the next is the one merely late at the
    # thaw (its successor was still ahead), not the oldest missed one as `one` would deliver.
    skipped = occurrences(skip)
    before = max(ms for ms in skipped if ms <= stopped)
    after = min(ms for ms in skipped if ms > before)
    assert after >= resumed - 1100, (stopped, resumed, skipped)
