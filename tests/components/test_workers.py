"""workers.py's pure parts: how many workers by default, and how metrics of several processes merge."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import prometheus_client
import pytest
from prometheus_client import CollectorRegistry

from delayed_pubsub.cli import build_parser
from delayed_pubsub.metrics import Metrics
from delayed_pubsub.workers import MergedMetrics, default_workers


@pytest.mark.parametrize(
    ("cpu_max", "expected"),
    [
        ("max 100000\n", len(os.sched_getaffinity(0)) - 1 or 1),  # no quota: the cores minus one
        ("200000 100000\n", 1),  # a 2-CPU limit: one worker beside the gRPC process
        ("150000 100000\n", 1),  # 1.5 CPUs rounds up to 2
        ("50000 100000\n", 1),  # below one CPU: still one
    ],
)
def test_default_workers_follows_cores_and_the_cgroup_quota(
    tmp_path: Path, cpu_max: str, expected: int
) -> None:
    path = tmp_path / "cpu.max"
    path.write_text(cpu_max)
    assert default_workers(path) == min(expected, max(1, len(os.sched_getaffinity(0)) - 1))


def test_default_workers_without_a_cgroup_file_is_cores_minus_one(tmp_path: Path) -> None:
    assert default_workers(tmp_path / "absent") == max(1, len(os.sched_getaffinity(0)) - 1)


@pytest.mark.parametrize("bad", ["-1", "two", ""])
def test_workers_flag_refuses_what_is_not_a_count(bad: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--workers", bad])
    assert "--workers" in capsys.readouterr().err


def test_workers_flag_takes_zero() -> None:
    assert build_parser().parse_args(["serve", "--workers", "0"]).workers == 0


def worker_metrics(tmp_path: Path, name: str, fired: int, pending: int, lateness_s: float) -> Path:
    """The file a worker writes: its own Metrics registry in the text format."""
    m = Metrics()
    m.fired.labels("delayed").inc(fired)
    m.pending.labels("delayed").set(pending)
    m.fire_lateness.labels("delayed").observe(lateness_s)
    path = tmp_path / f"{name}.prom"
    path.write_bytes(prometheus_client.generate_latest(m.registry))
    return path


def value(registry: CollectorRegistry, name: str, labels: dict[str, str]) -> float | None:
    return registry.get_sample_value(name, labels)


def test_merged_metrics_sum_counters_and_histograms_but_never_double_count_gauges(tmp_path: Path) -> None:
    local = Metrics()
    local.published.labels("delayed", "delayed").inc(7)
    files = [
        worker_metrics(tmp_path, "w0", fired=30, pending=100, lateness_s=0.002),
        worker_metrics(tmp_path, "w1", fired=12, pending=100, lateness_s=0.004),
        tmp_path / "w2-not-written-yet.prom",
    ]
    merged = CollectorRegistry(auto_describe=False)
    merged.register(MergedMetrics(local.registry, files))
    inst = {"instance": "delayed"}
    assert value(merged, "delayed_pubsub_fired_messages_total", inst) == 42
    assert value(merged, "delayed_pubsub_published_messages_total", {**inst, "mode": "delayed"}) == 7
    assert value(merged, "delayed_pubsub_pending_messages", inst) == 100  # both workers see the same 100
    assert value(merged, "delayed_pubsub_fire_lateness_seconds_count", inst) == 2
    assert value(merged, "delayed_pubsub_fire_lateness_seconds_sum", inst) == pytest.approx(0.006)
    text = prometheus_client.generate_latest(merged).decode()
    assert "_created" not in text
    # One family per name: a scraper refuses a second TYPE line.
    types = [line for line in text.splitlines() if line.startswith("# TYPE ")]
    assert len(types) == len(set(types))


def write_worker_metrics(path: Path, m: Metrics) -> None:
    path.write_bytes(prometheus_client.generate_latest(m.registry))


@pytest.mark.parametrize("created_series", [True, False])
def test_a_restarted_workers_counters_go_on_from_where_the_dead_one_stopped(
    tmp_path: Path, request: pytest.FixtureRequest, created_series: bool
) -> None:
    # Prometheus reads any fall of a counter as a reset and counts the whole
    # value again as new work: the endpoint's counters must never fall.
    if not created_series:
        # As PROMETHEUS_DISABLE_CREATED_SERIES does: then only a fall tells a restart.
        disable: Callable[[], None] = prometheus_client.disable_created_metrics  # untyped upstream
        enable: Callable[[], None] = prometheus_client.enable_created_metrics
        disable()
        request.addfinalizer(enable)
    path = tmp_path / "metrics-0.prom"
    merged = CollectorRegistry(auto_describe=False)
    merged.register(MergedMetrics(Metrics().registry, [path]))
    inst = {"instance": "delayed"}

    first = Metrics()
    first.fired.labels("delayed").inc(500)
    first.fire_lateness.labels("delayed").observe(0.002)
    write_worker_metrics(path, first)
    assert value(merged, "delayed_pubsub_fired_messages_total", inst) == 500

    # The worker dies. By the next scrape its successor has fired more than the
    # dead one had (nothing fell, only _created moved), or less (the counter fell).
    second = Metrics()
    second.fired.labels("delayed").inc(800 if created_series else 3)
    second.fire_lateness.labels("delayed").observe(0.004)
    write_worker_metrics(path, second)
    assert value(merged, "delayed_pubsub_fired_messages_total", inst) == (1300 if created_series else 503)
    assert value(merged, "delayed_pubsub_fire_lateness_seconds_count", inst) == 2
    assert value(merged, "delayed_pubsub_fire_lateness_seconds_sum", inst) == pytest.approx(0.006)
    le = {**inst, "le": "0.005"}
    assert value(merged, "delayed_pubsub_fire_lateness_seconds_bucket", le) == 2

    second.fired.labels("delayed").inc(7)
    write_worker_metrics(path, second)
    assert value(merged, "delayed_pubsub_fired_messages_total", inst) == (1307 if created_series else 510)
