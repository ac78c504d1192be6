"""Malformed history records: counted apart by what is wrong, never as events (rows and stats)."""

from __future__ import annotations

import io
from collections import Counter
from pathlib import Path
from typing import Any

import pandas as pd
import redis

from delayed_pubsub.cli import build_parser
from delayed_pubsub.spark.cli import run
from tests.components.spark.conftest import APP, add_history, fired, history_key
from tests.redis_server import RedisServer

DUE = 1_790_000_000_000  # 2026-09-21, a minute boundary plus change
REAL = 20

# Hand-written records of every kind of damage, each with the problem the reader must name.
# All but the event-less ones say `fired` on topic orders: read as events, they would be fires.
GOOD = {"event": "fired", "at": str(DUE + 5), "id": "bad", "topic": "orders", "due": str(DUE), "late": "5"}
MALFORMED: list[tuple[dict[bytes, bytes], str]] = [
    ({b"event": b"fired"}, "no at"),
    ({k.encode(): v.encode() for k, v in GOOD.items() if k != "event"}, "no event"),
    ({**{k.encode(): v.encode() for k, v in GOOD.items()}, b"event": b""}, "no event"),
    ({**{k.encode(): v.encode() for k, v in GOOD.items()}, b"event": b"exploded"}, "unknown event"),
    ({**{k.encode(): v.encode() for k, v in GOOD.items()}, b"at": b""}, "no at"),
    ({**{k.encode(): v.encode() for k, v in GOOD.items()}, b"at": b"yesterday"}, "at is not a time"),
    ({**{k.encode(): v.encode() for k, v in GOOD.items()}, b"at": b"0"}, "at is not a time"),
    ({**{k.encode(): v.encode() for k, v in GOOD.items()}, b"at": b"-5"}, "at is not a time"),
    ({**{k.encode(): v.encode() for k, v in GOOD.items()}, b"at": b"1.79e12"}, "at is not a time"),
    ({**{k.encode(): v.encode() for k, v in GOOD.items()}, b"at": b"[1790000000005]"}, "at is not a time"),
    ({**{k.encode(): v.encode() for k, v in GOOD.items()}, b"at": b"99999999999999999"}, "at is not a time"),
    ({**{k.encode(): v.encode() for k, v in GOOD.items()}, b"due": b"soon"}, "due is not a number"),
    ({**{k.encode(): v.encode() for k, v in GOOD.items()}, b"late": b"12.5"}, "late is not a number"),
    ({**{k.encode(): v.encode() for k, v in GOOD.items()}, b"late": b"fast"}, "late is not a number"),
    ({**{k.encode(): v.encode() for k, v in GOOD.items()}, b"size": b"true"}, "size is not a number"),
    ({**{k.encode(): v.encode() for k, v in GOOD.items()}, b"attempt": b"{}"}, "attempt is not a number"),
    ({**{k.encode(): v.encode() for k, v in GOOD.items()}, b"kind": b"weekly"}, "unknown kind"),
    ({**{k.encode(): v.encode() for k, v in GOOD.items()}, b"topic": b"ord\xffers"}, "not UTF-8"),
    ({**{k.encode(): v.encode() for k, v in GOOD.items()}, b"event": b"\xfe\xedfired"}, "not UTF-8"),
    ({b"\x00\xff": b"\x80\x81", b"event": b"\xc3\x28"}, "not UTF-8"),
]


def write_malformed(client: redis.Redis) -> None:
    for fields, _ in MALFORMED:
        client.xadd(history_key(), fields)  # type: ignore[arg-type]


def test_malformed_records_are_rows_that_say_why_and_are_no_event(
    spark: Any, options: dict[str, str], redis_client: redis.Redis
) -> None:
    add_history(redis_client, [fired("orders", DUE, late, id=f"m{late}") for late in range(REAL)])
    write_malformed(redis_client)
    rows = spark.read.format("delayed-history").options(**options).load().collect()
    assert len(rows) == REAL + len(MALFORMED)  # every record is a row: nothing hidden
    bad = [r for r in rows if r["malformed"] is not None]
    assert Counter(r["malformed"] for r in bad) == Counter(problem for _, problem in MALFORMED)
    assert all(r["event"] is None and r["fired_at"] is None for r in bad)
    # A time that is not one reads as null, never as 1970-01-01.
    assert all(r["at"] is None or r["at"].year == 2026 for r in rows)
    good = [r for r in rows if r["malformed"] is None]
    assert [r["event"] for r in good] == ["fired"] * REAL
    assert sorted(r["lateness_ms"] for r in good) == list(range(REAL))


def test_stats_count_malformed_records_apart_and_fires_only_the_real_ones(
    spark: Any, redis_server: RedisServer, redis_client: redis.Redis, tmp_path: Path
) -> None:
    add_history(redis_client, [fired("orders", DUE, late, id=f"m{late}") for late in range(REAL)])
    write_malformed(redis_client)
    out = io.StringIO()
    args = build_parser().parse_args(
        ["stats", "--redis-host", f"127.0.0.1:{redis_server.port}", "--app-id", APP, "--out", str(tmp_path)]
    )
    assert run(args, out) == 0
    tables = {p.stem: pd.read_parquet(p) for p in tmp_path.glob("*.parquet")}
    events = dict(zip(tables["events"]["event"], tables["events"]["count"], strict=True))
    assert events["fired"] == REAL
    assert sum(events.values()) == REAL
    fired_by_topic = tables["fired_by_topic"].set_index("topic")
    assert list(fired_by_topic.index) == ["orders"]
    assert fired_by_topic.loc["orders", "fired"] == REAL
    assert fired_by_topic.loc["orders", "lateness_max_ms"] == REAL - 1
    # Every fire in the minutes it happened: none bucketed at 1970.
    assert [t.year for t in tables["throughput"]["minute"]] == [2026]
    assert tables["throughput"]["fired"].sum() == REAL
    assert tables["lateness_histogram"]["count"].sum() == REAL
    malformed = dict(zip(tables["malformed"]["problem"], tables["malformed"]["count"], strict=True))
    assert malformed == dict(Counter(problem for _, problem in MALFORMED))
    text = out.getvalue()
    assert f"malformed history records (not counted as events): {len(MALFORMED)}" in text
    fired_line = next(line for line in text.splitlines() if line.strip().startswith("orders "))
    assert fired_line.split()[:2] == ["orders", str(REAL)]
    assert "at is not a time" in text
