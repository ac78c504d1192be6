"""`delayed-pubsub stats` on a real standalone Spark cluster and through Spark Connect: the same
figures as the embedded local run on the same data.

The cluster's Python workers (and the Connect server's) run an interpreter that
has pyspark, pyarrow and redis but not this project: the data sources reach
them only because the command ships its packages (spark.submit.pyFiles for a
classic session, a pyfile artifact over Connect).
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import redis

from delayed_pubsub.cli import build_parser
from delayed_pubsub.spark.cli import run
from tests.components.spark.conftest import APP, add_history, fired, schedule_waiting
from tests.redis_server import RedisServer
from tests.spark_cluster import ConnectServer, StandaloneCluster

STARTUP_S = 300  # a driver (or a Connect server) and executors start on a loaded 2-core machine
FIRED_PER_TOPIC = {"t1": 700, "t2": 450, "t3": 150}
OTHER = {"cancelled": 7, "expired": 5, "retried": 11, "deadlettered": 3, "scheduled": 40}
WAITING = 3 * 200
MINUTE0 = 1_795_000_020_000 // 60_000 * 60_000


def write_data(client: redis.Redis, port: int) -> None:
    """Fires over several topics and minutes, the rarer events, and envelopes waiting for days
    (so the due windows do not depend on when each run looks)."""
    records: list[Mapping[str, Any]] = []
    for topic, n in FIRED_PER_TOPIC.items():
        records += [fired(topic, MINUTE0 + i * 1_357, (i * 37) % 1_000) for i in range(n)]
    for event, n in OTHER.items():
        records += [{"event": event, "topic": "t1", "at": MINUTE0 + i} for i in range(n)]
    add_history(client, records)
    schedule_waiting(port, rounds=3, per_round=200, due_ms=time.time_ns() // 1_000_000 + 10 * 86_400_000)


def local_reference(redis_server: RedisServer, out: Path) -> str:
    """The embedded run (the test session's local[2] Spark, reused by getOrCreate)."""
    text = io.StringIO()
    args = build_parser().parse_args(
        ["stats", "--redis-host", redis_server.address, "--app-id", APP, "--out", str(out)]
    )
    assert run(args, text) == 0
    return text.getvalue()


def stats_cli(*argv: str, worker_python: str) -> tuple[str, str]:
    """The console script as a user runs it against a cluster; (stdout, stderr)."""
    env = dict(os.environ)
    env["PYSPARK_PYTHON"] = worker_python  # the workers' Python, without this project
    env["SPARK_LOCAL_IP"] = "127.0.0.1"  # the driver binds loopback only, like the cluster
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "delayed-pubsub"), "stats", "--app-id", APP, *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=STARTUP_S + 240,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr
    return proc.stdout, proc.stderr


def assert_same_stats(local_text: str, local_out: Path, remote_text: str, remote_out: Path) -> None:
    # Line 1 is the time of the run; every figure below it must be the same.
    assert remote_text.splitlines()[1:] == local_text.splitlines()[1:]
    local = {p.stem: pd.read_parquet(p) for p in local_out.glob("*.parquet")}
    remote = {p.stem: pd.read_parquet(p) for p in remote_out.glob("*.parquet")}
    assert set(remote) == set(local)
    assert len(local) == 8
    for name, table in local.items():
        if name == "pending_by_due":
            # Its bins start at each run's "now": compare what falls in them.
            table, other = (t.groupby("topic")["count"].sum() for t in (table, remote[name]))
            pd.testing.assert_series_equal(other, table)
            continue
        pd.testing.assert_frame_equal(remote[name], table, check_dtype=False, obj=name)
    # And the figures are the data's, not two equal mistakes.
    fired_by_topic = local["fired_by_topic"].set_index("topic")["fired"].to_dict()
    assert fired_by_topic == FIRED_PER_TOPIC
    events = local["events"].set_index("event")["count"].to_dict()
    # The engine records a `scheduled` event for each envelope it stores.
    assert {e: events[e] for e in OTHER} == {**OTHER, "scheduled": OTHER["scheduled"] + WAITING}
    assert int(local["pending_by_topic"]["pending"].sum()) == WAITING
    assert int(local["pending_by_window"]["later"].sum()) == WAITING


@pytest.mark.timeout(2 * STARTUP_S + 300)
def test_stats_on_a_standalone_cluster_equal_the_local_run(
    spark: Any,
    standalone: StandaloneCluster,
    worker_python: str,
    redis_server: RedisServer,
    redis_client: redis.Redis,
    tmp_path: Path,
) -> None:
    write_data(redis_client, redis_server.port)
    local_text = local_reference(redis_server, tmp_path / "local")
    before = len(standalone.state().get("completedapps", []))  # type: ignore[arg-type]
    text, stderr = stats_cli(
        "--redis-host",
        redis_server.address,
        "--master",
        standalone.url,
        "--out",
        str(tmp_path / "cluster"),
        worker_python=worker_python,
    )
    assert f"starting Spark ({standalone.url})" in stderr
    assert_same_stats(local_text, tmp_path / "local", text, tmp_path / "cluster")
    # It ran on the cluster: the master lists one more finished application, ours.
    apps = standalone.state().get("completedapps", [])
    assert isinstance(apps, list)
    assert len(apps) == before + 1
    assert apps[-1]["name"] == "delayed-pubsub stats"


@pytest.fixture(scope="module")
def connect_server(
    standalone: StandaloneCluster, worker_python: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ConnectServer]:
    """A Spark Connect server whose driver runs on the standalone cluster."""
    server = ConnectServer(tmp_path_factory.mktemp("spark-connect"), standalone.url, python=worker_python)
    try:
        server.start()
        yield server
    finally:
        server.stop()


@pytest.mark.timeout(2 * STARTUP_S + 300)
def test_stats_through_spark_connect_equal_the_local_run(
    spark: Any,
    connect_server: ConnectServer,
    worker_python: str,
    redis_server: RedisServer,
    redis_client: redis.Redis,
    tmp_path: Path,
) -> None:
    write_data(redis_client, redis_server.port)
    local_text = local_reference(redis_server, tmp_path / "local")
    text, stderr = stats_cli(
        "--redis-host",
        redis_server.address,
        "--remote",
        connect_server.url,
        "--out",
        str(tmp_path / "connect"),
        worker_python=worker_python,
    )
    assert f"starting Spark ({connect_server.url})" in stderr
    assert_same_stats(local_text, tmp_path / "local", text, tmp_path / "connect")
