"""The pod a cluster with Dapr would run, run: deploy/kubernetes/app.yaml's pod template with the
Dapr sidecar injector's own patch applied (scripts/injectpatch.sh: dapr/dapr pkg/injector/patcher
of the daprd version we build, configured as Dapr's Helm chart configures it), under
`podman kube play`.

Images, all from Debian packages (scripts/pod-images.sh): our image under the name app.yaml gives
it, daprd's image made of our daprd binary as Dapr lays its image out, a local stand-in for the
app container's python image, and Redis (Debian's redis-server) beside the pod on the pod's
network under the name `redis`, as deploy/kubernetes/redis.yaml's Service names it.

THE ONE CHANGE to the injected pod (standalone()): daprd's control-plane flags. No Dapr control
plane runs here, so daprd runs `--mode standalone` instead of `kubernetes`, without the operator,
sentry, placement and scheduler addresses and without `--enable-mtls`, and reads the Component,
Subscription and Resiliency of deploy/kubernetes/ from files (a ConfigMap mounted at
/dapr/resources) instead of from the operator. Everything else is the injector's output, as is.

KUBELET: what podman 4.3 does not do as the kubelet does, the test does (Pod.play, Pod.stop,
on_loopback), leaving the containers as they are: an emptyDir is made as the kubelet makes it
(mode 0777, with the pod's fsGroup: group fsGroup and setgid; podman makes it root's, 0755); the
containers start in order, each after the previous one's postStart hook returned (podman runs no
hooks); a stop sends SIGTERM to every container and SIGKILL only after
terminationGracePeriodSeconds (`podman pod stop --time`: podman 4.3's `kube down` alone SIGKILLs
at once, podman issue #22397, fixed in later releases); and, the one addition to the file podman
plays, each containerPort gets a private hostPort on 127.0.0.1 (podman 4.3 publishes every
containerPort on every address of the host, the kubelet none). The test runs the probes.

The pod's network is a private podman network. The test calls
daprd's HTTP API from inside the pod (daprd listens on the pod's loopback only, as injected), and
probes the containers as the kubelet does: HTTP GET and TCP connects to the pod's IP, exec in the
container.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import textwrap
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.e2e import harness
from tests.e2e.harness import LATENESS, LATENESS_TOLERANCE_MS, now_ms, rfc3339, unique
from tests.redis_server import free_port

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy" / "kubernetes"
DEPLOYMENT = "orders-app"
PUBSUB, TOPIC = "delayed", "orders"  # component.yaml's name, subscription.yaml's topic
RESOURCES = "/dapr/resources"  # where daprd reads the Component and Subscription files
# The flags by which the injector points daprd at Dapr's control plane (removed by standalone()).
CONTROL_PLANE_FLAGS = ("--control-plane-address", "--sentry-address", "--placement-host-address",
                       "--scheduler-host-address")  # fmt: skip
SOCKET_ERROR_WORDS = ("delayed-pubsub", ".sock", "pluggable")
# daprd's own stop cancels its streams to the component: an error line it logs whichever side
# stops first. Our socket going away would read otherwise (Unavailable, EOF, connection refused).
DAPRD_OWN_CANCEL = "code = Canceled desc = context canceled"


def podman_env(conf: Path) -> dict[str, str]:
    # `podman kube play` takes no --runtime or --ulimit: runc (crun fails on hybrid cgroups) and
    # the ulimits the infra container needs here come from this containers.conf.
    return {**os.environ, "CONTAINERS_CONF": str(conf)}


@dataclass
class Podman:
    env: dict[str, str]

    def __call__(
        self, *args: str, check: bool = True, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        exe = shutil.which("podman")
        if exe is None:
            pytest.fail(
                "podman is not installed: run scripts/setup.sh (it installs podman, runc, mmdebstrap)"
            )
        result = subprocess.run(
            [exe, *args], capture_output=True, text=True, timeout=timeout, check=False, env=self.env
        )
        if check and result.returncode != 0:
            pytest.fail(f"podman {' '.join(args)}: exit {result.returncode}\n{result.stderr[-3000:]}")
        return result

    def popen(self, *args: str, out: Path) -> subprocess.Popen[bytes]:
        exe = shutil.which("podman") or "podman"
        with out.open("wb") as f:
            return subprocess.Popen([exe, *args], stdout=f, stderr=subprocess.STDOUT, env=self.env)


def run_script(*args: str, timeout: float = 3600) -> str:
    result = subprocess.run(["bash", *args], capture_output=True, text=True, timeout=timeout, check=False)
    if result.returncode != 0:
        pytest.fail(f"{args[0]} failed (exit {result.returncode}):\n{result.stderr[-4000:]}", pytrace=False)
    return result.stdout


def containers(pod: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in pod["spec"]["containers"]}


def injected_pod(daprd_image: str, name: str) -> dict[str, Any]:
    """The Pod the Dapr injector makes of app.yaml's Deployment (its own code, no copy)."""
    out = run_script(
        str(REPO / "scripts" / "injectpatch.sh"),
        str(DEPLOY / "app.yaml"),
        DEPLOYMENT,
        daprd_image,
        "-pod-name",
        name,
    )
    pod: dict[str, Any] = yaml.safe_load(out)
    return pod


def standalone(injected: dict[str, Any]) -> dict[str, Any]:
    """THE ONE CHANGE: daprd's control-plane flags (see the module's docstring)."""
    pod: dict[str, Any] = json.loads(json.dumps(injected))
    daprd = containers(pod)["daprd"]
    args, kept = list(daprd["args"]), []
    assert "--mode" in args
    assert args[args.index("--mode") + 1] == "kubernetes"
    while args:
        arg = args.pop(0)
        if arg == "--mode":
            kept += ["--mode", "standalone"]
            args.pop(0)
        elif arg in CONTROL_PLANE_FLAGS:
            args.pop(0)
        elif arg != "--enable-mtls":
            kept.append(arg)
    # Empty addresses: no actors and no scheduler (standalone daprd would dial localhost for them).
    daprd["args"] = [*kept, "--resources-path", RESOURCES, "--placement-host-address", "",
                     "--scheduler-host-address", ""]  # fmt: skip
    daprd["volumeMounts"] = [*daprd.get("volumeMounts", []),
                             {"name": "dapr-resources", "mountPath": RESOURCES, "readOnly": True}]  # fmt: skip
    pod["spec"]["volumes"] = [*pod["spec"].get("volumes", []),
                              {"name": "dapr-resources", "configMap": {"name": "dapr-resources"}}]  # fmt: skip
    return pod


def on_loopback(spec: dict[str, Any]) -> dict[str, Any]:
    """KUBELET: podman 4.3 publishes every containerPort on the host's every address (the kubelet
    publishes none without a hostPort), so each gets a private host port on 127.0.0.1 instead."""
    pod: dict[str, Any] = json.loads(json.dumps(spec))
    for container in pod["spec"]["containers"]:
        for port in container.get("ports", []):
            port["hostIP"], port["hostPort"] = "127.0.0.1", free_port()
    return pod


def config_maps() -> list[dict[str, Any]]:
    """What `kubectl create configmap orders-app --from-file=examples/subscriber.py` makes, and
    the Dapr resources of deploy/kubernetes/ that the operator would serve daprd."""
    resources = {
        name: (DEPLOY / name).read_text()
        for name in ("component.yaml", "subscription.yaml", "resiliency.yaml")
    }
    return [
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "orders-app"},
         "data": {"subscriber.py": (REPO / "examples" / "subscriber.py").read_text()}},
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "dapr-resources"}, "data": resources},
    ]  # fmt: skip


@dataclass
class Pod:
    """The injected pod under podman, by name; its containers are `<pod>-<container>`."""

    podman: Podman
    name: str
    spec: dict[str, Any]
    injected: dict[str, Any]
    kube_file: Path
    network: str
    workdir: Path

    def ctr(self, container: str) -> str:
        return f"{self.name}-{container}"

    def ip(self) -> str:
        infra = self.podman("pod", "inspect", "--format", "{{.InfraContainerID}}", self.name).stdout.strip()
        nets = json.loads(
            self.podman("inspect", "--format", "{{json .NetworkSettings.Networks}}", infra).stdout
        )
        return str(nets[self.network]["IPAddress"])

    def play(self) -> None:
        """`podman kube play`, then started as the kubelet starts a pod (see KUBELET)."""
        self.podman(
            "kube", "play", "--start=false", "--network", self.network, str(self.kube_file), timeout=180
        )
        fs_group = self.spec["spec"].get("securityContext", {}).get("fsGroup")
        empty_dirs = {v["name"] for v in self.spec["spec"]["volumes"] if "emptyDir" in v}
        for name, container in containers(self.spec).items():
            paths = {m["mountPath"] for m in container.get("volumeMounts", []) if m["name"] in empty_dirs}
            mounts = json.loads(self.podman("inspect", "--format", "{{json .Mounts}}", self.ctr(name)).stdout)
            for mount in mounts:
                if mount["Destination"] in paths:
                    source = Path(mount["Source"])
                    os.chown(source, 0, -1 if fs_group is None else int(fs_group))
                    source.chmod(0o2777 if fs_group is not None else 0o777)
        for name, container in containers(self.spec).items():
            self.podman("start", self.ctr(name))
            hook = container.get("lifecycle", {}).get("postStart")
            if hook:
                ran = self.podman("exec", self.ctr(name), *hook["exec"]["command"], check=False, timeout=90)
                assert ran.returncode == 0, f"{name}'s postStart hook failed: {ran.stderr}\n{self.logs(name)}"

    def stop(self) -> None:
        """The kubelet's stop (see KUBELET): SIGTERM to every container, SIGKILL after the grace."""
        grace = str(self.spec["spec"]["terminationGracePeriodSeconds"])
        self.podman("pod", "stop", "--time", grace, self.name, check=False, timeout=120)

    def down(self) -> None:
        """stop(), then `podman kube down`."""
        self.stop()
        self.podman("kube", "down", str(self.kube_file), check=False, timeout=120)

    def inside(self, code: str, *args: str, timeout: float = 60) -> Any:
        """Runs Python in the app container (the pod's loopback: daprd's API); its stdout as JSON."""
        out = self.podman("exec", self.ctr(DEPLOYMENT), "python", "-c", code, *args, timeout=timeout)
        return json.loads(out.stdout)

    def dapr(self, method: str, path: str, body: str = "") -> tuple[int, str]:
        status, text = self.inside(HTTP_IN_POD, method, f"http://127.0.0.1:{DAPR_HTTP_PORT}{path}", body)
        return int(status), str(text)

    def publish(self, metadata: dict[str, str], data: dict[str, Any]) -> None:
        query = "&".join(f"metadata.{k}={v}" for k, v in metadata.items()).replace(" ", "%20")
        status, text = self.dapr("POST", f"/v1.0/publish/{PUBSUB}/{TOPIC}?{query}", json.dumps(data))
        assert status == 204, f"publish: {status} {text}"

    def arrivals(self, marker: str) -> list[dict[str, Any]]:
        status, text = self.inside(HTTP_IN_POD, "GET", f"http://127.0.0.1:{APP_PORT}/arrivals", "")
        assert status == 200, text
        return [a for a in json.loads(text) if marker in a["body"]]

    def wait_arrivals(self, marker: str, count: int, timeout: float) -> list[dict[str, Any]]:
        got: list[dict[str, Any]] = []

        def enough() -> bool:
            got[:] = self.arrivals(marker)
            return len(got) >= count

        try:
            harness.wait_until_blocking(enough, f"{count} arrival(s) of {marker}", timeout)
        except harness.HarnessError as exc:
            pytest.fail(f"{exc}: got {len(got)}\n{self.logs()}", pytrace=False)
        return got

    def log(self, container: str) -> str:
        out = self.podman("logs", self.ctr(container), check=False)
        return out.stdout + out.stderr

    def logs(self, container: str | None = None) -> str:
        names = [container] if container else list(containers(self.spec))
        return "\n".join(f"--- {n}:\n" + "\n".join(self.log(n).splitlines()[-30:]) for n in names)


# Ports of the injected pod, from the injector's output (checked in test_the_injectors_pod...).
DAPR_HTTP_PORT = 3500
APP_PORT = 6001
HTTP_IN_POD = textwrap.dedent("""
    import json, sys, urllib.error, urllib.request
    method, url, body = sys.argv[1:4]
    req = urllib.request.Request(url, data=body.encode() or None, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=20) as r:
            print(json.dumps([r.status, r.read().decode()]))
    except urllib.error.HTTPError as e:
        print(json.dumps([e.code, e.read().decode()]))
    except OSError as e:
        print(json.dumps([0, repr(e)]))
""")


def probe(pod: Pod, container: str, kind: str) -> tuple[bool, str]:
    """One probe of the container as the kubelet runs it: the manifest's httpGet, tcpSocket or exec."""
    spec = containers(pod.spec)[container]
    p = spec[kind]
    ports = {port["name"]: port["containerPort"] for port in spec.get("ports", [])}
    timeout = float(p.get("timeoutSeconds", 1))
    if "httpGet" in p:
        port = ports.get(p["httpGet"]["port"], p["httpGet"]["port"])
        try:
            r = httpx.get(f"http://{pod.ip()}:{port}{p['httpGet']['path']}", timeout=timeout)
        except httpx.HTTPError as exc:
            return False, repr(exc)
        return 200 <= r.status_code < 400, f"{r.status_code} {r.text}"
    if "tcpSocket" in p:
        port = ports.get(p["tcpSocket"]["port"], p["tcpSocket"]["port"])
        try:
            socket.create_connection((pod.ip(), int(port)), timeout=timeout).close()
        except OSError as exc:
            return False, repr(exc)
        return True, "connected"
    out = pod.podman("exec", pod.ctr(container), *p["exec"]["command"], check=False, timeout=timeout + 10)
    return out.returncode == 0, out.stdout + out.stderr


def wait_probe(pod: Pod, container: str, kind: str, want: bool, timeout: float, showing: str = "") -> str:
    """Probes until the probe passes (want) or fails, with `showing` in its answer."""
    seen = [""]

    def check() -> bool:
        ok, seen[0] = probe(pod, container, kind)
        return ok == want and showing in seen[0]

    try:
        harness.wait_until_blocking(check, f"{container} {kind} {'passing' if want else 'failing'}", timeout)
    except harness.HarnessError as exc:
        pytest.fail(f"{exc}; last: {seen[0]}\n{pod.logs()}", pytrace=False)
    return seen[0]


@pytest.fixture(scope="module")
def images() -> dict[str, str]:
    # make test builds them before the clock starts (scripts/test.sh); here a cache hit.
    out = run_script(str(REPO / "scripts" / "pod-images.sh"))
    return dict(line.split("=", 1) for line in out.strip().splitlines())


@pytest.fixture(scope="module")
def pod(images: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pod]:
    workdir = Path(tmp_path_factory.mktemp("pod"))
    conf = workdir / "containers.conf"
    conf.write_text(
        '[containers]\ndefault_ulimits = ["nofile=1024:1024", "nproc=1024:1024"]\n[engine]\nruntime = "runc"\n'
    )
    podman = Podman(podman_env(conf))
    name = unique("dps-pod")
    injected = injected_pod(images["DAPRD"], name)
    spec = standalone(injected)
    kube_file = workdir / "pod.yaml"
    kube_file.write_text(yaml.safe_dump_all([*config_maps(), on_loopback(spec)]))
    network = f"{name}-net"
    podman("network", "create", network)
    the_pod = Pod(podman, name, spec, injected, kube_file, network, workdir)
    try:
        # deploy/kubernetes/redis.yaml's Service `redis`, on the pod's network.
        podman("run", "-d", "--name", f"{name}-redis", "--network", network, "--network-alias", "redis",
               images["REDIS"], "redis-server", "--protected-mode", "no", "--save", "", "--appendonly", "no")  # fmt: skip
        the_pod.play()
        yield the_pod
    finally:
        the_pod.down()
        podman("rm", "--force", "--time", "0", f"{name}-redis", check=False)
        podman("network", "rm", "--force", network, check=False)


def test_the_injectors_pod_mounts_the_socket_folder_where_our_image_serves_it(pod: Pod) -> None:
    # What the rest of this module relies on, read from the injector's output (not from a copy).
    injected = containers(pod.injected)
    daprd, ours = (
        injected["daprd"],
        injected[pod.injected["metadata"]["annotations"]["dapr.io/pluggable-components"]],
    )
    socket_volume = next(v["name"] for v in pod.injected["spec"]["volumes"] if "emptyDir" in v)
    mounts = {c: {m["name"]: m["mountPath"] for m in injected[c].get("volumeMounts", [])} for c in injected}
    assert mounts["daprd"][socket_volume] == mounts[ours["name"]][socket_volume]
    # ... where our image serves its socket (and where daprd looks: the same variable, unset in
    # daprd's container, so its default).
    env = json.loads(pod.podman("inspect", "--format", "{{json .Config.Env}}", pod.ctr(ours["name"])).stdout)
    folder = dict(e.split("=", 1) for e in env)["DAPR_COMPONENTS_SOCKETS_FOLDER"]
    assert folder == mounts[ours["name"]][socket_volume], (
        "our image serves its socket outside the injector's volume"
    )
    assert "DAPR_COMPONENTS_SOCKETS_FOLDER" not in {e["name"] for e in daprd.get("env", [])}
    args = daprd["args"]
    assert args[args.index("--dapr-http-port") + 1] == str(DAPR_HTTP_PORT)
    assert args[args.index("--app-port") + 1] == str(APP_PORT)
    # The one change, and nothing else: every container but daprd is the injector's, as is.
    for name, container in containers(pod.spec).items():
        if name != "daprd":
            assert container == injected[name], name
    assert {k: v for k, v in containers(pod.spec)["daprd"].items() if k not in ("args", "volumeMounts")} == {
        k: v for k, v in daprd.items() if k not in ("args", "volumeMounts")
    }
    # Running: daprd found the component's socket on its one scan, and loaded the subscription.
    wait_probe(pod, "daprd", "readinessProbe", True, 90)
    status, text = pod.dapr("GET", "/v1.0/metadata")
    assert status == 200, text
    meta = json.loads(text)
    assert {"name": PUBSUB, "type": "pubsub.delayed-pubsub"}.items() <= next(
        c for c in meta["components"] if c["name"] == PUBSUB
    ).items(), meta["components"]
    assert any(s["pubsubname"] == PUBSUB and s["topic"] == TOPIC for s in meta["subscriptions"]), meta


def test_every_probe_passes_as_the_kubelet_calls_it(pod: Pod) -> None:
    for name, container in containers(pod.spec).items():
        for kind in ("readinessProbe", "livenessProbe"):
            if kind in container:
                wait_probe(pod, name, kind, True, 60)


def test_a_delayed_publish_arrives_at_the_app_on_time(pod: Pod) -> None:
    marker = unique("pod-delayed")
    due = (now_ms() // 1000 + 4) * 1000  # whole seconds: scheduledSendTime's resolution here
    pod.publish({"scheduledSendTime": rfc3339(due)}, {"marker": marker})
    got = pod.wait_arrivals(marker, 1, 20)
    lateness = got[0]["received_ms"] - due
    LATENESS.append(("pod", lateness))
    assert 0 <= lateness <= LATENESS_TOLERANCE_MS, f"lateness {lateness} ms"
    assert got[0]["data"] == {"marker": marker}


def test_a_recurring_schedule_fires_in_the_pod(pod: Pod) -> None:
    marker, schedule_id = unique("pod-every"), unique("pod-sched")
    start = now_ms()
    pod.publish({"schedule": "@every 1s", "scheduleId": schedule_id}, {"marker": marker})
    try:
        fires = pod.wait_arrivals(marker, 3, 20)
    finally:
        pod.publish({"scheduleId": schedule_id, "scheduleCancel": "true"}, {})
    times = sorted(f["received_ms"] for f in fires)
    assert times[0] >= start + 1000 - 50, "fired before its first period"
    assert all(b - a >= 500 for a, b in itertools.pairwise(times)), times


def test_our_container_restarted_alone_fails_readiness_and_loses_nothing_once_the_pod_is_recreated(
    pod: Pod,
) -> None:
    ours = pod.ctr("delayed-pubsub")
    markers = [unique("pod-before-kill") for _ in range(3)]
    due = (now_ms() // 1000 + 7) * 1000
    for marker in markers:
        pod.publish({"scheduledSendTime": rfc3339(due)}, {"marker": marker})
    started = pod.podman("inspect", "--format", "{{.State.StartedAt}}", ours).stdout
    # An OOM kill of our container alone, as the kernel does it (from outside podman, which would
    # take a `podman kill` for a stop): no clean-up; the pod's restart policy brings it back.
    os.kill(int(pod.podman("inspect", "--format", "{{.State.Pid}}", ours).stdout), signal.SIGKILL)

    def restarted() -> bool:
        running, at = pod.podman(
            "inspect", "--format", "{{.State.Running}} {{.State.StartedAt}}", ours
        ).stdout.split(" ", 1)
        return running == "true" and at != started

    try:
        harness.wait_until_blocking(restarted, "our container to be restarted in the pod", 60)
    except harness.HarnessError as exc:
        pytest.fail(f"{exc}\n{pod.logs()}", pytrace=False)
    # daprd does not re-open its subscription stream to a restarted component: the readiness
    # probe says so, and the kubelet takes the pod out of service.
    text = wait_probe(
        pod, "delayed-pubsub", "readinessProbe", False, 60, showing="delayed-pubsub.subscriptions"
    )
    assert text.startswith("503 "), text
    assert json.loads(text[4:])["services"]["delayed-pubsub.subscriptions"] == "NOT_SERVING", text
    # Its liveness passes: a restart of the container would not help, recreating the pod does.
    assert probe(pod, "delayed-pubsub", "livenessProbe")[0]
    # daprd's publishes reach the restarted component (resiliency.yaml retries them meanwhile).
    markers.append(unique("pod-after-restart"))
    pod.publish({"scheduledSendTime": rfc3339((now_ms() // 1000 + 2) * 1000)}, {"marker": markers[-1]})
    # As the docs say: recreate the pod (kubectl rollout restart). Redis keeps what was accepted.
    pod.down()
    pod.play()
    for marker in markers:
        got = pod.wait_arrivals(marker, 1, 60)
        assert len(got) == 1, f"{marker}: {len(got)} arrivals"


def test_a_pod_stop_stops_our_container_cleanly_within_the_grace_and_daprd_logs_no_socket_error(
    pod: Pod,
) -> None:
    wait_probe(pod, "daprd", "readinessProbe", True, 90)
    ours = pod.ctr("delayed-pubsub")
    waiter = pod.podman.popen("wait", ours, out=pod.workdir / "ours.exit")
    grace = pod.spec["spec"]["terminationGracePeriodSeconds"]
    started = time.monotonic()
    with ThreadPoolExecutor(1) as pool:
        stopping = pool.submit(pod.stop)
        waiter.wait(timeout=grace + 30)
        took = time.monotonic() - started
        stopping.result(timeout=grace + 60)
    # Stopped, not yet removed: their whole logs are there.
    ours_log, daprd_log = pod.log("delayed-pubsub"), pod.log("daprd")
    pod.down()
    assert (pod.workdir / "ours.exit").read_text().strip() == "0", ours_log[-3000:]
    assert took < grace, f"our container took {took:.1f}s to stop"
    assert "stopped; removed" in ours_log, ours_log[-3000:]
    # daprd was stopped too (SIGTERM), and its log covers its shutdown of our component.
    assert "Shutting down component delayed" in daprd_log, daprd_log[-3000:]
    errors = [
        line for line in daprd_log.splitlines()
        if ("level=error" in line or "level=fatal" in line)
        and any(w in line for w in SOCKET_ERROR_WORDS)
        and DAPRD_OWN_CANCEL not in line
    ]  # fmt: skip
    assert errors == [], "\n".join(errors)
