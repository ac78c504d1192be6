"""A loopback TCP proxy in front of Redis that loses one reply after the write landed.

The fault that duplicates writes: the command reaches Redis and is applied,
then the connection dies before the client reads the answer, and a client
that retries writes again. The proxy forwards everything, except that once a
client->server chunk contains `trigger`, it forwards the command, waits for
the server's reply and, unless that reply is an error (a NOSCRIPT before the
script is loaded, say), drops it and cuts the client's connection.
"""

from __future__ import annotations

import asyncio
import contextlib


class LossyProxy:
    def __init__(self, upstream_port: int, trigger: bytes, times: int = 1) -> None:
        self.upstream_port = upstream_port
        self.trigger = trigger
        self.remaining = times
        self.cut = 0
        self.port = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> LossyProxy:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _handle(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        sr, sw = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        armed = asyncio.Event()

        async def client_to_server() -> None:
            while data := await cr.read(65536):
                if self.remaining > 0 and self.trigger in data:
                    armed.set()
                sw.write(data)
                await sw.drain()

        async def server_to_client() -> None:
            while data := await sr.read(65536):
                if armed.is_set():
                    armed.clear()
                    if not data.startswith(b"-") and self.remaining > 0:
                        self.remaining -= 1
                        self.cut += 1
                        cw.close()  # the reply is lost; the write has landed
                        return
                cw.write(data)
                await cw.drain()

        up = asyncio.ensure_future(client_to_server())
        down = asyncio.ensure_future(server_to_client())
        for t in (up, down):
            self._tasks.add(t)
        try:
            await asyncio.wait({up, down}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (up, down):
                t.cancel()
                self._tasks.discard(t)
            for w in (cw, sw):
                with contextlib.suppress(Exception):
                    w.close()
