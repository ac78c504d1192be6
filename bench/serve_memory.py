"""Memory of `delayed-pubsub serve` and its worker processes, idle and under load: what the
memory request and limit of deploy/kubernetes/app.yaml are sized from.

A private redis-server, `serve` with its default workers (as the image runs it), a real daprd and
the example subscriber, as `make demo` runs them. RSS (VmRSS) of serve and of each worker,
sampled every 0.2 s:
  - idle: 10 s after daprd is up, nothing published;
  - load: the demo's kinds of publishes (delayed by 1-10 s, recurring schedules every second),
    through daprd's HTTP API at --rate publishes/s for --seconds, every one delivered to the app;
    peak and end RSS, and the arrivals seen.

    .venv/bin/python bench/serve_memory.py [--rate 200] [--seconds 60] [--schedules 20]
"""

from __future__ import annotations

import argparse
import platform
import random
import sys
import tempfile
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import children_of  # noqa: E402
from tests.e2e import harness  # noqa: E402
from tests.redis_server import RedisServer, free_port  # noqa: E402


def rss_mib(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


class Sampler(threading.Thread):
    """Peak RSS of serve and of its heaviest worker, and the last sample."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid = pid
        self.peak_serve = self.peak_worker = self.peak_total = 0.0
        self.last: tuple[float, list[float]] = (0.0, [])
        self.done = threading.Event()

    def sample(self) -> tuple[float, list[float]]:
        return rss_mib(self.pid), [rss_mib(c) for c in children_of(self.pid)]

    def run(self) -> None:
        while not self.done.is_set():
            serve, workers = self.last = self.sample()
            self.peak_serve = max(self.peak_serve, serve)
            self.peak_worker = max([self.peak_worker, *workers])
            self.peak_total = max(self.peak_total, serve + sum(workers))
            time.sleep(0.2)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rate", type=float, default=200, help="delayed publishes per second")
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--schedules", type=int, default=20, help="recurring schedules (@every 1s)")
    args = parser.parse_args()

    daprd_path = harness.find_daprd()
    with tempfile.TemporaryDirectory(prefix="dps-mem-") as d:
        work = Path(d)
        redis = RedisServer(work / "redis")
        redis.start()
        procs: list[harness.ManagedProcess] = []
        try:
            sockets = work / "sockets"
            serve = harness.start_component(work, sockets)  # default --workers, as the image runs
            procs.append(serve)
            resources = work / "resources"
            resources.mkdir()
            (resources / "delayed.yaml").write_text(
                harness.component_yaml("delayed", harness.component_metadata(redis.port))
            )
            app_port = free_port()
            procs.append(harness.start_subscriber(work, app_port, ["delayed=orders", "delayed=reminders"]))
            ports = harness.DaprdPorts.free()
            procs.append(
                harness.start_daprd(daprd_path, work, sockets, "mem-app", app_port, resources, ports)
            )
            assert serve.proc is not None
            sampler = Sampler(serve.proc.pid)
            time.sleep(10)
            idle_serve, idle_workers = sampler.sample()
            sampler.start()
            dapr = f"http://127.0.0.1:{ports.http}/v1.0/publish/delayed"
            sent = 0
            with httpx.Client(timeout=10) as client:
                for i in range(args.schedules):
                    q = f"metadata.schedule=%40every%201s&metadata.scheduleId=mem-{i}"
                    client.post(f"{dapr}/reminders?{q}", json={"i": i}).raise_for_status()
                start = time.monotonic()
                while (elapsed := time.monotonic() - start) < args.seconds:
                    if sent < elapsed * args.rate:
                        delay = random.randint(1, 10)
                        r = client.post(
                            f"{dapr}/orders?metadata.scheduledSendDelay={delay}s",
                            json={"n": sent, "pad": "x" * 300},
                        )
                        r.raise_for_status()
                        sent += 1
                    else:
                        time.sleep(0.002)
                for i in range(args.schedules):
                    q = f"metadata.scheduleId=mem-{i}&metadata.scheduleCancel=true"
                    client.post(f"{dapr}/reminders?{q}", json={}).raise_for_status()

                def delivered() -> int:
                    got = client.get(f"http://127.0.0.1:{app_port}/arrivals").json()
                    return len({a["data"]["n"] for a in got if a["topic"] == "orders"})

                # Every delayed publish delivered (the sampler still running), or 120 s passed.
                deadline = time.monotonic() + 120
                while (arrivals := delivered()) < sent and time.monotonic() < deadline:
                    time.sleep(1)
            sampler.done.set()
            sampler.join()
            end_serve, end_workers = sampler.last
        finally:
            for p in reversed(procs):
                p.stop()
            redis.stop()

    print(
        f"# serve_memory  {datetime.now(UTC):%Y-%m-%d %H:%M} UTC  {platform.node()}  {platform.processor() or platform.machine()}"
    )
    print(
        f"# {' '.join(sys.argv)}  (workers: {len(idle_workers)}; {sent} delayed publishes at {args.rate:g}/s for {args.seconds:g} s, {args.schedules} schedules @every 1s; {arrivals} of the delayed ones delivered)"
    )
    print("| | serve | each worker | serve + workers |")
    print("|---|---|---|---|")
    print(
        f"| idle | {idle_serve:.1f} MiB | {', '.join(f'{w:.1f}' for w in idle_workers)} MiB | {idle_serve + sum(idle_workers):.1f} MiB |"
    )
    print(
        f"| under load, peak | {sampler.peak_serve:.1f} MiB | {sampler.peak_worker:.1f} MiB | {sampler.peak_total:.1f} MiB |"
    )
    print(
        f"| after the load | {end_serve:.1f} MiB | {', '.join(f'{w:.1f}' for w in end_workers)} MiB | {end_serve + sum(end_workers):.1f} MiB |"
    )


if __name__ == "__main__":
    main()
