"""delayed-pending and delayed-history as batch sources, on data from the real component and Redis."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import redis

from delayed_middleware.envelope import Envelope, encode_envelope
from delayed_middleware.keys import EngineKeys, delayed_topic
from tests.components.driver import Component
from tests.components.spark import workload as w
from tests.components.spark.conftest import APP
from tests.components.spark.envelopes import extended_envelope
from tests.redis_server import free_port


def load(spark: Any, source: str, options: dict[str, str], **extra: str) -> Any:
    return spark.read.format(source).options(**options, **extra).load()


async def test_pending_rows_from_the_component(
    spark: Any,
    component: Callable[[str], Component],
    props: dict[str, str],
    redis_client: redis.Redis,
    options: dict[str, str],
) -> None:
    await w.publish_workload(component, props, redis_client)
    df = load(spark, "delayed-pending", options, numPartitions="3")
    assert df.rdd.getNumPartitions() == 3
    rows = df.collect()
    # What fired left the delayed topic; exactly the 50 waiting ones remain, once each.
    assert len(rows) == w.WAITING
    assert len({r["stream_id"] for r in rows}) == w.WAITING
    assert {(r["topic"], r["status"], r["kind"], r["delayed_topic"]) for r in rows} == {
        (w.WAIT_TOPIC, "pending", "oneshot", f"{APP}-delayed")
    }
    for r in rows:
        waited_ms = (r["due_at"] - r["scheduled_at"]).total_seconds() * 1000
        # due = the component's now + 1 h; scheduled_at is read a moment later.
        assert w.WAIT_MS - 50 <= waited_ms <= w.WAIT_MS
        assert r["id"] == r["stream_id"]  # no scheduleId given
        assert r["pubsub_name"] == "delayed"
    assert sum(r["size_bytes"] for r in rows) == sum(len(b'{"n": %d}' % i) for i in range(w.WAITING))
    # One partition or three: the same rows.
    assert sorted(
        r["stream_id"] for r in load(spark, "delayed-pending", options, numPartitions="1").collect()
    ) == sorted(r["stream_id"] for r in rows)


def test_recurring_due_from_ids_hash_and_parked_status(
    spark: Any, redis_client: redis.Redis, options: dict[str, str]
) -> None:
    keys = EngineKeys.for_topic(delayed_topic(APP))
    rec_id: bytes = redis_client.xadd(  # type: ignore[assignment]
        keys.stream, {"data": extended_envelope(kind=1, schedule="@every 2s"), "metadata": "{}"}
    )
    parked_id: bytes = redis_client.xadd(  # type: ignore[assignment]
        keys.stream,
        {
            "data": encode_envelope(Envelope(id="", topic="x", due_ms=7, published_at_ms=1, message=b"p")),
            "metadata": "{}",
        },
    )
    redis_client.hset(keys.ids, "rem", f"{rec_id.decode()} 1795000000000 1795000002000")
    redis_client.hset(keys.parked, parked_id, "target refused: no pubsub kafka")
    rows = {r["stream_id"]: r for r in load(spark, "delayed-pending", options).collect()}
    rec, parked = rows[rec_id.decode()], rows[parked_id.decode()]
    assert (rec["kind"], rec["schedule"], rec["status"], rec["id"]) == (
        "recurring",
        "@every 2s",
        "pending",
        "rem",
    )
    assert rec["due_at"].timestamp() * 1000 == 1795000000000
    assert rec["next_due_at"].timestamp() * 1000 == 1795000002000
    assert (parked["status"], parked["reason"]) == ("parked", "target refused: no pubsub kafka")


def test_history_rows(spark: Any, redis_client: redis.Redis, options: dict[str, str]) -> None:
    w.write_history(redis_client)
    df = load(spark, "delayed-history", options, numPartitions="2")
    total = w.FIRED + w.WAITING + w.FIRED + sum(w.COUNTS.values())
    assert df.count() == total
    fired = df.where("event = 'fired'").orderBy("lateness_ms").collect()
    assert [r["lateness_ms"] for r in fired] == list(range(w.FIRED))
    assert all(r["topic"] == w.FIRE_TOPIC and r["fired_at"] == r["at"] for r in fired)
    assert all((r["fired_at"] - r["due_at"]).total_seconds() * 1000 == r["lateness_ms"] for r in fired)
    counts = {r["event"]: r["count"] for r in df.groupBy("event").count().collect()}
    assert counts == {"scheduled": 150, "fired": 100, **w.COUNTS}
    # No row twice, none lost, whatever the split.
    assert df.select("history_id").distinct().count() == total


def test_empty_streams_read_as_empty(spark: Any, options: dict[str, str]) -> None:
    assert load(spark, "delayed-history", options).count() == 0
    assert load(spark, "delayed-pending", options).count() == 0


def test_bad_option_fails_naming_it(spark: Any, options: dict[str, str]) -> None:
    with pytest.raises(Exception, match=r"invalid option numPartitions='0'"):
        load(spark, "delayed-history", options, numPartitions="0")
    with pytest.raises(Exception, match=r"(?i)invalid option redisHots='x'.*did you mean redisHost"):
        load(spark, "delayed-pending", options, redisHots="x")


def test_unreachable_redis_names_the_address(spark: Any) -> None:
    port = free_port()
    df = load(
        spark,
        "delayed-history",
        {"redisHost": f"127.0.0.1:{port}", "consumerID": APP, "redisMaxRetries": "0"},
    )
    with pytest.raises(Exception, match=rf"redis at 127\.0\.0\.1:{port} is unreachable"):
        df.count()


def test_other_apps_and_hostile_keys_are_not_read(
    spark: Any, redis_client: redis.Redis, options: dict[str, str]
) -> None:
    # Another app's delayed topic and history, and a topic that looks like an engine key.
    other = EngineKeys.for_topic(delayed_topic("other"))
    redis_client.xadd(other.history, {"event": "fired", "topic": "z", "late": "5"})
    redis_client.xadd(other.stream, {"data": b"junk"})
    redis_client.xadd("{app1-delayed}:history-fake", {"event": "fired"})
    assert load(spark, "delayed-history", options).count() == 0
    assert load(spark, "delayed-pending", options).count() == 0
