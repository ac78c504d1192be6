"""The fast path, measured: three layouts through ONE real daprd, in one run.

Layouts (the app subscribes over HTTP; one Redis; daprd 1.18):
  ours      all through our component: publish to it, subscribe through it;
  builtin   all through Dapr's built-in pubsub.redis;
  fastpath  delayed publishes through ours, the subscription on the built-in
            pubsub.redis on the same Redis/DB/consumerID (dapr/fastpath/).

For each: the publish rate through daprd's gRPC API (ghz, a Go client, as an
app's SDK would call daprd; plain publishes for ours/builtin, delayed ones for
the fast path) and how long a backlog of N messages takes to reach the HTTP
app. The ours/builtin backlogs are N entries XADDed at once (pipelined) in
pubsub.redis's format onto a subscribed topic; the fast path's backlog is the
N delayed publishes themselves, all due at the same instant T, timed from T.

    .venv/bin/python bench/fastpath.py [--messages 20000] [--concurrency 64]

Needs redis-server, daprd (scripts/daprd.sh finds or builds it) and ghz (built
from the Go module proxy on first use, as in bench/grpc_ceiling.py).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import math
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from bench.common import PAYLOAD, daprd_heading, start_serve, stop_all  # noqa: E402
from bench.grpc_ceiling import ghz_path  # noqa: E402
from tests.e2e import harness  # noqa: E402
from tests.redis_server import RedisServer, free_port  # noqa: E402

APP_ID = "bench-app"
# (pubsub, topic) the app subscribes to, one per measured backlog.
SUBSCRIPTIONS = (("delayed", "bl-ours"), ("pubsub", "bl-builtin"), ("pubsub", "fast"))
ORDER = json.dumps({"orderId": 66, "item": "x" * 64}).encode()


# --- the HTTP app: counts arrivals per route, as fast as one asyncio process can ---


class _AppProtocol(asyncio.Protocol):
    def __init__(self, state: dict[str, Any]) -> None:
        self.state = state
        self.buf = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            lines = self.buf[:end].decode("latin-1").split("\r\n")
            method, path, _ = lines[0].split(" ", 2)
            length = 0
            for line in lines[1:]:
                key, _, value = line.partition(":")
                if key.strip().lower() == "content-length":
                    length = int(value.strip())
            if len(self.buf) < end + 4 + length:
                return
            self.buf = self.buf[end + 4 + length :]
            self.reply(*self.route(method, path))

    def route(self, method: str, path: str) -> tuple[int, Any]:
        if method == "POST" and path.startswith("/events/"):
            now = time.time_ns() // 1_000_000
            counts = self.state["counts"].setdefault(path, [0, now, now])
            counts[0] += 1
            counts[2] = now
            return 200, {"status": "SUCCESS"}
        if path == "/dapr/subscribe":
            return 200, [
                {"pubsubname": p, "topic": t, "route": f"/events/{p}/{t}"} for p, t in self.state["subs"]
            ]
        if path == "/dapr/config":
            return 200, {}
        if path == "/stats":
            return 200, self.state["counts"]
        if path == "/healthz":
            return 200, {"ok": True}
        return 404, {"error": path}

    def reply(self, status: int, payload: Any) -> None:
        body = json.dumps(payload).encode()
        head = f"HTTP/1.1 {status} {'OK' if status == 200 else 'Not Found'}\r\n"
        head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        assert self.transport is not None
        self.transport.write(head.encode() + body)


async def _serve_app(port: int, subs: Sequence[tuple[str, str]]) -> None:
    state: dict[str, Any] = {"subs": list(subs), "counts": {}}
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _AppProtocol(state), "127.0.0.1", port, backlog=1024)
    async with server:
        await server.serve_forever()


# --- daprd's gRPC API through ghz ----------------------------------------------


def write_protoset(path: Path) -> None:
    """The Dapr runtime API as a FileDescriptorSet, from the dapr SDK's generated modules."""
    from dapr.proto.runtime.v1 import dapr_pb2
    from google.protobuf import descriptor_pb2

    files = descriptor_pb2.FileDescriptorSet()
    seen: set[str] = set()

    def add(fd: Any) -> None:
        if fd.name in seen:
            return
        for dep in fd.dependencies:
            add(dep)
        seen.add(fd.name)
        proto = descriptor_pb2.FileDescriptorProto()
        fd.CopyToProto(proto)
        files.file.append(proto)

    add(dapr_pb2.DESCRIPTOR)
    path.write_bytes(files.SerializeToString())


def ghz_publish(
    exe: str,
    protoset: Path,
    grpc_port: int,
    pubsub: str,
    topic: str,
    metadata: Mapping[str, str],
    n: int,
    c: int,
) -> float:
    """N unary PublishEvent calls through daprd; returns publishes per second (all must be OK)."""
    data = {
        "pubsub_name": pubsub,
        "topic": topic,
        "data": base64.b64encode(ORDER).decode(),
        "data_content_type": "application/json",
        "metadata": dict(metadata),
    }
    out = subprocess.run(
        [
            exe, "--insecure", "--protoset", str(protoset),
            "--call", "dapr.proto.runtime.v1.Dapr/PublishEvent",
            "-d", json.dumps(data), "-n", str(n), "-c", str(c), "--connections", "4",
            "--format", "json", f"127.0.0.1:{grpc_port}",
        ],
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    report = json.loads(out)
    ok = report["statusCodeDistribution"].get("OK", 0)
    if ok != n:
        raise SystemExit(
            f"{pubsub}/{topic}: only {ok} of {n} publishes OK: {report.get('errorDistribution')}"
        )
    return float(report["rps"])


# --- measuring deliveries -------------------------------------------------------


def stats(app_port: int) -> dict[str, list[int]]:
    result: dict[str, list[int]] = httpx.get(f"http://127.0.0.1:{app_port}/stats", timeout=5).json()
    return result


def wait_delivered(app_port: int, route: str, n: int, timeout_s: float = 300) -> tuple[int, int]:
    """(first, last) arrival wall ms once `n` messages reached `route`."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = stats(app_port).get(route, [0, 0, 0])
        if got[0] >= n:
            return got[1], got[2]
        if time.monotonic() > deadline:
            raise SystemExit(f"{route}: only {got[0]} of {n} arrived within {timeout_s:.0f}s")
        time.sleep(0.02)


def xadd_backlog(redis_port: int, topic: str, n: int) -> int:
    """N CloudEvents in pubsub.redis's entry format, pipelined; returns the wall ms before the first."""
    import redis

    client = redis.Redis(port=redis_port)
    t0 = time.time_ns() // 1_000_000
    try:
        for start in range(0, n, 1000):
            pipe = client.pipeline(transaction=False)
            for _ in range(start, min(n, start + 1000)):
                pipe.xadd(topic, {"data": PAYLOAD, "metadata": b"{}"})
            pipe.execute()
    finally:
        client.close()
    return t0


def rfc3339(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--messages", type=int, default=20_000)
    ap.add_argument("--concurrency", type=int, default=64)
    a = ap.parse_args()
    n = a.messages
    exe = ghz_path()
    daprd_path = harness.find_daprd()
    print(daprd_heading(daprd_path, f"{n} messages per figure; ghz, {a.concurrency} concurrent"))
    with tempfile.TemporaryDirectory(prefix="dpsf-") as d:
        work = Path(d)
        server = RedisServer(work / "redis", appendonly=False)
        server.start()
        procs: list[Any] = []
        try:
            socket_dir = work / "sockets"
            socket_dir.mkdir()
            procs.append(start_serve(socket_dir / "delayed-pubsub.sock", work / "component.log"))
            app_port = free_port()
            subs = [f"{p}={t}" for p, t in SUBSCRIPTIONS]
            app = subprocess.Popen(
                [sys.executable, __file__, "--", "app", str(app_port), *subs],
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
            redis_host = f"127.0.0.1:{server.port}"
            (resources / "delayed.yaml").write_text(
                harness.component_yaml(
                    "delayed",
                    {"redisHost": redis_host, "enableDelayedMessaging": "true"},
                    "pubsub.delayed-pubsub",
                )
            )
            (resources / "pubsub.yaml").write_text(
                harness.component_yaml("pubsub", {"redisHost": redis_host}, "pubsub.redis")
            )
            ports = harness.DaprdPorts.free()
            daprd = harness.start_daprd(daprd_path, work, socket_dir, APP_ID, app_port, resources, ports)
            procs.append(daprd)
            base = f"http://127.0.0.1:{ports.http}/v1.0/metadata"
            harness.wait_until_blocking(
                lambda: len(httpx.get(base, timeout=2).json().get("subscriptions", [])) == len(SUBSCRIPTIONS),
                "daprd to load the subscriptions",
                30,
                process=daprd,
            )
            protoset = work / "dapr.protoset"
            write_protoset(protoset)
            run(a, exe, protoset, ports.grpc, server.port, app_port)
        finally:
            stop_all(procs)
            server.stop()


def run(
    a: argparse.Namespace, exe: str, protoset: Path, grpc_port: int, redis_port: int, app_port: int
) -> None:
    n, c = a.messages, a.concurrency
    # Warm-up: connections, daprd's pools, our server's first calls.
    ghz_publish(exe, protoset, grpc_port, "pubsub", "warm", {}, 2000, c)
    ghz_publish(exe, protoset, grpc_port, "delayed", "warm", {}, 2000, c)

    rate_builtin = ghz_publish(exe, protoset, grpc_port, "pubsub", "pub-builtin", {}, n, c)
    rate_ours = ghz_publish(exe, protoset, grpc_port, "delayed", "pub-ours", {}, n, c)
    # Every delayed publish due at one instant T, after the last of them is stored.
    due_ms = (
        (time.time_ns() // 1_000_000 + math.ceil(n / max(rate_ours * 0.4, 200) * 1000) + 3000) // 1000 * 1000
    )
    rate_delayed = ghz_publish(
        exe, protoset, grpc_port, "delayed", "fast", {"scheduledSendTime": rfc3339(due_ms)}, n, c
    )
    stored_ms = time.time_ns() // 1_000_000
    if stored_ms >= due_ms:
        print(
            f"WARNING: publishing ended {stored_ms - due_ms} ms after the due time; the fast-path figure is off"
        )
    first, last = wait_delivered(app_port, "/events/pubsub/fast", n)
    fast_s = (last - due_ms) / 1000
    fast_first = first - due_ms

    t0 = xadd_backlog(redis_port, "bl-builtin", n)
    _, last_b = wait_delivered(app_port, "/events/pubsub/bl-builtin", n)
    builtin_s = (last_b - t0) / 1000
    t0 = xadd_backlog(redis_port, "bl-ours", n)
    _, last_o = wait_delivered(app_port, "/events/delayed/bl-ours", n)
    ours_s = (last_o - t0) / 1000

    print()
    print(
        f"| layout | publish through daprd (gRPC, msgs/s) | {n} backlog to the HTTP app | delivery msgs/s |"
    )
    print("|---|---|---|---|")
    print(f"| all through ours | {rate_ours:,.0f} plain | {ours_s:.2f} s | {n / ours_s:,.0f} |")
    print(
        f"| all through the built-in pubsub.redis | {rate_builtin:,.0f} plain | {builtin_s:.2f} s | {n / builtin_s:,.0f} |"
    )
    print(
        f"| fast path (delayed via ours, subscribed on the built-in) | {rate_delayed:,.0f} delayed | "
        f"{fast_s:.2f} s after due (first after {fast_first} ms) | {n / fast_s:,.0f} |"
    )
    print()
    print(
        f"ratios: fast-path delivery {ours_s / fast_s:.1f}x faster than all-ours, "
        f"{fast_s / builtin_s:.2f}x the built-in's time; delayed publish = {rate_delayed / rate_ours:.2f}x ours plain, "
        f"{rate_delayed / rate_builtin:.2f}x the built-in's plain"
    )


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1:3] == ["--", "app"]:
        port, *specs = sys.argv[3:]
        pairs = [tuple(s.split("=", 1)) for s in specs]
        asyncio.run(_serve_app(int(port), [(p, t) for p, t in pairs]))
    else:
        main()
