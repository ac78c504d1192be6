"""Unary Publish from a Go gRPC client (ghz), as daprd is a Go client.

bench/publish.py drives the component from Python, whose own grpc.aio client
eats half the 2 cores. Here ghz (Go) drives, against three servers in one run:
  - a bare grpc.aio server whose Features returns at once (the Python gRPC ceiling),
  - our component's Features (no Redis),
  - our component's Publish (one XADD each),
so the cost of our code shows as a ratio to the bare ceiling.

ghz comes from the Go module proxy (`go install github.com/bojand/ghz/cmd/ghz@v0.120.0`,
into ~/.cache/dapr-delayed-pubsub/bin), built on first use.

    .venv/bin/python bench/grpc_ceiling.py [--requests 20000] [--concurrency 64]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import (  # noqa: E402
    start_process,
    start_serve,
    stop,
)
from tests.redis_server import RedisServer  # noqa: E402

GHZ_VERSION = "v0.120.0"
CACHE_BIN = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "dapr-delayed-pubsub" / "bin"
PROTO = [
    "--proto",
    str(ROOT / "proto/dapr/proto/components/v1/pubsub.proto"),
    "--import-paths",
    str(ROOT / "proto"),
]

BARE_SERVER = """
import asyncio, sys
from delayed_pubsub_pb.dapr.proto.components.v1 import common_pb2, pubsub_pb2_grpc
import grpc

class Bare(pubsub_pb2_grpc.PubSubServicer):
    async def Features(self, request, context):
        return common_pb2.FeaturesResponse(features=["BULK_PUBSUB"])

async def main():
    server = grpc.aio.server()
    pubsub_pb2_grpc.add_PubSubServicer_to_server(Bare(), server)
    server.add_insecure_port("unix:" + sys.argv[1])
    await server.start()
    await server.wait_for_termination()

asyncio.run(main())
"""


def ghz_path() -> str:
    found = shutil.which("ghz") or (str(CACHE_BIN / "ghz") if (CACHE_BIN / "ghz").exists() else None)
    if found:
        return found
    CACHE_BIN.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        ["go", "install", f"github.com/bojand/ghz/cmd/ghz@{GHZ_VERSION}"],
        check=True,
        env={**os.environ, "GOBIN": str(CACHE_BIN), "GOFLAGS": ""},
    )
    return str(CACHE_BIN / "ghz")


def ghz(exe: str, sock: Path, call: str, data: Mapping[str, object], n: int, c: int) -> dict[str, float]:
    out = subprocess.run(
        [
            exe,
            "--insecure",
            *PROTO,
            "--call",
            f"dapr.proto.components.v1.PubSub/{call}",
            "-m",
            json.dumps({"x-component-instance": "bench"}),
            "-d",
            json.dumps(data),
            "-n",
            str(n),
            "-c",
            str(c),
            "--connections",
            "1",
            "--format",
            "json",
            f"unix://{sock}",
        ],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    report = json.loads(out)
    ok = report["statusCodeDistribution"].get("OK", 0)
    if ok != n:
        raise SystemExit(f"{call}: only {ok} of {n} OK: {report['statusCodeDistribution']}")
    p99 = next(x["latency"] for x in report["latencyDistribution"] if x["percentage"] == 99)
    return {"rps": report["rps"], "p99_ms": p99 / 1e6}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=20_000)
    ap.add_argument("--concurrency", type=int, default=64)
    a = ap.parse_args()
    exe = ghz_path()
    print(
        f"# {datetime.now(UTC):%Y-%m-%d %H:%M UTC} on {platform.node()}, {os.cpu_count()} cores, "
        f"Python {platform.python_version()}, load {os.getloadavg()[0]:.1f}; ghz {GHZ_VERSION}, "
        f"{a.requests} requests, {a.concurrency} concurrent, 1 connection"
    )
    with tempfile.TemporaryDirectory(prefix="dpsg-") as d:
        folder = Path(d)
        redis_server = RedisServer(folder / "redis", appendonly=False)
        redis_server.start()
        procs: list[subprocess.Popen[bytes]] = []
        try:
            bare_sock, ours_sock = folder / "bare.sock", folder / "ours.sock"
            procs.append(
                start_process(
                    [sys.executable, "-c", BARE_SERVER, str(bare_sock)], bare_sock, folder / "bare.log"
                )
            )
            procs.append(start_serve(ours_sock, folder / "ours.log"))
            init = {
                "metadata": {
                    "properties": {"redisHost": f"127.0.0.1:{redis_server.port}", "consumerID": "bench"}
                }
            }
            ghz(exe, ours_sock, "Init", init, 1, 1)
            n, c = a.requests, a.concurrency
            bare = ghz(exe, bare_sock, "Features", {}, n, c)
            feats = ghz(exe, ours_sock, "Features", {}, n, c)
            pub = ghz(
                exe,
                ours_sock,
                "Publish",
                {"topic": "orders", "pubsub_name": "bench", "data": "eyJvcmRlcklkIjo2Nn0="},
                n,
                c,
            )
            for name, r in (("bare grpc.aio Features", bare), ("our Features", feats), ("our Publish", pub)):
                print(
                    f"{name:24s} {r['rps']:8.0f} req/s  p99 {r['p99_ms']:6.1f} ms  "
                    f"ratio to bare {r['rps'] / bare['rps']:.2f}"
                )
        finally:
            for p in procs:
                stop(p)
            redis_server.stop()


if __name__ == "__main__":
    main()
