"""tests/waiting.py, the one wait of the test suite: what a test author relies on when a wait fails
(the message says what was awaited, after how long, and the last error a tolerated check raised), a
condition met during the last sleep still counts, a dead process ends the wait at once; and no test
module defines a wait loop or a port picker of its own again."""

from __future__ import annotations

import ast
import asyncio
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.waiting import wait_until, wait_until_blocking

TESTS = Path(__file__).resolve().parent
# The one home of each helper; a definition of the same name anywhere else in tests/ is a copy.
HOMES = {"wait_until": "waiting.py", "wait_until_blocking": "waiting.py", "free_port": "redis_server.py"}


async def test_a_timeout_names_what_was_awaited_and_how_long() -> None:
    with pytest.raises(AssertionError, match=r"timed out after 0\.1 s waiting for the queue to drain"):
        await wait_until(lambda: False, "the queue to drain", within_s=0.1)


async def test_without_what_the_message_quotes_the_check_as_the_test_wrote_it() -> None:
    queue: list[int] = [1]
    with pytest.raises(AssertionError, match=r"lambda: len\(queue\) == 0"):
        await wait_until(lambda: len(queue) == 0, within_s=0.05)


async def test_a_condition_met_during_the_last_sleep_still_counts() -> None:
    # The deadline passes while the wait sleeps; the check is looked at once more before failing.
    start = time.monotonic()
    await wait_until(lambda: time.monotonic() - start >= 0.05, "50 ms", within_s=0.01, every_s=0.1)


async def test_a_coroutine_check_is_awaited() -> None:
    calls: list[int] = []

    async def ready() -> bool:
        await asyncio.sleep(0)
        calls.append(1)
        return len(calls) >= 3

    await wait_until(ready, "the third look", within_s=5)
    assert len(calls) == 3


async def test_an_error_of_a_tolerated_type_is_not_yet_and_the_last_one_is_shown() -> None:
    def refused() -> bool:
        raise ConnectionRefusedError("port 1 refused")

    with pytest.raises(AssertionError, match=r"waiting for Redis.*port 1 refused"):
        await wait_until(refused, "Redis", within_s=0.05, tolerate=(OSError,))


async def test_an_error_not_tolerated_fails_at_once() -> None:
    def broken() -> bool:
        raise KeyError("no such field")

    start = time.monotonic()
    with pytest.raises(KeyError):
        await wait_until(broken, "a field", within_s=30)
    assert time.monotonic() - start < 5


class _Process:
    """A real child process, seen as tests.waiting.Watched."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc

    def alive(self) -> bool:
        return self.proc.poll() is None

    def fail(self, what: str) -> Exception:
        return RuntimeError(f"child {what} (exit {self.proc.returncode})")


def test_a_blocking_wait_ends_at_once_when_the_awaited_process_exits() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    try:
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=r"child exited while waiting for a socket \(exit 3\)"):
            wait_until_blocking(lambda: False, "a socket", 30, process=_Process(proc))
        assert time.monotonic() - start < 10
    finally:
        proc.kill()
        proc.wait()


def test_a_blocking_timeout_raises_the_error_the_caller_chose() -> None:
    with pytest.raises(RuntimeError, match=r"timed out after 0\.05 s waiting for a replica in sync"):
        wait_until_blocking(lambda: False, "a replica in sync", 0.05, error=RuntimeError)


def test_no_test_module_defines_its_own_wait_or_port_picker() -> None:
    copies = []
    for path in sorted(TESTS.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or node.name not in HOMES:
                continue
            if path.relative_to(TESTS).as_posix() != HOMES[node.name]:
                copies.append(f"{path.relative_to(TESTS)}:{node.lineno} {node.name}")
    assert copies == [], f"import these from tests/waiting.py or tests/redis_server.py instead: {copies}"
