"""`delayed-pubsub serve` as a real subprocess, the way an operator runs it beside daprd:
start it, wait until its socket answers, stop it (SIGTERM, or kill -9 for a crash)."""

from __future__ import annotations

import os
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import grpc

from tests.components.driver import Component
from tests.redis_server import RedisServer

ROOT = Path(__file__).resolve().parents[2]


def serve_env(root: Path = ROOT) -> dict[str, str]:
    """The environment of a serve process: the packages of the tree at `root` (this checkout, or
    an older release's, tests/components/test_upgrade.py) first on its path."""
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(str(root / p) for p in ("proto", "middleware", "components")),
    }


def start_serve(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """`delayed-pubsub serve --log-level debug ARGS`, its output on a pipe."""
    return subprocess.Popen(
        [sys.executable, "-m", "delayed_pubsub", "serve", "--log-level", "debug", *args],
        env={**serve_env(), **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


# How long a serve may take to listen. A quiet machine starts one in under 2 s; a machine at load 45
# took more than 15 s, and a start limit is not what these tests prove.
START_LIMIT_S = 60.0


def wait_for_socket(proc: subprocess.Popen[bytes], path: Path, within: float = START_LIMIT_S) -> None:
    """Waits until `path` is a socket that accepts a connection; fails with serve's output if
    the process exits first."""
    deadline = time.monotonic() + within
    while True:
        if path.exists() and stat.S_ISSOCK(path.stat().st_mode):
            try:
                with socket.socket(socket.AF_UNIX) as s:
                    s.connect(str(path))
                return
            except OSError:
                pass
        if proc.poll() is not None:
            out = proc.stdout.read().decode() if proc.stdout else ""
            raise AssertionError(f"serve exited with {proc.returncode}:\n{out}")
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def terminate(proc: subprocess.Popen[bytes]) -> int:
    """SIGTERM, then the exit code (killed, and the timeout raised, after 15 s)."""
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise


def children_of(pid: int) -> list[int]:
    """The pids of `pid`'s child processes, from /proc (empty once it is gone)."""
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def alive(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


class Serve:
    """One `delayed-pubsub serve` process with its log in a file."""

    def __init__(self, folder: Path, name: str, *args: str, root: Path = ROOT) -> None:
        self.socket = folder / f"{name}.sock"
        self.log = folder / f"{name}.log"
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "delayed_pubsub", "serve", "--socket", str(self.socket), *args],
                env=serve_env(root),
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + START_LIMIT_S
        while not self._listening():
            assert self.proc.poll() is None, f"serve exited: {self.log.read_text()}"
            assert time.monotonic() < deadline, f"{self.socket} never appeared"
            time.sleep(0.05)

    def _listening(self) -> bool:
        if not (self.socket.exists() and stat.S_ISSOCK(self.socket.stat().st_mode)):
            return False
        with socket.socket(socket.AF_UNIX) as s:
            try:
                s.connect(str(self.socket))
            except OSError:
                return False
        return True

    def children(self) -> list[int]:
        """The pids of the processes serve started (its workers) that run now."""
        return children_of(self.proc.pid)

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@asynccontextmanager
async def instance(serve: Serve, props: dict[str, str]) -> AsyncIterator[Component]:
    """The component instance `delayed` on a serve process, initialised with `props`."""
    async with grpc.aio.insecure_channel(f"unix://{serve.socket}") as ch:
        c = Component(ch, "delayed")
        await c.init(props)
        yield c


def props_for(redis_server: RedisServer) -> dict[str, str]:
    """Init metadata of a replica of app1 with delayed messaging on the test Redis."""
    return {
        "redisHost": f"127.0.0.1:{redis_server.port}",
        "consumerID": "app1",
        "enableDelayedMessaging": "true",
    }
