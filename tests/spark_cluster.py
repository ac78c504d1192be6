"""A real Spark standalone cluster and a Spark Connect server, from pyspark's own distribution.

`StandaloneCluster` is one master and one worker (`spark-class
org.apache.spark.deploy.master.Master` / `...worker.Worker`); `ConnectServer`
is `sbin/start-connect-server.sh` in the foreground. All bind 127.0.0.1 on
private ports, keep their logs and work folders under the given folder, and are
stopped by process id. A missing Java or pyspark is an error, never a skip.

`bare_python` writes an interpreter for the workers that sees the venv's
third-party packages (pyspark, pyarrow, redis, ...) but not this project: what
a cluster without our package installed looks like, so a test proves the code
reached the workers the documented way.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import site
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping
from pathlib import Path

from tests.redis_server import free_port

START_TIMEOUT_S = 240.0  # JVM start-up on a loaded 2-core machine


def spark_home() -> Path:
    """The Spark distribution inside the pyspark wheel (bin/, sbin/, jars/)."""
    import pyspark

    home = Path(pyspark.__file__).parent
    if not (home / "bin" / "spark-class").exists():
        raise RuntimeError(
            f"pyspark at {home} has no bin/spark-class: pip install '.[spark]' in a checkout"
        )
    return home


def _java_env(folder: Path) -> dict[str, str]:
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        raise RuntimeError("java is not installed: run `make test` (it installs openjdk-17-jre-headless)")
    env = dict(os.environ)
    env.update(
        SPARK_HOME=str(spark_home()),
        SPARK_LOCAL_IP="127.0.0.1",
        SPARK_LOG_DIR=str(folder / "logs"),
        SPARK_PID_DIR=str(folder / "pids"),
        SPARK_WORKER_DIR=str(folder / "work"),
        SPARK_LOCAL_DIRS=str(folder / "tmp"),
        # Spark's own log4j2 defaults (INFO to the log files above).
        SPARK_CONF_DIR=str(folder / "conf"),
    )
    for sub in ("logs", "pids", "work", "tmp", "conf"):
        (folder / sub).mkdir(parents=True, exist_ok=True)
    return env


def _stop(proc: subprocess.Popen[bytes] | None) -> None:
    """SIGTERM the process group we started (the JVM and any shell in front of it), then SIGKILL."""
    if proc is None or proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _wait(what: str, proc: subprocess.Popen[bytes], check: object, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}: {log.read_text()[-3000:]}")
        try:
            if check():  # type: ignore[operator]
                return
        except (OSError, ValueError):
            # Not listening yet, or (ValueError) its web UI answering before its JSON page
            # is served: a CI run failed on `Expecting value` the second the master came up.
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{what} not up within {START_TIMEOUT_S}s: {log.read_text()[-3000:]}")


class StandaloneCluster:
    """One standalone master and one worker with `cores` cores, on loopback."""

    def __init__(self, folder: Path, cores: int = 2, memory: str = "2g") -> None:
        self.folder = folder
        self.cores = cores
        self.memory = memory
        self.port = free_port()
        self.ui_port = free_port()
        self._master: subprocess.Popen[bytes] | None = None
        self._worker: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"spark://127.0.0.1:{self.port}"

    def _spawn(self, name: str, args: list[str], env: Mapping[str, str]) -> subprocess.Popen[bytes]:
        log = self.folder / f"{name}.log"
        return subprocess.Popen(
            [str(spark_home() / "bin" / "spark-class"), *args],
            stdout=log.open("wb"),
            stderr=subprocess.STDOUT,
            env=dict(env),
            start_new_session=True,
        )

    def state(self) -> dict[str, object]:
        """The master's status page as JSON (workers, running applications)."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.ui_port}/json/", timeout=5) as r:
            return dict(json.loads(r.read()))

    def alive_workers(self) -> int:
        workers = self.state().get("workers", [])
        assert isinstance(workers, list)
        return sum(1 for w in workers if isinstance(w, dict) and w.get("state") == "ALIVE")

    def start(self) -> None:
        env = _java_env(self.folder)
        self._master = self._spawn(
            "master",
            [
                "org.apache.spark.deploy.master.Master",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--webui-port",
                str(self.ui_port),
            ],
            env,
        )
        _wait("spark master", self._master, lambda: self.state() is not None, self.folder / "master.log")
        self._worker = self._spawn(
            "worker",
            [
                "org.apache.spark.deploy.worker.Worker",
                "--host",
                "127.0.0.1",
                "--port",
                str(free_port()),
                "--webui-port",
                str(free_port()),
                "--cores",
                str(self.cores),
                "--memory",
                self.memory,
                "--work-dir",
                str(self.folder / "work"),
                self.url,
            ],
            env,
        )
        _wait("spark worker", self._worker, lambda: self.alive_workers() >= 1, self.folder / "worker.log")

    def stop(self) -> None:
        _stop(self._worker)
        _stop(self._master)


class ConnectServer:
    """`start-connect-server.sh --wait` on loopback, its driver on `master`, its Python workers `python`."""

    def __init__(self, folder: Path, master: str, python: str = sys.executable) -> None:
        self.folder = folder
        self.master = master
        self.python = python
        self.port = free_port()
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"sc://127.0.0.1:{self.port}"

    def _listening(self) -> bool:
        with socket.create_connection(("127.0.0.1", self.port), timeout=1):
            return True

    def start(self) -> None:
        env = _java_env(self.folder)
        env["PYSPARK_PYTHON"] = self.python
        log = self.folder / "connect.log"
        self._proc = subprocess.Popen(
            [
                str(spark_home() / "sbin" / "start-connect-server.sh"),
                "--wait",
                "--master",
                self.master,
                "--conf",
                "spark.connect.grpc.binding.address=127.0.0.1",
                "--conf",
                f"spark.connect.grpc.binding.port={self.port}",
                "--conf",
                "spark.ui.enabled=false",
                "--conf",
                f"spark.pyspark.python={self.python}",
            ],
            stdout=log.open("wb"),
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        _wait("spark connect server", self._proc, self._listening, log)

    def stop(self) -> None:
        _stop(self._proc)


def bare_python(folder: Path) -> Path:
    """An interpreter for Spark's Python workers that imports the venv's third-party packages but
    not this project (its editable install is a .pth hook, which `-S` leaves out)."""
    script = folder / "python-without-delayed-pubsub"
    paths = os.pathsep.join(site.getsitepackages())
    script.write_text(
        "#!/bin/sh\n"
        "# site-packages on the path, its .pth hooks (our editable install) not run.\n"
        f'PYTHONPATH="{paths}${{PYTHONPATH:+:$PYTHONPATH}}" exec "{sys.executable}" -S "$@"\n'
    )
    script.chmod(0o755)
    return script
