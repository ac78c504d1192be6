"""Operators racing: two `retry-dead` runs, or the dashboard's Retry beside one, move each dead letter
back exactly once (real CLI processes, a real dashboard, a real Redis and Redis Cluster)."""

from __future__ import annotations

import asyncio
import re
from collections import Counter
from collections.abc import Callable
from typing import Any

import httpx
import redis
import redis.asyncio as aioredis
import redis.asyncio.cluster as acluster

from delayed_middleware.deadletters import GaveUp, write_dead_letter
from delayed_middleware.entry import StreamEntry, decode_entry
from delayed_middleware.keys import EngineKeys, delayed_topic
from delayed_middleware.outbox import decode_outbox_entry
from tests.components.conftest import Dashboard
from tests.components.driver import cli, cluster_conn
from tests.redis_server import RedisCluster, RedisServer, stream_entries

Start = Callable[..., Dashboard]
OUTBOX = EngineKeys.for_topic(delayed_topic("app1")).outbox
TOKEN = "operator-token-0123456789"
LETTERS = 400
HAND_OFFS = 100


async def dead_letters(
    client: Any, dlt: str, topic: str, n: int = LETTERS, hand_offs: int = HAND_OFFS
) -> None:
    """`n` dead letters of app1 on `dlt`, written by the component's one dead-letter writer: the first
    `n - hand_offs` a subscriber's on `topic`, the rest hand-offs bound for other-pubsub/`topic`."""
    for i in range(n):
        why = GaveUp(
            reason="handler failed",
            attempts=3,
            source_topic=topic,
            consumer="app1",
            at_ms=1_700_000_000_000,
            pubsub="other-pubsub" if i >= n - hand_offs else "",
        )
        await write_dead_letter(client, "app1", dlt, StreamEntry(f"m{i}".encode(), {"k": "v"}), why)


def moved_counts(*outs: str) -> list[int]:
    counts = []
    for out in outs:
        m = re.search(r"^(\d+) dead letters moved back$", out, re.MULTILINE)
        assert m, out
        counts.append(int(m.group(1)))
    return counts


def bodies_back(client: redis.Redis | Any, topic: str, outbox: str) -> Counter[bytes]:
    """Each body on `topic` and in the outbox, with how many copies."""
    on_topic = [decode_entry(f).data for _, f in stream_entries(client, topic)]
    handed = [decode_outbox_entry(f).data for _, f in stream_entries(client, outbox)]
    return Counter(on_topic + handed)


def assert_each_once(copies: Counter[bytes], n: int = LETTERS) -> None:
    assert sum(copies.values()) == n, f"{sum(copies.values())} copies for {n} letters"
    assert set(copies) == {f"m{i}".encode() for i in range(n)}
    assert set(copies.values()) == {1}


async def test_two_retry_dead_runs_at_once_move_each_letter_back_once(
    redis_server: RedisServer, aclient: aioredis.Redis, redis_client: redis.Redis
) -> None:
    await dead_letters(aclient, "dlq", "orders")
    conn = ["--redis-host", f"127.0.0.1:{redis_server.port}", "--app-id", "app1"]
    a, b = await asyncio.gather(cli("retry-dead", *conn), cli("retry-dead", *conn))
    assert (a.code, b.code) == (0, 0), (a.err, b.err)
    assert sum(moved_counts(a.out, b.out)) == LETTERS
    assert_each_once(bodies_back(redis_client, "orders", OUTBOX))
    assert redis_client.xlen(OUTBOX) == HAND_OFFS
    assert redis_client.xlen("dlq") == 0
    assert "0 dead letters" in (await cli("dead", *conn)).out


async def test_the_dashboards_retry_double_clicked_beside_a_cli_run_moves_each_letter_once(
    redis_server: RedisServer, aclient: aioredis.Redis, redis_client: redis.Redis, dashboard: Start
) -> None:
    await dead_letters(aclient, "dlq", "orders")
    ids = [i for i, _ in stream_entries(redis_client, "dlq")]
    conn = ["--redis-host", f"127.0.0.1:{redis_server.port}", "--app-id", "app1"]
    d = dashboard(*conn, "--allow-actions", "--token-env", "DASH_TOKEN", env={"DASH_TOKEN": TOKEN})
    clicks = asyncio.Semaphore(16)

    async def click(client: httpx.AsyncClient, id: str) -> bool:
        async with clicks:
            r = await client.post(
                f"{d.url}/actions/retry-dead",
                data={"topic": "dlq", "id": id},
                headers={"X-Dashboard-Token": TOKEN},
            )
        assert r.status_code in (200, 404), r.text
        ok: bool = r.json()["ok"]
        return ok

    async with httpx.AsyncClient(timeout=60) as client:
        # Every letter clicked twice (a double click), while a CLI run moves them all too.
        run, clicked = await asyncio.gather(
            cli("retry-dead", *conn),
            asyncio.gather(*(click(client, id) for id in ids for _ in range(2))),
        )
    assert run.code == 0, run.err
    [by_cli] = moved_counts(run.out)
    assert by_cli + sum(clicked) == LETTERS, (by_cli, sum(clicked))
    assert_each_once(bodies_back(redis_client, "orders", OUTBOX))
    assert redis_client.xlen("dlq") == 0


async def test_two_retry_dead_runs_at_once_on_a_cluster_move_each_letter_once(
    cluster: RedisCluster, admin: Any
) -> None:
    engine = cluster.owner(OUTBOX).port
    # The dead-letter topic, the topic and the outbox on three masters: the letters cross slots.
    dlt = next(t for t in (f"dead-{i}" for i in range(100)) if cluster.owner(t).port != engine)
    topic = next(
        t
        for t in (f"orders-{i}" for i in range(100))
        if cluster.owner(t).port not in (engine, cluster.owner(dlt).port)
    )
    # A second dead-letter topic hashing with its topic: those letters move in one script.
    near_dlt, near_topic = "{near}dead", "{near}orders"
    client = acluster.RedisCluster(host="127.0.0.1", port=cluster.nodes[0].port)
    # More letters than on one node: a cluster client starts slower, and each run must
    # still be moving letters when the other starts.
    n = 4 * LETTERS
    try:
        await dead_letters(client, dlt, topic, n=n)
        await dead_letters(client, near_dlt, near_topic, n=50, hand_offs=0)
    finally:
        await client.aclose()
    conn = cluster_conn(cluster)
    a, b = await asyncio.gather(cli("retry-dead", *conn), cli("retry-dead", *conn))
    assert (a.code, b.code) == (0, 0), (a.err, b.err)
    assert sum(moved_counts(a.out, b.out)) == n + 50
    assert_each_once(bodies_back(admin, topic, OUTBOX), n)
    near = Counter(decode_entry(f).data for _, f in stream_entries(admin, near_topic))
    assert near == Counter({f"m{i}".encode(): 1 for i in range(50)})
    assert admin.xlen(dlt) == admin.xlen(near_dlt) == 0
