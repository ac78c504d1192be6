"""`bench peers`'s steady workload: its subscriber receives in a process of its own, every
accepted message is received there, and the server CPU row counts no bench process."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from bench import peers


@pytest.fixture
async def ours(tmp_path: Path) -> AsyncIterator[peers.Ours]:
    system = peers.Ours(tmp_path, workers=1)
    await system.setup()
    try:
        yield system
    finally:
        await system.close()


async def test_steady_is_received_in_a_process_of_its_own_and_every_accepted_message_arrives(
    ours: peers.Ours,
) -> None:
    run = peers.Run(peers.Sizes(rate=200, steady_s=1, burst=0, unary=0, pipelined=0, pending=0))
    await peers.steady(ours, run)

    arrivals = run.arrivals["ours"]
    indices = {a.head.split(b":")[1] for a in arrivals}
    assert indices == {str(i).encode() for i in range(200)}, run.notes
    assert len(run.lateness["ours"]) == 200
    # Stamped in the subscriber process: after each message's due time, and not by this one.
    assert all(a.at >= peers.due_of(a.head) for a in arrivals)
    note = next(n for n in run.notes if "subscriber process of its own" in n)
    pid = int(note.split("(pid ", 1)[1].split(",", 1)[0])
    assert pid != os.getpid()
    assert pid not in ours.pids()
    assert run.subscriber_lags["ours"], "the subscriber's loop lag was not measured"
    rows = {r.workload: r for r in run.rows}
    assert rows["server CPU per steady message (200/s)"].ours > 0


async def test_a_subscriber_process_that_dies_fails_the_run_at_once_instead_of_hanging(
    ours: peers.Ours,
) -> None:
    subscriber = peers.SubscriberProcess(ours)
    try:
        await subscriber.start()
        assert subscriber.pid
        assert subscriber.pid != os.getpid()
        os.kill(subscriber.pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(peers.SubscriberGone, match="exit code -9"):
            await subscriber.finish(expect=1, within_s=30)
        assert time.monotonic() - t0 < 10
    finally:
        subscriber.close()
