"""PNG charts of the stats tables (matplotlib, headless).

Three files, directly in the output folder: lateness_histogram.png,
pending_by_due.png, fires_per_minute.png. A chart with no data still gets a
file, saying so, so a dashboard that embeds them never shows a broken image.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

from delayed_pubsub.spark import require_extra

require_extra()

import matplotlib  # noqa: E402
import pandas as pd  # noqa: E402

matplotlib.use("Agg")  # no display on servers; set before pyplot is imported

import matplotlib.pyplot as plt  # noqa: E402

from delayed_pubsub.spark.stats import StatsTables  # noqa: E402
from delayed_pubsub.terminal import printable  # noqa: E402

LATENESS_PNG: Final = "lateness_histogram.png"
PENDING_PNG: Final = "pending_by_due.png"
FIRES_PNG: Final = "fires_per_minute.png"
_SIZE: Final = (7.0, 3.6)
_DPI: Final = 100


def chart_text(text: str) -> str:
    """A name from Redis (topic, app id) as chart text: shown as written. Unprintable characters
    are escaped as the printed tables escape them, and `$` is escaped, else matplotlib reads
    `$...$` as mathtext and a topic such as `a$x^{$` fails the whole chart."""
    return printable(text).replace("$", r"\$")


def write_charts(stats: StatsTables, out_dir: Path, app_id: str) -> list[Path]:
    """Write the three charts into out_dir; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    app_id = chart_text(app_id)
    no_fires = "no fires in the history"
    return [
        _chart(
            out_dir / LATENESS_PNG,
            f"{app_id}: fire lateness (fired at - due)",
            stats.lateness_histogram.empty,
            no_fires,
            lambda fig, ax: _lateness(stats, fig, ax),
        ),
        _chart(
            out_dir / PENDING_PNG,
            f"{app_id}: pending messages by due time",
            stats.pending_by_due.empty,
            "nothing pending",
            lambda fig, ax: _pending(stats, fig, ax),
        ),
        _chart(
            out_dir / FIRES_PNG,
            f"{app_id}: fires per minute",
            stats.throughput.empty,
            no_fires,
            lambda fig, ax: _fires(stats, fig, ax),
        ),
    ]


def _chart(path: Path, title: str, empty: bool, empty_text: str, draw: Callable[[Any, Any], None]) -> Path:
    """One chart file: its frame and title, and either the drawing or, with no data, a note saying so."""
    fig, ax = plt.subplots(figsize=_SIZE)
    ax.set_title(title)
    if empty:
        _empty(ax, empty_text)
    else:
        draw(fig, ax)
    return _save(fig, path)


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=_DPI)
    plt.close(fig)
    return path


def _empty(ax: Any, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="grey")
    ax.set_xticks([])
    ax.set_yticks([])


def _lateness(stats: StatsTables, fig: Any, ax: Any) -> None:
    hist = stats.lateness_histogram
    widths = hist["bin_end_ms"] - hist["bin_start_ms"]
    ax.bar(hist["bin_start_ms"], hist["count"], width=0.9 * widths, align="edge", color="#4c72b0")
    fired = stats.fired_by_topic
    if not fired.empty:
        for q, style in (("lateness_p50_ms", "--"), ("lateness_p99_ms", ":")):
            # The all-topics line would need all values; mark the busiest topic's instead.
            top = fired.sort_values("fired", ascending=False).iloc[0]
            if top[q] is not None:
                ax.axvline(
                    float(top[q]),
                    color="#c44e52",
                    linestyle=style,
                    label=f"{q[9:12]} ({chart_text(str(top['topic']))})",
                )
        ax.legend(loc="upper right", fontsize=8)
    ax.set_xlabel("lateness (ms)")
    ax.set_ylabel("messages")


def _unit(width_ms: float) -> tuple[str, float]:
    for name, ms in (("days", 86_400_000), ("hours", 3_600_000), ("minutes", 60_000)):
        if width_ms >= ms:
            return name, ms
    return "seconds", 1_000


def _pending(stats: StatsTables, fig: Any, ax: Any) -> None:
    table = stats.pending_by_due
    # Relative to the moment of the stats: "due in N minutes" reads at a glance.
    start_ms = (table["due_from"].astype("int64") // 1_000_000) - stats.now_ms
    width_ms = float(((table["due_to"] - table["due_from"]).iloc[0]).total_seconds() * 1000)
    unit, unit_ms = _unit(width_ms)
    frame = table.assign(x=start_ms / unit_ms)
    pivot = frame.pivot_table(index="x", columns="topic", values="count", aggfunc="sum").fillna(0)
    bottom = None
    for topic in pivot.columns:
        ax.bar(
            pivot.index,
            pivot[topic],
            width=width_ms / unit_ms,
            align="edge",
            bottom=bottom,
            label=chart_text(str(topic)),
        )
        bottom = pivot[topic] if bottom is None else bottom + pivot[topic]
    ax.legend(loc="upper right", fontsize=8, title="topic")
    ax.set_xlabel(f"due in ({unit} from now; overdue counted in the first bar)")
    ax.set_ylabel("messages")


def _fires(stats: StatsTables, fig: Any, ax: Any) -> None:
    tp = stats.throughput
    ax.plot(tp["minute"], tp["fired"], marker="o", color="#55a868")
    first, last = tp["minute"].min(), tp["minute"].max()
    if last - first < pd.Timedelta(minutes=10):
        # A few minutes of data: matplotlib would stretch one point over years.
        ax.set_xlim(first - pd.Timedelta(minutes=5), last + pd.Timedelta(minutes=5))
    ax.set_ylim(bottom=0)
    ax.set_xlabel("minute (UTC)")
    ax.set_ylabel("fired")
    fig.autofmt_xdate()
