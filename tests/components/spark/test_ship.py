"""The zip `stats` ships to a Spark cluster's workers (spark/ship.py) works from the zip itself."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from delayed_pubsub.spark.ship import package_zip

# Run by a Python that has only the zip: -S leaves out site-packages (and so this checkout's
# editable install), -I the current directory and PYTHONPATH.
_PROBE = """
import sys
sys.path.insert(0, sys.argv[1])
from delayed_middleware import lua_scripts
assert lua_scripts.__file__.startswith(sys.argv[1]), lua_scripts.__file__
for text in (lua_scripts.FIRE, lua_scripts.CLAIM, lua_scripts.HIST_WALK):
    assert "redis.call" in text and "--!include" not in text
print("ok")
"""


def test_the_lua_scripts_load_from_the_shipped_zip(tmp_path: Path) -> None:
    zip_path = package_zip(tmp_path)
    probe = subprocess.run(
        [sys.executable, "-S", "-I", "-c", _PROBE, str(zip_path)], capture_output=True, text=True, timeout=60
    )
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.strip() == "ok"
