"""The server, its metrics, the operator CLI and the dashboard stay within the size bounds."""

from __future__ import annotations

from tests.shape import ROOT, oversized_classes, too_complex

PACKAGE = ROOT / "components" / "delayed_pubsub"
FILES = [
    PACKAGE / "server.py",
    PACKAGE / "metrics.py",
    PACKAGE / "operate.py",
    *sorted((PACKAGE / "dashboard").glob("*.py")),
]


def test_no_server_metrics_operate_or_dashboard_class_is_over_25_methods_or_450_lines() -> None:
    assert oversized_classes(FILES) == []


def test_no_server_metrics_operate_or_dashboard_function_is_over_complexity_15() -> None:
    assert too_complex(FILES) == []
