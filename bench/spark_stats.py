"""`delayed-pubsub stats` end to end over 1,000,000 history events and 1,000,000 pending envelopes.

A private redis-server (AOF off) is filled fast with pipelined XADDs of valid
records: lifecycle history entries in the documented format
(delayed_middleware.history; 80 % fired with lateness 0-999 ms, the rest
scheduled / cancelled / expired / retried / dead-lettered) and DelayedMessage
envelopes on `<app>-delayed` (100-byte payloads, due over the next two days),
ten topics each. Then the real console script runs, as a user would, once with
`--master local[1]` (one read partition per stream) and once with `local[2]`
(two): wall time end to end, Spark start-up included, and rows/s.

    .venv/bin/python bench/spark_stats.py [--history 1000000] [--pending 1000000] [--standalone]

`--standalone` also runs it with `--master spark://…` against a standalone master and one worker (2 cores)
started from pyspark's own distribution on loopback (tests/spark_cluster.py), in the same run, and checks
that its printed figures equal local[2]'s.
"""

from __future__ import annotations

import argparse
import difflib
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for sub in ("proto", "middleware", "components", "."):
    sys.path.insert(0, str(ROOT / sub))

from delayed_middleware.envelope import Envelope, encode_envelope  # noqa: E402
from delayed_middleware.keys import EngineKeys, delayed_topic  # noqa: E402
from tests.redis_server import RedisServer  # noqa: E402
from tests.spark_cluster import StandaloneCluster  # noqa: E402

APP = "bench"
TOPICS = [f"topic-{i}" for i in range(10)]
PIPELINE = 5_000


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def fill_history(client: object, n: int, rng: random.Random) -> float:
    key = EngineKeys.for_topic(delayed_topic(APP)).history
    start, base = time.monotonic(), now_ms() - 3_600_000
    pipe = client.pipeline(transaction=False)  # type: ignore[attr-defined]
    others = ["scheduled", "cancelled", "expired", "retried", "deadlettered"]
    for i in range(n):
        topic = TOPICS[i % len(TOPICS)]
        due = base + i * 3  # spread over ~50 minutes
        if rng.random() < 0.8:
            late = rng.randrange(1000)
            fields = {"event": "fired", "at": due + late, "due": due, "late": late}
        else:
            fields = {"event": others[i % len(others)], "at": due, "due": due, "late": ""}
        fields |= {"id": f"m{i}", "sid": "", "topic": topic, "kind": "oneshot", "size": 100, "attempt": 1}
        fields |= {"reason": "", "schedule": ""}
        pipe.xadd(key, fields)
        if len(pipe) >= PIPELINE:
            pipe.execute()
    pipe.execute()
    return time.monotonic() - start


def fill_pending(client: object, n: int) -> float:
    key = EngineKeys.for_topic(delayed_topic(APP)).stream
    start, now = time.monotonic(), now_ms()
    # 1,000 distinct envelopes cycled: encoding is not what is measured.
    templates = [
        encode_envelope(
            Envelope(
                id="",
                topic=TOPICS[i % len(TOPICS)],
                due_ms=now + 60_000 + i * 172_800,  # over the next two days
                published_at_ms=now,
                message=b"x" * 100,
                pubsub_name="delayed",
            )
        )
        for i in range(1000)
    ]
    pipe = client.pipeline(transaction=False)  # type: ignore[attr-defined]
    for i in range(n):
        pipe.xadd(key, {"data": templates[i % 1000], "metadata": "{}"})
        if len(pipe) >= PIPELINE:
            pipe.execute()
    pipe.execute()
    return time.monotonic() - start


def run_stats(address: str, master: str, out: Path) -> tuple[float, str]:
    script = Path(sys.executable).parent / "delayed-pubsub"
    start = time.monotonic()
    proc = subprocess.run(
        [
            str(script),
            "stats",
            "--redis-host",
            address,
            "--app-id",
            APP,
            "--master",
            master,
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    wall = time.monotonic() - start
    if proc.returncode != 0:
        raise SystemExit(f"stats failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return wall, proc.stdout


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--history", type=int, default=1_000_000)
    parser.add_argument("--pending", type=int, default=1_000_000)
    parser.add_argument("--standalone", action="store_true", help="also on a standalone master and worker")
    args = parser.parse_args()
    rows = args.history + args.pending
    print(
        f"# {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, {platform.node()}, {os.cpu_count()} cores, "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    with tempfile.TemporaryDirectory(prefix="bench-spark-") as tmp:
        folder = Path(tmp)
        server = RedisServer(folder / "redis", appendonly=False)
        server.start()
        try:
            client = server.client()
            h_s = fill_history(client, args.history, random.Random(7))
            p_s = fill_pending(client, args.pending)
            mem = int(client.info("memory")["used_memory"])
            print(
                f"filled: {args.history:,} history events in {h_s:.1f} s, {args.pending:,} envelopes in "
                f"{p_s:.1f} s; Redis used_memory {mem / 2**20:,.0f} MiB"
            )
            results = []
            for parts in (1, 2):
                wall, text = run_stats(server.address, f"local[{parts}]", folder / f"out{parts}")
                results.append((parts, wall))
                print(
                    f"partitions {parts}: {wall:.1f} s end to end, {rows / wall:,.0f} rows/s "
                    f"(load average {os.getloadavg()[0]:.1f})"
                )
            if args.standalone:
                cluster = StandaloneCluster(folder / "spark", cores=2)
                cluster.start()
                try:
                    wall, remote_text = run_stats(server.address, cluster.url, folder / "out-standalone")
                finally:
                    cluster.stop()
                results.append((0, wall))
                same = _figures(remote_text) == _figures(text)
                print(
                    f"standalone master + 1 worker (2 cores): {wall:.1f} s end to end, {rows / wall:,.0f} rows/s; "
                    f"figures {'equal' if same else 'DIFFER from'} local[2]'s"
                )
                if not same:
                    print("\n".join(difflib.unified_diff(_figures(text), _figures(remote_text), lineterm="")))
            print("\n--- stats output (2 partitions) ---\n" + text)
            print("| read partitions (`--master`) | wall time, start-up included | rows/s |")
            print("|---|---:|---:|")
            for parts, wall in results:
                master = f"`local[{parts}]`" if parts else "`spark://…` standalone, 1 worker, 2 cores"
                print(f"| {parts or 2} ({master}) | {wall:.1f} s | {rows / wall:,.0f} |")
        finally:
            server.stop()


def _figures(text: str) -> list[str]:
    """The printed summary without what depends on when it ran: the header line and the due windows
    (counted from now, they shift between two runs)."""
    out: list[str] = []
    skipping = False
    for line in text.splitlines():
        if line.startswith("delayed-pubsub stats for"):
            continue
        if line and not line.startswith(" "):
            skipping = line.startswith("pending by due window")
        if not skipping and line.strip():
            out.append(line)
    return out


if __name__ == "__main__":
    main()
