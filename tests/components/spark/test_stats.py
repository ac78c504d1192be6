"""`delayed-pubsub stats` on the known workload: exact figures, Parquet tables, PNG charts."""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import redis

from delayed_middleware.history import HistoryRecord
from delayed_pubsub.cli import build_parser
from delayed_pubsub.component_file import ComponentFileError
from delayed_pubsub.spark.charts import FIRES_PNG, LATENESS_PNG, PENDING_PNG
from delayed_pubsub.spark.cli import component_metadata, run
from tests.components.driver import Component, cli
from tests.components.spark import workload as w
from tests.components.spark.conftest import APP, add_history, fired
from tests.redis_server import RedisServer, free_port

STARTUP_S = 240  # a CLI process starts its own Spark: slow on a loaded 2-core machine
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def stats_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["stats", *argv])


async def test_stats_figures_tables_and_charts(
    spark: Any,
    component: Callable[[str], Component],
    props: dict[str, str],
    redis_client: redis.Redis,
    redis_server: RedisServer,
    tmp_path: Path,
) -> None:
    await w.publish_workload(component, props, redis_client)
    w.write_other_events(redis_client)
    # What the engine recorded for the real fires: the figures Spark must reproduce.
    check_stats_on_workload(redis_server, tmp_path, w.real_fired(redis_client))


def check_stats_on_workload(redis_server: RedisServer, tmp_path: Path, real: list[HistoryRecord]) -> None:
    lateness = np.array([r.lateness_ms for r in real], dtype=float)
    per_minute = Counter(r.at_ms // 60_000 * 60_000 for r in real)
    out = io.StringIO()
    # The shared session is running: the command's getOrCreate() reuses it.
    code = run(
        stats_args("--redis-host", f"127.0.0.1:{redis_server.port}", "--app-id", APP, "--out", str(tmp_path)),
        out,
    )
    assert code == 0
    text = out.getvalue()
    assert f"stats for app '{APP}'" in text
    assert "cancelled 3, expired 2, retried 4, deadlettered 1" in text

    tables = {p.stem: pd.read_parquet(p) for p in tmp_path.glob("*.parquet")}
    assert set(tables) == {
        "pending_by_topic",
        "pending_by_window",
        "fired_by_topic",
        "throughput",
        "events",
        "lateness_histogram",
        "pending_by_due",
        "malformed",
    }
    pending = tables["pending_by_topic"].set_index("topic")
    assert list(pending.index) == [w.WAIT_TOPIC]
    assert pending.loc[w.WAIT_TOPIC, "pending"] == w.WAITING
    assert pending.loc[w.WAIT_TOPIC, "parked"] == 0
    window = tables["pending_by_window"].set_index("topic").loc[w.WAIT_TOPIC]
    assert (window["next_minute"], window["next_hour"], window["next_day"], window["later"]) == (
        0,
        w.WAITING,
        0,
        0,
    )

    fired = tables["fired_by_topic"].set_index("topic").loc[w.FIRE_TOPIC]
    assert fired["fired"] == w.FIRED
    assert len(real) == w.FIRED
    # Exact percentiles with linear interpolation, as numpy's default.
    assert fired["lateness_p50_ms"] == pytest.approx(np.percentile(lateness, 50))
    assert fired["lateness_p95_ms"] == pytest.approx(np.percentile(lateness, 95))
    assert fired["lateness_p99_ms"] == pytest.approx(np.percentile(lateness, 99))
    assert fired["lateness_max_ms"] == lateness.max()
    assert list(tables["throughput"]["fired"]) == [per_minute[m] for m in sorted(per_minute)]
    assert [t.value // 1_000_000 for t in tables["throughput"]["minute"]] == sorted(per_minute)
    events = dict(zip(tables["events"]["event"], tables["events"]["count"], strict=True))
    assert {k: events[k] for k in w.COUNTS} == w.COUNTS
    assert events["fired"] == w.FIRED
    assert events["scheduled"] == w.FIRED + w.WAITING
    assert tables["lateness_histogram"]["count"].sum() == w.FIRED
    assert tables["pending_by_due"]["count"].sum() == w.WAITING

    # The printed table says the same.
    fired_line = next(line for line in text.splitlines() if line.strip().startswith(f"{w.FIRE_TOPIC} "))
    cells = fired_line.split()
    assert cells[:2] == [w.FIRE_TOPIC, "100"]
    assert float(cells[2]) == pytest.approx(np.percentile(lateness, 50), abs=0.06)
    assert float(cells[5]) == lateness.max()

    # Bars and lines are drawn in colour; an empty chart holds only grey text. Real
    # fires may all land in one minute: that chart is then a single marker.
    for name, least in ((LATENESS_PNG, 150), (PENDING_PNG, 150), (FIRES_PNG, 30)):
        path = tmp_path / name
        assert path.read_bytes().startswith(PNG_MAGIC), name
        assert coloured_pixels(path) > least, name


def coloured_pixels(path: Path) -> int:
    """Pixels whose channels differ (not white, black or grey)."""
    import matplotlib.image

    rgb = matplotlib.image.imread(str(path))[..., :3]
    return int(((rgb.max(axis=-1) - rgb.min(axis=-1)) > 0.2).sum())


def test_stats_on_nothing_prints_empty_tables_and_charts(
    spark: Any, options: dict[str, str], tmp_path: Path
) -> None:
    out = io.StringIO()
    assert (
        run(
            stats_args("--redis-host", options["redisHost"], "--app-id", "nobody", "--out", str(tmp_path)),
            out,
        )
        == 0
    )
    assert "(none)" in out.getvalue()
    for name in (LATENESS_PNG, PENDING_PNG, FIRES_PNG):
        assert (tmp_path / name).read_bytes().startswith(PNG_MAGIC)
        assert coloured_pixels(tmp_path / name) < 50  # "no data" said in grey, no bars


def test_stats_errors_are_one_line(spark: Any, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert run(stats_args("--app-id", APP), io.StringIO()) == 2
    assert "give --redis-host" in capsys.readouterr().err
    port = free_port()
    assert run(stats_args("--redis-host", f"127.0.0.1:{port}", "--app-id", APP), io.StringIO()) == 1
    err = capsys.readouterr().err
    assert f"redis at 127.0.0.1:{port} is unreachable" in err
    assert "Traceback" not in err


def test_component_yaml(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(
        """
apiVersion: dapr.io/v1alpha1
kind: Component
metadata: {name: delayed}
spec:
  type: pubsub.delayed-pubsub
  version: v1
  metadata:
    - {name: redisHost, value: "10.0.0.5:6380"}
    - {name: redisPassword, value: "pw"}
    - {name: enableTLS, value: "true"}
    - {name: consumerID, value: "{appID}-eu"}
    - {name: someFutureKey, value: "x"}
"""
    )
    assert component_metadata(path, {}) == {
        "redisHost": "10.0.0.5:6380",
        "redisPassword": "pw",
        "enableTLS": "true",
        "consumerID": "{appID}-eu",
    }
    from delayed_pubsub.spark.cli import reader_options

    opts = reader_options(stats_args("--component", str(path), "--app-id", "shop"))
    assert opts["consumerID"] == "shop-eu"
    assert opts["redisHost"] == "10.0.0.5:6380"
    # --redis-host wins over the YAML.
    assert (
        reader_options(stats_args("--component", str(path), "--redis-host", "h:1", "--app-id", "s"))[
            "redisHost"
        ]
        == "h:1"
    )

    secret = tmp_path / "s.yaml"
    secret.write_text(
        "kind: Component\nspec:\n  type: pubsub.delayed-pubsub\n  metadata:\n"
        "    - name: redisPassword\n      secretKeyRef: {name: redis, key: pw}\n"
    )
    # A secretKeyRef comes from the environment, as the operator commands read it.
    assert component_metadata(secret, {"PW": "from-env"}) == {"redisPassword": "from-env"}
    with pytest.raises(ComponentFileError, match="set the environment variable PW or REDIS_PW"):
        component_metadata(secret, {})
    other = tmp_path / "o.yaml"
    other.write_text("kind: ConfigMap\n")
    with pytest.raises(ComponentFileError, match=r"holds no pub/sub Component"):
        component_metadata(other, {})


def test_missing_extra_is_one_clear_message() -> None:
    # The system Python has no pyspark: import our package alone (stdlib only) there.
    root = Path(__file__).resolve().parents[3]
    code = (
        f"import sys; sys.path[:0] = {json.dumps([str(root / 'components'), str(root / 'middleware')])};"
        "from delayed_pubsub.spark import require_extra; require_extra()"
    )
    proc = subprocess.run(["python3.11", "-I", "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert "ImportError: the Spark subscriber needs pyspark" in proc.stderr
    assert "pip install '.[spark]' in a checkout of dapr-delayed-pubsub" in proc.stderr


def test_stats_reads_redis_settings_from_the_component_yaml(
    spark: Any, redis_client: redis.Redis, redis_server: RedisServer, tmp_path: Path
) -> None:
    add_history(redis_client, [fired("a", 1_000, 5) for _ in range(3)], app=f"{APP}-eu")
    yaml_file = tmp_path / "delayed.yaml"
    yaml_file.write_text(
        "apiVersion: dapr.io/v1alpha1\nkind: Component\nmetadata: {name: delayed}\nspec:\n"
        "  type: pubsub.delayed-pubsub\n  version: v1\n  metadata:\n"
        f'    - {{name: redisHost, value: "{redis_server.address}"}}\n'
        '    - {name: consumerID, value: "{appID}-eu"}\n'
        '    - {name: enableDelayedMessaging, value: "true"}\n'
    )
    out = io.StringIO()
    assert run(stats_args("--component", str(yaml_file), "--app-id", APP), out) == 0
    fired_line = next(line for line in out.getvalue().splitlines() if line.strip().startswith("a "))
    assert fired_line.split()[:2] == ["a", "3"]


@pytest.mark.timeout(2 * STARTUP_S + 60)
async def test_stats_and_pending_resolve_the_same_secret_key_ref_from_the_environment(
    redis_client: redis.Redis, redis_server: RedisServer, tmp_path: Path
) -> None:
    add_history(redis_client, [fired("a", 1_000, n) for n in range(4)])
    yaml_file = tmp_path / "delayed.yaml"
    yaml_file.write_text(
        "apiVersion: dapr.io/v1alpha1\nkind: Component\nmetadata: {name: delayed}\nspec:\n"
        "  type: pubsub.delayed-pubsub\n  version: v1\n  metadata:\n"
        f'    - {{name: redisHost, value: "{redis_server.address}"}}\n'
        "    - name: redisPassword\n      secretKeyRef: {name: redis, key: redis-password}\n"
        '    - {name: enableDelayedMessaging, value: "true"}\n'
    )
    # The CLI processes start their own Spark: the venv's interpreter, loopback.
    env = {k: v for k, v in os.environ.items() if k not in ("PYSPARK_PYTHON", "SPARK_LOCAL_IP")}
    redis_client.config_set("requirepass", "st-s3cret")
    try:
        stats = await cli(
            "stats",
            "--component",
            str(yaml_file),
            "--app-id",
            APP,
            env={**env, "REDIS_PASSWORD": "st-s3cret"},
            within=STARTUP_S,
        )
        assert stats.code == 0, stats.err[-2000:]
        fired_line = next(line for line in stats.out.splitlines() if line.strip().startswith("a "))
        assert fired_line.split()[:2] == ["a", "4"]
        pending = await cli(
            "pending",
            "--component",
            str(yaml_file),
            "--app-id",
            APP,
            "--json",
            env={**env, "REDIS_PASSWORD": "st-s3cret"},
        )
        assert pending.code == 0, pending.err

        # Without the variable both refuse alike, before touching Redis (or starting Spark).
        said = "redisPassword comes from a secretKeyRef: set the environment variable REDIS_PASSWORD or REDIS_REDIS_PASSWORD"
        for command in ("stats", "pending"):
            missing = await cli(command, "--component", str(yaml_file), "--app-id", APP, env=env)
            assert missing.code == 2, (command, missing.err)
            assert said in missing.err, (command, missing.err)
            assert "Traceback" not in missing.err
    finally:
        redis_client.config_set("requirepass", "")


# Run alone, the Spark session starts inside this test: slow on a loaded 2-core machine.
@pytest.mark.timeout(STARTUP_S + 60)
async def test_stats_shows_escape_sequences_in_topic_names_as_text_in_its_tables_and_charts(
    spark: Any,
    component: Callable[[str], Component],
    props: dict[str, str],
    redis_client: redis.Redis,
    redis_server: RedisServer,
    tmp_path: Path,
) -> None:
    # Retitles the terminal, rings, clears the screen; `$x^{$` is broken mathtext for matplotlib.
    evil = "\x1b]0;pwned\x07orders\x1b[2J$x^{$"
    c = component("delayed")
    await c.init({**props, "enableDelayedMessaging": "true"})
    await c.publish(evil, b"later", {"scheduledSendDelay": "1h"})
    due = int(time.time() * 1000) - 60_000
    add_history(redis_client, [fired(evil, due + i, 5 + i, id=f"e{i}") for i in range(3)])
    out = io.StringIO()
    code = run(
        stats_args("--redis-host", f"127.0.0.1:{redis_server.port}", "--app-id", APP, "--out", str(tmp_path)),
        out,
    )
    assert code == 0
    text = out.getvalue()
    assert not any(ch in text for ch in "\x1b\x07"), repr(text)
    shown = r"\x1b]0;pwned\x07orders\x1b[2J$x^{$"
    # Pending by topic, by due window, and fired by topic each name it, escaped.
    assert sum(shown in line for line in text.splitlines()) >= 3, text
    for name in (LATENESS_PNG, PENDING_PNG, FIRES_PNG):
        assert (tmp_path / name).read_bytes().startswith(PNG_MAGIC)
        assert coloured_pixels(tmp_path / name) > 50


# Run alone, the Spark session starts inside this test: slow on a loaded 2-core machine.
@pytest.mark.timeout(STARTUP_S + 60)
def test_stats_takes_the_redis_password_from_the_flag_or_the_environment_as_pending_does(
    spark: Any,
    redis_client: redis.Redis,
    redis_server: RedisServer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from delayed_pubsub.redis_flags import PASSWORD_ENV

    add_history(redis_client, [fired("a", 1_000, n) for n in range(2)])
    base = ("--redis-host", redis_server.address, "--app-id", APP)
    redis_client.config_set("requirepass", "st-flag-pw")
    try:
        out = io.StringIO()
        assert run(stats_args(*base, "--redis-password", "st-flag-pw"), out) == 0
        assert next(line for line in out.getvalue().splitlines() if line.strip().startswith("a ")).split()[
            :2
        ] == ["a", "2"]
        monkeypatch.setenv(PASSWORD_ENV, "st-flag-pw")
        out = io.StringIO()
        assert run(stats_args(*base), out) == 0
        assert "a " in out.getvalue()
    finally:
        redis_client.config_set("requirepass", "")
