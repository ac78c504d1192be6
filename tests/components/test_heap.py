"""serve and its workers keep their start-up heap out of the garbage collector's full collections.

A full collection walks every tracked object: with the tens of thousands
that grpc, protobuf and redis-py leave behind at start-up, each one paused the
event loop for tens of milliseconds (the steady-delivery p99 came from those
pauses). The processes here are real: the `delayed-pubsub` entry point, run as
`serve` and as `worker` in a subprocess.
"""

from __future__ import annotations

import asyncio
import gc
import sys
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest

from delayed_pubsub.heap import freeze_startup_heap

# Objects a process frozen at start-up holds at least (grpc, protobuf, redis-py
# and our modules come to about 56,000; an unfrozen heap reports 0).
FROZEN_AT_LEAST = 20_000

# Runs the real entry point up to the point where serve would start serving,
# and prints how many objects its heap had frozen by then.
SERVE_UNTIL_IT_SERVES = """
import gc, sys
from delayed_pubsub import cli

async def serving(*args, **kwargs):
    print(gc.get_freeze_count())

cli.serve = serving
sys.exit(cli.main(sys.argv[1:]))
"""

# Runs a real worker over a folder that does not exist (it stops at once), then
# prints how many objects its heap had frozen.
WORKER_THAT_STOPS = """
import gc, sys
from delayed_pubsub import cli

code = cli.main(sys.argv[1:])
print(gc.get_freeze_count())
sys.exit(code)
"""


class Cycle:
    """An object that refers to itself: only the cycle collector can free it."""

    def __init__(self) -> None:
        self.me = self


@pytest.fixture
def collector_paused() -> Iterator[None]:
    """Automatic collections off (only explicit ones run), and this process's heap unfrozen after."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.unfreeze()
        if was:
            gc.enable()


async def run_python(script: str, *args: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        script,
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode()


def frozen_count(output: str) -> int:
    return int(output.strip().splitlines()[-1])


async def test_serve_freezes_its_start_up_heap_before_it_serves(tmp_path: Path) -> None:
    code, out = await run_python(
        SERVE_UNTIL_IT_SERVES, "serve", "--socket", str(tmp_path / "dps.sock"), "--workers", "0"
    )

    assert code == 0, out
    assert frozen_count(out) >= FROZEN_AT_LEAST, out


async def test_a_worker_freezes_its_start_up_heap(tmp_path: Path) -> None:
    code, out = await run_python(
        WORKER_THAT_STOPS, "worker", "--state", str(tmp_path / "gone"), "--index", "0"
    )

    assert code == 0, out
    assert frozen_count(out) >= FROZEN_AT_LEAST, out


@pytest.mark.usefixtures("collector_paused")
def test_garbage_made_before_the_freeze_is_freed_not_frozen() -> None:
    made = Cycle()
    gone = weakref.ref(made)
    del made

    freeze_startup_heap()

    assert gone() is None


@pytest.mark.usefixtures("collector_paused")
def test_cycles_made_after_the_freeze_are_still_collected() -> None:
    kept = Cycle()
    freeze_startup_heap()
    made = Cycle()
    gone = weakref.ref(made)
    del made

    gc.collect()

    assert gone() is None
    assert kept.me is kept
