"""The window in which publishes through daprd fail while `delayed-pubsub serve` restarts.

A real stack (redis-server, `serve`, a subscriber app, daprd 1.18) and one client
that POSTs `/v1.0/publish/delayed/<topic>` in a loop (one at a time, 10 ms apart).
Meanwhile `serve` is restarted: SIGTERM (graceful, as an upgrade or a container
restart does it) or SIGKILL (an OOM kill), and a new `serve` is started as soon as
the old one is gone. Printed per scenario: publishes sent, failed, the window from
the last success before the first failure to the first success after the last one,
and the slowest successful publish. Every scenario runs once without a Resiliency
resource (daprd's default: no retry of component calls) and once with a retry
policy on the component's outbound calls.

    DAPRD=~/.cache/dapr-delayed-pubsub/daprd-1.18.1 .venv/bin/python bench/restart.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
for sub in ("proto", "middleware", "components", "."):
    if str(ROOT / sub) not in sys.path:
        sys.path.insert(0, str(ROOT / sub))

from tests.e2e import harness  # noqa: E402
from tests.redis_server import RedisServer, free_port  # noqa: E402

PUBSUB = "delayed"
TOPIC = "restart-bench"

RESILIENCY = """apiVersion: dapr.io/v1alpha1
kind: Resiliency
metadata:
  name: component-retry
spec:
  policies:
    retries:
      componentRetry:
        policy: constant
        duration: 200ms
        maxRetries: 50
  targets:
    components:
      delayed:
        outbound:
          retry: componentRetry
"""


@dataclass
class Outcome:
    sent: int = 0
    failed: int = 0
    window_s: float = 0.0
    slowest_ok_s: float = 0.0
    restart_s: float = 0.0
    codes: dict[int, int] = field(default_factory=dict)


def publisher(url: str, stop: threading.Event, log: list[tuple[float, float, int]]) -> None:
    with httpx.Client(timeout=60) as client:
        while not stop.is_set():
            began = time.monotonic()
            try:
                code = client.post(url, json={"at": began}).status_code
            except httpx.HTTPError:
                code = 0
            log.append((began, time.monotonic(), code))
            time.sleep(0.01)


def summarize(log: list[tuple[float, float, int]]) -> Outcome:
    out = Outcome(sent=len(log))
    bad = [i for i, (_, _, code) in enumerate(log) if code != 204]
    for _, _, code in log:
        out.codes[code] = out.codes.get(code, 0) + 1
    out.failed = len(bad)
    if bad:
        before = log[bad[0] - 1][1] if bad[0] > 0 else log[0][0]
        after = log[bad[-1] + 1][1] if bad[-1] + 1 < len(log) else log[-1][1]
        out.window_s = after - before
    ok = [end - start for start, end, code in log if code == 204]
    out.slowest_ok_s = max(ok, default=0.0)
    return out


def run(daprd: str, redis: RedisServer, how: signal.Signals, resiliency: bool, workdir: Path) -> Outcome:
    socket_dir = workdir / "sockets"
    resources = workdir / "resources"
    resources.mkdir(parents=True)
    (resources / f"{PUBSUB}.yaml").write_text(
        harness.component_yaml(PUBSUB, harness.component_metadata(redis.port, consumerID="bench"))
    )
    if resiliency:
        (resources / "resiliency.yaml").write_text(RESILIENCY)
    component = harness.start_component(workdir, socket_dir)
    app_port = free_port()
    app = harness.start_subscriber(workdir, app_port, [])
    ports = harness.DaprdPorts.free()
    dapr = harness.start_daprd(daprd, workdir, socket_dir, "restart-bench", app_port, resources, ports)
    log: list[tuple[float, float, int]] = []
    stop = threading.Event()
    url = f"http://127.0.0.1:{ports.http}/v1.0/publish/{PUBSUB}/{TOPIC}"
    thread = threading.Thread(target=publisher, args=(url, stop, log), daemon=True)
    try:
        thread.start()
        time.sleep(1.0)
        assert component.proc is not None
        signalled = time.monotonic()
        component.proc.send_signal(how)
        component.proc.wait(30)
        component.proc = None
        component = harness.start_component(workdir, socket_dir)
        # After SIGKILL the stale socket file is there at once: wait until the new process answers.
        harness.wait_until_blocking(
            lambda: _answers(socket_dir / "delayed-pubsub.sock"), "new serve", 30, process=component
        )
        restart_s = time.monotonic() - signalled
        time.sleep(4.0)
    finally:
        stop.set()
        thread.join(60)
        dapr.stop()
        component.stop()
        app.stop()
    out = summarize(log)
    out.restart_s = restart_s
    return out


def _answers(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(str(path))
    return True


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    daprd = os.environ.get("DAPRD") or harness.find_daprd()
    with tempfile.TemporaryDirectory(prefix="dps-restart-") as tmp:
        redis = RedisServer(Path(tmp) / "redis")
        redis.start()
        try:
            print(
                f"{'scenario':34} {'sent':>5} {'failed':>6} {'window s':>9} {'slowest ok s':>12} "
                f"{'restart s':>9}  codes"
            )
            n = 0
            for how in (signal.SIGTERM, signal.SIGKILL):
                for resiliency in (False, True):
                    outcomes = []
                    for _ in range(args.rounds):
                        n += 1
                        outcomes.append(run(daprd, redis, how, resiliency, Path(tmp) / f"run{n}"))
                    name = f"{how.name} {'+ resiliency retry' if resiliency else '(daprd default)'}"
                    for o in outcomes:
                        print(
                            f"{name:34} {o.sent:5d} {o.failed:6d} {o.window_s:9.3f} {o.slowest_ok_s:12.3f} "
                            f"{o.restart_s:9.3f}  "
                            f"{dict(sorted(o.codes.items()))}"
                        )
                    med = statistics.median(o.window_s for o in outcomes)
                    print(f"{name:34} median window {med:.3f} s, failures {[o.failed for o in outcomes]}")
        finally:
            redis.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
