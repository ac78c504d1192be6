"""deploy/kubernetes holds together: what a cluster would only tell at `kubectl apply` time, or
worse, when the pod runs. No cluster here: the manifests are read and held to the Dockerfile, to
`delayed-pubsub serve`'s own parser and health endpoints, and to what the Dapr injector does:
its own patch (scripts/injectpatch.sh runs dapr/dapr's pkg/injector/patcher on app.yaml) says
which socket volume it adds, where it mounts it, and which ports daprd takes.
tests/e2e/test_pod_e2e.py runs that pod."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from delayed_pubsub.cli import build_parser
from delayed_pubsub.health_http import CHECK_TIMEOUT_S, LIVENESS_PATH, READINESS_PATH
from delayed_pubsub.server import DEFAULT_SOCKETS_FOLDER, SOCKET_NAME, SOCKETS_FOLDER_ENV

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy" / "kubernetes"

# daprd's profiling port, off unless dapr.io/enable-profiling (so not in the injector's patch).
DAPRD_PROFILING_PORT = 7777


def load(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def resources(folder: Path = DEPLOY) -> list[dict[str, Any]]:
    return [doc for path in sorted(folder.glob("*.yaml")) for doc in load(path)]


def one(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def dockerfile_arg(name: str) -> str:
    m = re.search(rf"^ARG {name}=(\S+)$", (REPO / "Dockerfile").read_text(), re.M)
    assert m, f"Dockerfile has no ARG {name}=default"
    return m.group(1)


@pytest.fixture(scope="module")
def app() -> dict[str, Any]:
    return one(resources(), "Deployment", "orders-app")


@pytest.fixture(scope="module")
def injected() -> dict[str, Any]:
    """The Pod the Dapr injector makes of app.yaml (its own patcher, the daprd version we build)."""
    result = subprocess.run(
        ["bash", str(REPO / "scripts" / "injectpatch.sh"), str(DEPLOY / "app.yaml"), "orders-app", "daprd"],
        capture_output=True, text=True, timeout=1800, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-4000:]
    pod_: dict[str, Any] = yaml.safe_load(result.stdout)
    return pod_


@pytest.fixture(scope="module")
def daprd_gid() -> int:
    """The group of Dapr's own daprd image (its USER, dapr/dapr docker/Dockerfile of the version
    we build): daprd runs in it, as the injector's patch sets no user by default."""
    go = shutil.which("go") or "/usr/local/go/bin/go"
    module = subprocess.run(
        [go, "list", "-mod=readonly", "-m", "-f", "{{.Dir}}", "github.com/dapr/dapr"],
        cwd=REPO / "tools" / "injectpatch", capture_output=True, text=True, timeout=120, check=True,
    ).stdout.strip()  # fmt: skip
    m = re.search(r"^USER (\d+):(\d+)$", (Path(module) / "docker" / "Dockerfile").read_text(), re.M)
    assert m, "no USER uid:gid in dapr/dapr's docker/Dockerfile"
    return int(m.group(2))


def injected_socket_mounts(injected: dict[str, Any]) -> tuple[str, dict[str, str]]:
    """The socket volume the injector adds (its emptyDir) and where it mounts it, by container."""
    volumes = [v["name"] for v in injected["spec"]["volumes"] if "emptyDir" in v]
    assert len(volumes) == 1, injected["spec"]["volumes"]
    mounts = {
        c["name"]: m["mountPath"]
        for c in injected["spec"]["containers"]
        for m in c.get("volumeMounts", [])
        if m["name"] == volumes[0]
    }
    return volumes[0], mounts


def daprd_ports(injected: dict[str, Any]) -> set[int]:
    """daprd's ports in the pod's shared network namespace, as the injector gives them."""
    daprd = next(c for c in injected["spec"]["containers"] if c["name"] == "daprd")
    ports = {int(p["containerPort"]) for p in daprd["ports"]}
    args = daprd["args"]
    ports.add(int(args[args.index("--dapr-public-port") + 1]))  # the health port, not declared
    return ports | {DAPRD_PROFILING_PORT}


def pod(app: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = app["spec"]["template"]["spec"]
    return spec


def pod_annotations(app: dict[str, Any]) -> dict[str, str]:
    return dict(app["spec"]["template"]["metadata"]["annotations"])


def component_container(app: dict[str, Any]) -> dict[str, Any]:
    name = pod_annotations(app)["dapr.io/pluggable-components"]
    containers: list[dict[str, Any]] = [c for c in pod(app)["containers"] if c["name"] == name]
    assert len(containers) == 1, f"dapr.io/pluggable-components names {name!r}, no such container"
    return containers[0]


def serve_args(container: dict[str, Any]) -> Any:
    """The container's args as `delayed-pubsub serve` parses them (SystemExit if one is unknown)."""
    return build_parser().parse_args(["serve", *container.get("args", [])])


def test_every_manifest_is_a_kubernetes_or_dapr_resource() -> None:
    paths = sorted(DEPLOY.rglob("*.yaml"))
    assert len(paths) >= 7
    for path in paths:
        for doc in load(path):
            assert {"apiVersion", "kind", "metadata"} <= doc.keys(), path
            assert doc["metadata"].get("name"), path


def test_component_container_is_the_one_named_in_the_dapr_annotation_and_runs_the_image(
    app: dict[str, Any],
) -> None:
    notes = pod_annotations(app)
    assert notes["dapr.io/enabled"] == "true"
    assert notes["dapr.io/app-id"] == "orders-app"
    container = component_container(app)
    assert container["image"].split(":")[0].endswith("dapr-delayed-pubsub")
    assert "command" not in container, "the image's entry point is `delayed-pubsub serve`"
    # The Component's type is what daprd derives from the socket's file name.
    component = one(resources(), "Component", "delayed")
    assert component["spec"]["type"] == "pubsub." + Path(SOCKET_NAME).stem


def test_component_and_daprd_see_the_same_socket_folder(
    app: dict[str, Any], injected: dict[str, Any]
) -> None:
    volume, mounts = injected_socket_mounts(injected)
    name = pod_annotations(app)["dapr.io/pluggable-components"]
    # The injector mounts its socket volume in daprd and in the component container, at one path.
    assert set(mounts) == {"daprd", name}, mounts
    assert mounts["daprd"] == mounts[name]
    container = component_container(app)
    env = {e["name"]: e.get("value") for e in container.get("env", [])}
    image_env = re.search(rf"{SOCKETS_FOLDER_ENV}=\$\{{SOCKETS_FOLDER\}}", (REPO / "Dockerfile").read_text())
    assert image_env, "the image sets the socket folder from its SOCKETS_FOLDER arg"
    folder = env.get(SOCKETS_FOLDER_ENV) or dockerfile_arg("SOCKETS_FOLDER")
    socket = serve_args(container).socket
    assert socket is None or str(socket.parent) == folder
    # daprd reads DAPR_COMPONENTS_SOCKETS_FOLDER (not the injector's DAPR_COMPONENT_SOCKETS_FOLDER),
    # default the same folder: any other place must be set on both sides, so keep the default.
    assert folder == mounts[name] == DEFAULT_SOCKETS_FOLDER
    # The injector adds the volume and the mounts; a second one of that name or path breaks the pod.
    assert volume not in {v["name"] for v in pod(app).get("volumes", [])}
    for c in pod(app)["containers"]:
        assert mounts[name] not in {m["mountPath"] for m in c.get("volumeMounts", [])}, c["name"]


def test_component_runs_as_the_images_non_root_user_in_daprds_group(
    app: dict[str, Any], daprd_gid: int
) -> None:
    uid, gid = int(dockerfile_arg("UID")), int(dockerfile_arg("GID"))
    assert uid != 0
    assert gid == daprd_gid  # the socket is 0660 in this group: daprd can connect, nobody else
    sc = component_container(app)["securityContext"]
    assert sc["runAsNonRoot"] is True
    assert (sc["runAsUser"], sc["runAsGroup"]) == (uid, gid)
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"]["drop"] == ["ALL"]
    # The pod-wide group gives the shared folder (and so the socket) to daprd's group, and no
    # pod-wide runAsUser: it would also apply to the injected daprd.
    pod_sc = pod(app)["securityContext"]
    assert pod_sc["fsGroup"] == gid
    assert "runAsUser" not in pod_sc
    # The injector's emptyDir is world-writable without the sticky bit: serve refuses it unless told.
    assert serve_args(component_container(app)).allow_insecure_socket_folder is True
    for c in pod(app)["containers"]:
        assert c["securityContext"]["runAsNonRoot"] is True, c["name"]
        assert c["securityContext"]["runAsUser"] != 0, c["name"]


def test_probes_reach_the_health_endpoints_serve_opens(app: dict[str, Any], injected: dict[str, Any]) -> None:
    container = component_container(app)
    args = serve_args(container)
    assert args.health_port is not None, "no --health-port: the probes would find nothing"
    assert args.health_address == "0.0.0.0", "the kubelet probes the pod IP, not loopback"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    for probe, path in (("livenessProbe", LIVENESS_PATH), ("readinessProbe", READINESS_PATH)):
        get = container[probe]["httpGet"]
        assert get["path"] == path, probe
        port = ports.get(get["port"], get["port"])
        assert port == args.health_port, probe
        # The endpoint answers 503 within its own check timeout: the probe must wait longer.
        assert container[probe]["timeoutSeconds"] > CHECK_TIMEOUT_S, probe
    taken = daprd_ports(injected) | {int(pod_annotations(app)["dapr.io/app-port"])}
    assert not taken & {args.health_port, args.metrics_port}, "a port daprd or the app already uses"


def test_graceful_stop_fits_the_termination_grace(app: dict[str, Any]) -> None:
    args = serve_args(component_container(app))
    assert args.grace < pod(app)["terminationGracePeriodSeconds"]


def test_component_container_waits_for_its_socket_before_daprd_starts(app: dict[str, Any]) -> None:
    container = component_container(app)
    # The injector appends daprd after these (a native sidecar would start before them all).
    assert pod_annotations(app).get("dapr.io/enable-native-sidecar", "false") == "false"
    hook = container["lifecycle"]["postStart"]["exec"]["command"]
    assert Path(SOCKET_NAME).name in " ".join(hook)
    assert SOCKETS_FOLDER_ENV in " ".join(hook)


def test_post_start_hook_returns_once_the_socket_is_there(app: dict[str, Any], tmp_path: Path) -> None:
    hook = component_container(app)["lifecycle"]["postStart"]["exec"]["command"]
    assert hook[0] == "python"  # the image's venv python is first on its PATH
    env = {**os.environ, SOCKETS_FOLDER_ENV: str(tmp_path)}
    runner = subprocess.Popen([sys.executable, *hook[1:]], env=env)
    try:
        time.sleep(0.5)
        assert runner.poll() is None, "returned before the socket existed"
        with socket.socket(socket.AF_UNIX) as server:
            server.bind(str(tmp_path / SOCKET_NAME))
            assert runner.wait(timeout=10) == 0
    finally:
        if runner.poll() is None:
            runner.kill()


def test_component_subscription_and_resiliency_are_scoped_to_the_app(app: dict[str, Any]) -> None:
    docs = resources()
    app_id = pod_annotations(app)["dapr.io/app-id"]
    component = one(docs, "Component", "delayed")
    assert component["scopes"] == [app_id]
    meta = {m["name"]: m.get("value") for m in component["spec"]["metadata"]}
    assert meta["enableDelayedMessaging"] == "true"
    redis_service = one(docs, "Service", "redis")
    assert meta["redisHost"] == f"redis:{redis_service['spec']['ports'][0]['port']}"
    subscription = one(docs, "Subscription")
    assert subscription["spec"]["pubsubname"] == "delayed"
    assert subscription["scopes"] == [app_id]
    resiliency = one(docs, "Resiliency")
    assert set(resiliency["spec"]["targets"]["components"]) == {"delayed"}
    assert resiliency["scopes"] == [app_id]


def app_routes(app: dict[str, Any]) -> set[str]:
    """The routes examples/subscriber.py serves for the app container's --sub flags."""
    container = next(c for c in pod(app)["containers"] if c["name"] == pod_annotations(app)["dapr.io/app-id"])
    routes = set()
    for arg in container["command"]:
        if arg.startswith("--sub="):
            pubsub, topic = arg.removeprefix("--sub=").split(":")[0].split("=", 1)
            routes.add(f"/events/{pubsub}/{topic}")
    return routes


def test_subscriptions_route_to_paths_the_app_serves(app: dict[str, Any]) -> None:
    container = next(c for c in pod(app)["containers"] if c["name"] == "orders-app")
    assert container["command"][:2] == ["python", "/app/subscriber.py"]
    assert str(container["ports"][0]["containerPort"]) == pod_annotations(app)["dapr.io/app-port"]
    assert f"--port={pod_annotations(app)['dapr.io/app-port']}" in container["command"]
    for folder in (DEPLOY, DEPLOY / "fastpath"):
        subscription = one(resources(folder), "Subscription")
        assert subscription["spec"]["routes"]["default"] in app_routes(app), folder


def test_fast_path_subscribes_through_pubsub_redis_on_the_same_redis(app: dict[str, Any]) -> None:
    main, fast = resources(), resources(DEPLOY / "fastpath")
    delayed = {m["name"]: m.get("value") for m in one(main, "Component", "delayed")["spec"]["metadata"]}
    builtin = one(fast, "Component")
    meta = {m["name"]: m.get("value") for m in builtin["spec"]["metadata"]}
    assert builtin["spec"]["type"] == "pubsub.redis"
    for key in ("redisHost", "redisDB", "consumerID"):
        assert meta.get(key) == delayed.get(key), key
    assert builtin["scopes"] == one(main, "Component", "delayed")["scopes"]
    sub, fast_sub = one(main, "Subscription"), one(fast, "Subscription")
    # Same name: applying the fast path replaces the subscription instead of adding a second
    # consumer of the same consumer group.
    assert fast_sub["metadata"]["name"] == sub["metadata"]["name"]
    assert fast_sub["spec"]["topic"] == sub["spec"]["topic"]
    assert fast_sub["spec"]["pubsubname"] == builtin["metadata"]["name"]


def test_docs_walkthrough_applies_these_manifests() -> None:
    text = (REPO / "docs" / "kubernetes.md").read_text()
    commands = [
        shlex.split(line.strip()) for line in text.splitlines() if line.strip().startswith("kubectl ")
    ]
    applied = {c[c.index("-f") + 1] for c in commands if c[1] == "apply" and "-f" in c}
    assert {"deploy/kubernetes/", "deploy/kubernetes/fastpath/"} <= applied
    assert "docker build -t dapr-delayed-pubsub:latest ." in text
