"""What the dashboard costs against a large backlog: server CPU and Redis commands per page and per live tick.

    .venv/bin/python bench/dashboard.py [--pending 1000000] [--clients 10]

Schedules `--pending` envelopes (8 topics, due over the next 30 days) through
the real engine on a private redis-server, then runs the real `delayed-pubsub
dashboard` process and measures, from /proc (its user+system CPU) and from
INFO commandstats (every command Redis ran, less the INFO calls themselves):

- one poll: the census every live page is served from (what `pending` scans);
- a page refresh of each page, served between polls;
- a live tick (one poll fanned out over Server-Sent Events) with 1 and with
  `--clients` open streams;
- the peer: one `delayed-pubsub pending --limit 0 --json` run (the operator CLI
  polling by hand), its CPU from the kernel's accounting of the child.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import resource
import socket
import subprocess
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import redis
import redis.asyncio as aioredis

ROOT = Path(__file__).resolve().parents[1]
for sub in ("proto", "middleware", "components"):
    if str(ROOT / sub) not in sys.path:
        sys.path.append(str(ROOT / sub))
sys.path.insert(0, str(ROOT))

from bench.common import bench_engine  # noqa: E402
from delayed_middleware.clock import SystemClock  # noqa: E402
from delayed_middleware.envelope import Envelope  # noqa: E402
from tests.redis_server import RedisServer  # noqa: E402

APP = "bench"
EXE = Path(sys.executable).with_name("delayed-pubsub")
TICK = os.sysconf("SC_CLK_TCK")


async def schedule(port: int, n: int) -> None:
    client = aioredis.Redis(port=port)
    engine = bench_engine(client, SystemClock(), {"consumerID": APP})
    now = int(time.time() * 1000)
    batch = 1000
    for start in range(0, n, batch):
        envs = [
            Envelope(
                id="",
                topic=f"topic-{i % 8}",
                # Over the next 30 days, a minute apart at most: every due window has some.
                due_ms=now + 120_000 + (i * 2_591_999_000 // max(n, 1)),
                published_at_ms=now,
                message=b"x" * 200,
                schedule_id=f"order-{i}" if i % 2 else "",
            )
            for i in range(start, min(start + batch, n))
        ]
        await engine.schedule(envs)
    await client.aclose()


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def commands(client: redis.Redis) -> int:
    stats: Any = client.info("commandstats")
    return sum(int(v["calls"]) for k, v in stats.items() if k != "cmdstat_info")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Dashboard:
    def __init__(self, redis_port: int, interval: float, log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = ["dashboard", "--redis-host", f"127.0.0.1:{redis_port}", "--app-id", APP]
        args += ["--port", str(self.port), "--interval", str(interval)]
        self.proc = subprocess.Popen([str(EXE), *args], stdout=log.open("wb"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(f"{self.url}/healthz", timeout=1)
                return
            except httpx.TransportError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise SystemExit(f"dashboard did not start: {log.read_text()}") from None
                time.sleep(0.1)

    def health(self) -> Any:
        return httpx.get(f"{self.url}/healthz", timeout=10).json()

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


def measure(d: Dashboard, client: redis.Redis, path: str, times: int) -> tuple[float, float, float]:
    """(CPU ms, Redis commands, wall ms) per GET of `path`, averaged over `times`."""
    c0, k0, w0 = cpu_s(d.proc.pid), commands(client), time.perf_counter()
    for _ in range(times):
        r = httpx.get(f"{d.url}{path}", timeout=600)
        assert r.status_code == 200, (path, r.status_code)
    wall = time.perf_counter() - w0
    return (cpu_s(d.proc.pid) - c0) * 1000 / times, (commands(client) - k0) / times, wall * 1000 / times


def sse_clients(url: str, n: int, stop: threading.Event) -> list[threading.Thread]:
    def read() -> None:
        try:
            with httpx.stream("GET", f"{url}/events", timeout=None) as r:
                for _ in r.iter_bytes():
                    if stop.is_set():
                        return
        except httpx.HTTPError:
            return  # the dashboard stopped under it

    threads = [threading.Thread(target=read, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    return threads


def ticks(d: Dashboard, client: redis.Redis, clients: int, n: int) -> tuple[float, float, float, float]:
    """(CPU ms, Redis commands, seconds, the last poll's wall ms) per live tick with `clients` open streams, over `n` ticks."""
    stop = threading.Event()
    sse_clients(d.url, clients, stop)
    deadline = time.monotonic() + 60
    while d.health()["watchers"] < clients:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    # Start at a poll's end: count whole ticks.
    first = d.health()["polls"]
    while d.health()["polls"] == first:
        time.sleep(0.05)
    p0, c0, k0, w0 = d.health()["polls"], cpu_s(d.proc.pid), commands(client), time.monotonic()
    while d.health()["polls"] < p0 + n:
        time.sleep(0.05)
    polls = d.health()["polls"] - p0
    poll_ms = d.health()["pollMs"]
    result = (
        (cpu_s(d.proc.pid) - c0) * 1000 / polls,
        (commands(client) - k0) / polls,
        (time.monotonic() - w0) / polls,
        poll_ms,
    )
    stop.set()
    return result


def cli_peer(port: int, client: redis.Redis) -> tuple[float, float, float]:
    """(CPU ms, Redis commands, wall ms) of one `delayed-pubsub pending --limit 0 --json`."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    k0, w0 = commands(client), time.perf_counter()
    subprocess.run(
        [str(EXE), "pending", "--redis-host", f"127.0.0.1:{port}", "--app-id", APP, "--limit", "0", "--json"],
        stdout=subprocess.DEVNULL,
        check=True,
    )
    wall = time.perf_counter() - w0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return cpu * 1000, commands(client) - k0, wall * 1000


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pending", type=int, default=1_000_000)
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--refreshes", type=int, default=50)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        server = RedisServer(Path(folder), appendonly=False)
        server.start()
        try:
            client = redis.Redis(port=server.port)
            t = time.perf_counter()
            asyncio.run(schedule(server.port, args.pending))
            print(f"scheduled {args.pending:,} in {time.perf_counter() - t:.0f} s", file=sys.stderr)
            rows: list[tuple[str, tuple[float, float, float]]] = []
            rows.append(("`pending --limit 0 --json` (the CLI, peer)", cli_peer(server.port, client)))

            # Polls only when asked: the first page view makes the one poll, refreshes are served from it.
            d = Dashboard(server.port, 3600, Path(folder) / "dash.log")
            try:
                rows.append(
                    ("first overview (waits for the poll: census + render)", measure(d, client, "/", 1))
                )
                assert d.health()["polls"] == 1
                rows.append(("overview refresh", measure(d, client, "/", args.refreshes)))
                rows.append(("pending, first page of 50", measure(d, client, "/pending", args.refreshes)))
                rows.append(
                    (
                        "pending, a page deep in the stream",
                        measure(d, client, "/pending?after=1-0@0", args.refreshes),
                    )
                )
                rows.append(
                    (
                        "pending, scheduleId prefix search",
                        measure(d, client, "/pending?q=order-12345", args.refreshes),
                    )
                )
                rows.append(("message detail", measure(d, client, "/message?id=order-777", args.refreshes)))
                rows.append(("schedules, first page", measure(d, client, "/schedules", 5)))
                rows.append(("dead letters", measure(d, client, "/dead", args.refreshes)))
                assert d.health()["polls"] == 1, "a page refresh polled"
            finally:
                d.stop()
            d = Dashboard(server.port, 1, Path(folder) / "dash2.log")
            try:
                one = ticks(d, client, 1, 3)
                many = ticks(d, client, args.clients, 3)
            finally:
                d.stop()
            print(
                f"machine {platform.node()} ({os.cpu_count()} cores), {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, "
                f"{args.pending:,} pending"
            )
            print()
            print("| request | server CPU ms | Redis commands | wall ms |")
            print("|---|---:|---:|---:|")
            for name, (cpu, cmds, wall) in rows:
                print(f"| {name} | {cpu:,.1f} | {cmds:,.0f} | {wall:,.1f} |")
            print()
            print(
                "| live tick (one poll, sent to every open stream) | server CPU ms per tick "
                "| Redis commands per tick | s between ticks | poll wall ms |"
            )
            print("|---|---:|---:|---:|---:|")
            for name, (cpu, cmds, gap, poll) in (
                ("1 open stream", one),
                (f"{args.clients} open streams", many),
            ):
                print(f"| {name} | {cpu:,.0f} | {cmds:,.0f} | {gap:.1f} | {poll:,.0f} |")
        finally:
            server.stop()


if __name__ == "__main__":
    main()
