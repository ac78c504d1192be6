"""Waiting in tests: poll a condition until it holds, or fail saying what was awaited.

A test waits for an event it can observe (an entry in Redis, a socket, a counter), never for a
fixed time. The default bound (30 s) is only a backstop for when the event never comes, so it is
generous (the CI machine is shared and has 2 cores); a test whose promise is a bound ("within 2 s")
passes that bound as `within_s`. `wait_until` is for tests on the event loop, and
`wait_until_blocking` for plain code such as fixtures starting a process. Both check one last time
at the deadline, so a condition that becomes true during the final sleep still counts.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from typing import Protocol

# A check's source longer than this is cut in a failure message.
_MAX_SOURCE_CHARS = 200


class Watched(Protocol):
    """A process a wait depends on: if it exits the wait fails at once, with its report."""

    def alive(self) -> bool: ...

    def fail(self, what: str) -> Exception: ...


def _describe(check: Callable[[], object]) -> str:
    """The check's own source line (`lambda: ...` as the test wrote it), else its name."""
    try:
        source = " ".join(inspect.getsource(check).split())
    except (OSError, TypeError):
        return getattr(check, "__qualname__", repr(check))
    return source if len(source) <= _MAX_SOURCE_CHARS else source[:_MAX_SOURCE_CHARS] + "…"


def _timed_out(what: str, within_s: float, last: BaseException | None) -> str:
    message = f"timed out after {within_s:g} s waiting for {what}"
    return message if last is None else f"{message} (last error: {last!r})"


def _holds(
    check: Callable[[], object], tolerate: tuple[type[BaseException], ...]
) -> tuple[bool, BaseException | None]:
    """Whether `check` holds now; an exception of a `tolerate` type counts as "not yet"."""
    try:
        return bool(check()), None
    except tolerate as e:
        return False, e


async def wait_until(
    check: Callable[[], object],
    what: str | None = None,
    within_s: float = 30.0,
    *,
    every_s: float = 0.02,
    tolerate: tuple[type[BaseException], ...] = (),
) -> None:
    """Poll `check` every `every_s` until it is true; AssertionError naming `what` (or, if not
    given, the check's source) after `within_s`. `check` may be a coroutine function (a look
    through an async client). Exceptions propagate at once (a check that raises is a broken
    test), except those of the `tolerate` types, which count as "not yet" and the last of which
    the failure message shows."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            result = check()
            held, last = bool(await result if inspect.isawaitable(result) else result), None
        except tolerate as e:
            held, last = False, e
        if held:
            return
        if time.monotonic() >= deadline:
            raise AssertionError(_timed_out(what or _describe(check), within_s, last))
        await asyncio.sleep(every_s)


def wait_until_blocking(
    check: Callable[[], object],
    what: str,
    within_s: float,
    *,
    every_s: float = 0.05,
    tolerate: tuple[type[BaseException], ...] = (),
    process: Watched | None = None,
    error: Callable[[str], Exception] = AssertionError,
) -> None:
    """`wait_until` for code off the event loop (it sleeps the thread). If `process` exits first
    the wait fails at once with `process.fail(...)`; on timeout it raises `process.fail(...)` if a
    process is given (its report carries the log), else `error(message)`."""
    deadline = time.monotonic() + within_s
    while True:
        held, last = _holds(check, tolerate)
        if held:
            return
        if process is not None and not process.alive():
            raise process.fail(f"exited while waiting for {what}")
        if time.monotonic() >= deadline:
            message = _timed_out(what, within_s, last)
            raise process.fail(message) if process is not None else error(message)
        time.sleep(every_s)
