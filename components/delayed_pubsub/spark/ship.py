"""Shipping this package's code to a Spark cluster's Python workers.

The data sources run their readers in Python workers: on the executors and, for
planning, beside the driver (on a Spark Connect server, beside the server). Those
must import `delayed_pubsub` at the very version the driver runs. Spark's
documented way for pure-Python code is a zip on the workers' `sys.path`:
`spark.submit.pyFiles` (what `spark-submit --py-files` sets) for a classic
session, `SparkSession.addArtifacts(..., pyfile=True)` over Spark Connect. The
zip holds our three import packages only (the generated protobuf stubs, the
middleware and the component), a few hundred kB.

Third-party packages with native code (pyarrow, pandas, redis' hiredis,
protobuf) cannot be imported from a zip: they must be installed in the workers'
Python, or shipped as a packed environment with `spark.archives` (see
docs/analytics.md).
"""

from __future__ import annotations

import hashlib
import importlib.util
import io
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

# The import packages of this distribution (pyproject's packages.find), in import order.
PACKAGES: Final = ("delayed_pubsub_pb", "delayed_middleware", "delayed_pubsub")
_SKIP_DIRS: Final = frozenset({"__pycache__"})
_SKIP_SUFFIXES: Final = (".pyc", ".pyo")
# Fixed timestamp: the same sources give the same bytes, so the same file name.
_ZIP_TIME: Final = (2020, 1, 1, 0, 0, 0)


def _package_files(package: str) -> Iterator[tuple[str, Path]]:
    """(name inside the zip, file) for every file of an import package."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"cannot find the package {package} to ship to the Spark workers")
    for location in spec.submodule_search_locations:
        root = Path(location)
        for path in sorted(root.rglob("*")):
            rel = path.relative_to(root)
            if path.is_dir() or _SKIP_DIRS.intersection(rel.parts) or path.name.endswith(_SKIP_SUFFIXES):
                continue
            yield f"{package}/{rel.as_posix()}", path


def package_zip(folder: Path | None = None) -> Path:
    """Write the zip of our packages into `folder` (a new temporary folder if None) and return it.

    The file is named by a hash of its content (`delayed_pubsub-<hash>.zip`):
    Spark Connect keys artifacts by name, so a changed package never collides
    with one a long-lived server already holds.
    """
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for package in PACKAGES:
            for name, path in _package_files(package):
                info = zipfile.ZipInfo(name, date_time=_ZIP_TIME)
                info.compress_type = zipfile.ZIP_DEFLATED
                zf.writestr(info, path.read_bytes())
    data = buf.getvalue()
    folder = folder if folder is not None else Path(tempfile.mkdtemp(prefix="delayed-pubsub-ship-"))
    out = folder / f"delayed_pubsub-{hashlib.sha256(data).hexdigest()[:16]}.zip"
    out.write_bytes(data)
    return out


def is_connect(spark: Any) -> bool:
    """True for a Spark Connect session (pyspark.sql.connect), False for a classic one."""
    return type(spark).__module__.startswith("pyspark.sql.connect")


def ship_to_connect(spark: Any, zip_path: Path) -> None:
    """Put the zip on the Connect server's Python workers' path (a session-scoped artifact)."""
    spark.addArtifacts(str(zip_path), pyfile=True)
