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
from delayed_pubsub.workers import MergedMetrics, cgroup_cpu_quota, default_workers, explain_default_workers

CORES = len(os.sched_getaffinity(0))


def cgroup_v2(root: Path, cpu_max: str) -> Path:
    """A cgroup v2 mount as a container sees it: cpu.max at its root."""
    (root / "cpu.max").write_text(cpu_max)
    return root


def cgroup_v1(root: Path, quota: str, period: str = "100000\n", hierarchy: str = "cpu") -> Path:
    """A cgroup v1 mount as a container sees it: the cpu controller in its own folder."""
    (root / hierarchy).mkdir()
    (root / hierarchy / "cpu.cfs_quota_us").write_text(quota)
    (root / hierarchy / "cpu.cfs_period_us").write_text(period)
    return root


@pytest.mark.parametrize(
    ("cpu_max", "quota"),
    [
        ("max 100000\n", None),  # no quota
        ("200000 100000\n", 2.0),  # a 2-CPU limit
        ("150000 100000\n", 1.5),  # 1500m
        ("50000 100000\n", 0.5),  # below one CPU
        ("garbage\n", None),  # unreadable: no quota rather than a crash
    ],
)
def test_cgroup_v2_quota_is_read_from_cpu_max(tmp_path: Path, cpu_max: str, quota: float | None) -> None:
    assert cgroup_cpu_quota(cgroup_v2(tmp_path, cpu_max)) == quota


@pytest.mark.parametrize(
    ("quota_us", "period_us", "hierarchy", "quota"),
    [
        ("-1\n", "100000\n", "cpu", None),  # no quota
        ("200000\n", "100000\n", "cpu", 2.0),
        ("150000\n", "100000\n", "cpu,cpuacct", 1.5),  # the usual combined mount
        ("25000\n", "50000\n", "cpu", 0.5),  # another period
        ("x\n", "100000\n", "cpu", None),
    ],
)
def test_cgroup_v1_quota_is_read_from_cfs_quota_and_period(
    tmp_path: Path, quota_us: str, period_us: str, hierarchy: str, quota: float | None
) -> None:
    assert cgroup_cpu_quota(cgroup_v1(tmp_path, quota_us, period_us, hierarchy)) == quota


def test_cgroup_v2_quota_wins_over_a_v1_hierarchy(tmp_path: Path) -> None:
    cgroup_v1(tmp_path, "300000\n")
    assert cgroup_cpu_quota(cgroup_v2(tmp_path, "100000 100000\n")) == 1.0


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda root: cgroup_v2(root, "max 100000\n"), max(1, CORES - 1)),
        (lambda root: cgroup_v1(root, "-1\n"), max(1, CORES - 1)),
        # A 2-CPU limit: one worker beside the gRPC process (fewer when fewer cores).
        (lambda root: cgroup_v2(root, "200000 100000\n"), 1),
        (lambda root: cgroup_v1(root, "200000\n"), 1),
        (lambda root: cgroup_v1(root, "50000\n"), 1),  # below one CPU: still one
        (lambda root: root, max(1, CORES - 1)),  # no cgroup files: the cores minus one
    ],
)
def test_default_workers_follows_cores_and_the_cgroup_quota(
    tmp_path: Path, make: Callable[[Path], Path], expected: int
) -> None:
    assert default_workers(make(tmp_path)) == expected


def test_default_workers_rounds_a_fractional_quota_up_and_caps_it_by_the_cores(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A 16-core node: the quota, not the node, decides.
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    assert default_workers(cgroup_v1(tmp_path, "250000\n")) == 2  # 2.5 CPUs -> 3 cores -> 2 workers
    assert default_workers(tmp_path / "absent") == 15
    assert explain_default_workers(tmp_path) == "2: 16 cores, cgroup CPU quota 2.5"


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
