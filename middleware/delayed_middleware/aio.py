"""Small helpers every Redis-facing loop shares: reply text, our own stop, retrying a call.

- `text`: redis-py hands back bytes or str (whether the client decodes
  responses) and None for a missing field; callers want one str.
- `raise_if_stopped`: the end of a loop is decided by our own stop flag,
  never by a cancellation request. redis-py can swallow a CancelledError and
  fail the call instead (and Python 3.11's TaskGroup can leave a request on a
  task nobody means to stop), see delayed_middleware.liveness.
- `retrying`: run one Redis call until it works, backing off between tries,
  and give up (CancelledError) only once stopped.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from delayed_middleware.backoff import Backoff

T = TypeVar("T")


def text(value: object, errors: str = "strict") -> str:
    """A Redis reply value as str: bytes decoded as UTF-8 (`errors` as for bytes.decode),
    None as '', anything else by str()."""
    if isinstance(value, bytes):
        return value.decode(errors=errors)
    return "" if value is None else str(value)


def raise_if_stopped(stopping: bool) -> None:
    """Raise CancelledError when `stopping` (our own stop flag) is set.

    Called where a loop would otherwise go round again: a stop whose
    CancelledError a library swallowed still ends the loop.
    """
    if stopping:
        raise asyncio.CancelledError


async def retrying(
    call: Callable[[], Awaitable[T]],
    *,
    retried: tuple[type[BaseException], ...],
    on_error: Callable[[BaseException], Awaitable[None]],
    stopped: Callable[[], bool],
    sleep: Callable[[float], Awaitable[None]],
    backoff: Backoff,
    call_timeout: float | None,
) -> T:
    """`await call()` until it returns, each try bounded by `call_timeout` (None: unbounded).

    An exception of `retried` is awaited `on_error` (which counts and logs it,
    repairs what it can, or raises to give up), then the loop backs off (`backoff`, slept with `sleep`:
    the caller's clock) and tries again; once `stopped()` it raises
    CancelledError instead. Anything else propagates. `backoff.failures` tells
    the caller afterwards whether the call had to be retried.
    """
    while True:
        try:
            async with asyncio.timeout(call_timeout):
                return await call()
        except retried as e:
            await on_error(e)
        raise_if_stopped(stopped())
        await sleep(backoff.next())
