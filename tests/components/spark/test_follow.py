"""`delayed-pubsub stats --follow` as a user runs it: the console script of a venv that is not
activated, no PYSPARK_PYTHON or SPARK_LOCAL_IP in the environment, stopped with Ctrl-C."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import redis

from tests.components.spark.conftest import APP, add_history, fired
from tests.redis_server import RedisServer

STARTUP_S = 240  # Spark's start-up on a loaded 2-core machine


def _fired_on(line: str, topic: str) -> int | None:
    parts = line.split()
    if len(parts) == 6 and parts[0] == topic and parts[1].replace(",", "").isdigit():
        return int(parts[1].replace(",", ""))
    return None


@pytest.mark.timeout(STARTUP_S + 300)
def test_follow_refreshes_until_ctrl_c(
    redis_server: RedisServer, redis_client: redis.Redis, tmp_path: Path
) -> None:
    add_history(redis_client, [fired("a", 1_000, n) for n in range(20)])
    script = Path(sys.executable).parent / "delayed-pubsub"
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYSPARK_PYTHON", "PYSPARK_DRIVER_PYTHON", "SPARK_LOCAL_IP", "VIRTUAL_ENV")
    }
    env["PATH"] = "/usr/bin:/bin"  # the venv is not activated
    proc = subprocess.Popen(
        [
            str(script),
            "stats",
            "--redis-host",
            redis_server.address,
            "--app-id",
            APP,
            "--follow",
            "--out",
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    lines: queue.Queue[str] = queue.Queue()

    def pump() -> None:
        for line in proc.stdout or []:
            lines.put(line)

    threading.Thread(target=pump, daemon=True).start()
    errors: list[str] = []
    threading.Thread(target=lambda: errors.extend(proc.stderr or []), daemon=True).start()

    def wait_for_fired(n: int, within_s: float) -> None:
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            try:
                line = lines.get(timeout=1)
            except queue.Empty:
                assert proc.poll() is None, f"stats exited with {proc.returncode}: {''.join(errors)[-2000:]}"
                continue
            if _fired_on(line, "a") == n:
                return
        raise AssertionError(
            f"no refresh showing {n} fired on a within {within_s} s: {''.join(errors)[-2000:]}"
        )

    try:
        wait_for_fired(20, STARTUP_S)
        add_history(redis_client, [fired("a", 1_000, 50) for _ in range(5)])
        wait_for_fired(25, 120)
        assert (tmp_path / "fires_per_minute.png").stat().st_size > 0
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=60)
        assert code == 0, "".join(errors)[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    stderr = "".join(errors)
    assert "Traceback" not in stderr
    # Quiet: Spark's INFO/WARN chatter is not shown.
    assert " WARN " not in stderr
    assert " INFO " not in stderr
