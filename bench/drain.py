"""A backlog drained through ONE real daprd: the built-in pubsub.redis against ours, in one run.

Before daprd starts, N entries are written straight to each topic's stream in
pubsub.redis's own entry format (fields `data` = a CloudEvent, `metadata` = JSON):
`drain-builtin` (subscribed through the built-in `pubsub`) and `drain-ours`
(subscribed through our `delayed`). One daprd (1.18, HTTP app channel) loads both
components on the same Redis; a Go HTTP app (bench/drain_app, answers 200 at once)
subscribes to both. Each figure is timed from daprd's launch to its last arrival;
the two backlogs drain side by side on the same daprd.

    .venv/bin/python -m bench drain [--messages 20000] [--fast-path] [--streams K]
                                    [--ours KEY=VALUE ...] [--bare] [--bare-go] [--no-ours]

--fast-path: also N delayed messages published to our serve (over gRPC, due at
once) and fired onto `drain-fast` before daprd starts, subscribed through the
built-in: the fast path of dapr/fastpath/ (how long the fire took is printed too).
--streams K: ours through K component instances (one socket, one consumer group),
each subscribed to `drain-ours`: K PullMessages streams share the backlog.
--ours KEY=VALUE: subscription settings of our component (concurrency, queueDepth, ...).
--bare / --bare-go: also the floor of a pluggable stream, `drain-bare` / `drain-bare-go` through a
bare component in Python on grpc.aio (bench/bare_pubsub.py) / in Go (bench/bare_go) that sends N
messages from memory and drops the acks: the best pace any component in that language can reach
through daprd's pluggable path. --no-ours leaves ours out.

Besides the times, what explains them: how many deliveries the app held at once
per route, our component's sent-but-unacked count sampled once a second (its
Prometheus counters) and the send->ack time it implies (Little's law), the app's
answer time and the time from one answer to the next call on a route (on a route
daprd calls one at a time, the part of each message's round trip that is daprd's and
the pub/sub's), and each process's CPU.

Needs redis-server, Go (the app is built into ~/.cache on first use) and daprd
(scripts/daprd.sh finds or builds it).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for _sub in ("proto", "middleware", "components", "."):
    sys.path.insert(0, str(ROOT / _sub))

import grpc  # noqa: E402
import httpx  # noqa: E402
import redis  # noqa: E402

from bench.common import MD, PAYLOAD, daprd_heading, start_http_app, start_serve, stop_all  # noqa: E402
from bench.delay import bulk_schedule  # noqa: E402
from bench.deliver import cpu_seconds  # noqa: E402
from delayed_pubsub_pb.dapr.proto.components.v1 import common_pb2, pubsub_pb2, pubsub_pb2_grpc  # noqa: E402
from tests.e2e import harness  # noqa: E402
from tests.redis_server import RedisServer, free_port  # noqa: E402

APP_ID = "drain-app"
APP_SOURCE = Path(__file__).resolve().parent / "drain_app"
BARE_GO_SOURCE = Path(__file__).resolve().parent / "bare_go"
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "dapr-delayed-pubsub"
BUILTIN = ("pubsub", "drain-builtin")
FAST = ("pubsub", "drain-fast")
OURS_TOPIC = "drain-ours"
# The bare components: figure -> (component name, its type's socket name, topic).
BARE = {
    "bare Python": ("bare", "bare-pubsub", "drain-bare"),
    "bare Go": ("barego", "bare-go", "drain-bare-go"),
}


def go_binary(source: Path, name: str) -> Path:
    """A Go program of the bench, built with `go build` into the cache once per version of its source."""
    digest = hashlib.sha256(
        b"".join(p.read_bytes() for p in sorted(source.iterdir()) if p.suffix in (".go", ".mod", ".sum"))
    ).hexdigest()[:12]
    exe = CACHE / f"{name}-{digest}"
    if not exe.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        subprocess.run(["go", "build", "-o", str(exe), "."], cwd=source, check=True)
    return exe


def app_binary() -> Path:
    """The Go app."""
    return go_binary(APP_SOURCE, "drain-app")


def start_bare(figure: str, sockets: Path, n: int, log: Path) -> subprocess.Popen[bytes]:
    """The bare component of `figure`, sending `n` messages on its stream (0: none, when its backlog
    is not the one timed), once its socket is there."""
    socket = sockets / f"{BARE[figure][1]}.sock"
    if figure == "bare Python":
        args = [sys.executable, "-m", "bench.bare_pubsub", str(socket), str(n)]
    else:
        args = [str(go_binary(BARE_GO_SOURCE, "bare-go")), str(socket), str(n)]
    with log.open("ab") as out:
        proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=out)
    harness.wait_until_blocking(lambda: socket.exists(), f"{figure}'s socket", 30)
    return proc


def write_backlog(client: redis.Redis, topic: str, n: int) -> None:
    """N CloudEvents on `topic` in pubsub.redis's entry format, pipelined."""
    for start in range(0, n, 2000):
        pipe = client.pipeline(transaction=False)
        for _ in range(start, min(n, start + 2000)):
            pipe.xadd(topic, {"data": PAYLOAD, "metadata": b"{}"})
        pipe.execute()


async def fire_fast_path(socket: Path, client: redis.Redis, n: int) -> float:
    """N delayed messages onto drain-fast through our serve, due at once; returns the seconds until
    all of them have fired (landed on the stream).

    Published as instance "bench" with the app's consumerID: fired entries land where the
    built-in reads them (dapr/fastpath/). They fire before daprd starts, so the fast path's
    drain is timed like the other backlogs' (a due instant at daprd's launch would need the
    publishing time guessed beforehand, which a loaded machine makes wrong).
    """
    t0 = time.perf_counter()
    redis_host = f"127.0.0.1:{client.connection_pool.connection_kwargs['port']}"
    async with grpc.aio.insecure_channel(f"unix://{socket}") as channel:
        stub = pubsub_pb2_grpc.PubSubStub(channel)  # type: ignore[no-untyped-call]
        props = {"redisHost": redis_host, "consumerID": APP_ID, "enableDelayedMessaging": "true"}
        init = pubsub_pb2.PubSubInitRequest(metadata=common_pb2.MetadataRequest(properties=props))
        await stub.Init(init, metadata=MD)
        await bulk_schedule(stub, FAST[1], [time.time_ns() // 1_000_000] * n, PAYLOAD)
    harness.wait_until_blocking(lambda: client.xlen(FAST[1]) >= n, "the fast path's messages to fire", 300)
    return time.perf_counter() - t0


def redis_calls(client: redis.Redis) -> dict[str, int]:
    """Calls per Redis command so far (INFO commandstats)."""
    stats: dict[str, dict[str, int]] = client.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()}


# --- sampling during the drain ------------------------------------------------------


def prometheus_sum(text: str, metric: str, match: str = "") -> float:
    """The sum of a Prometheus metric's samples (lines naming `match`, if given)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(metric) and (line[len(metric)] in " {") and match in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


@dataclass
class Sampler:
    """Our component's sent-but-unacked count, every `every_s`, in a thread, until stopped: the
    samples from its first send until `total` are acked (zeros in between count too).

    Once a second: a scrape costs serve ~10 ms of CPU (its metrics merged and rendered) with
    the GIL held, and at 4 a second it was ~10 % of serve's CPU in a drain (py-spy), counted
    in serve's CPU per message and slowing its loop."""

    metrics_port: int
    total: int
    every_s: float = 1.0
    unacked: list[float] = field(default_factory=list)
    stop_flag: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        with httpx.Client(timeout=2) as http:
            while not self.stop_flag.wait(self.every_s):
                try:
                    text = http.get(f"http://127.0.0.1:{self.metrics_port}/metrics").text
                except httpx.HTTPError:
                    continue
                sent = prometheus_sum(text, "delayed_pubsub_delivered_messages_total")
                acked = prometheus_sum(text, "delayed_pubsub_acked_messages_total")
                if sent > 0 and acked < self.total:
                    self.unacked.append(sent - acked)


def wait_all(app_port: int, routes: Mapping[str, Sequence[str]], n: int, timeout_s: float) -> dict[str, Any]:
    """/stats once every figure's routes hold `n` arrivals together."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = httpx.get(f"http://127.0.0.1:{app_port}/stats", timeout=5).json()
        counts = {k: sum(got.get(r, {}).get("count", 0) for r in rs) for k, rs in routes.items()}
        if all(c >= n for c in counts.values()):
            return dict(got)
        if time.monotonic() > deadline:
            raise SystemExit(f"not all arrived within {timeout_s:.0f} s: {counts} of {n}")
        time.sleep(0.1)


# --- the run ------------------------------------------------------------------------


@dataclass
class Layout:
    ours: list[str]  # our component instances, each subscribed to drain-ours (none: ours left out)
    fast_path: bool
    bare: list[str] = field(default_factory=list)  # figures of BARE

    def subscriptions(self) -> list[tuple[str, str]]:
        subs = [BUILTIN] + [(name, OURS_TOPIC) for name in self.ours]
        subs += [(BARE[figure][0], BARE[figure][2]) for figure in self.bare]
        return subs + ([FAST] if self.fast_path else [])

    def routes(self) -> dict[str, list[str]]:
        routes = {"built-in": [f"/events/{BUILTIN[0]}/{BUILTIN[1]}"]}
        if self.ours:
            routes["ours"] = [f"/events/{name}/{OURS_TOPIC}" for name in self.ours]
        for figure in self.bare:
            routes[figure] = [f"/events/{BARE[figure][0]}/{BARE[figure][2]}"]
        if self.fast_path:
            routes["fast path"] = [f"/events/{FAST[0]}/{FAST[1]}"]
        return routes


def write_resources(folder: Path, redis_port: int, layout: Layout, ours_meta: dict[str, str]) -> None:
    folder.mkdir()
    host = {"redisHost": f"127.0.0.1:{redis_port}"}
    (folder / "pubsub.yaml").write_text(harness.component_yaml("pubsub", host, "pubsub.redis"))
    for name in layout.ours:
        yaml = harness.component_yaml(name, {**host, **ours_meta}, "pubsub.delayed-pubsub")
        (folder / f"{name}.yaml").write_text(yaml)
    for figure in layout.bare:
        name, kind, _ = BARE[figure]
        (folder / f"{name}.yaml").write_text(harness.component_yaml(name, {}, f"pubsub.{kind}"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--messages", type=int, default=20_000)
    ap.add_argument("--fast-path", action="store_true")
    ap.add_argument("--streams", type=int, default=1)
    ap.add_argument("--ours", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument(
        "--bare", action="store_true", help="also the bare Python component (bench/bare_pubsub.py)"
    )
    ap.add_argument("--bare-go", action="store_true", help="also the bare Go component (bench/bare_go)")
    ap.add_argument("--no-ours", action="store_true", help="leave our component out")
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument(
        "--apart",
        action="store_true",
        help="each backlog drained alone, by a daprd of its own (same components and subscriptions), "
        "one after the other: no drain slows another, and each process's CPU is that backlog's",
    )
    ap.add_argument("--json", action="store_true", help="also print the figures as one JSON line")
    a = ap.parse_args()
    ours_meta = dict(kv.split("=", 1) for kv in a.ours)
    ours = [] if a.no_ours else [f"delayed{i}" if i else "delayed" for i in range(a.streams)]
    bare = [f for f, wanted in (("bare Python", a.bare), ("bare Go", a.bare_go)) if wanted]
    layout = Layout(ours, a.fast_path, bare)
    n = a.messages
    app_exe = app_binary()
    daprd_path = harness.find_daprd()
    extra = f", ours: {a.streams} streams {ours_meta or ''}" if a.streams > 1 or ours_meta else ""
    print(daprd_heading(daprd_path, f"{n}-entry backlogs, HTTP app (Go){extra}"))
    setup = Setup(a, layout, ours_meta, app_exe, daprd_path)
    with tempfile.TemporaryDirectory(prefix="dpsdrain-") as d:
        figures = apart(Path(d), setup) if a.apart else run(Path(d), setup)
    if a.json:
        print(json.dumps(figures))


@dataclass(frozen=True)
class Setup:
    """What every daprd of one bench run is given."""

    args: argparse.Namespace
    layout: Layout
    ours_meta: dict[str, str]
    app_exe: Path
    daprd_path: str


def apart(work: Path, setup: Setup) -> dict[str, Any]:
    """Each backlog alone (run(only=...)), then its time and every process's CPU per message side by side."""
    n = setup.args.messages
    merged: dict[str, Any] = {"seconds": {}, "app_at_once": {}, "cpu_us": {}, "ours_unacked_max": 0}
    for figure in setup.layout.routes():
        print(f"\n## {figure}, alone")
        folder = work / figure.replace(" ", "-")
        folder.mkdir()
        got = run(folder, setup, only=figure)
        merged["seconds"][figure] = got["seconds"][figure]
        merged["app_at_once"][figure] = got["app_at_once"][figure]
        merged["cpu_us"][figure] = {k: v / n * 1e6 for k, v in got["cpu_s"].items()}
        merged["ours_unacked_max"] = max(merged["ours_unacked_max"], got["ours_unacked_max"])
    seconds = merged["seconds"]
    merged["ratios"] = ratios = {f: seconds["built-in"] / s for f, s in seconds.items() if f != "built-in"}
    merged["ratio"] = ratios.get("ours")
    print("\n## each alone")
    names = list(merged["cpu_us"]["built-in"])
    print(f"| backlog | drained (s) | msgs/s | CPU per message (us): {', '.join(names)} | total |")
    print("|---|---|---|---|---|")
    for figure, s in seconds.items():
        cpu = merged["cpu_us"][figure]
        parts = ", ".join(f"{cpu[k]:.0f}" for k in names)
        print(f"| {figure} | {s:.2f} | {n / s:,.0f} | {parts} | {sum(cpu.values()):.0f} |")
    print()
    for figure, r in ratios.items():
        print(f"alone, {figure} drains at {r:.2f}x the built-in's pace")
    return merged


def run(work: Path, setup: Setup, only: str | None = None) -> dict[str, Any]:
    """One daprd over the layout; the backlogs of `only` (a figure) or of all; returns the figures."""
    a, layout = setup.args, setup.layout
    n = a.messages
    wanted = {k: v for k, v in layout.routes().items() if only in (None, k)}
    server = RedisServer(work / "redis", appendonly=False)
    server.start()
    procs: list[Any] = []
    sampler: Sampler | None = None
    client = redis.Redis(port=server.port)
    try:
        if "built-in" in wanted:
            write_backlog(client, BUILTIN[1], n)
        if "ours" in wanted and layout.ours:
            write_backlog(client, OURS_TOPIC, n)
        sockets = work / "sockets"
        sockets.mkdir()
        metrics_port = free_port()
        serve = start_serve(
            sockets / "delayed-pubsub.sock", work / "serve.log", "--metrics-port", str(metrics_port)
        )
        procs.append(serve)
        bares = {}
        for figure in layout.bare:
            bares[figure] = start_bare(figure, sockets, n if figure in wanted else 0, work / "bare.log")
            procs.append(bares[figure])
        app_port = free_port()
        app = start_http_app(
            [str(setup.app_exe), str(app_port), *(f"{p}={t}" for p, t in layout.subscriptions())],
            app_port,
            work / "app.log",
        )
        procs.append(app)
        resources = work / "resources"
        write_resources(resources, server.port, layout, setup.ours_meta)
        if "fast path" in wanted:
            fired_s = asyncio.run(fire_fast_path(sockets / "delayed-pubsub.sock", client, n))
            print(
                f"fast path: {n} delayed messages published and fired in {fired_s:.2f} s, before daprd's launch"
            )
        assert server.proc is not None
        watched = {"daprd": 0, "serve": serve.pid, "app": app.pid, "redis": server.proc.pid}
        watched |= {figure: proc.pid for figure, proc in bares.items()}
        cpu0 = {k: cpu_seconds(pid) for k, pid in watched.items() if pid}
        calls0 = redis_calls(client)
        ports = harness.DaprdPorts.free()
        launch_ms = time.time_ns() // 1_000_000
        daprd = harness.start_daprd(setup.daprd_path, work, sockets, APP_ID, app_port, resources, ports)
        procs.append(daprd)
        assert daprd.proc is not None
        watched["daprd"] = daprd.proc.pid
        sampler = Sampler(metrics_port, n if "ours" in wanted else 0)
        threading.Thread(target=sampler.run, daemon=True).start()
        stats = wait_all(app_port, wanted, n, a.timeout)
        sampler.stop_flag.set()
        cpu = {k: cpu_seconds(pid) - cpu0.get(k, 0.0) for k, pid in watched.items()}
        calls = {k: v - calls0.get(k, 0) for k, v in redis_calls(client).items() if v > calls0.get(k, 0)}
        figures = report(n, launch_ms, layout, wanted, stats, sampler, cpu)
        # What each message cost Redis: the pub/subs' reads and acks (the rest is start-up).
        busy = sorted(calls.items(), key=lambda kv: -kv[1])[:6]
        per = n * len(wanted)
        print("Redis calls per message: " + ", ".join(f"{k} {v / per:.2f}" for k, v in busy))
        figures["redis_calls"] = calls
        return figures
    finally:
        if sampler is not None:
            sampler.stop_flag.set()
        stop_all(procs)
        client.close()
        server.stop()


def report(
    n: int,
    launch_ms: int,
    layout: Layout,
    wanted: Mapping[str, Sequence[str]],
    stats: dict[str, Any],
    sampler: Sampler,
    cpu: dict[str, float],
) -> dict[str, Any]:
    """Print the figures; return them (seconds per backlog, the app's most held at once per route)."""
    seconds: dict[str, float] = {}
    at_once: dict[str, list[int]] = {}
    print()
    print(
        "| backlog | subscribed through | drained (s, from daprd's launch) | msgs/s | app held at once (max) |"
    )
    print("|---|---|---|---|---|")
    through = {
        "built-in": "pubsub.redis",
        "ours": f"ours, {len(layout.ours)} stream(s)",
        "fast path": "pubsub.redis",
        **{figure: f"pubsub.{kind}" for figure, (_, kind, _) in BARE.items()},
    }
    for figure, routes in wanted.items():
        rows = [stats[r] for r in routes]
        first = min(r["first_ms"] for r in rows)
        last = max(r["last_ms"] for r in rows)
        seconds[figure] = s = (last - launch_ms) / 1000
        at_once[figure] = [r["max_at_once"] for r in rows]
        print(f"| {figure} | {through[figure]} | {s:.2f} (first at {(first - launch_ms) / 1000:.2f}) | "
              f"{n / s:,.0f} | {'+'.join(map(str, at_once[figure]))} |")  # fmt: skip
    print()
    ratio = seconds["built-in"] / seconds["ours"] if {"built-in", "ours"} <= set(seconds) else None
    if ratio is not None:
        print(f"ours drains at {ratio:.2f}x the built-in's pace "
              f"({seconds['ours']:.2f} s vs {seconds['built-in']:.2f} s)")  # fmt: skip
    for figure in BARE:
        if {"built-in", figure} <= set(seconds):
            print(f"{figure}: {seconds[figure]:.2f} s = {seconds['built-in'] / seconds[figure]:.2f}x "
                  "the built-in's pace (the floor of a pluggable stream)")  # fmt: skip
    if {"built-in", "fast path"} <= set(seconds):
        print(f"fast path: {seconds['fast path']:.2f} s = {seconds['built-in'] / seconds['fast path']:.2f}x "
              "the built-in's pace (fired before daprd's launch)")  # fmt: skip
    unacked = sorted(sampler.unacked)
    if unacked and "ours" in wanted:
        mean = sum(unacked) / len(unacked)
        rows = [stats[r] for r in wanted["ours"]]
        busy_s = (max(r["last_ms"] for r in rows) - min(r["first_ms"] for r in rows)) / 1000
        print(
            f"ours, sent and not yet acked (every {sampler.every_s:g} s, {len(unacked)} samples): median "
            f"{unacked[len(unacked) // 2]:.0f}, max {unacked[-1]:.0f}; send->ack ~ {mean / (n / busy_s) * 1000:.1f} ms "
            f"(mean unacked / rate), {busy_s / n * 1e6:.0f} us per message on the stream(s)"
        )
    for figure, routes in wanted.items():
        rows = [stats[r] for r in routes]
        gaps = sum(r["gaps"] for r in rows)
        if gaps:
            answer_us = sum(r["answer_ns"] for r in rows) / sum(r["count"] for r in rows) / 1000
            gap_us = sum(r["gap_ns"] for r in rows) / gaps / 1000
            print(
                f"{figure}: the app answers in {answer_us:.0f} us; from an answer to the next call on the "
                f"same route (none in flight) {gap_us:.0f} us ({gaps:,} gaps)"
            )
    print("CPU seconds from launch to the last arrival: " + ", ".join(f"{k} {v:.2f}" for k, v in cpu.items()))
    return {
        "seconds": seconds,
        "ratio": ratio,
        "app_at_once": at_once,
        "ours_unacked_max": unacked[-1] if unacked else 0,
        "cpu_s": cpu,
    }


if __name__ == "__main__":
    main()
