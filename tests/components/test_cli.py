"""The `delayed-pubsub` command line itself, run as a real process."""

from __future__ import annotations

import tomllib
from pathlib import Path

from tests.components.driver import cli

ROOT = Path(__file__).resolve().parents[2]


async def test_version_prints_the_version_pyproject_declares_and_its_storage_formats() -> None:
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]

    result = await cli("--version")

    assert result.code == 0, result.err
    assert result.out.strip() == f"delayed-pubsub {declared} (storage format 3; reads formats 1 to 3)"
