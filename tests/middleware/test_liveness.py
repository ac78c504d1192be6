"""Supervised loops end only on our stop flag; any other end is reported and restarted."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from delayed_middleware.backoff import Backoff
from delayed_middleware.liveness import Supervised
from tests.waiting import wait_until

FAST = Backoff(base_s=0.01, cap_s=0.05)


async def test_a_loop_that_raises_is_logged_at_error_counted_and_restarted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    runs: list[int] = []
    states: list[bool] = []

    async def body(stop: asyncio.Event) -> None:
        runs.append(len(runs))
        if len(runs) < 3:
            raise RuntimeError("a bug")
        await stop.wait()

    loop = Supervised("the loop", body, backoff=FAST, on_state=lambda up, _: states.append(up))
    loop.start()
    try:
        await wait_until(lambda: len(runs) == 3 and loop.up, "a third run", every_s=0.01)
        assert loop.restarts == 2
        assert states == [True, False, True, False, True]
        errors = [r for r in caplog.records if r.levelno == logging.ERROR]
        assert len(errors) == 2
        assert "the loop ended unexpectedly" in errors[0].getMessage()
        assert "a bug" in errors[0].getMessage()
    finally:
        assert await loop.stop()
    assert not loop.up


async def test_a_loop_started_but_not_yet_run_is_not_down_and_one_that_ended_is() -> None:
    ended = asyncio.Event()

    async def body(stop: asyncio.Event) -> None:
        ended.set()  # returns without a stop: it ended, and waits for its restart

    loop = Supervised("fresh", body, backoff=Backoff(base_s=30.0, cap_s=30.0))
    loop.start()
    try:
        # start() only schedules the first run: a health report made now (as a worker's
        # first heartbeat is) must not see an "ended" loop.
        assert not loop.down
        await wait_until(ended.is_set, "the first run ended", every_s=0.01)
        await wait_until(lambda: loop.down, "down, waiting for its restart", every_s=0.01)
    finally:
        await loop.stop()


async def test_a_loop_that_returns_without_a_stop_is_restarted() -> None:
    runs = 0

    async def body(stop: asyncio.Event) -> None:
        nonlocal runs
        runs += 1

    loop = Supervised("returns", body, backoff=FAST)
    loop.start()
    try:
        await wait_until(lambda: runs >= 3, "three runs", every_s=0.01)
        assert loop.restarts >= 2
    finally:
        await loop.stop()


async def test_a_failed_taskgroup_child_is_no_stop_and_the_next_run_starts_clean() -> None:
    """Python 3.11: a TaskGroup child failing while its parent waits in __aexit__
    leaves a cancellation request on the parent. Read as a stop, it ended firing."""
    seen: list[int] = []

    async def failing_child() -> None:
        await asyncio.sleep(0.01)
        raise ConnectionError("an APPEND failed")

    async def body(stop: asyncio.Event) -> None:
        task = asyncio.current_task()
        assert task is not None
        seen.append(task.cancelling())
        if len(seen) == 1:
            try:
                async with asyncio.TaskGroup() as tg:
                    tg.create_task(failing_child())
            except BaseExceptionGroup:
                pass
            # What the old check looked at: a request nobody meant as a stop.
            seen.append(task.cancelling())
            raise asyncio.CancelledError  # the old check's reaction, ending the run
        await stop.wait()

    loop = Supervised("fire", body, backoff=FAST)
    loop.start()
    try:
        await wait_until(lambda: len(seen) == 3, "the second run", every_s=0.01)
        assert loop.up
        assert loop.restarts == 1
        # The second run's task carries no leftover request.
        assert seen[2] == 0
    finally:
        await loop.stop()


async def test_stop_is_prompt_even_when_the_body_swallows_cancellation() -> None:
    """redis-py can swallow a CancelledError: a real stop must still end the loop fast."""
    swallowed = 0

    async def body(stop: asyncio.Event) -> None:
        nonlocal swallowed
        while True:  # ignores the stop flag on purpose
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                swallowed += 1
                if swallowed > 3:
                    raise

    loop = Supervised("stubborn", body, backoff=FAST)
    loop.start()
    await asyncio.sleep(0.05)
    started = time.monotonic()
    assert await loop.stop(timeout_s=5.0)
    assert time.monotonic() - started < 1.0
    assert swallowed == 4
    assert loop.restarts == 0


async def test_a_body_that_never_ends_is_abandoned_after_the_stop_bound(
    caplog: pytest.LogCaptureFixture,
) -> None:
    release = asyncio.Event()
    ended = asyncio.Event()

    async def body(stop: asyncio.Event) -> None:
        try:
            while True:
                try:
                    await asyncio.sleep(10)
                except asyncio.CancelledError:
                    if release.is_set():
                        raise
        finally:
            ended.set()

    loop = Supervised("deaf", body, backoff=FAST)
    loop.start()
    await asyncio.sleep(0.05)
    started = time.monotonic()
    assert not await loop.stop(timeout_s=0.3)
    assert time.monotonic() - started < 1.0
    assert any("did not stop within" in r.getMessage() for r in caplog.records if r.levelno == logging.ERROR)
    # Abandoned, not forgotten: the supervisor keeps cancelling it until it ends.
    release.set()
    await asyncio.wait_for(ended.wait(), 2)


async def test_a_loop_without_a_beat_for_its_bound_shows_as_stalled() -> None:
    beat = asyncio.Event()
    loop: Supervised

    async def body(stop: asyncio.Event) -> None:
        while not stop.is_set():
            if beat.is_set():
                loop.beat()
            await asyncio.sleep(0.02)

    loop = Supervised("slow", body, backoff=FAST, stall_after_s=0.2)
    loop.start()
    try:
        await wait_until(lambda: loop.up, "up", every_s=0.01)
        assert loop.healthy
        await wait_until(lambda: loop.stalled, "stalled", 2, every_s=0.01)
        assert not loop.healthy
        beat.set()
        await wait_until(lambda: loop.healthy, "beating again", 2, every_s=0.01)
    finally:
        await loop.stop()


async def test_cancelling_the_supervising_task_is_its_owners_stop() -> None:
    ended = asyncio.Event()

    async def body(stop: asyncio.Event) -> None:
        try:
            await asyncio.sleep(10)
        finally:
            ended.set()

    loop = Supervised("owned", body, backoff=FAST)
    loop.start()
    await asyncio.sleep(0.05)
    task = loop._task
    assert task is not None
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert ended.is_set()
    assert loop.stopping
    assert loop.restarts == 0
