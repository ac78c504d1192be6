"""`delayed-pubsub history` as a real process: bounded by default, streamed, paged with a cursor."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

from delayed_middleware.entry import decode_entry
from delayed_middleware.history import EVENTS, Retention
from delayed_middleware.inspector import HISTORY_SLACK_MS
from delayed_middleware.instants import format_instant, parse_instant
from delayed_middleware.keys import EngineKeys, delayed_topic, shard_topics
from tests.components.conftest import history_fields, run_cli, write_history
from tests.components.driver import Component
from tests.redis_server import RedisServer, stream_entries

Factory = Callable[[str], Component]
HISTORY = EngineKeys.for_topic(delayed_topic("app1")).history
T0 = 1_790_000_000_000
LONG = 50_000
# The CLI alone (Python, redis-py, rich, protobuf) peaks near 60 MB; a history
# held in memory passes 300 MB at this length.
RSS_BOUND_MB = 120


def conn(server: RedisServer, *more: str) -> list[str]:
    return ["--redis-host", f"127.0.0.1:{server.port}", "--app-id", "app1", *more]


def long_history(client: redis.Redis, n: int = LONG) -> None:
    write_history(
        client, HISTORY, ((f"{T0 + i}-0", history_fields("scheduled", f"m{i}", T0 + i)) for i in range(n))
    )


def rows(text: str) -> list[list[str]]:
    """The data rows of the streamed table (header and the count line left out)."""
    lines = text.splitlines()
    assert lines[0].split()[:3] == ["cursor", "at", "event"], lines[0]
    assert lines[-1].endswith(" records"), lines[-1]
    return [line.split() for line in lines[1:-1]]


def test_history_by_default_shows_the_newest_100_records_in_bounded_memory(
    redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    long_history(redis_client)
    result = run_cli("history", *conn(redis_server))
    assert result.code == 0, result.err
    shown = rows(result.out)
    assert [r[3] for r in shown] == [f"m{i}" for i in range(LONG - 100, LONG)]  # the newest, oldest first
    assert shown[-1][0] == f"{T0 + LONG - 1}-0"  # each row names its cursor
    assert shown[-1][1] == format_instant(T0 + LONG - 1)
    assert result.out.splitlines()[-1] == "100 records"
    assert "newest 100" in result.err
    assert "--limit 0" in result.err
    assert result.peak_rss_mb < RSS_BOUND_MB, result.peak_rss_mb


def test_history_limit_0_json_streams_every_record_in_bounded_memory(
    redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    long_history(redis_client)
    result = run_cli("history", *conn(redis_server, "--limit", "0", "--json"))
    assert result.code == 0, result.err
    records = result.json()
    assert len(records) == LONG
    assert [r["id"] for r in records] == [f"m{i}" for i in range(LONG)]
    assert records[0] == {
        "cursor": f"{T0}-0",
        "at": format_instant(T0),
        "event": "scheduled",
        "id": "m0",
        "scheduleId": None,
        "topic": "orders",
        "kind": "oneshot",
        "due": format_instant(T0),
        "lateMs": None,
        "size": 3,
        "attempt": 1,
        "reason": "",
        "schedule": None,
        "occurrence": None,
    }
    assert result.err == ""  # stdout is the JSON, nothing else anywhere
    assert result.peak_rss_mb < RSS_BOUND_MB, result.peak_rss_mb


def test_history_pages_with_after_give_every_record_once_across_shards(
    redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    # Three shard histories whose stream ids collide (each shard numbers its
    # own): a cursor that forgot the shard would skip or repeat records.
    keys = [EngineKeys.for_topic(t).history for t in shard_topics("app1", 3)]
    layout = {
        0: ["1000-0", "1000-1", "2000-0"],
        1: ["1000-0", "1000-1", "1000-2"],
        2: ["999-5", "1000-1", "2000-0", "3000-0"],
    }
    for shard, ids in layout.items():
        write_history(
            redis_client, keys[shard], ((i, history_fields("fired", f"s{shard}-{i}", 1000)) for i in ids)
        )
    flags = conn(redis_server, "--delay-shards", "3")
    everything = run_cli("history", *flags, "--limit", "0", "--json")
    assert everything.code == 0, everything.err
    expected = sorted(
        (int(i.split("-")[0]), int(i.split("-")[1]), shard) for shard, ids in layout.items() for i in ids
    )
    assert [r["cursor"] for r in everything.json()] == [f"{ms}-{seq}@{shard}" for ms, seq, shard in expected]
    paged: list[str] = []
    after = "1970-01-01T00:00:00Z"  # a time: from the start
    for _ in range(20):
        page = run_cli("history", *flags, "--limit", "2", "--json", "--after", after)
        assert page.code == 0, page.err
        got = page.json()
        assert len(got) <= 2
        paged += [r["id"] for r in got]
        if "more records follow" not in page.err:
            break
        after = page.err.rsplit("--after ", 1)[1].strip()
        assert after == got[-1]["cursor"]
    assert paged == [r["id"] for r in everything.json()]


def test_history_after_a_time_starts_there_and_bad_paging_flags_are_refused(
    redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    write_history(
        redis_client,
        HISTORY,
        ((f"{T0 + i * 1000}-0", history_fields("fired", f"m{i}", T0)) for i in range(5)),
    )
    result = run_cli("history", *conn(redis_server, "--after", format_instant(T0 + 2000), "--json"))
    assert result.code == 0, result.err
    assert [r["id"] for r in result.json()] == ["m2", "m3", "m4"]
    after_cursor = run_cli("history", *conn(redis_server, "--after", f"{T0 + 2000}-0", "--json"))
    assert [r["id"] for r in after_cursor.json()] == ["m3", "m4"]
    for flags, named in [
        (["--after", "yesterday"], "yesterday"),
        (["--after", f"{T0}-0@3"], f"{T0}-0@3"),
        (["--limit", "-1"], "-1"),
        (["--after", "1h", "--since", "1h"], "--since"),
    ]:
        bad = run_cli("history", *conn(redis_server, *flags))
        assert bad.code == 2, (flags, bad)
        assert named in bad.err, (flags, bad.err)
        assert bad.out == ""


def test_history_piped_into_head_ends_quietly(redis_server: RedisServer, redis_client: redis.Redis) -> None:
    long_history(redis_client, 20_000)
    exe = Path(sys.executable).with_name("delayed-pubsub")
    args = " ".join(conn(redis_server, "--limit", "0"))
    done = subprocess.run(
        f"{exe} history {args} | head -n 3", shell=True, capture_output=True, text=True, timeout=120
    )
    assert len(done.stdout.splitlines()) == 3
    assert "Traceback" not in done.stderr, done.stderr
    assert "Error" not in done.stderr, done.stderr


def test_a_corrupt_history_record_is_shown_not_fatal(
    redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    redis_client.xadd(HISTORY, {b"\xff\xfe": b"\x80", b"event": b"fired", b"id": b"m\xff"}, id=f"{T0}-0")
    # A reason is an app's error text: it may try to drive the operator's terminal.
    hostile = "\x1b]0;owned\x07\x1b[2J\rdone\x9b1m"
    fields = history_fields("retried", "after", T0 + 1, reason=hostile)
    write_history(redis_client, HISTORY, [(f"{T0 + 1}-0", fields)])
    result = run_cli("history", *conn(redis_server))
    assert result.code == 0, result.err
    assert [r[3] for r in rows(result.out)] == ["m\ufffd", "after"]
    assert rows(result.out)[1][-1] == "\\x1b]0;owned\\x07\\x1b[2J\\rdone\\x9b1m"
    assert not any((ord(c) < 32 and c != "\n") or 0x7F <= ord(c) <= 0x9F for c in result.out)


def history_events(inspect_output: str, id: str) -> list[str]:
    """The events of `id` in the history table `inspect` prints."""
    cells = [line.split() for line in inspect_output.splitlines()]
    return [c[1] for c in cells if len(c) > 2 and c[1] in EVENTS and c[2] == id]


def tick_records(client: redis.Redis) -> int:
    newest: Any = client.xrevrange(HISTORY, count=50)
    return sum(fields[b"id"] == b"tick" for _, fields in newest)


def history_reads(client: redis.Redis) -> int:
    """XRANGE and XREVRANGE calls Redis has served so far."""
    stats = client.info("commandstats")
    return sum(int(stats.get(f"cmdstat_{c}", {}).get("calls", 0)) for c in ("xrange", "xrevrange"))


def write_older_records(redis_client: redis.Redis, now: int) -> None:
    """20,000 `fired` records of other messages, ten minutes before `now`."""
    write_history(
        redis_client,
        HISTORY,
        (
            (f"{now - 600_000 + i}-0", history_fields("fired", f"old{i}", now - 600_000))
            for i in range(20_000)
        ),
    )


async def test_inspect_reads_a_messages_records_by_its_time_not_the_whole_history(
    component: Factory, props: dict[str, str], redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    # 20,000 records of other messages before it and 20,000 after: a scan reads 80 pages or more.
    now = int(time.time() * 1000)
    write_older_records(redis_client, now)
    c = component("delayed")
    await c.init({**props, "enableDelayedMessaging": "true"})
    await c.publish("orders", b"v1", {"scheduledSendDelay": "1h", "scheduleId": "inv-1"})
    await c.publish("orders", b"v2", {"scheduledSendDelay": "1h", "scheduleId": "inv-1"})  # replaces v1
    await asyncio.sleep(HISTORY_SLACK_MS / 1000 + 0.5)  # the others' records come later, as in real traffic
    write_history(
        redis_client, HISTORY, (("*", history_fields("fired", f"new{i}", now)) for i in range(20_000))
    )
    before = history_reads(redis_client)
    result = run_cli("inspect", *conn(redis_server), "inv-1")
    reads = history_reads(redis_client) - before
    assert result.code == 0, result.err
    assert "v2" in result.out
    # v1's scheduling, its replacement and v2's scheduling: all written with the envelope.
    assert history_events(result.out, "inv-1") == ["scheduled", "replaced", "scheduled"], result.out
    assert reads <= 5, reads

    # A recurring message has records after its scheduling: read back from the newest, down to it.
    await asyncio.sleep(HISTORY_SLACK_MS / 1000 + 0.5)
    await c.publish("orders", b"tick", {"schedule": "@every 1s", "scheduleId": "tick"})
    deadline = time.monotonic() + 30
    while tick_records(redis_client) < 4:
        assert time.monotonic() < deadline, "the schedule did not fire 3 times within 30 s"
        await asyncio.sleep(0.2)
    before = history_reads(redis_client)
    shown = run_cli("inspect", *conn(redis_server), "tick")
    reads = history_reads(redis_client) - before
    assert shown.code == 0, shown.err
    ticks = history_events(shown.out, "tick")
    assert ticks[0] == "scheduled", shown.out
    assert ticks.count("fired") >= 3, shown.out
    assert reads <= 5, reads


async def test_history_of_an_envelope_id_reads_from_its_own_time_on(
    component: Factory, props: dict[str, str], redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    # 20,000 records of messages before it: nothing about it can be among them.
    now = int(time.time() * 1000)
    write_older_records(redis_client, now)
    c = component("delayed")
    await c.init({**props, "enableDelayedMessaging": "true"})
    await c.publish("orders", b"x", {"scheduledSendDelay": "1h"})
    entries: Any = redis_client.xrange("app1-delayed")
    [(envelope, _)] = entries
    id = envelope.decode()
    assert run_cli("cancel", *conn(redis_server), id).code == 0
    for flags in ([], ["--limit", "0"]):
        before = history_reads(redis_client)
        result = run_cli("history", *conn(redis_server, "--id", id, "--json", *flags))
        reads = history_reads(redis_client) - before
        assert result.code == 0, result.err
        assert [r["event"] for r in result.json()] == ["scheduled", "cancelled"], flags
        assert reads <= 5, (flags, reads)


def write_indexed_records(redis_client: redis.Redis, n: int = 20_000) -> None:
    """`n` records of other scheduleIds, written as the retrier and the forwarder write them (linked
    into the by-id index)."""
    retention = Retention()
    now = int(time.time() * 1000)
    for start in range(0, n, 2_000):
        pipe = redis_client.pipeline(transaction=False)
        for i in range(start, min(n, start + 2_000)):
            retention.append(pipe, HISTORY, {**history_fields("handedoff", f"other{i}", now), "sid": ""}, now)
        pipe.execute()


async def test_history_of_a_schedule_id_reads_its_own_records_not_the_whole_history(
    component: Factory, props: dict[str, str], redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    # 20,000 records of other scheduleIds before it and 20,000 after: a scan reads 80 pages or more.
    write_indexed_records(redis_client)
    c = component("delayed")
    await c.init({**props, "enableDelayedMessaging": "true"})
    await c.publish("orders", b"tick", {"schedule": "@every 1s", "scheduleId": "tick"})
    deadline = time.monotonic() + 30
    while tick_records(redis_client) < 4:
        assert time.monotonic() < deadline, "the schedule did not fire 3 times within 30 s"
        await asyncio.sleep(0.2)
    await c.publish("orders", b"", {"scheduleCancel": "true", "scheduleId": "tick"})
    write_indexed_records(redis_client)
    for flags in ([], ["--limit", "0"], ["--limit", "2"]):
        before = history_reads(redis_client)
        result = run_cli("history", *conn(redis_server, "--id", "tick", "--json", *flags))
        reads = history_reads(redis_client) - before
        assert result.code == 0, result.err
        events = [r["event"] for r in result.json()]
        if flags == ["--limit", "2"]:
            assert events == ["fired", "cancelled"], events  # the newest two
        else:
            assert len(events) >= 5, events
            assert events == ["scheduled"] + ["fired"] * (len(events) - 2) + ["cancelled"], events
        # One XRANGE per record of tick and a few more: not a page of the other 40,000.
        assert reads <= 2 * len(events) + 6, (flags, reads)


async def test_history_json_names_the_occurrence_of_a_jittered_fire(
    component: Factory, props: dict[str, str], redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    c = component("delayed")
    await c.init({**props, "enableDelayedMessaging": "true"})
    await c.publish("orders", b"tick", {"schedule": "@every 2s", "scheduleJitter": "1s", "scheduleId": "j"})
    deadline = time.monotonic() + 30
    while len(stream_entries(redis_client, "orders")) < 2:
        assert time.monotonic() < deadline, "the schedule did not fire twice within 30 s"
        await asyncio.sleep(0.2)
    result = run_cli("history", *conn(redis_server, "--id", "j", "--json"))
    assert result.code == 0, result.err
    fired = [r for r in result.json() if r["event"] == "fired"]
    assert len(fired) >= 2, result.json()
    # Due up to 1 s after its occurrence's nominal time (a 1 ms jitter of 0 writes no `occurrence`).
    named = [r for r in fired if r["occurrence"] is not None]
    assert named, fired
    for r in named:
        assert 0 < parse_instant(r["due"]) - parse_instant(r["occurrence"]) < 1000, r
    # The metadata each fire stamped names the same occurrence.
    stamped = {
        decode_entry(f).metadata["scheduleOccurrence"] for _, f in stream_entries(redis_client, "orders")
    }
    assert {r["occurrence"] for r in named} <= stamped
