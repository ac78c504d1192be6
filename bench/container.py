"""The component's container image against the same `delayed-pubsub serve` run on the host.

    python bench/container.py [--runs 5]

Builds the image with scripts/image.sh (podman, base from Debian packages), then, --runs times
each, for the container and for the host process: time from start to a socket that answers
(what daprd waits for), resident memory once serving, and time from SIGTERM to exit (what a pod's
termination grace must cover). The container runs as deploy/kubernetes runs it (no capabilities,
read-only root filesystem, the socket folder a mounted world-writable directory). Prints the
image's size and its layers, and a markdown table of medians.
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDER = "/tmp/dapr-components-sockets"


def podman(*args: str) -> str:
    runtime = ["--runtime", "/usr/sbin/runc"] if Path("/usr/sbin/runc").exists() else []
    exe = shutil.which("podman")
    if exe is None:
        raise SystemExit("podman is not installed (scripts/setup.sh installs it)")
    return subprocess.run([exe, *runtime, *args], capture_output=True, text=True, check=True).stdout


def answers(sock: Path) -> bool:
    try:
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(str(sock))
        return True
    except OSError:
        return False


def wait(check: Callable[[], bool], within: float = 60) -> None:
    deadline = time.monotonic() + within
    while not check():
        if time.monotonic() > deadline:
            raise SystemExit("timed out")
        time.sleep(0.005)


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def run_container(image: str, folder: Path) -> tuple[float, float, float]:
    name = f"dps-bench-{time.monotonic_ns()}"
    sock = folder / "delayed-pubsub.sock"
    t0 = time.monotonic()
    podman(
        "run", "--detach", "--name", name, "--network", "host", "--cap-drop", "ALL",
        "--read-only", "--read-only-tmpfs=false", "--ulimit", "nofile=1024:1024",
        "--ulimit", "nproc=1024:1024", "-v", f"{folder}:{FOLDER}", image, "--allow-insecure-socket-folder",
    )  # fmt: skip
    try:
        wait(lambda: answers(sock))
        started = time.monotonic() - t0
        pid = int(podman("inspect", "--format", "{{.State.Pid}}", name).strip())
        rss = rss_mib(pid)
        t1 = time.monotonic()
        podman("kill", "--signal", "TERM", name)
        code = podman("wait", name).strip()
        stopped = time.monotonic() - t1
        if code != "0" or sock.exists():
            raise SystemExit(f"container exit {code}, socket left: {sock.exists()}")
        return started, rss, stopped
    finally:
        subprocess.run(["podman", "rm", "--force", "--time", "0", name], capture_output=True, check=False)


def run_host(folder: Path) -> tuple[float, float, float]:
    sock = folder / "delayed-pubsub.sock"
    exe = Path(sys.executable).with_name("delayed-pubsub")
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [str(exe), "serve", "--socket", str(sock), "--allow-insecure-socket-folder"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait(lambda: answers(sock))
        started = time.monotonic() - t0
        rss = rss_mib(proc.pid)
        t1 = time.monotonic()
        proc.terminate()
        code = proc.wait(60)
        stopped = time.monotonic() - t1
        if code != 0 or sock.exists():
            raise SystemExit(f"host exit {code}, socket left: {sock.exists()}")
        return started, rss, stopped
    finally:
        if proc.poll() is None:
            proc.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()

    t = time.monotonic()
    image = subprocess.run(
        ["bash", str(ROOT / "scripts" / "image.sh")], capture_output=True, text=True, check=True
    ).stdout.split()[-1]
    print(f"scripts/image.sh: {time.monotonic() - t:.1f} s (cached base and layers)")
    info = json.loads(podman("image", "inspect", image))[0]
    print(f"{image}: {info['Size'] / 1e6:.1f} MB")
    print(podman("history", "--format", "{{.Size}}\t{{.CreatedBy}}", image)[:3000])

    results: dict[str, list[tuple[float, float, float]]] = {"container": [], "host": []}
    for _ in range(args.runs):
        for kind in ("container", "host"):
            with tempfile.TemporaryDirectory(prefix="dps-bc-") as d:
                folder = Path(d) / "s"
                folder.mkdir()
                folder.chmod(0o777)
                results[kind].append(
                    run_container(image, folder) if kind == "container" else run_host(folder)
                )

    def med(kind: str, i: int) -> float:
        return statistics.median(r[i] for r in results[kind])

    print(f"\n| measure (median of {args.runs}) | container (podman, runc) | host process | ratio |")
    print("|---|---|---|---|")
    for label, i, unit in (("start to socket answering", 0, "s"), ("RSS serving, idle", 1, "MiB"),
                           ("SIGTERM to exit, socket removed", 2, "s")):  # fmt: skip
        c, h = med("container", i), med("host", i)
        print(f"| {label} | {c:.2f} {unit} | {h:.2f} {unit} | {c / h:.2f}x |")


if __name__ == "__main__":
    main()
