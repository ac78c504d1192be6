"""A real redis-server on a private loopback port, for tests and benchmarks.

Missing redis-server is an error, never a skip: CI must prove the real thing.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import cast

import redis


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """One redis-server process; restartable on the same port and data dir."""

    def __init__(self, workdir: Path, port: int | None = None, appendonly: bool = True) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError(
                "redis-server is not installed: run `make test` (it installs it) or `apt-get install -y redis-server`"
            )
        self.exe = exe
        self.workdir = workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.appendonly = appendonly
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def start(self) -> None:
        args = [
            self.exe,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.workdir),
            "--save",
            "",
            "--appendonly",
            "yes" if self.appendonly else "no",
            "--appendfsync",
            "everysec",
            "--daemonize",
            "no",
            "--loglevel",
            "warning",
            "--logfile",
            str(self.workdir / "redis.log"),
        ]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        client = redis.Redis(port=self.port, socket_connect_timeout=0.2)
        try:
            while True:
                try:
                    if client.ping():
                        return
                except redis.ConnectionError:
                    if self.proc.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(
                            f"redis-server did not start on port {self.port}; see {self.workdir / 'redis.log'}"
                        ) from None
                    time.sleep(0.05)
        finally:
            client.close()

    def stop(self, kill: bool = False) -> None:
        if self.proc is None:
            return
        if kill:
            self.proc.kill()
        else:
            self.proc.terminate()
        self.proc.wait(timeout=10)
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port)


def stream_entries(client: redis.Redis, key: str) -> list[tuple[str, dict[bytes, bytes]]]:
    """XRANGE key - + as (id, fields): redis-py's own return type is too loose to use."""
    raw = cast("list[tuple[bytes, dict[bytes, bytes]]]", client.xrange(key))
    return [(i.decode(), f) for i, f in raw]
