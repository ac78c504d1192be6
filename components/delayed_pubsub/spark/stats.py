"""The stats tables of `delayed-pubsub stats`: Spark aggregations over delayed-pending and delayed-history.

Every figure is computed by Spark (so the same job scales out with `--master`);
what comes back to the driver is small: one row per topic, per event kind, per
minute or per histogram bin, as pandas DataFrames in a frozen StatsTables.

Definitions (what a user checks against):
- pending by due window: envelopes with status "pending" whose due time is at
  most one minute from now (overdue ones included), one hour, one day, or later;
  each envelope counts in exactly one window.
- lateness: the history's `late` of "fired" events (fired-at minus due, ms);
  p50/p95/p99 are exact percentiles with linear interpolation between ranks
  (numpy's default), max the largest.
- throughput: "fired" events per UTC minute of their fired-at time.
- malformed: history records that do not follow the format
  (delayed_middleware.history.record_problem), counted by what is wrong; they
  are no event, so none of the figures above counts them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Final

from delayed_pubsub.spark import require_extra

require_extra()

import pandas as pd  # noqa: E402
import pyspark.sql.functions as F  # noqa: E402
from pyspark.sql import DataFrame  # noqa: E402

from delayed_middleware.history import CANCELLED, DEAD_LETTERED, EVENTS, EXPIRED, FIRED, RETRIED  # noqa: E402
from delayed_pubsub.spark.rows import PARKED, PENDING, UNDECODABLE  # noqa: E402
from delayed_pubsub.terminal import printable  # noqa: E402

MINUTE_MS: Final = 60_000
WINDOWS: Final = (("next_minute", MINUTE_MS), ("next_hour", 3_600_000), ("next_day", 86_400_000))
LATER: Final = "later"
# The counts the summary line leads with (the "cancelled / expired / retried / dead letters").
HEADLINE_EVENTS: Final = (CANCELLED, EXPIRED, RETRIED, DEAD_LETTERED)
HISTOGRAM_BINS: Final = 40


@dataclass(frozen=True)
class StatsTables:
    """The tables, small enough for the driver; each becomes `<name>.parquet` with --out."""

    pending_by_topic: pd.DataFrame  # topic, pending, parked, undecodable, size_bytes, next_due_at
    pending_by_window: pd.DataFrame  # topic, next_minute, next_hour, next_day, later
    fired_by_topic: pd.DataFrame  # topic, fired, lateness p50/p95/p99/max (ms)
    throughput: pd.DataFrame  # minute, fired
    events: pd.DataFrame  # event, count (every known event, zeros included)
    lateness_histogram: pd.DataFrame  # bin_start_ms, bin_end_ms, count
    pending_by_due: pd.DataFrame  # due_from, due_to, topic, count
    malformed: pd.DataFrame  # problem, count (history records that do not parse)
    now_ms: int

    def tables(self) -> dict[str, pd.DataFrame]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "now_ms"}


def compute_stats(history: DataFrame, pending: DataFrame, now_ms: int) -> StatsTables:
    """All tables from a history and a pending DataFrame (as the data sources give them).

    Four Spark jobs in all (each source is read from Redis once, then cached):
    pending per topic, pending per due bin, fires per topic, and one
    grouping-sets pass for event counts, fires per minute and the lateness
    histogram.
    """
    h = history.select("event", "topic", "fired_at", "lateness_ms", "malformed").persist()
    p = pending.select("topic", "status", "due_at", "size_bytes").persist()
    try:
        per_topic = _pending_per_topic(p, now_ms)
        fired = _fired_by_topic(h)
        events, throughput, histogram, malformed = _history_breakdown(h, fired)
        return StatsTables(
            pending_by_topic=per_topic[
                ["topic", "pending", "parked", "undecodable", "size_bytes", "next_due_at"]
            ],
            pending_by_window=per_topic.loc[
                per_topic["pending"] > 0, ["topic", *(n for n, _ in WINDOWS), LATER]
            ].reset_index(drop=True),
            fired_by_topic=fired.drop(columns=["lateness_min_ms"]),
            throughput=throughput,
            events=events,
            lateness_histogram=histogram,
            pending_by_due=_pending_by_due(p, now_ms, per_topic["max_due_ms"].max()),
            malformed=malformed,
            now_ms=now_ms,
        )
    finally:
        h.unpersist()
        p.unpersist()


def _count_if(cond: Any) -> Any:
    return F.sum(F.when(cond, 1).otherwise(0)).cast("long")


def _due_ms(col: str = "due_at") -> Any:
    return F.unix_millis(F.col(col))


def _pending_per_topic(p: DataFrame, now_ms: int) -> pd.DataFrame:
    waiting = F.col("status") == PENDING
    due_in = _due_ms() - F.lit(now_ms)
    windows = []
    lower: int | None = None
    for name, upper in WINDOWS:
        cond = due_in <= upper if lower is None else (due_in > lower) & (due_in <= upper)
        windows.append(_count_if(waiting & cond).alias(name))
        lower = upper
    windows.append(_count_if(waiting & (due_in > lower)).alias(LATER))
    df = (
        p.groupBy("topic")
        .agg(
            _count_if(waiting).alias("pending"),
            _count_if(F.col("status") == PARKED).alias("parked"),
            _count_if(F.col("status") == UNDECODABLE).alias("undecodable"),
            F.sum("size_bytes").cast("long").alias("size_bytes"),
            # Times cross to the driver as epoch ms: collect() would give naive local-time datetimes.
            F.min(F.when(waiting, _due_ms())).alias("next_due_at"),
            F.max(F.when(waiting, _due_ms())).alias("max_due_ms"),
            *windows,
        )
        .orderBy("topic")
    )
    columns = ["topic", "pending", "parked", "undecodable", "size_bytes", "next_due_at", "max_due_ms"]
    out = _pandas(df, [*columns, *(n for n, _ in WINDOWS), LATER])
    out["next_due_at"] = pd.to_datetime(out["next_due_at"], unit="ms", utc=True)
    return out


def _fired_by_topic(h: DataFrame) -> pd.DataFrame:
    fired = h.where(F.col("event") == FIRED)
    pct = F.percentile(F.col("lateness_ms"), F.array(F.lit(0.5), F.lit(0.95), F.lit(0.99)))
    df = (
        fired.groupBy("topic")
        .agg(
            F.count("*").alias("fired"),
            pct.alias("pct"),
            F.max("lateness_ms").alias("lateness_max_ms"),
            F.min("lateness_ms").alias("lateness_min_ms"),
        )
        .orderBy("topic")
    )
    out = _pandas(df, ["topic", "fired", "pct", "lateness_max_ms", "lateness_min_ms"])
    for i, name in enumerate(("lateness_p50_ms", "lateness_p95_ms", "lateness_p99_ms")):
        out[name] = [None if v is None or len(v) <= i else float(v[i]) for v in out["pct"]]
    return out[
        [
            "topic",
            "fired",
            "lateness_p50_ms",
            "lateness_p95_ms",
            "lateness_p99_ms",
            "lateness_max_ms",
            "lateness_min_ms",
        ]
    ]


def _history_breakdown(
    h: DataFrame, fired: pd.DataFrame
) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """Event counts, fires per minute, the lateness histogram and the malformed records by problem,
    in one pass (grouping sets)."""
    lo = fired["lateness_min_ms"].dropna()
    hi = fired["lateness_max_ms"].dropna()
    lo_ms = int(lo.min()) if len(lo) else 0
    hi_ms = int(hi.max()) if len(hi) else 0
    width = max(1, math.ceil((hi_ms - lo_ms + 1) / HISTOGRAM_BINS))
    is_fired = F.col("event") == FIRED
    minute = F.when(
        is_fired & F.col("fired_at").isNotNull(), F.unix_millis(F.date_trunc("minute", F.col("fired_at")))
    )
    late_bin = F.when(
        is_fired & F.col("lateness_ms").isNotNull(), F.floor((F.col("lateness_ms") - lo_ms) / width)
    )
    rows = (
        h.select("event", minute.alias("minute"), late_bin.alias("bin"), "malformed")
        .groupingSets([["event"], ["minute"], ["bin"], ["malformed"]], "event", "minute", "bin", "malformed")
        .agg(F.count("*").alias("n"), F.grouping_id().alias("g"))
        .collect()
    )
    # grouping_id bits (event, minute, bin, malformed), 1 = not grouped by it.
    # A malformed record's event is null (no event): it is counted only by its problem.
    counted = {r["event"]: int(r["n"]) for r in rows if r["g"] == 0b0111 and r["event"] is not None}
    names = list(EVENTS)
    events = pd.DataFrame({"event": names, "count": [counted.get(n, 0) for n in names]})
    problems = sorted(
        (str(r["malformed"]), int(r["n"])) for r in rows if r["g"] == 0b1110 and r["malformed"] is not None
    )
    malformed = pd.DataFrame(
        {
            "problem": pd.Series([p for p, _ in problems], dtype="object"),
            "count": pd.Series([n for _, n in problems], dtype="int64"),
        }
    )
    per_minute = sorted(
        (int(r["minute"]), int(r["n"])) for r in rows if r["g"] == 0b1011 and r["minute"] is not None
    )
    throughput = pd.DataFrame(
        {
            "minute": pd.to_datetime([m for m, _ in per_minute], unit="ms", utc=True),
            "fired": pd.Series([n for _, n in per_minute], dtype="int64"),
        }
    )
    by_bin = {int(r["bin"]): int(r["n"]) for r in rows if r["g"] == 0b1101 and r["bin"] is not None}
    if not by_bin:
        histogram = pd.DataFrame({"bin_start_ms": [], "bin_end_ms": [], "count": []})
    else:
        bins = range((hi_ms - lo_ms) // width + 1)
        histogram = pd.DataFrame(
            {
                "bin_start_ms": [lo_ms + b * width for b in bins],
                "bin_end_ms": [lo_ms + (b + 1) * width for b in bins],
                "count": [by_bin.get(b, 0) for b in bins],
            }
        )
    return events, throughput, histogram, malformed


# Bin widths for the pending-by-due chart: the smallest that gives at most 60 bars.
_DUE_WIDTHS_MS: Final = (1_000, 10_000, 60_000, 600_000, 3_600_000, 21_600_000, 86_400_000, 7 * 86_400_000)


def _pending_by_due(p: DataFrame, now_ms: int, max_due_ms: Any) -> pd.DataFrame:
    if max_due_ms is None or pd.isna(max_due_ms):
        return pd.DataFrame({"due_from": [], "due_to": [], "topic": [], "count": []})
    waiting = p.where((F.col("status") == PENDING) & F.col("due_at").isNotNull())
    span = max(0, int(max_due_ms) - now_ms)
    width = next((w for w in _DUE_WIDTHS_MS if span / w <= 60), 30 * 86_400_000)
    # Overdue envelopes fall into the first bin ("due now").
    b = F.greatest(F.floor((_due_ms() - F.lit(now_ms)) / width), F.lit(0)).alias("b")
    rows = waiting.groupBy(b, "topic").count().orderBy("b", "topic").collect()
    return pd.DataFrame(
        {
            "due_from": pd.to_datetime([now_ms + int(r["b"]) * width for r in rows], unit="ms", utc=True),
            "due_to": pd.to_datetime([now_ms + (int(r["b"]) + 1) * width for r in rows], unit="ms", utc=True),
            "topic": [r["topic"] for r in rows],
            "count": [int(r["count"]) for r in rows],
        }
    )


def _pandas(df: DataFrame, columns: list[str]) -> pd.DataFrame:
    rows = df.collect()
    return pd.DataFrame([[r[c] for c in columns] for r in rows], columns=columns)


# --- output -------------------------------------------------------------------------


def write_parquet(stats: StatsTables, out_dir: Path) -> list[Path]:
    """Each table as `<out_dir>/<name>.parquet` (one file each, written on the driver)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, table in stats.tables().items():
        path = out_dir / f"{name}.parquet"
        table.to_parquet(path, index=False)
        paths.append(path)
    return paths


def _fmt(value: Any) -> str:
    if value is None or value is pd.NaT or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, pd.Timestamp) or hasattr(value, "strftime"):
        return str(value.strftime("%Y-%m-%d %H:%M:%S"))
    if isinstance(value, float):
        return f"{value:,.1f}"
    if isinstance(value, int):
        return f"{value:,}"
    # A topic name is any text a publisher chose: escape sequences are shown, not obeyed.
    return printable(str(value))


def text_table(title: str, df: pd.DataFrame, empty: str = "(none)") -> str:
    """A plain aligned text table (numbers right-aligned)."""
    lines = [title]
    if df.empty:
        return "\n".join([*lines, f"  {empty}"])
    headers = [str(c) for c in df.columns]
    cells = [[_fmt(v) for v in row] for row in df.itertuples(index=False, name=None)]
    numeric = [pd.api.types.is_numeric_dtype(df[c]) for c in df.columns]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]

    def line(values: list[str]) -> str:
        return "  " + "  ".join(
            v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric, strict=True)
        )

    lines.append(line(headers))
    lines.append("  " + "  ".join("-" * w for w in widths))
    lines.extend(line(r) for r in cells)
    return "\n".join(lines)


def render(stats: StatsTables, app_id: str, recent_minutes: int = 10) -> str:
    """The whole report as printed by `delayed-pubsub stats`."""
    now = pd.Timestamp(stats.now_ms, unit="ms", tz="UTC").strftime("%Y-%m-%d %H:%M:%S UTC")
    events = dict(zip(stats.events["event"], stats.events["count"], strict=True))
    headline = ", ".join(f"{e} {events.get(e, 0):,}" for e in HEADLINE_EVENTS)
    tp = stats.throughput
    parts = [
        f"delayed-pubsub stats for app {app_id!r} at {now}",
        text_table("pending by topic", stats.pending_by_topic),
        text_table("pending by due window (from now)", stats.pending_by_window),
        text_table("fired by topic, lateness in ms", stats.fired_by_topic),
        text_table(
            f"fires per minute (last {recent_minutes} of {len(tp)} minutes with fires)",
            tp.tail(recent_minutes),
        ),
        text_table("lifecycle events", stats.events[stats.events["count"] > 0], empty="(no history)"),
        text_table(
            f"malformed history records (not counted as events): {int(stats.malformed['count'].sum()):,}",
            stats.malformed,
        ),
        f"{headline}",
    ]
    return "\n\n".join(parts) + "\n"
