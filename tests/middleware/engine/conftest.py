"""Fixtures of the engine tests: both fire paths for the promises they share."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from delayed_middleware.engine.two_phase import TwoPhaseFire
from tests.middleware.engine.helpers import two_phase_engines

FIRE_PATHS = ("fire", "two-phase")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "both_fire_paths: run once through FIRE (one node) and once through CLAIM, APPEND and"
        " RELEASE (Redis Cluster's path): both must give users the same results",
    )
    config.addinivalue_line(
        "markers",
        "two_phase_path: run only through Redis Cluster's path (a step the single node does not have)",
    )


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if metafunc.definition.get_closest_marker("two_phase_path"):
        metafunc.parametrize("fire_path", ["two-phase"], indirect=True)
    elif metafunc.definition.get_closest_marker("both_fire_paths"):
        metafunc.parametrize("fire_path", FIRE_PATHS, indirect=True)


@pytest.fixture(autouse=True)
def fire_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The fire path of a `both_fire_paths` test: on "two-phase" every engine the test builds
    fires through the two-phase path, whatever its config says. Other tests keep their own."""
    path: str = getattr(request, "param", "fire")
    if path != "two-phase":
        yield path
        return
    built = two_phase_engines(request.module, monkeypatch)
    yield path
    # A test that built no engine through its module's DelayEngine ran the single path twice.
    assert built, f"{request.node.name} built no engine on the two-phase path"
    assert all(isinstance(e.parts.firer.path, TwoPhaseFire) for e in built)
