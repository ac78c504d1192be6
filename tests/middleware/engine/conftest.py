"""Fixtures of the engine tests: both fire paths for the promises they share."""

from __future__ import annotations

import pytest

from delayed_middleware.engine import DelayEngine

FIRE_PATHS = ("fire", "two-phase")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "both_fire_paths: run once through FIRE (one node) and once through CLAIM, APPEND and"
        " RELEASE (Redis Cluster's path): both must give users the same results",
    )


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if metafunc.definition.get_closest_marker("both_fire_paths"):
        metafunc.parametrize("fire_path", FIRE_PATHS, indirect=True)


@pytest.fixture(autouse=True)
def fire_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The fire path of a `both_fire_paths` test: on "two-phase" every engine the test builds
    fires through the two-phase path, whatever its config says. Other tests keep their own."""
    path: str = getattr(request, "param", "fire")
    if path == "two-phase":
        monkeypatch.setattr(DelayEngine, "_fire_once", DelayEngine._fire_two_phase)
    return path
