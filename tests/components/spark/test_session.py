"""The SparkSession set-up of `delayed-pubsub stats`: environment defaults and a clean failure without Java."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from delayed_pubsub.spark.session import prepare_environment


def test_local_master_gets_our_interpreter_and_loopback() -> None:
    env: dict[str, str] = {}
    prepare_environment(env, "local[*]")
    assert env == {
        "PYSPARK_PYTHON": sys.executable,
        "PYSPARK_DRIVER_PYTHON": sys.executable,
        "SPARK_LOCAL_IP": "127.0.0.1",
    }


def test_user_settings_win_and_a_cluster_master_keeps_its_address() -> None:
    env = {"PYSPARK_PYTHON": "/opt/py", "SPARK_LOCAL_IP": "10.1.2.3"}
    prepare_environment(env, "local[2]")
    assert (env["PYSPARK_PYTHON"], env["SPARK_LOCAL_IP"]) == ("/opt/py", "10.1.2.3")
    remote: dict[str, str] = {}
    prepare_environment(remote, "spark://master:7077")
    assert "SPARK_LOCAL_IP" not in remote  # executors must reach the driver
    assert remote["PYSPARK_PYTHON"] == sys.executable


def test_without_java_stats_fails_in_one_line(tmp_path: Path) -> None:
    script = Path(sys.executable).parent / "delayed-pubsub"
    env = {k: v for k, v in os.environ.items() if k not in ("JAVA_HOME", "SPARK_HOME")}
    env["PATH"] = str(tmp_path)  # no java, no bash: Spark's launcher cannot start
    proc = subprocess.run(
        [str(script), "stats", "--redis-host", "127.0.0.1:1", "--app-id", "x"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 1
    assert "Spark did not start" in proc.stderr
    assert "Java 17" in proc.stderr
    assert "Traceback" not in proc.stderr
