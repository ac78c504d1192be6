"""Unary publishes through ONE real daprd: ours (plain and delayed) against Dapr's built-in pubsub.redis.

One Redis, one daprd (1.18), three pub/sub components on it: `pubsub` (the
built-in pubsub.redis), `delayed` (our `serve`) and, with --base DIR, `base`
(our `serve` from another source tree, e.g. `git archive main | tar -x -C DIR`,
on a socket of its own: component type pubsub.delayed-pubsub-base). ghz (a Go
client, as an app's SDK) sends PublishEvent calls to daprd's gRPC API, in
interleaved rounds. For each figure: publishes/s, and the CPU each process
spent per publish (daprd, our serve, redis-server), so that the share of the
time that is daprd's and the share that is ours can be read off.

    .venv/bin/python bench/daprd_publish.py [--messages 20000] [--concurrency 64] [--rounds 2] [--base DIR]

Needs redis-server, daprd (scripts/daprd.sh finds or builds it) and ghz.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from bench.common import daprd_heading, start_process, start_serve, stop_all  # noqa: E402
from bench.deliver import cpu_seconds  # noqa: E402
from bench.fastpath import ghz_publish, write_protoset  # noqa: E402
from bench.grpc_ceiling import ghz_path  # noqa: E402
from bench.unary import SERVE_FROM  # noqa: E402
from tests.e2e import harness  # noqa: E402
from tests.redis_server import RedisServer, free_port  # noqa: E402

APP_ID = "bench-app"
# Due in an hour: nothing fires during the run.
DELAYED = {"scheduledSendDelay": "1h"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--messages", type=int, default=20_000)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--base", type=Path, help="also `serve` from this source tree")
    a = ap.parse_args()
    n, c = a.messages, a.concurrency
    exe = ghz_path()
    daprd_path = harness.find_daprd()
    print(daprd_heading(daprd_path, f"ghz, {n} publishes x {a.rounds} rounds, {c} concurrent"))
    with tempfile.TemporaryDirectory(prefix="dpsd-") as d:
        work = Path(d)
        server = RedisServer(work / "redis", appendonly=False)
        server.start()
        procs: list[Any] = []
        try:
            sockets = work / "sockets"
            sockets.mkdir()
            ours = start_serve(sockets / "delayed-pubsub.sock", work / "ours.log")
            procs.append(ours)
            base = None
            if a.base:
                sock = sockets / "delayed-pubsub-base.sock"
                args = ["serve", "--socket", str(sock), "--log-level", "warning"]
                base = start_process(
                    [sys.executable, "-c", SERVE_FROM, str(a.base.resolve()), *args], sock, work / "base.log"
                )
                procs.append(base)
            app_port = free_port()
            # The app only answers daprd's start-up calls: nothing subscribes.
            app = subprocess.Popen(
                [sys.executable, str(ROOT / "bench/fastpath.py"), "--", "app", str(app_port)],
                stdout=subprocess.DEVNULL,
                stderr=(work / "app.log").open("wb"),
            )
            procs.append(app)
            harness.wait_until_blocking(
                lambda: httpx.get(f"http://127.0.0.1:{app_port}/healthz", timeout=1).status_code == 200,
                "the bench app",
                15,
            )
            resources = work / "resources"
            resources.mkdir()
            props = {"redisHost": f"127.0.0.1:{server.port}", "enableDelayedMessaging": "true"}
            (resources / "delayed.yaml").write_text(
                harness.component_yaml("delayed", props, "pubsub.delayed-pubsub")
            )
            if base is not None:
                (resources / "base.yaml").write_text(
                    harness.component_yaml("base", props, "pubsub.delayed-pubsub-base")
                )
            (resources / "pubsub.yaml").write_text(
                harness.component_yaml("pubsub", {"redisHost": props["redisHost"]}, "pubsub.redis")
            )
            ports = harness.DaprdPorts.free()
            daprd = harness.start_daprd(daprd_path, work, sockets, APP_ID, app_port, resources, ports)
            procs.append(daprd)
            protoset = work / "dapr.protoset"
            write_protoset(protoset)
            assert daprd.proc is not None
            pids = {"daprd": daprd.proc.pid, "ours": ours.pid, "redis": _redis_pid(server.port)}
            if base is not None:
                pids["base"] = base.pid
            runs: dict[str, tuple[str, Mapping[str, str], str]] = {
                "built-in pubsub.redis, plain": ("pubsub", {}, ""),
                "ours, plain": ("delayed", {}, "ours"),
                "ours, delayed (scheduledSendDelay)": ("delayed", DELAYED, "ours"),
            }
            if base is not None:
                runs["base, plain"] = ("base", {}, "base")
                runs["base, delayed (scheduledSendDelay)"] = ("base", DELAYED, "base")
            for pubsub, md, _ in runs.values():  # warm-up
                ghz_publish(exe, protoset, ports.grpc, pubsub, "warm", md, 2000, c)
            rps: dict[str, list[float]] = {k: [] for k in runs}
            cpu: dict[str, dict[str, list[float]]] = {
                k: {"daprd": [], "component": [], "redis": []} for k in runs
            }
            for _ in range(a.rounds):
                for name, (pubsub, md, component) in runs.items():
                    before = {k: cpu_seconds(p) for k, p in pids.items()}
                    rps[name].append(ghz_publish(exe, protoset, ports.grpc, pubsub, "orders", md, n, c))
                    after = {k: cpu_seconds(p) for k, p in pids.items()}
                    used = {k: (after[k] - before[k]) / n * 1e6 for k in pids}
                    cpu[name]["daprd"].append(used["daprd"])
                    cpu[name]["component"].append(used[component] if component else 0.0)
                    cpu[name]["redis"].append(used["redis"])
        finally:
            stop_all(procs)
            server.stop()
    builtin = statistics.median(rps["built-in pubsub.redis, plain"])
    print()
    print(
        "| publishes through daprd | msgs/s (median) | ratio to built-in | daprd CPU/msg | component CPU/msg "
        "| redis CPU/msg | daprd's share | component's share |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name in runs:
        r = statistics.median(rps[name])
        dc, cc, rc = (statistics.median(cpu[name][k]) for k in ("daprd", "component", "redis"))
        total = dc + cc + rc
        print(
            f"| {name} | {r:,.0f} | {r / builtin:.2f} | {dc:.0f} µs | {cc:.0f} µs | {rc:.0f} µs "
            f"| {dc / total:.0%} | {cc / total:.0%} |"
        )


def _redis_pid(port: int) -> int:
    import redis

    client = redis.Redis(port=port)
    try:
        info: dict[str, Any] = client.info("server")
        return int(info["process_id"])
    finally:
        client.close()


if __name__ == "__main__":
    main()
