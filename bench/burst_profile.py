"""Where the wall time of a 50k burst goes: per-process CPU and run-queue wait over the fire window.

    .venv/bin/python -m bench.burst_profile [--messages 50000] [--workers 1] [--no-subscriber] [--runs 1]

The `bench peers` burst on our side alone (a private redis-server with AOF
everysec, `delayed-pubsub serve`, N messages due at one instant T stored by
BulkPublish, one PullMessages subscriber acking each message), with every
process sampled from /proc every 20 ms: CPU time (utime + stime, all threads),
and time spent runnable but waiting for a core (/proc/PID/task/*/schedstat,
second field). For the window T -> all fired (XLEN of the target = N) it
prints, per process: CPU seconds, run-queue wait seconds, and the rest of the
window (blocked: for Redis, idle between commands). Redis's own view comes
from INFO commandstats: the FIRE script's calls and their summed time.
`--no-subscriber` fires with nobody subscribed: the delivery's share.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.common import children_of
from bench.peers import Ours

TICKS = os.sysconf("SC_CLK_TCK")


def cpu_and_wait(pid: int) -> tuple[float, float]:
    """(CPU seconds, run-queue wait seconds) of every thread of `pid` so far."""
    cpu = wait = 0.0
    try:
        with open(f"/proc/{pid}/stat") as f:
            parts = f.read().rsplit(")", 1)[1].split()
        cpu = (int(parts[11]) + int(parts[12])) / TICKS
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                wait += int(f.read().split()[1]) / 1e9
    except (OSError, IndexError):
        pass
    return cpu, wait


@dataclass
class Sample:
    at: float
    fired: int
    fire_calls: int
    fire_usec: int
    procs: dict[str, tuple[float, float]] = field(default_factory=dict)


def sample(ours: Ours, names: dict[str, int], sha_client: Any) -> Sample:
    assert ours.client is not None
    stats: dict[str, Any] = sha_client.info("commandstats")
    evalsha = stats.get("cmdstat_evalsha", {"calls": 0, "usec": 0})
    s = Sample(time.time(), int(ours.client.xlen("orders")), int(evalsha["calls"]), int(evalsha["usec"]))
    for name, pid in names.items():
        s.procs[name] = cpu_and_wait(pid)
    return s


async def one_run(n: int, workers: int, subscribe: bool, workdir: Path) -> None:
    ours = Ours(workdir, workers)
    await ours.setup()
    try:
        assert ours.serve is not None
        assert ours.redis.proc is not None
        kids = children_of(ours.serve.pid)
        names = {"redis": ours.redis.proc.pid, "serve": ours.serve.pid, "client": os.getpid()}
        for k, pid in enumerate(kids):
            names[f"worker{k}"] = pid
        sha_client = ours.redis.client()
        received = 0

        def got(data: bytes, at: float) -> None:
            nonlocal received
            received += 1

        # As `bench peers` gives a burst alone: storing at 5,000/s with room to spare.
        due = time.time() + 3 + 2 * n / 5_000
        for first in range(0, n, 1000):
            await ours.schedule_many(first, [due] * min(1000, n - first))
        if time.time() > due:
            print("note: storing took past the due time; the window includes that")
        stop_sub = await ours.subscribe(got) if subscribe else None
        samples: list[Sample] = []
        done = threading.Event()

        def sampler() -> None:
            # A thread, so the client's own loop (the subscriber) does not delay the samples.
            while not done.is_set():
                s = sample(ours, names, sha_client)
                samples.append(s)
                if s.fired >= n and s.at > due:
                    return
                time.sleep(0.02)

        await asyncio.sleep(max(0.0, due - 0.2 - time.time()))
        t = threading.Thread(target=sampler)
        t.start()
        while t.is_alive():  # noqa: ASYNC110 (the sampler thread ends itself)
            await asyncio.sleep(0.05)
        if stop_sub is not None:
            await stop_sub()
        report(samples, due, n, received)
    finally:
        await ours.close()


def report(samples: list[Sample], due: float, n: int, received: int) -> None:
    start = max((s for s in samples if s.at <= due), key=lambda s: s.at, default=samples[0])
    end = next(s for s in samples if s.fired >= n)
    first_fire = next((s for s in samples if s.fired > 0), end)
    window = end.at - start.at
    print(
        f"T -> all fired {end.at - due:.2f} s (first fired seen {first_fire.at - due:.2f} s); "
        f"window {window:.2f} s; received by then {received}"
    )
    calls = end.fire_calls - start.fire_calls
    usec = end.fire_usec - start.fire_usec
    print(
        f"  Redis: {calls} EVALSHA, {usec / 1e6:.2f} s inside them "
        f"({usec / max(1, calls) / 1000:.2f} ms/call, {usec / n:.1f} us/fired msg)"
    )
    for name in start.procs:
        c0, w0 = start.procs[name]
        c1, w1 = end.procs[name]
        cpu, wait = c1 - c0, w1 - w0
        print(
            f"  {name:8s} CPU {cpu:5.2f} s ({cpu / window:4.0%} of a core), "
            f"run-queue wait {wait:5.2f} s, blocked/idle {max(0.0, window - cpu - wait):5.2f} s"
        )
    # The timeline, 200 ms steps: fired so far and Redis's share of a core.
    prev = start
    for s in samples:
        if s.at - prev.at >= 0.2 or s is end:
            rc = (s.procs["redis"][0] - prev.procs["redis"][0]) / (s.at - prev.at)
            rw = (s.procs["redis"][1] - prev.procs["redis"][1]) / (s.at - prev.at)
            print(
                f"    +{s.at - due:5.2f} s fired {s.fired:6d}  redis cpu {rc:4.0%} wait {rw:4.0%}  "
                f"fire calls {s.fire_calls - prev.fire_calls:3d}"
            )
            prev = s
        if s is end:
            break


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--messages", type=int, default=50_000)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--no-subscriber", action="store_true")
    parser.add_argument("--runs", type=int, default=1)
    args = parser.parse_args()
    for _ in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="bench-burst-") as d:
            asyncio.run(one_run(args.messages, args.workers, not args.no_subscriber, Path(d)))


if __name__ == "__main__":
    main()
