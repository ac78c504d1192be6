"""The container image under a real runtime (podman), driven by a real daprd on the host.

Built by scripts/image.sh (base from Debian packages, no registry). Run the way a Kubernetes pod
runs it: the image's own non-root user, no capabilities, a read-only root filesystem, the socket
folder a shared world-writable directory like the emptyDir the Dapr injector adds, the network
shared with daprd. A missing podman is a failure, never a skip.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import stat
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.e2e import harness
from tests.e2e.harness import LATENESS, LATENESS_TOLERANCE_MS, ManagedProcess, Stack, carries, now_ms, unique
from tests.redis_server import RedisServer, free_port

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
APP_ID = "container-app"
PUBSUB = "delayed"
SOCKETS_FOLDER = "/tmp/dapr-components-sockets"  # the image's, and the injector's default
# The image's user: its own uid, and daprd's gid (the Dapr sidecar runs as 65532:65532).
IMAGE_UID, IMAGE_GID = 10001, 65532
# Kubernetes' default terminationGracePeriodSeconds: SIGKILL follows if the stop takes longer.
TERMINATION_GRACE_S = 30


def podman(*args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """podman with the runtime that works here (runc: crun fails on hybrid cgroups)."""
    exe = shutil.which("podman")
    if exe is None:
        pytest.fail("podman is not installed: run scripts/setup.sh (it installs podman, runc, mmdebstrap)")
    runtime = ["--runtime", "/usr/sbin/runc"] if os.path.exists("/usr/sbin/runc") else []
    return subprocess.run(
        [exe, *runtime, *args], capture_output=True, text=True, timeout=timeout, check=check
    )


def manifest_container() -> dict[str, Any]:
    """The component container of deploy/kubernetes/app.yaml."""
    app = next(
        doc
        for doc in yaml.safe_load_all((REPO / "deploy" / "kubernetes" / "app.yaml").read_text())
        if doc and doc["kind"] == "Deployment"
    )
    spec = app["spec"]["template"]
    name = spec["metadata"]["annotations"]["dapr.io/pluggable-components"]
    container: dict[str, Any] = next(c for c in spec["spec"]["containers"] if c["name"] == name)
    return container


def manifest_args(health_port: int, metrics_port: int) -> list[str]:
    """The manifest's `serve` arguments, with private loopback ports instead of the pod's."""
    private = {
        "--health-port": str(health_port),
        "--health-address": "127.0.0.1",
        "--metrics-port": str(metrics_port),
        "--metrics-address": "127.0.0.1",
    }
    args = []
    for arg in manifest_container()["args"]:
        flag = arg.split("=", 1)[0]
        args.append(f"{flag}={private[flag]}" if flag in private else arg)
    assert any(a.startswith("--health-port=") for a in args), "the manifest serves no health port"
    return args


@pytest.fixture(scope="module")
def image() -> str:
    result = subprocess.run(
        ["bash", str(REPO / "scripts" / "image.sh")], capture_output=True, text=True, timeout=1800
    )
    if result.returncode != 0:
        pytest.fail(f"scripts/image.sh failed (exit {result.returncode}):\n{result.stderr[-4000:]}")
    return result.stdout.strip().splitlines()[-1]


@dataclass
class Container:
    """A `podman run` of the image, by name."""

    name: str
    process: ManagedProcess
    health_port: int

    def state(self) -> dict[str, object]:
        out = podman("inspect", "--format", "{{json .State}}", self.name, check=False)
        return json.loads(out.stdout) if out.returncode == 0 else {}


@pytest.fixture(scope="module")
def sockets() -> Iterator[Path]:
    # Short (unix socket paths are limited to 107 bytes), and as the injector's emptyDir is:
    # owned by root, writable by everyone, no sticky bit.
    with tempfile.TemporaryDirectory(prefix="dps-ct-") as d:
        folder = Path(d) / "sockets"
        folder.mkdir()
        folder.chmod(0o777)
        yield folder


@pytest.fixture(scope="module")
def container(image: str, sockets: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Container]:
    name = unique("dps-test")
    health_port = free_port()
    workdir = Path(tmp_path_factory.mktemp("container"))
    args = [
        *(["--runtime", "/usr/sbin/runc"] if os.path.exists("/usr/sbin/runc") else []),
        "run", "--name", name,
        "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024",
        # The pod's securityContext (deploy/kubernetes): no capabilities, no privilege
        # escalation, nothing written outside the socket folder.
        "--cap-drop", "ALL", "--security-opt", "no-new-privileges",
        "--read-only", "--read-only-tmpfs=false",
        # A pod's containers share one network namespace: Redis and daprd on loopback.
        "--network", "host",
        "-v", f"{sockets}:{SOCKETS_FOLDER}",
        image,
        *manifest_args(health_port, free_port()),
    ]  # fmt: skip
    exe = shutil.which("podman")
    if exe is None:
        pytest.fail("podman is not installed: run scripts/setup.sh (it installs podman, runc, mmdebstrap)")
    proc = ManagedProcess("podman run", [exe, *args], workdir / "container.log").start()
    try:
        harness.wait_until_blocking(
            (sockets / "delayed-pubsub.sock").is_socket, "the container's socket", 60, process=proc
        )
        # The manifest's postStart hook, run in the container: it finds the socket and returns.
        hook = manifest_container()["lifecycle"]["postStart"]["exec"]["command"]
        assert podman("exec", name, *hook, timeout=60).returncode == 0
        yield Container(name, proc, health_port)
    except harness.HarnessError as exc:
        pytest.fail(str(exc), pytrace=False)
    finally:
        podman("rm", "--force", "--time", "0", name, check=False)
        proc.stop()


@pytest.fixture(scope="module")
def container_stack(
    container: Container, sockets: Path, daprd_path: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    workdir = Path(tmp_path_factory.mktemp("container-stack"))
    redis = RedisServer(workdir / "redis")
    redis.start()
    resources = workdir / "resources"
    resources.mkdir()
    (resources / f"{PUBSUB}.yaml").write_text(
        harness.component_yaml(PUBSUB, harness.component_metadata(redis.port))
    )
    started: list[ManagedProcess] = []
    try:
        app_port = free_port()
        subscriber = harness.start_subscriber(workdir, app_port, [f"{PUBSUB}=orders"])
        started.append(subscriber)
        ports = harness.DaprdPorts.free()
        daprd = harness.start_daprd(daprd_path, workdir, sockets, APP_ID, app_port, resources, ports)
        started.append(daprd)
        stack = Stack(workdir, redis.port, app_port, ports, (PUBSUB,), daprd, container.process, subscriber)

        def subscribed() -> bool:
            meta = stack.client.get(f"{stack.dapr_url}/v1.0/metadata").json()
            return any(s["pubsubname"] == PUBSUB for s in meta.get("subscriptions", []))

        harness.wait_until_blocking(
            subscribed, "daprd to load the component and the subscription", 30, process=daprd
        )
        yield stack
        stack.client.close()
    except harness.HarnessError as exc:
        pytest.fail(str(exc), pytrace=False)
    finally:
        for proc in reversed(started):
            proc.stop()
        redis.stop()


# The first test to ask for the image builds it: minutes on a fresh machine (make test builds it
# before pytest starts, so there this is a cache hit).
@pytest.mark.timeout(1800)
def test_image_runs_as_its_own_user_with_the_socket_folder_as_a_volume(image: str) -> None:
    config = json.loads(podman("image", "inspect", "--format", "{{json .Config}}", image).stdout)
    assert config["User"] == f"{IMAGE_UID}:{IMAGE_GID}"
    assert config["Entrypoint"] == ["delayed-pubsub", "serve"]
    assert SOCKETS_FOLDER in config["Volumes"]
    assert f"DAPR_COMPONENTS_SOCKETS_FOLDER={SOCKETS_FOLDER}" in config["Env"]
    # The component only: the Spark tools are a separate install.
    probe = podman(
        "run", "--rm", "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024",
        "--entrypoint", "python", image, "-c",
        "import importlib.util as u, os; "
        "print(os.getuid(), os.getgid(), u.find_spec('pyspark') is None, u.find_spec('pytest') is None)",
    )  # fmt: skip
    assert probe.stdout.split() == [str(IMAGE_UID), str(IMAGE_GID), "True", "True"]


def test_container_socket_is_for_the_component_and_daprds_group_only(
    container: Container, sockets: Path
) -> None:
    st = (sockets / "delayed-pubsub.sock").stat()
    assert stat.S_ISSOCK(st.st_mode)
    assert (st.st_uid, st.st_gid) == (IMAGE_UID, IMAGE_GID)
    assert stat.S_IMODE(st.st_mode) == 0o660


def test_delayed_publish_through_daprd_arrives_on_time_from_the_container(
    container_stack: Stack, container: Container
) -> None:
    ready = httpx.get(f"http://127.0.0.1:{container.health_port}/readyz", timeout=5)
    assert ready.status_code == 200, ready.text

    marker = unique("ct")
    payload = {"marker": marker}
    due_ms = now_ms() + 2000
    reply = container_stack.publish(PUBSUB, "orders", payload, {"scheduledSendDelay": "2s"})
    assert reply.status_code == 204, reply.text

    assert container_stack.wait_arrivals(carries(marker), 1, timeout=1.7) == [], "arrived early"
    got = container_stack.wait_arrivals(carries(marker), 1, timeout=10)
    assert len(got) == 1, f"expected one arrival, got {got}\n{container_stack.logs()}"
    lateness = got[0]["received_ms"] - due_ms
    LATENESS.append(("container", lateness))
    assert got[0]["data"] == payload
    assert 0 <= lateness <= LATENESS_TOLERANCE_MS, f"lateness {lateness} ms"


def test_sigterm_stops_the_container_promptly_and_removes_the_socket(
    container_stack: Stack, container: Container, sockets: Path
) -> None:
    # As the kubelet stops a pod: SIGTERM, while daprd still holds its subscription stream.
    assert container_stack.daprd.alive()
    started = time.monotonic()
    podman("kill", "--signal", "TERM", container.name)
    waited = podman("wait", container.name, check=False, timeout=TERMINATION_GRACE_S + 10)
    took = time.monotonic() - started
    exit_code = waited.stdout.strip()
    assert exit_code == "0", f"exit {exit_code!r} {waited.stderr}\n{container.process.log_tail()}"
    assert took < TERMINATION_GRACE_S, f"the stop took {took:.1f}s"
    assert not (sockets / "delayed-pubsub.sock").exists()
    assert "stopped; removed" in podman("logs", container.name).stderr


def test_container_killed_and_restarted_replaces_its_stale_socket_and_serves_publishes(
    container_stack: Stack, container: Container, sockets: Path
) -> None:
    sock = sockets / "delayed-pubsub.sock"
    podman("start", container.name)  # stopped by the SIGTERM test
    harness.wait_until_blocking(sock.is_socket, "the container's socket", 60)
    # An OOM kill: no clean-up, the socket file stays in the shared folder.
    podman("kill", "--signal", "KILL", container.name)
    podman("wait", container.name, timeout=60)
    assert sock.is_socket()
    # The kubelet starts the same container again, on the same folder.
    podman("start", container.name)
    marker = unique("after-kill")
    deadline = time.monotonic() + 60
    while True:
        # daprd reconnects with its own backoff; until then its publish fails (nothing accepted).
        reply = container_stack.publish(PUBSUB, "orders", {"marker": marker}, {"scheduledSendDelay": "1s"})
        if reply.status_code == 204:
            break
        assert time.monotonic() < deadline, f"publish still {reply.status_code}: {reply.text}"
        time.sleep(0.5)
    assert stat.S_IMODE(sock.stat().st_mode) == 0o660
    # daprd never re-opens its subscription stream: the probe says so (the pod needs recreating).
    deadline = time.monotonic() + 30
    while True:
        ready = httpx.get(f"http://127.0.0.1:{container.health_port}/readyz", timeout=5)
        if ready.status_code == 503:
            break
        assert time.monotonic() < deadline, f"readyz stayed {ready.status_code}: {ready.text}"
        time.sleep(0.2)
    assert ready.json()["services"]["delayed-pubsub.subscriptions"] == "NOT_SERVING"
    assert httpx.get(f"http://127.0.0.1:{container.health_port}/healthz", timeout=5).status_code == 200


def limits_as_podman_flags() -> list[str]:
    """app.yaml's CPU and memory limits of the component container, as `podman run` flags."""
    limits = manifest_container()["resources"]["limits"]
    cpu = str(limits["cpu"])
    cpus = int(cpu[:-1]) / 1000 if cpu.endswith("m") else float(cpu)
    memory = str(limits["memory"])
    assert memory.endswith("Mi"), memory
    return ["--cpus", f"{cpus:g}", "--memory", f"{int(memory[:-2])}m"]


@pytest.mark.parametrize("cpus", ["0.5", "1.5", None])
def test_serve_reads_the_containers_cpu_quota_for_its_default_workers(image: str, cpus: str | None) -> None:
    # `serve --help` says what the default is here and why: the quota `podman run --cpus` (a
    # Kubernetes CPU limit) sets in the container's cgroup, v1 or v2 as the host has it.
    limit = ["--cpus", cpus] if cpus else []
    out = podman(
        "run", "--rm", "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024", *limit, image, "--help",
    )  # fmt: skip
    text = " ".join(out.stdout.split())
    cores = len(os.sched_getaffinity(0))
    quota = f"cgroup CPU quota {cpus}" if cpus else "no cgroup CPU quota"
    workers = max(1, min(cores, math.ceil(float(cpus)) if cpus else cores) - 1)
    assert f"(here {workers}: {cores} cores, {quota})" in text, text


def test_under_the_manifests_cpu_and_memory_limits_serve_starts_its_workers_and_serves(
    image: str, tmp_path: Path
) -> None:
    folder = tmp_path / "sockets"
    folder.mkdir()
    folder.chmod(0o777)
    name = unique("dps-limits")
    podman(
        "run", "-d", "--name", name, "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024",
        *limits_as_podman_flags(), "--read-only", "--read-only-tmpfs=false", "--network", "none",
        "-v", f"{folder}:{SOCKETS_FOLDER}", image, "--allow-insecure-socket-folder", "--log-format=json",
    )  # fmt: skip
    try:
        harness.wait_until_blocking((folder / "delayed-pubsub.sock").is_socket, "the container's socket", 60)

        def worker_runs() -> bool:
            return '"worker 0: pid' in podman("logs", name).stderr

        harness.wait_until_blocking(worker_runs, "the worker process to start", 60)
        logs = podman("logs", name).stderr
        assert f"firing in {max(1, len(os.sched_getaffinity(0)) - 1)} worker process(es)" in logs, logs
        state = json.loads(podman("inspect", "--format", "{{json .State}}", name).stdout)
        assert state["Running"] is True
        assert state["OOMKilled"] is False
    except harness.HarnessError as exc:
        pytest.fail(f"{exc}\n{podman('logs', name, check=False).stderr[-3000:]}", pytrace=False)
    finally:
        podman("rm", "--force", "--time", "0", name, check=False)
