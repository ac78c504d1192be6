"""The shared loop helpers: reply text, our own stop, retrying one call."""

from __future__ import annotations

import asyncio

import pytest

from delayed_middleware.aio import raise_if_stopped, retrying, text
from delayed_middleware.backoff import Backoff


@pytest.mark.parametrize(
    ("value", "expected"),
    [(b"1-0", "1-0"), ("1-0", "1-0"), (None, ""), (7, "7"), (b"", "")],
)
def test_text_reads_bytes_str_and_missing_values_alike(value: object, expected: str) -> None:
    assert text(value) == expected


def test_text_refuses_or_replaces_bytes_that_are_not_utf8_as_asked() -> None:
    with pytest.raises(UnicodeDecodeError):
        text(b"\xff")
    assert text(b"a\xff", errors="replace") == "a\ufffd"


def test_raise_if_stopped_raises_only_once_stopped() -> None:
    raise_if_stopped(False)
    with pytest.raises(asyncio.CancelledError):
        raise_if_stopped(True)


class Flaky:
    """A call that fails `failures` times with `error`, then returns 'ok'."""

    def __init__(self, failures: int, error: BaseException) -> None:
        self.left = failures
        self.error = error
        self.calls = 0

    async def __call__(self) -> str:
        self.calls += 1
        if self.left:
            self.left -= 1
            raise self.error
        return "ok"


async def run(
    call: Flaky,
    *,
    stopped: list[bool] | None = None,
    seen: list[BaseException] | None = None,
    call_timeout: float | None = None,
) -> tuple[str, list[float]]:
    slept: list[float] = []
    errors = seen if seen is not None else []

    async def sleep(s: float) -> None:
        slept.append(s)

    async def on_error(e: BaseException) -> None:
        errors.append(e)

    result = await retrying(
        call,
        retried=(ConnectionError, TimeoutError),
        on_error=on_error,
        stopped=lambda: bool(stopped and stopped[0]),
        sleep=sleep,
        backoff=Backoff(base_s=0.05, cap_s=2.0),
        call_timeout=call_timeout,
    )
    return result, slept


async def test_retrying_backs_off_through_failures_until_the_call_works() -> None:
    call = Flaky(3, ConnectionError("down"))
    seen: list[BaseException] = []
    result, slept = await run(call, seen=seen)
    assert (result, call.calls, len(seen), len(slept)) == ("ok", 4, 3, 3)
    # Growing waits, never a busy loop.
    assert slept == sorted(slept)
    assert slept[0] > 0


async def test_retrying_lets_an_error_it_does_not_retry_through_at_once() -> None:
    call = Flaky(1, ValueError("bug"))
    with pytest.raises(ValueError, match="bug"):
        await run(call)
    assert call.calls == 1


async def test_retrying_gives_up_once_stopped_even_when_the_cancellation_was_swallowed() -> None:
    # A library that swallows the CancelledError fails the call instead: our stop flag ends the loop.
    call = Flaky(1_000, ConnectionError("cancelled inside redis-py"))
    with pytest.raises(asyncio.CancelledError):
        await run(call, stopped=[True])
    assert call.calls == 1


async def test_retrying_bounds_each_try_and_retries_one_that_hangs() -> None:
    hung = asyncio.Event()
    calls = 0

    async def hangs_once() -> str:
        nonlocal calls
        calls += 1
        if calls == 1:
            await hung.wait()
        return "ok"

    slept: list[float] = []

    async def sleep(s: float) -> None:
        slept.append(s)

    async def on_error(e: BaseException) -> None:
        assert isinstance(e, TimeoutError)

    result = await retrying(
        hangs_once,
        retried=(TimeoutError,),
        on_error=on_error,
        stopped=lambda: False,
        sleep=sleep,
        backoff=Backoff(base_s=0.05, cap_s=2.0),
        call_timeout=0.05,
    )
    assert (result, calls, len(slept)) == ("ok", 2, 1)
