"""TCP proxies on loopback in front of a real Redis, each changing one thing.

`LosingProxy` can lose a reply: it forwards a command that contains a marker to
Redis, then cuts both connections before Redis's answer gets back. The write has
landed; the client never learns it did. `VersionProxy` shows another Redis version
in INFO, every other byte coming from the real server.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine
from typing import Any

Pump = Callable[[], Coroutine[Any, Any, None]]


class _Proxy:
    """Forwards 127.0.0.1:<port> to Redis at `upstream_port`, one pair of pumps per connection.

    Subclasses say what each direction does (`_pumps`); this class owns the listener, the
    upstream connection and the teardown, so a connection ends the same way in every proxy.
    """

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.port = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _pumps(
        self,
        client_r: asyncio.StreamReader,
        client_w: asyncio.StreamWriter,
        redis_r: asyncio.StreamReader,
        redis_w: asyncio.StreamWriter,
    ) -> tuple[Pump, Pump]:
        """(client -> Redis, Redis -> client); the connection ends when either returns."""
        raise NotImplementedError

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            redis_r, redis_w = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:
            client_w.close()
            self._tasks.discard(task)
            return
        pumps = [asyncio.create_task(p()) for p in self._pumps(client_r, client_w, redis_r, redis_w)]
        try:
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            pass  # stop(): asyncio's stream callback must not see a cancelled task fail
        finally:
            for p in pumps:
                p.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
            for w in (client_w, redis_w):
                w.close()
                with contextlib.suppress(Exception):
                    await w.wait_closed()
            self._tasks.discard(task)


class LosingProxy(_Proxy):
    """Forwards 127.0.0.1:<port> to Redis at `upstream_port`.

    While `armed`, the first client->Redis chunk that contains `marker` is
    forwarded, Redis is given `settle_s` to execute it, and then the client and
    Redis sides of that connection are both closed without the reply.
    """

    def __init__(self, upstream_port: int, marker: bytes, settle_s: float = 0.2) -> None:
        super().__init__(upstream_port)
        self.marker = marker
        self.settle_s = settle_s
        self.armed = False
        self.cuts = 0

    def _pumps(
        self,
        client_r: asyncio.StreamReader,
        client_w: asyncio.StreamWriter,
        redis_r: asyncio.StreamReader,
        redis_w: asyncio.StreamWriter,
    ) -> tuple[Pump, Pump]:
        cut = asyncio.Event()

        async def upstream() -> None:
            while data := await client_r.read(65536):
                redis_w.write(data)
                await redis_w.drain()
                if self.armed and self.marker in data:
                    self.armed = False
                    self.cuts += 1
                    cut.set()
                    await asyncio.sleep(self.settle_s)  # Redis executes it; its reply is dropped
                    return

        async def downstream() -> None:
            while data := await redis_r.read(65536):
                if cut.is_set():
                    return
                client_w.write(data)
                await client_w.drain()

        return upstream, downstream


class VersionProxy(_Proxy):
    """Forwards 127.0.0.1:<port> to a real Redis at `upstream_port`, with one change: every reply's
    `redis_version:<real>` reads `redis_version:<shown>`. No Redis older than 6.2 is available here;
    this is how an Init meets one, every other byte coming from the real server.

    `shown` must be as long as the real version, so a RESP bulk string's length stays right.
    """

    def __init__(self, upstream_port: int, real: str, shown: str) -> None:
        if len(real) != len(shown):
            raise ValueError(f"{shown!r} must be as long as {real!r}")
        super().__init__(upstream_port)
        self._needle = f"redis_version:{real}".encode()
        self._replacement = f"redis_version:{shown}".encode()
        self.rewritten = 0

    def _held_back(self, data: bytes) -> int:
        """How many bytes at the end of `data` could start the needle (kept until more arrives)."""
        for k in range(min(len(self._needle) - 1, len(data)), 0, -1):
            if data.endswith(self._needle[:k]):
                return k
        return 0

    def _pumps(
        self,
        client_r: asyncio.StreamReader,
        client_w: asyncio.StreamWriter,
        redis_r: asyncio.StreamReader,
        redis_w: asyncio.StreamWriter,
    ) -> tuple[Pump, Pump]:
        async def downstream() -> None:
            pending = b""
            while data := await redis_r.read(65536):
                pending += data
                self.rewritten += pending.count(self._needle)
                pending = pending.replace(self._needle, self._replacement)
                keep = self._held_back(pending)
                client_w.write(pending[: len(pending) - keep])
                await client_w.drain()
                pending = pending[len(pending) - keep :]

        return _forward(client_r, redis_w), downstream


class SlowProxy(_Proxy):
    """Forwards 127.0.0.1:<port> to Redis at `upstream_port`, each reply held `delay_s` first:
    a Redis across a slow network (every round trip at least `delay_s`)."""

    def __init__(self, upstream_port: int, delay_s: float) -> None:
        super().__init__(upstream_port)
        self.delay_s = delay_s

    def _pumps(
        self,
        client_r: asyncio.StreamReader,
        client_w: asyncio.StreamWriter,
        redis_r: asyncio.StreamReader,
        redis_w: asyncio.StreamWriter,
    ) -> tuple[Pump, Pump]:
        return _forward(client_r, redis_w), _forward(redis_r, client_w, self.delay_s)


class DelayingProxy(_Proxy):
    """Forwards 127.0.0.1:<port> to Redis at `upstream_port`, slowly for some commands.

    While `armed`, each client->Redis chunk that contains `marker` reaches Redis
    `delay_s` late, and what that connection sends after it waits behind it, as
    on a slow link or in front of a busy Redis. Everything else passes at once.
    """

    def __init__(self, upstream_port: int, marker: bytes, delay_s: float) -> None:
        super().__init__(upstream_port)
        self.marker = marker
        self.delay_s = delay_s
        self.armed = False
        self.delayed = 0

    def _pumps(
        self,
        client_r: asyncio.StreamReader,
        client_w: asyncio.StreamWriter,
        redis_r: asyncio.StreamReader,
        redis_w: asyncio.StreamWriter,
    ) -> tuple[Pump, Pump]:
        async def upstream() -> None:
            while data := await client_r.read(65536):
                if self.armed and self.marker in data:
                    self.delayed += 1
                    await asyncio.sleep(self.delay_s)
                redis_w.write(data)
                await redis_w.drain()

        return upstream, _forward(redis_r, client_w)


class LateReplyProxy(_Proxy):
    """Forwards 127.0.0.1:<port> to Redis at `upstream_port`.

    While `armed`, the first client->Redis chunk that contains `marker` reaches Redis at once,
    and what Redis answers next on that connection reaches the client `delay_s` late: the write
    has landed, the client does not know it yet (a slow way back).
    """

    def __init__(self, upstream_port: int, marker: bytes, delay_s: float) -> None:
        super().__init__(upstream_port)
        self.marker = marker
        self.delay_s = delay_s
        self.armed = False
        self.held = 0

    def _pumps(
        self,
        client_r: asyncio.StreamReader,
        client_w: asyncio.StreamWriter,
        redis_r: asyncio.StreamReader,
        redis_w: asyncio.StreamWriter,
    ) -> tuple[Pump, Pump]:
        late = asyncio.Event()

        async def upstream() -> None:
            while data := await client_r.read(65536):
                if self.armed and self.marker in data:
                    self.armed = False
                    self.held += 1
                    late.set()
                redis_w.write(data)
                await redis_w.drain()

        async def downstream() -> None:
            while data := await redis_r.read(65536):
                if late.is_set():
                    late.clear()
                    await asyncio.sleep(self.delay_s)
                client_w.write(data)
                await client_w.drain()

        return upstream, downstream


def _forward(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay_s: float = 0.0) -> Pump:
    """A pump that copies `reader` to `writer` unchanged, each chunk `delay_s` late."""

    async def pump() -> None:
        while data := await reader.read(65536):
            if delay_s:
                await asyncio.sleep(delay_s)
            writer.write(data)
            await writer.drain()

    return pump
