"""Where the steady workload's lateness goes: each message's path, stage by stage.

Runs `bench peers`'s steady workload (rate/s delayed unary publishes, each due 1 s
after it is sent, one PullMessages stream acking each message) on our side only,
with `serve` started through a wrapper that stamps each message in the serve
process, and splits each message's due -> received time into:

  fire     due -> fired         the stream entry id's time (Redis's clock when FIRE appended it)
  idle     fired -> asked       no read was on the wire when it fired: until the XREADGROUP that
                                returned it was sent (serve's fetch loop held back, or busy)
  read     -> read              that XREADGROUP's reply reached the subscription (serve)
  queue    read -> handed       handed to grpc.aio by the PullMessages handler (serve)
  write    handed -> written    grpc.aio asks for the next one: this one is written (serve)
  client   written -> received  the subscriber's read returned it (the bench's subscriber
                                process, apart from the one that publishes)

It prints the stages' medians over all messages, and their means over the median's
neighbourhood (p45-p55) and over the slowest 1 %, with the load average: a structural
wait shows as a stage that is long even when the machine is quiet. Every clock here is
the same machine's wall clock.

    .venv/bin/python bench/steady_trace.py [--rate 1000] [--seconds 10] [--workers 1]
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from statistics import median
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for sub in ("proto", "middleware", "components", "."):
    sys.path.insert(0, str(ROOT / sub))

HOOKED = "--hooked-serve"
TRACE_ENV = "DPS_STEADY_TRACE"
STAGES = ("fire", "idle", "read", "queue", "write", "client")


def hooked_serve(argv: list[str]) -> int:
    """`delayed-pubsub serve` with stamps on each message's read and write; they are
    written to $DPS_STEADY_TRACE as JSON when the process exits."""
    from bench.common import probe_lag
    from delayed_pubsub import fetch, subscription
    from delayed_pubsub.cli import main

    stamps: dict[str, list[float]] = {}
    lags: list[float] = []
    windows: list[int] = []
    push = subscription.Subscription._push
    deliveries = subscription.Subscription.deliveries
    read_new = fetch.Fetcher._read_new
    read_new_acking = fetch.Fetcher._read_new_acking
    asked = {"at": 0.0}  # when the XREADGROUP now on the wire was sent (one fetch loop)
    ack_nowait = subscription.Subscription.ack_nowait
    acked: dict[str, float] = {}

    def stamped_ack_nowait(self: Any, entry_id: str) -> bool:
        acked.setdefault(entry_id, time.time())
        return ack_nowait(self, entry_id)

    async def stamped_read_new(self: Any, count: int, block_ms: int) -> None:
        asked["at"] = time.time()
        await read_new(self, count, block_ms)

    async def stamped_read_new_acking(self: Any, count: int) -> None:
        asked["at"] = time.time()
        await read_new_acking(self, count)

    def stamped_push(self: Any, entry_id: str, fields: Any, attempt: int, requeue: bool = False) -> None:
        # The window as the read found it: a read held back by a full window shows here.
        windows.append(len(self._unacked))
        stamps.setdefault(entry_id, [asked["at"], time.time()])
        push(self, entry_id, fields, attempt, requeue)

    async def stamped_deliveries(self: Any) -> AsyncIterator[Any]:
        if not lags:
            asyncio.get_running_loop().create_task(probe_lag(lags))
        async for d in deliveries(self):
            mark = stamps.setdefault(d.id, [0.0, 0.0])
            mark.append(time.time())
            yield d
            mark.append(time.time())

    subscription.Subscription._push = stamped_push  # type: ignore[method-assign]
    fetch.Fetcher._read_new = stamped_read_new  # type: ignore[method-assign]
    fetch.Fetcher._read_new_acking = stamped_read_new_acking  # type: ignore[method-assign]
    subscription.Subscription.ack_nowait = stamped_ack_nowait  # type: ignore[method-assign]
    subscription.Subscription.deliveries = stamped_deliveries  # type: ignore[method-assign]

    def dump() -> None:
        Path(os.environ[TRACE_ENV]).write_text(
            json.dumps({"stamps": stamps, "lags": lags, "windows": windows, "acked": acked})
        )

    atexit.register(dump)
    return main(argv)


def lag_line(name: str, lags: list[float]) -> str:
    lags = sorted(lags)
    if not lags:
        return f"{name} loop lag: not measured"
    n = len(lags)
    return (
        f"{name} loop lag (5 ms probe): p50 {lags[n // 2]:.1f} ms, p99 {lags[int(n * 0.99)]:.1f} ms, "
        f"max {lags[-1]:.1f} ms"
    )


def stage_split(rows: list[tuple[float, ...]]) -> dict[str, list[float]]:
    """rows: (due, fired, asked, read, handed, written, received), seconds; ms per stage per row."""
    out: dict[str, list[float]] = {s: [] for s in ("total", *STAGES)}
    for due, fired, asked, read, handed, written, received in rows:
        out["total"].append((received - due) * 1000)
        # A read sent before the fire waited for it in Redis: no idle time, all read.
        asked = max(asked, fired)
        for name, a, b in zip(
            STAGES,
            (due, fired, asked, read, handed, written),
            (fired, asked, read, handed, written, received),
            strict=True,
        ):
            out[name].append((b - a) * 1000)
    return out


def report(
    rows: list[tuple[float, ...]], load: tuple[float, float], lags: dict[str, list[float]]
) -> list[str]:
    rows = sorted(rows, key=lambda r: r[-1] - r[0])
    n = len(rows)
    split = stage_split(rows)

    def mean_of(lo: int, hi: int) -> dict[str, float]:
        return {k: sum(v[lo:hi]) / max(1, hi - lo) for k, v in split.items()}

    med = {k: median(v) for k, v in split.items()}
    middle = mean_of(int(n * 0.45), int(n * 0.55) or 1)
    slowest = mean_of(int(n * 0.99), n)
    lines = [
        f"{n} messages; load average {load[0]:.1f} before, {load[1]:.1f} after; "
        f"total p50 {split['total'][n // 2]:.1f} ms, p99 {split['total'][int(n * 0.99)]:.1f} ms, "
        f"max {split['total'][-1]:.1f} ms",
        "",
        "| stage | median of each stage, ms | mean over p45-p55, ms | mean over slowest 1 %, ms |",
        "|---|---:|---:|---:|",
    ]
    for k in ("total", *STAGES):
        lines.append(f"| {k} | {med[k]:.2f} | {middle[k]:.2f} | {slowest[k]:.2f} |")
    lines += ["", *(lag_line(name, v) for name, v in lags.items())]
    return lines


async def run(
    rate: int, seconds: int, workers: int | None, workdir: Path
) -> tuple[list[tuple[float, ...]], dict[str, list[float]]]:
    from bench import peers
    from bench.common import PACKAGE_PATH, probe_lag, start_process

    trace = workdir / "trace.json"

    class Traced(peers.Ours):
        """Ours, with serve started through hooked_serve."""

        def _start_serve(self) -> subprocess.Popen[bytes]:
            extra = () if self.workers is None else ("--workers", str(self.workers))
            os.environ[TRACE_ENV] = str(trace)
            os.environ["PYTHONPATH"] = PACKAGE_PATH
            argv = [
                sys.executable,
                __file__,
                HOOKED,
                "serve",
                "--socket",
                str(self.socket),
                "--log-level",
                "warning",
            ]
            return start_process([*argv, *extra], self.socket, self.workdir / "serve.log")

    system = Traced(workdir, workers)
    sizes = peers.Sizes(rate=rate, steady_s=seconds, burst=0, unary=0, pipelined=0, pending=0)
    result = peers.Run(sizes)
    await system.setup()
    publisher_lags: list[float] = []
    prober = asyncio.create_task(probe_lag(publisher_lags))
    try:
        await peers.steady(system, result)
    finally:
        prober.cancel()
        await system.close()
    for note in result.notes:
        # The refusals' messages differ only in their counts: the first words say enough.
        print("note:", note[:160])
    traced = json.loads(trace.read_text())
    stamps = traced["stamps"]
    rows: list[tuple[float, ...]] = []
    first: dict[bytes, peers.Arrival] = {}
    for a in result.arrivals.get(system.name, []):
        first.setdefault(a.head, a)  # a redelivery is not the message's first arrival
    for a in first.values():
        mark = stamps.get(a.id, [])
        if len(mark) < 4:
            continue
        fired = int(a.id.split("-")[0]) / 1000
        rows.append((peers.due_of(a.head), fired, *mark[:4], a.at))
    # Outside the total: the ack's way back, which holds the message's slot in the window.
    back = sorted((traced["acked"][a.id] - a.at) * 1000 for a in first.values() if a.id in traced["acked"])
    if back:
        print(
            f"ack back (received -> ack taken by serve): p50 {back[len(back) // 2]:.1f} ms, "
            f"p99 {back[int(len(back) * 0.99)]:.1f} ms, max {back[-1]:.1f} ms"
        )
    windows = sorted(traced["windows"])
    if windows:
        print(
            f"unacked when read: p50 {windows[len(windows) // 2]}, p99 {windows[int(len(windows) * 0.99)]}, "
            f"max {windows[-1]} (window 100)"
        )
    return rows, {
        "serve": traced["lags"],
        "subscriber": result.subscriber_lags.get(system.name, []),
        "publisher": publisher_lags,
    }


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == HOOKED:
        sys.exit(hooked_serve(sys.argv[2:]))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=int, default=1000, help="delayed publishes per second")
    ap.add_argument("--seconds", type=int, default=10, help="how long to publish")
    ap.add_argument("--workers", type=int, default=None, help="serve --workers N (default: serve's)")
    ap.add_argument("--runs", type=int, default=1, help="repeat, each on a fresh serve and Redis")
    a = ap.parse_args()
    import gc

    gc.collect()
    gc.freeze()
    for k in range(a.runs):
        with tempfile.TemporaryDirectory(prefix="dps-trace-") as d:
            before = os.getloadavg()[0]
            rows, lags = asyncio.run(run(a.rate, a.seconds, a.workers, Path(d)))
            print("\n".join(report(rows, (before, os.getloadavg()[0]), lags)))
            if k + 1 < a.runs:
                print()


if __name__ == "__main__":
    main()
