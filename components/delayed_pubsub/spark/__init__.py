"""The Spark subscriber: the delayed topic and the lifecycle history as Spark data.

Two PySpark Python Data Sources, batch and streaming:

- ``delayed-pending``: what waits on ``<consumerID>-delayed`` (one row per envelope);
- ``delayed-history``: what happened, from ``{<consumerID>-delayed}:history``.

::

    from delayed_pubsub.spark import register
    register(spark)
    df = spark.read.format("delayed-history").option("redisHost", "localhost:6379") \\
        .option("consumerID", "myapp").load()

and ``delayed-pubsub stats`` built on them. Everything here needs the ``[spark]``
extra (pyspark, pyarrow, pandas, matplotlib); this package itself imports none of
it, so the rest of the component works without it, and a missing extra is one
clear ImportError (``require_extra``) instead of a stack of them.
"""

from __future__ import annotations

import importlib.util
from typing import Any

__all__ = ["SPARK_EXTRA_MODULES", "register", "require_extra"]

# Import name -> distribution name, for the message.
SPARK_EXTRA_MODULES = {
    "pyspark": "pyspark",
    "pyarrow": "pyarrow",
    "pandas": "pandas",
    "matplotlib": "matplotlib",
}


def require_extra() -> None:
    """Raise ImportError naming what is missing and how to install it (python-sdk's habit)."""
    missing = [dist for mod, dist in SPARK_EXTRA_MODULES.items() if importlib.util.find_spec(mod) is None]
    if missing:
        raise ImportError(
            f"the Spark subscriber needs {', '.join(missing)}: "
            "pip install '.[spark]' in a checkout of dapr-delayed-pubsub (and Java 17 for pyspark)"
        )


def register(spark: Any) -> None:
    """Register the ``delayed-pending`` and ``delayed-history`` data sources on a SparkSession."""
    require_extra()
    from delayed_pubsub.spark.datasource import register as _register

    _register(spark)
