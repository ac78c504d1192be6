"""A SparkSession for `delayed-pubsub stats`: quiet, on loopback, with our interpreter on the workers.

Run from a virtual environment that is not activated, Spark would start its
Python workers with whatever `python3` is on PATH (without pyspark or this
package) and bind the driver to the machine's first non-loopback address: both
are set here when the user has not set them.
"""

from __future__ import annotations

import atexit
import os
import sys
import tempfile
import threading
from collections.abc import Mapping, MutableMapping
from pathlib import Path
from typing import Any, Final, TextIO

from delayed_pubsub.spark import require_extra

# Spark's own start-up chatter (native-hadoop, default profile, ...) reaches stderr
# before any setLogLevel could run: only errors get through this config. (The
# JVM's own "Using incubator modules" line is not log4j's and stays.)
_LOG4J2 = """\
# Spark prints "Setting default log level" unless its shell logger (one of
# org.apache.spark's, WARN when not configured) has root's level: both error.
rootLogger.level = error
rootLogger.appenderRef.stderr.ref = console
appender.console.type = Console
appender.console.name = console
appender.console.target = SYSTEM_ERR
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = %d{HH:mm:ss} %p %c{1}: %m%n
logger.spark.name = org.apache.spark
logger.spark.level = error
logger.hadoop.name = org.apache.hadoop
logger.hadoop.level = error
logger.sparkproject.name = org.sparkproject
logger.sparkproject.level = error
"""


def prepare_environment(env: MutableMapping[str, str], master: str = "local[*]") -> None:
    """Set PYSPARK_PYTHON (this interpreter) and, for a local master, SPARK_LOCAL_IP (loopback) when unset.

    A cluster's executors must reach the driver, so with a remote master the
    driver keeps Spark's own choice of address (or the user's SPARK_LOCAL_IP).
    """
    env.setdefault("PYSPARK_PYTHON", sys.executable)
    env.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    if master.startswith("local"):
        env.setdefault("SPARK_LOCAL_IP", "127.0.0.1")


def _log4j_file() -> Path:
    fd, name = tempfile.mkstemp(prefix="delayed-pubsub-log4j2-", suffix=".properties")
    with os.fdopen(fd, "w") as f:
        f.write(_LOG4J2)
    path = Path(name)
    atexit.register(path.unlink, missing_ok=True)
    return path


def is_local(master: str) -> bool:
    """True for an embedded master (`local`, `local[N]`, `local[*]`): nothing to ship."""
    return master == "local" or master.startswith("local[")


def build_session(
    master: str = "local[*]",
    app_name: str = "delayed-pubsub stats",
    *,
    remote: str | None = None,
    conf: Mapping[str, str] | None = None,
) -> Any:
    """A SparkSession (or the running one) with both data sources registered.

    `master` is a classic master URL; `remote` (`sc://host:port`) a Spark Connect
    server instead. `conf` are extra Spark settings (`--conf`), applied last.
    On anything but an embedded master our packages are shipped to the Python
    workers (delayed_pubsub.spark.ship): as `spark.submit.pyFiles` for a classic
    session, as a pyfile artifact over Connect.
    """
    require_extra()
    from pyspark.sql import SparkSession

    from delayed_pubsub.spark.datasource import register
    from delayed_pubsub.spark.ship import package_zip, ship_to_connect

    extra = dict(conf or {})
    if remote is not None:
        # The Connect server is the driver: its JVM, logs, UI and Python workers are its own,
        # so only the session's SQL settings are ours to set.
        builder = SparkSession.builder.remote(remote).appName(app_name)
        for key, value in {**_SQL_CONF, **extra}.items():
            builder = builder.config(key, value)
        spark = builder.getOrCreate()
        ship_to_connect(spark, package_zip())
        register(spark)
        return spark

    prepare_environment(os.environ, master)
    log4j = _log4j_file()
    builder = (
        SparkSession.builder.master(master)
        .appName(app_name)
        .config("spark.driver.extraJavaOptions", f"-Dlog4j2.configurationFile=file:{log4j}")
        .config("spark.executor.extraJavaOptions", f"-Dlog4j2.configurationFile=file:{log4j}")
        # No web UI port on the user's machine for a command-line job; our own progress line instead.
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
    )
    if not is_local(master):
        # The workers import the data sources from this zip, at the driver's version; a
        # user's own --py-files (spark.submit.pyFiles in --conf) are kept beside it.
        shipped = str(package_zip())
        theirs = extra.pop("spark.submit.pyFiles", "")
        builder = builder.config("spark.submit.pyFiles", ",".join(p for p in (theirs, shipped) if p))
    for key, value in {**_SQL_CONF, **extra}.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    register(spark)
    return spark


_SQL_CONF: Final = {
    "spark.sql.session.timeZone": "UTC",
    # The stats tables are small: 200 shuffle partitions would be 200 tiny tasks each.
    "spark.sql.shuffle.partitions": "8",
}


class Progress:
    """A one-line status on a terminal while Spark works: the phase and its stage's task counts.

    Polls Spark's status tracker from a daemon thread, redrawing one line; when
    `out` is not a terminal, each phase is written once as a plain line.
    """

    def __init__(self, spark: Any, out: TextIO = sys.stderr, interval_s: float = 0.25) -> None:
        from delayed_pubsub.spark.ship import is_connect

        # A Connect client has no SparkContext: its status line is the phase alone.
        self._tracker = None if is_connect(spark) else spark.sparkContext.statusTracker()
        self._out = out
        self._interval = interval_s
        self._phase = "starting"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._enabled = out.isatty()

    def phase(self, text: str) -> None:
        self._phase = text
        if not self._enabled:
            # Logs and pipes get one line per phase instead of a redrawn one.
            self._out.write(f"delayed-pubsub stats: {text}…\n")
            self._out.flush()

    def __enter__(self) -> Progress:
        if self._enabled:
            self._thread = threading.Thread(target=self._run, name="stats-progress", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
            self._out.write("\r\033[K")
            self._out.flush()

    def line(self) -> str:
        """The current status text (phase, then done/total tasks of the running stages)."""
        parts = [self._phase]
        if self._tracker is None:
            return self._phase
        try:
            for stage_id in self._tracker.getActiveStageIds():
                info = self._tracker.getStageInfo(stage_id)
                if info is not None:
                    parts.append(f"stage {stage_id}: {info.numCompletedTasks}/{info.numTasks} tasks")
        except Exception:  # the tracker may be gone while the session stops
            pass
        return " | ".join(parts)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self._out.write("\r\033[K" + self.line()[:150])
            self._out.flush()
