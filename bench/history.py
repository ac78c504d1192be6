"""What reading the lifecycle history costs: `delayed-pubsub history` and `inspect` as processes.

    .venv/bin/python bench/history.py [--records 100000] [--before DIR] [--timeout 300]

A private redis-server (AOF off) holding N pending messages scheduled through
the engine (one `scheduled` history record each; every 10th has a scheduleId).
Each CLI run is its own process, measured with os.wait4: wall seconds, CPU
seconds and peak RSS. A run over --timeout is killed and reported as such.

`--before DIR`: also run the same reads with the packages of another checkout
(DIR/proto, DIR/middleware, DIR/components, e.g. `git archive` of an older
commit) in the same run, on the same data, for a before/after ratio. Flags the
older CLI lacks are left out of its runs.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for sub in ("proto", "middleware", "components", "."):
    sys.path.insert(0, str(ROOT / sub))

from bench.ops import populate  # noqa: E402
from delayed_middleware.keys import EngineKeys, delayed_topic  # noqa: E402
from delayed_pubsub_pb.delayedpubsub.v1 import delayed_pb2  # noqa: E402
from tests.redis_server import RedisServer  # noqa: E402


@dataclass(frozen=True)
class Run:
    wall_s: float
    cpu_s: float
    peak_rss_mb: float
    killed: bool
    out_bytes: int

    def __str__(self) -> str:
        state = f"KILLED at {self.wall_s:.0f} s" if self.killed else f"{self.wall_s:.2f} s wall"
        return f"{state}, {self.cpu_s:.2f} s CPU, peak RSS {self.peak_rss_mb:.0f} MB, {self.out_bytes} B out"


def timed(argv: list[str], code: Path | None, timeout: float) -> Run:
    """One CLI process: its own rusage (os.wait4), not the sum over every child so far."""
    env = {**os.environ, "COLUMNS": "200"}
    if code is not None:
        env["PYTHONPATH"] = os.pathsep.join(str(code / p) for p in ("proto", "middleware", "components"))
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=out, stderr=err, env=env)
        killed = False
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() - t > timeout:
                proc.kill()
                killed = True
                pid, status, usage = os.wait4(proc.pid, 0)
                break
            time.sleep(0.02)
        took = time.perf_counter() - t
        proc.returncode = os.waitstatus_to_exitcode(status)
        if not killed and proc.returncode != 0:
            err.seek(0)
            raise SystemExit(f"{argv} exited {proc.returncode}: {err.read()[-2000:].decode()}")
        size = out.seek(0, os.SEEK_END)
    return Run(took, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024, killed, size)


def middle_envelope(port: int) -> str:
    """The id of an envelope scheduled halfway through the population (one without a scheduleId)."""
    import redis

    client = redis.Redis(port=port)
    first: Any = client.xrange("bench-delayed", count=1)
    last: Any = client.xrevrange("bench-delayed", count=1)
    lo, hi = (int(rows[0][0].split(b"-")[0]) for rows in (first, last))
    rows: Any = client.xrange("bench-delayed", f"{(lo + hi) // 2}", "+", count=20)
    client.close()
    for entry_id, fields in rows:
        if not delayed_pb2.DelayedMessage.FromString(fields[b"data"]).scheduleId:
            return str(entry_id.decode())
    raise SystemExit("no envelope without a scheduleId found")


def memory(port: int) -> str:
    """The history's and its by-id index's memory (MEMORY USAGE, every element counted)."""
    import redis

    keys = EngineKeys.for_topic(delayed_topic("bench"))
    client = redis.Redis(port=port)
    try:
        history = client.memory_usage(keys.history, samples=0) or 0
        index = client.memory_usage(keys.history_index, samples=0) or 0
        fields = client.hlen(keys.history_index)
        records = client.xlen(keys.history)
    finally:
        client.close()
    return (
        f"history: {records} records, {history / 2**20:.1f} MB ({history / max(records, 1):.0f} B each); "
        f"by-id index: {fields} fields, {index / 2**20:.1f} MB ({index / max(fields, 1):.0f} B each)"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--records", type=int, default=100_000)
    parser.add_argument("--before", type=Path, default=None, help="an older checkout to compare with")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--only-before", action="store_true", help="with --before: skip this checkout's runs")
    args = parser.parse_args()
    exe = [sys.executable, "-m", "delayed_pubsub"]
    n = args.records
    sched = f"sched-{(n // 2) // 10 * 10}"  # a scheduleId in the middle of the history
    with tempfile.TemporaryDirectory(prefix="bench-history-") as d:
        server = RedisServer(Path(d) / "redis", appendonly=False)
        server.start()
        try:
            t = time.perf_counter()
            asyncio.run(populate(server.port, n, 30))
            print(f"populated {n} pending messages ({n} history records) in {time.perf_counter() - t:.0f} s")
            conn = ["--redis-host", f"127.0.0.1:{server.port}", "--app-id", "bench"]
            print(memory(server.port), flush=True)
            envelope = middle_envelope(server.port)
            after: list[tuple[str, list[str]]] = [
                ("pending --json (reference)", ["pending", "--json"]),
                ("history (default: newest 100)", ["history"]),
                ("history --limit 0 (all, table)", ["history", "--limit", "0"]),
                ("history --limit 0 --json (all)", ["history", "--limit", "0", "--json"]),
                (f"history --id {sched}", ["history", "--id", sched]),
                (f"history --id {envelope} (an envelope id)", ["history", "--id", envelope]),
                (f"inspect {sched}", ["inspect", sched]),
            ]
            before: list[tuple[str, list[str]]] = [
                ("pending --json (reference)", ["pending", "--json"]),
                ("history (default)", ["history"]),
                (f"history --id {sched}", ["history", "--id", sched]),
                (f"history --id {envelope} (an envelope id)", ["history", "--id", envelope]),
                (f"inspect {sched}", ["inspect", sched]),
            ]
            runs = [] if args.only_before else [("after", None, after)]
            if args.before is not None:
                runs.append(("before", args.before, before))
            for label, code, commands in runs:
                for name, argv in commands:
                    print(f"{label:6} {name}: {timed([*exe, *argv, *conn], code, args.timeout)}", flush=True)
        finally:
            server.stop()


if __name__ == "__main__":
    main()
