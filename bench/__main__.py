"""`python -m bench`: the benchmarks of this folder, from one registry.

    python -m bench                   # the quick set, each at its quick sizes (what `make bench` runs)
    python -m bench --list            # every benchmark: quick or opt-in, what it needs, what it measures
    python -m bench NAME [args]       # one benchmark, with its own options (`python -m bench NAME --help`)
    python -m bench NAME --quick      # one benchmark of the quick set at its quick sizes

The quick set needs only what `make setup` installs (redis-server, the venv) and finishes in
minutes; its figures are smaller runs of the same measurements. The others are opt-in: long at
their sizes, or they need daprd, ghz, NATS, podman or a Spark session. Figures go to stdout; the
curated ones are kept in bench/RESULTS.md, each with the exact command that produced it.
"""

from __future__ import annotations

import runpy
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Bench:
    """One benchmark script, bench/<name>.py, run as its `__main__` with its own argv."""

    name: str
    description: str
    # The arguments of its run in the quick set; None: opt-in, never run by default.
    quick: tuple[str, ...] | None = None
    # Why an opt-in benchmark is not in the quick set: its length, or what it needs beyond
    # redis-server and the venv.
    why_opt_in: str = ""


# The one registry: `python -m bench`, `make bench` and the test of this folder read it.
BENCHES: tuple[Bench, ...] = (
    # --- the quick set: run by `python -m bench` and `make bench`, in this order -------------
    Bench(
        "publish",
        "unary and bulk Publish, publish -> pull -> ack, vs redis-benchmark XADD",
        ("--messages", "5000"),
    ),
    Bench(
        "delay",
        "lateness at a steady rate, a same-instant burst's drain, delayed vs plain ingest, bytes per pending",
        ("--steady-seconds", "5", "--burst", "10000", "--ingest", "5000", "--pending", "50000"),
    ),
    Bench(
        "deliver",
        "a backlog drained through PullMessages: time, CPU per message, exactly once",
        ("--messages", "20000"),
    ),
    Bench("memory", "Redis bytes per pending delayed message, by key role", ("--messages", "20000")),
    Bench(
        "schedules",
        "@every schedules in one instance: lateness, exactly once, CPU; bulk cancels",
        ("--schedules", "1000", "--window", "5", "--cancels", "10000"),
    ),
    Bench(
        "chaos",
        "kill -9 cycles of two replicas under a firing backlog: lost and doubled",
        ("--messages", "5000", "--cycles", "3", "--window", "15", "--settle", "60"),
    ),
    Bench("engine_attacks", "longest script call (SLOWLOG) for hostile envelopes", ()),
    Bench(
        "compaction_cost",
        "the density check's Redis time on dense and sparse streams",
        ("--entries", "100000"),
    ),
    Bench(
        "ops",
        "Inspector scans, the operator CLI as a process, the nack and hand-off paths",
        ("--pending", "10000", "--nacks", "500", "--handoffs", "1000"),
    ),
    Bench(
        "handoff",
        "hand-offs per second through one forwarder to a sidecar that accepts at once, each once",
        ("--handoffs", "3000", "--runs", "1"),
    ),
    Bench(
        "recover",
        "the start-up recovery sweep of one shard: nothing to recover, and 1 envelope in 10 orphaned",
        ("--pending", "20000"),
    ),
    Bench(
        "retry_idle",
        "the retry pollers' CPU in the gRPC process at idle, with vs without a retry policy",
        why_opt_in="a minute of idle time, measured, per run",
    ),
    Bench(
        "history",
        "`delayed-pubsub history` and `inspect` as processes: wall, CPU, peak RSS",
        ("--records", "10000"),
    ),
    Bench(
        "history_rows",
        "CPU of history entries -> Arrow rows (the Spark reader's hot loop)",
        ("--records", "100000"),
    ),
    Bench(
        "spark_pending",
        "the delayed-pending reader before and after a compaction pass",
        ("--envelopes", "10000"),
    ),
    Bench(
        "liveness",
        "firing on Redis Cluster under a small connection pool: every accepted publish lands",
        ("--runs", "1"),
    ),
    Bench(
        "ops_cluster",
        "the operator tools reading every shard on Redis Cluster vs one shard",
        ("--pending", "10000"),
    ),
    # --- opt-in: long, or needing more than redis-server ------------------------------------
    Bench(
        "cluster",
        "the two-phase fire over 1-6 shards and 1-3 replicas on Redis Cluster",
        why_opt_in="long: 9 shard/replica runs of a 20k burst",
    ),
    Bench(
        "peers",
        "side by side with NATS JetStream message schedules (--quick <= 10 min, --full)",
        why_opt_in="long; nats-server (go install)",
    ),
    Bench(
        "steady_trace",
        "the steady workload's lateness split by stage: fire, idle, read, queue, write, client",
        why_opt_in="a diagnosis, not a figure: ~30 s per run at 1,000/s",
    ),
    Bench(
        "grpc_ceiling",
        "unary Publish driven by a Go client vs a bare grpc.aio server",
        why_opt_in="needs ghz (go install)",
    ),
    Bench(
        "unary",
        "unary Publish vs the grpc.aio ceiling and a thread-pool server",
        why_opt_in="needs ghz (go install)",
    ),
    Bench(
        "fastpath",
        "ours, the built-in pubsub.redis and the fast path through one daprd",
        why_opt_in="needs daprd and ghz",
    ),
    Bench(
        "serve_memory",
        "RSS of serve and its workers, idle and under delayed publishes through daprd (app.yaml's sizing)",
        why_opt_in="needs daprd; about 3 minutes",
    ),
    Bench(
        "restart",
        "failed publishes through daprd while serve restarts, with and without resiliency",
        why_opt_in="needs daprd",
    ),
    Bench(
        "container", "the container image vs serve on the host: start, RSS, stop", why_opt_in="needs podman"
    ),
    Bench(
        "spark_stats",
        "`delayed-pubsub stats` over 1M history events and 1M pending",
        why_opt_in="long; needs Java (a Spark session)",
    ),
    Bench(
        "planning",
        "publish planning and settings start-up, this tree vs a git ref",
        why_opt_in="a before/after against a git ref (--base)",
    ),
    Bench(
        "history_index",
        "what the history's by-id index costs the fire path: 50,000 scheduleIds due at one instant",
        why_opt_in="a before/after: run it again on the older tree (PYTHONPATH) in the same sitting",
    ),
    Bench(
        "fire_cost",
        "Redis CPU and commands per fired message: 50,000 one-shots due at one instant, AOF off or everysec",
        why_opt_in="a before/after: run it again on the older tree (PYTHONPATH) in the same sitting",
    ),
    Bench(
        "catchup_cost",
        "a 3-day outage of a 1-minute schedule caught up with scheduleCatchup all (4,320 deliveries) vs one",
        why_opt_in="a one-off measurement kept in bench/RESULTS.md (about a minute of wall time)",
    ),
    Bench(
        "cancel_triggers",
        "what CANCEL's look at Cluster's triggers set costs, by its size (two-phase keys on one node)",
        why_opt_in="a before/after: run it again on the older tree (git archive) in the same sitting",
    ),
    Bench(
        "trigger_request",
        "a schedule's trigger with a request id on Cluster's two-phase path, by the triggers set's size",
        why_opt_in="a before/after: run it again on the older tree (git archive) in the same sitting",
    ),
    Bench(
        "burst_profile",
        "where the wall time of a 50k burst goes: per-process CPU and run-queue wait over T -> all fired",
        why_opt_in="a diagnosis, not a figure to track: long (the burst waits for its due time)",
    ),
    Bench(
        "pause",
        "pending --prefix/--after paging and scheduleIdPrefix cancels over 1M pending",
        why_opt_in="long: fills 1M pending messages",
    ),
    Bench(
        "reschedule",
        "scheduleReschedule's cost: 10,000 moves of pending one-shots, against 10,000 cancels, 1 and 50 in flight",
        why_opt_in="a few minutes: 3 runs of 10,000 moves and 10,000 cancels at each concurrency",
    ),
    Bench(
        "dashboard",
        "the dashboard's CPU and Redis commands per page refresh and per live tick over 1M pending",
        why_opt_in="long: fills 1M pending messages",
    ),
    Bench(
        "backfill",
        "`delayed-pubsub backfill` of 4,320 occurrences (@every and a zoned cron): wall, CPU, Redis CPU",
        why_opt_in="a figure for RESULTS.md, not a regression gate",
    ),
    Bench(
        "deliver_stages",
        "CPU per delivered message, stage by stage below gRPC (Redis round trip, decode, window, response)",
        why_opt_in="a breakdown of deliver's figure: run it beside `deliver --ceiling`",
    ),
    Bench(
        "drain",
        "a backlog drained through daprd: ours vs the built-in pubsub.redis (and the fast path, bare components)",
        why_opt_in="needs daprd and Go (its HTTP app and bare Go component are built with go build)",
    ),
    Bench(
        "daprd_publish",
        "unary publishes through daprd: ours (plain, delayed) against the built-in pubsub.redis",
        why_opt_in="needs daprd and ghz",
    ),
)

# Python files of bench/ that are not benchmarks.
NOT_BENCHMARKS: dict[str, str] = {
    "__init__": "the package",
    "__main__": "this registry and runner",
    "common": "what the benchmarks share: payload, call metadata, serve as a process",
    "bare_pubsub": "the bare Python pluggable component `drain --bare` runs (the floor of a stream)",
}

BY_NAME = {b.name: b for b in BENCHES}


def listing() -> str:
    """The registry as text: one line per benchmark."""
    width = max(len(b.name) for b in BENCHES)
    lines = []
    for b in BENCHES:
        if b.quick is not None:
            kind, extra = "quick ", " ".join(b.quick)
        else:
            kind, extra = "opt-in", b.why_opt_in
        lines.append(f"{b.name:<{width}}  {kind}  {b.description}" + (f"  [{extra}]" if extra else ""))
    return "\n".join(lines)


def run_quick_set() -> int:
    """Every benchmark of the quick set, each in its own process; a summary; 1 if any failed."""
    results: list[tuple[str, int, float]] = []
    for b in BENCHES:
        if b.quick is None:
            continue
        command = [sys.executable, "-m", "bench", b.name, *b.quick]
        print(f"\n==> python -m bench {b.name} {' '.join(b.quick)}", flush=True)
        started = time.monotonic()
        code = subprocess.run(command, cwd=HERE.parent, check=False).returncode
        results.append((b.name, code, time.monotonic() - started))
    print("\n==> quick set")
    for name, code, took in results:
        print(f"{name:<16} {'ok' if code == 0 else f'FAILED ({code})':<12} {took:7.1f} s")
    return 1 if any(code for _, code, _ in results) else 0


def main() -> None:
    args = sys.argv[1:]
    if not args:
        raise SystemExit(run_quick_set())
    if args[0] in ("-h", "--help"):
        print(__doc__)
        print(listing())
        return
    if args[0] == "--list":
        print(listing())
        return
    bench = BY_NAME.get(args[0])
    if bench is None:
        raise SystemExit(f"no benchmark {args[0]!r}; `python -m bench --list` names them all")
    rest = args[1:]
    if rest == ["--quick"] and bench.quick is not None:
        rest = list(bench.quick)
    sys.argv = [f"bench {bench.name}", *rest]
    # As `python bench/<name>.py` runs it: its own `__main__` block (some mains are coroutines).
    runpy.run_module(f"bench.{bench.name}", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
