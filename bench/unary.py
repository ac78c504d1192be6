"""Unary Publish against the grpc.aio ceiling, and grpc.aio against a thread-pool server, in one run.

A Go client (ghz, as daprd is a Go client) drives, in interleaved rounds:
  - bare grpc.aio: a server whose Features returns at once (the ceiling of any
    grpc.aio unary call here),
  - bare sync: the same on grpc's thread-pool server,
  - ours (grpc.aio, `delayed-pubsub serve`): Features, Publish (one XADD each,
    coalesced with concurrent ones into one pipeline), and a delayed Publish
    (scheduledSendDelay 1h: the delay engine's schedule script, nothing fires),
  - ours behind a thread-pool server: the real PubSubServicer on its asyncio
    loop in a thread, each sync handler bridging into it
    (run_coroutine_threadsafe), as a sync server inside the component would.
  - with --uvloop: the bare server and ours again, each on uvloop's event loop,
  - with --base DIR: `serve` from another source tree (before/after in one run).
  - with --in-process N: also our servicer's delayed Publish without gRPC (N calls in
    one process, 64 in flight, handed over one per loop pass as grpc.aio does; with
    --base, that tree's too, the two alternated): the CPU our own code and redis-py
    take per delayed publish, without grpc.aio's share or its noise.
Each figure comes with the server process's CPU per call (utime+stime from /proc),
and its ratio to the bare grpc.aio server's.

    .venv/bin/python bench/unary.py [--requests 10000] [--concurrency 64] [--rounds 2] [--no-sync] [--uvloop]
                                    [--base DIR] [--in-process N]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import start_process, start_serve, stop  # noqa: E402
from bench.deliver import cpu_seconds  # noqa: E402
from bench.grpc_ceiling import BARE_SERVER, GHZ_VERSION, ghz, ghz_path  # noqa: E402
from tests.redis_server import RedisServer  # noqa: E402

BARE_SYNC_SERVER = """
import sys
from concurrent import futures
import grpc
from delayed_pubsub_pb.dapr.proto.components.v1 import common_pb2, pubsub_pb2_grpc

class Bare(pubsub_pb2_grpc.PubSubServicer):
    def Features(self, request, context):
        return common_pb2.FeaturesResponse(features=["BULK_PUBSUB"])

server = grpc.server(futures.ThreadPoolExecutor(int(sys.argv[2])))
pubsub_pb2_grpc.add_PubSubServicer_to_server(Bare(), server)
server.add_insecure_port("unix:" + sys.argv[1])
server.start()
server.wait_for_termination()
"""

# The real component's servicer, its asyncio loop in a thread, behind grpc's
# thread-pool server. Only the unary calls this benchmark makes are bridged.
SYNC_BRIDGE_SERVER = """
import asyncio, sys, threading
from concurrent import futures
import grpc
from delayed_middleware.clock import SystemClock
from delayed_pubsub.instance import Instances
from delayed_pubsub.metrics import Metrics
from delayed_pubsub.servicer import PubSubServicer
from delayed_pubsub_pb.dapr.proto.components.v1 import pubsub_pb2_grpc

class Aborted(Exception):
    pass

class Context:
    def __init__(self, sync):
        self.sync = sync
    def invocation_metadata(self):
        return self.sync.invocation_metadata()
    async def abort(self, code, details):
        raise Aborted(code, details)

loop = asyncio.new_event_loop()
threading.Thread(target=loop.run_forever, daemon=True).start()
servicer = PubSubServicer(Instances(SystemClock(), Metrics()))

def bridge(name):
    method = getattr(servicer, name)
    def handler(self, request, context):
        try:
            return asyncio.run_coroutine_threadsafe(method(request, Context(context)), loop).result()
        except Aborted as e:
            context.abort(*e.args)
    return handler

Bridge = type("Bridge", (pubsub_pb2_grpc.PubSubServicer,), {n: bridge(n) for n in ("Init", "Features", "Publish")})
server = grpc.server(futures.ThreadPoolExecutor(int(sys.argv[2])))
pubsub_pb2_grpc.add_PubSubServicer_to_server(Bridge(), server)
server.add_insecure_port("unix:" + sys.argv[1])
server.start()
server.wait_for_termination()
"""

PUBLISH = {"topic": "orders", "pubsub_name": "bench", "data": "eyJvcmRlcklkIjo2Nn0="}
# Due in an hour: nothing fires during the run, so the figure is the publish's own cost.
DELAYED_PUBLISH = {**PUBLISH, "metadata": {"scheduledSendDelay": "1h"}}

# The bare server and `serve`, each on uvloop's event loop instead of asyncio's.
UVLOOP = "import asyncio, uvloop; asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())\n"
SERVE_ON_UVLOOP = UVLOOP + "import sys\nfrom delayed_pubsub.cli import main\nsys.exit(main(sys.argv[1:]))\n"
# `serve` from another source tree (argv[1]: e.g. `git archive main | tar -x -C DIR`), ahead of ours on sys.path.
SERVE_FROM = """
import sys
base = sys.argv.pop(1)
sys.path[:0] = [base + "/proto", base + "/middleware", base + "/components"]
from delayed_pubsub.cli import main
sys.exit(main(sys.argv[1:]))
"""

# Our servicer's delayed Publish in one process, no gRPC (argv: source tree, calls, Redis port).
# Prints the process CPU per call and the SCHEDULE script calls per publish.
IN_PROCESS = """
import asyncio, sys, time
tree, calls, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
sys.path[:0] = [tree + "/proto", tree + "/middleware", tree + "/components"]
import redis
from delayed_middleware.clock import SystemClock
from delayed_pubsub.instance import Instances
from delayed_pubsub.metrics import Metrics
from delayed_pubsub.servicer import PubSubServicer
from delayed_pubsub_pb.dapr.proto.components.v1 import pubsub_pb2

class Context:
    def invocation_metadata(self):
        return (("x-component-instance", "bench"),)
    async def abort(self, code, details):
        raise RuntimeError(code, details)

async def main():
    servicer = PubSubServicer(Instances(SystemClock(), Metrics(), background=False))
    props = {"redisHost": f"127.0.0.1:{port}", "consumerID": "bench", "enableDelayedMessaging": "true"}
    await servicer.Init(pubsub_pb2.PubSubInitRequest(metadata={"properties": props}), Context())
    request = pubsub_pb2.PublishRequest(
        topic="orders", pubsub_name="bench", data=b'{"orderId":66}', metadata={"scheduledSendDelay": "1h"}
    )
    context = Context()

    async def run(n):
        slots = asyncio.Semaphore(64)
        tasks = set()
        for _ in range(n):
            await slots.acquire()
            task = asyncio.ensure_future(servicer.Publish(request, context))
            task.add_done_callback(lambda _: slots.release())
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            await asyncio.sleep(0)  # one call handed over per loop pass, as grpc.aio does
        await asyncio.gather(*tasks)

    def scripts():
        return redis.Redis(port=port).info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0)

    await run(2000)
    before, cpu = scripts(), time.process_time()
    await run(calls)
    cpu = time.process_time() - cpu
    print(cpu / calls * 1e6, (scripts() - before) / calls)

asyncio.run(main())
"""


def in_process(trees: dict[str, Path], calls: int, rounds: int, port: int) -> None:
    """IN_PROCESS for each tree, alternated `rounds` times; prints the medians."""
    cpu: dict[str, list[float]] = {k: [] for k in trees}
    scripts: dict[str, list[float]] = {k: [] for k in trees}
    for _ in range(rounds):
        for name, tree in trees.items():
            out = subprocess.run(
                [sys.executable, "-c", IN_PROCESS, str(tree), str(calls), str(port)],
                check=True,
                capture_output=True,
                text=True,
            ).stdout.split()
            cpu[name].append(float(out[0]))
            scripts[name].append(float(out[1]))
    print(
        f"{'in-process delayed Publish (no gRPC)':48s} {'CPU/call (median)':>18s} {'script calls/publish':>21s}"
    )
    for name in trees:
        print(
            f"{name:48s} {statistics.median(cpu[name]):15.1f} us {statistics.median(scripts[name]):21.3f}"
            f"   {[round(c, 1) for c in cpu[name]]}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2, help="interleaved repetitions of every measurement")
    ap.add_argument("--threads", type=int, default=4, help="thread-pool size of the sync servers")
    ap.add_argument("--no-sync", action="store_true", help="leave out the thread-pool servers")
    ap.add_argument("--uvloop", action="store_true", help="also the bare server and ours on uvloop")
    ap.add_argument(
        "--base", type=Path, help="also `serve` from this source tree (an export of another commit)"
    )
    ap.add_argument(
        "--in-process",
        type=int,
        metavar="N",
        help="also our delayed Publish without gRPC, N calls per round (and --base's)",
    )
    a = ap.parse_args()
    exe = ghz_path()
    n, c = a.requests, a.concurrency
    with tempfile.TemporaryDirectory(prefix="dpsu-") as d:
        folder = Path(d)
        redis_server = RedisServer(folder / "redis", appendonly=False)
        redis_server.start()
        servers = ["bare", "ours"] + ([] if a.no_sync else ["bare_sync", "ours_sync"])
        servers += ["bare_uvloop", "ours_uvloop"] if a.uvloop else []
        servers += ["ours_base"] if a.base else []
        socks = {k: folder / f"{k}.sock" for k in servers}
        procs: dict[str, subprocess.Popen[bytes]] = {}
        try:
            procs["bare"] = start_process(
                [sys.executable, "-c", BARE_SERVER, str(socks["bare"])], socks["bare"], folder / "bare.log"
            )
            procs["ours"] = start_serve(socks["ours"], folder / "ours.log")
            if not a.no_sync:
                procs["bare_sync"] = start_process(
                    [sys.executable, "-c", BARE_SYNC_SERVER, str(socks["bare_sync"]), str(a.threads)],
                    socks["bare_sync"],
                    folder / "bare_sync.log",
                )
                procs["ours_sync"] = start_process(
                    [sys.executable, "-c", SYNC_BRIDGE_SERVER, str(socks["ours_sync"]), str(a.threads)],
                    socks["ours_sync"],
                    folder / "ours_sync.log",
                )
            if a.uvloop:
                procs["bare_uvloop"] = start_process(
                    [sys.executable, "-c", UVLOOP + BARE_SERVER, str(socks["bare_uvloop"])],
                    socks["bare_uvloop"],
                    folder / "bare_uvloop.log",
                )
                procs["ours_uvloop"] = start_process(
                    [
                        sys.executable,
                        "-c",
                        SERVE_ON_UVLOOP,
                        "serve",
                        "--socket",
                        str(socks["ours_uvloop"]),
                        "--log-level",
                        "warning",
                    ],
                    socks["ours_uvloop"],
                    folder / "ours_uvloop.log",
                )
            if a.base:
                args = ["serve", "--socket", str(socks["ours_base"]), "--log-level", "warning"]
                procs["ours_base"] = start_process(
                    [sys.executable, "-c", SERVE_FROM, str(a.base.resolve()), *args],
                    socks["ours_base"],
                    folder / "ours_base.log",
                )
            props = {
                "redisHost": f"127.0.0.1:{redis_server.port}",
                "consumerID": "bench",
                "enableDelayedMessaging": "true",
            }
            init = {"metadata": {"properties": props}}
            for k in servers:
                if k.startswith("ours"):
                    ghz(exe, socks[k], "Init", init, 1, 1)
                    ghz(exe, socks[k], "Publish", PUBLISH, 500, 16)  # warm-up
                    ghz(exe, socks[k], "Publish", DELAYED_PUBLISH, 500, 16)
            runs: dict[str, tuple[str, str, Mapping[str, object]]] = {
                "bare grpc.aio, Features (no-op)": ("bare", "Features", {}),
                "ours grpc.aio, Features": ("ours", "Features", {}),
                "ours grpc.aio, Publish": ("ours", "Publish", PUBLISH),
                "ours grpc.aio, delayed Publish": ("ours", "Publish", DELAYED_PUBLISH),
            }
            if a.base:
                runs |= {
                    "base, Features": ("ours_base", "Features", {}),
                    "base, Publish": ("ours_base", "Publish", PUBLISH),
                    "base, delayed Publish": ("ours_base", "Publish", DELAYED_PUBLISH),
                }
            if not a.no_sync:
                runs |= {
                    f"bare sync ({a.threads} threads), Features (no-op)": ("bare_sync", "Features", {}),
                    f"ours sync bridge ({a.threads} threads), Features": ("ours_sync", "Features", {}),
                    f"ours sync bridge ({a.threads} threads), Publish": ("ours_sync", "Publish", PUBLISH),
                }
            if a.uvloop:
                runs |= {
                    "bare grpc.aio on uvloop, Features (no-op)": ("bare_uvloop", "Features", {}),
                    "ours on uvloop, Features": ("ours_uvloop", "Features", {}),
                    "ours on uvloop, Publish": ("ours_uvloop", "Publish", PUBLISH),
                    "ours on uvloop, delayed Publish": ("ours_uvloop", "Publish", DELAYED_PUBLISH),
                }
            rps: dict[str, list[float]] = {k: [] for k in runs}
            cpu: dict[str, list[float]] = {k: [] for k in runs}
            for _ in range(a.rounds):
                for name, (server, call, data) in runs.items():
                    pid = procs[server].pid
                    before = cpu_seconds(pid)
                    rps[name].append(ghz(exe, socks[server], call, data, n, c)["rps"])
                    cpu[name].append((cpu_seconds(pid) - before) / n * 1e6)
            if a.in_process:
                trees = {"ours": ROOT} | ({"base": a.base.resolve()} if a.base else {})
                in_process(trees, a.in_process, a.rounds, redis_server.port)
        finally:
            for p in procs.values():
                stop(p)
            redis_server.stop()
    bare = statistics.median(rps["bare grpc.aio, Features (no-op)"])
    bare_cpu = statistics.median(cpu["bare grpc.aio, Features (no-op)"])
    print(
        f"# {platform.node()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"load {os.getloadavg()[0]:.1f}; ghz {GHZ_VERSION}, {n} requests x {a.rounds} rounds, "
        f"{c} concurrent, 1 connection"
    )
    print(
        f"{'server, call':48s} {'calls/s (median)':>16s} {'ratio to bare aio':>18s} {'server CPU/call':>16s}"
        f" {'CPU ratio to bare aio':>22s}"
    )
    for name in runs:
        r = statistics.median(rps[name])
        c_us = statistics.median(cpu[name])
        print(f"{name:48s} {r:16,.0f} {r / bare:18.2f} {c_us:13.0f} us {c_us / bare_cpu:22.2f}")


if __name__ == "__main__":
    main()
