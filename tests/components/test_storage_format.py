"""The storage format version and the rollback window, through the component as daprd drives it,
on a real Redis: what Init writes and refuses, what a publish in the window is refused, and that a
format this version does not know is refused without changing anything."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from datetime import UTC, datetime

import grpc
import pytest
import redis
import redis.cluster

from delayed_middleware.entry import decode_entry
from delayed_middleware.envelope import decode_envelope
from delayed_middleware.keys import shard_topics
from delayed_pubsub_pb.dapr.proto.components.v1 import pubsub_pb2
from tests.components.driver import Component, cli, cluster_props
from tests.conftest import small_stream_nodes
from tests.redis_server import RedisCluster, RedisServer, stream_entries
from tests.waiting import wait_until

FORMAT = "{app1-delayed}:format"
HISTORY = "{app1-delayed}:history"
MOVED = "{app1-delayed}:moved"


def release_1_data(client: redis.Redis | redis.cluster.RedisCluster, history: str) -> None:
    """What release 0.1.0 leaves: engine data (a history record) and no format key."""
    client.xadd(history, {"event": "scheduled", "id": "old-1"})


NEW_FORMAT_PUBLISHES = [
    {"schedule": "0 0 5 * * *", "scheduleTimeZone": "Europe/Berlin"},
    {"schedule": "CRON_TZ=America/New_York 0 0 5 * * *"},
    {"schedule": "@every 1h", "scheduleLimit": "3"},
    {"schedule": "@every 1h", "scheduleEnd": "2099-01-01T00:00:00Z"},
    {"schedule": "@every 1h", "scheduleStart": "2099-01-01T00:00:00Z"},
    {"schedule": "@every 1h", "scheduleJitter": "5s"},
]
# What needs format 3: a catch-up policy other than the default, or any window (release 0.2.0
# skips fields 19 and 20, so it would catch `all` up as `one` and `none` with one delivery).
CATCHUP_PUBLISHES = [
    {"schedule": "@every 1h", "scheduleCatchup": "all"},
    {"schedule": "@every 1h", "scheduleCatchup": "NONE"},
    {"schedule": "0 0 5 * * *", "scheduleCatchupWindow": "1h"},
    {"schedule": "@every 1h", "scheduleCatchupWindow": "24h"},
]


def release_2_data(client: redis.Redis) -> None:
    """What release 0.2.0 leaves: engine data and its format key, 2."""
    client.set(FORMAT, "2")
    client.xadd(HISTORY, {"event": "scheduled", "id": "old-1"})


def catchups_stored(client: redis.Redis) -> list[tuple[int, int]]:
    """(policy, window ms) of each envelope on the delayed topic with either field written."""
    envelopes = [decode_envelope(decode_entry(f).data) for _, f in stream_entries(client, "app1-delayed")]
    return [(e.catchup, e.catchup_window_ms) for e in envelopes if e.catchup or e.catchup_window_ms]


@pytest.fixture
def delayed_props(props: dict[str, str]) -> dict[str, str]:
    return {**props, "enableDelayedMessaging": "true"}


def snapshot(client: redis.Redis) -> dict[str, object]:
    """The app's delayed data (its format, envelopes, due index, ids, history), each key's DUMP:
    equal snapshots mean nothing was stored, changed or deleted. (The history's by-id index is
    left out: a background sweep builds it on its own schedule.)"""
    keys = [FORMAT, "app1-delayed", "{app1-delayed}:ids", "{app1-delayed}:pending", HISTORY, MOVED]
    keys += [k.decode() for k in client.keys("{app1-delayed}:due*")]  # type: ignore[union-attr]
    return {k: client.dump(k) for k in sorted(keys)}


async def refused(call: object) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call  # type: ignore[misc]
    return err.value


@pytest.fixture
async def at_format_2(
    component: Callable[[str], Component], delayed_props: dict[str, str], redis_client: redis.Redis
) -> Component:
    """The component Init'ed on an app of release 0.2.0, which stays at format 2."""
    release_2_data(redis_client)
    c = component("delayed")
    await c.init(delayed_props)
    return c


async def lowering_is_refused(
    c: Component, props: dict[str, str], client: redis.Redis, *formats: str
) -> None:
    """Init with each of `formats` (below the stored one) is refused, changing nothing."""
    before = snapshot(client)
    for lower in formats:
        err = await refused(c.init({**props, "storageFormat": lower}))
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "cannot be lowered" in (err.details() or ""), err.details()
    assert snapshot(client) == before


async def test_a_fresh_app_starts_at_the_newest_format_and_takes_every_option(
    component: Callable[[str], Component], delayed_props: dict[str, str], redis_client: redis.Redis
) -> None:
    c = component("delayed")
    await c.init(delayed_props)
    assert redis_client.get(FORMAT) == b"3"
    for n, md in enumerate(NEW_FORMAT_PUBLISHES + CATCHUP_PUBLISHES):
        await c.publish("ticks", b"x", {**md, "scheduleId": f"s{n}"})
    await c.publish("ticks", b"", {"schedulePause": "true", "scheduleId": "s0"})
    assert sorted(catchups_stored(redis_client)) == [(0, 3_600_000), (0, 86_400_000), (1, 0), (2, 0)]


async def test_an_upgraded_app_stays_in_the_previous_format_and_refuses_what_it_cannot_hold(
    component: Callable[[str], Component], delayed_props: dict[str, str], redis_client: redis.Redis
) -> None:
    release_1_data(redis_client, HISTORY)
    c = component("delayed")
    await c.init(delayed_props)
    assert redis_client.get(FORMAT) == b"1"
    for n, md in enumerate(NEW_FORMAT_PUBLISHES):
        before = snapshot(redis_client)
        err = await refused(c.publish("ticks", b"x", {**md, "scheduleId": f"s{n}"}))
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION, md
        assert "storageFormat: 2" in (err.details() or ""), err.details()
        assert snapshot(redis_client) == before, f"{md} stored something"
    for n, md in enumerate(CATCHUP_PUBLISHES):
        err = await refused(c.publish("ticks", b"x", {**md, "scheduleId": f"c{n}"}))
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION, md
        assert "storageFormat: 3" in (err.details() or ""), err.details()
    # What the previous release can read is taken as before.
    await c.publish("ticks", b"x", {"schedule": "@every 1h", "scheduleId": "plain"})
    await c.publish("ticks", b"x", {"scheduledSendDelay": "1h", "scheduleId": "once"})
    err = await refused(c.publish("ticks", b"", {"schedulePause": "true", "scheduleId": "plain"}))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "storageFormat" in (err.details() or "")
    # A bulk publish fails only the entries that need the newer format.
    reply = await c.bulk_publish(
        "ticks",
        [
            pubsub_pb2.BulkMessageEntry(
                entry_id="a", event=b"a", metadata={"schedule": "@every 1h", "scheduleId": "ba"}
            ),
            pubsub_pb2.BulkMessageEntry(
                entry_id="b",
                event=b"b",
                metadata={"schedule": "@every 1h", "scheduleJitter": "1s", "scheduleId": "bb"},
            ),
        ],
    )
    assert [(f.entry_id, "storageFormat" in f.error) for f in reply.failed_entries] == [("b", True)]
    ids = {k.decode() for k in redis_client.hkeys("{app1-delayed}:ids")}  # type: ignore[union-attr]
    assert ids == {"plain", "once", "ba"}


async def test_raising_the_setting_is_one_change_and_lowering_it_is_refused(
    component: Callable[[str], Component], delayed_props: dict[str, str], redis_client: redis.Redis
) -> None:
    release_1_data(redis_client, HISTORY)
    c = component("delayed")
    await c.init(delayed_props)
    assert redis_client.get(FORMAT) == b"1"
    await c.init({**delayed_props, "storageFormat": "2"})
    assert redis_client.get(FORMAT) == b"2"
    await c.publish("ticks", b"x", {"schedule": "@every 1h", "scheduleJitter": "1s", "scheduleId": "j"})
    # Once raised, the setting may be removed: the stored format stays.
    await c.init(delayed_props)
    await c.publish("ticks", b"", {"schedulePause": "true", "scheduleId": "j"})
    await lowering_is_refused(c, delayed_props, redis_client, "1")


async def test_an_app_of_release_2_stays_at_format_2_and_refuses_each_catch_up_key(
    at_format_2: Component, delayed_props: dict[str, str], redis_client: redis.Redis
) -> None:
    c = at_format_2
    assert redis_client.get(FORMAT) == b"2"
    await c.publish("ticks", b"x", {"schedule": "@every 1h", "scheduleId": "plain"})
    for n, md in enumerate(CATCHUP_PUBLISHES):
        # A new schedule, and a replace of a pending one: neither stores anything.
        for sid in (f"c{n}", "plain"):
            before = snapshot(redis_client)
            err = await refused(c.publish("ticks", b"x", {**md, "scheduleId": sid}))
            assert err.code() == grpc.StatusCode.FAILED_PRECONDITION, md
            details = err.details() or ""
            assert "storageFormat: 3" in details, details
            assert "format 2 (release 0.2.0)" in details, details
            assert snapshot(redis_client) == before, f"{md} stored something"
    # What format 2 holds is taken: zones, bounds, jitter, a pause, the default catch-up said aloud.
    for n, md in enumerate(NEW_FORMAT_PUBLISHES):
        await c.publish("ticks", b"x", {**md, "scheduleId": f"s{n}"})
    await c.publish("ticks", b"", {"schedulePause": "true", "scheduleId": "s0"})
    await c.publish("ticks", b"x", {"schedule": "@every 1h", "scheduleCatchup": "one", "scheduleId": "one"})
    # A bulk fails only the entries that need format 3, whether the key is an entry's or the request's.
    entry = pubsub_pb2.BulkMessageEntry
    reply = await c.bulk_publish(
        "ticks",
        [
            entry(entry_id="a", event=b"a", metadata={"schedule": "@every 1h", "scheduleId": "ba"}),
            entry(entry_id="b", event=b"b", metadata={**CATCHUP_PUBLISHES[0], "scheduleId": "bb"}),
            entry(entry_id="c", event=b"c", metadata={**CATCHUP_PUBLISHES[2], "scheduleId": "bc"}),
        ],
    )
    assert sorted((f.entry_id, "storageFormat: 3" in f.error) for f in reply.failed_entries) == [
        ("b", True),
        ("c", True),
    ]
    reply = await c.bulk_publish(
        "ticks", [entry(entry_id="d", event=b"d"), entry(entry_id="e", event=b"e")], CATCHUP_PUBLISHES[1]
    )
    assert sorted(f.entry_id for f in reply.failed_entries) == ["d", "e"]
    ids = {k.decode() for k in redis_client.hkeys("{app1-delayed}:ids")}  # type: ignore[union-attr]
    assert ids == {"plain", "one", "ba"} | {f"s{n}" for n in range(len(NEW_FORMAT_PUBLISHES))}
    assert catchups_stored(redis_client) == [], "format 2 data holds a catch-up field"


@pytest.mark.parametrize(
    ("md", "key"),
    [
        ({"scheduleCatchup": "some"}, "scheduleCatchup"),
        ({"scheduleCatchupWindow": "-1h"}, "scheduleCatchupWindow"),
        ({"scheduleCatchupWindow": "a day"}, "scheduleCatchupWindow"),
    ],
)
async def test_at_format_2_a_bad_catch_up_value_is_invalid_argument_not_a_format_refusal(
    at_format_2: Component, redis_client: redis.Redis, md: dict[str, str], key: str
) -> None:
    """A value no format could take is the publisher's mistake: it is named as such, so raising
    storageFormat is never the advice for it."""
    c = at_format_2
    before = snapshot(redis_client)
    err = await refused(c.publish("ticks", b"x", {"schedule": "@every 1h", **md}))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    details = err.details() or ""
    assert key in details, details
    assert md[key] in details, details
    assert "storageFormat" not in details, details
    # A catch-up key on a one-shot is a mistake too, whatever the format.
    err = await refused(c.publish("ticks", b"x", {"scheduledSendDelay": "1h", "scheduleCatchup": "all"}))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    assert snapshot(redis_client) == before


async def test_raising_format_2_to_3_takes_the_catch_up_keys_and_lowering_it_again_is_refused(
    at_format_2: Component, delayed_props: dict[str, str], redis_client: redis.Redis
) -> None:
    c = at_format_2
    await c.init({**delayed_props, "storageFormat": "3"})
    assert redis_client.get(FORMAT) == b"3"
    for n, md in enumerate(CATCHUP_PUBLISHES):
        await c.publish("ticks", b"x", {**md, "scheduleId": f"c{n}"})
    assert sorted(catchups_stored(redis_client)) == [(0, 3_600_000), (0, 86_400_000), (1, 0), (2, 0)]
    await lowering_is_refused(c, delayed_props, redis_client, "2", "1")


@pytest.mark.parametrize("stored", [b"99", b"two"])
async def test_a_format_this_version_does_not_know_refuses_init_and_changes_nothing(
    component: Callable[[str], Component],
    delayed_props: dict[str, str],
    redis_client: redis.Redis,
    stored: bytes,
) -> None:
    c = component("delayed")
    await c.init(delayed_props)
    await c.publish("ticks", b"x", {"scheduledSendDelay": "1h", "scheduleId": "kept"})
    redis_client.set(FORMAT, stored)
    before = snapshot(redis_client)
    other = component("other")
    err = await refused(other.init(delayed_props))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    details = err.details() or ""
    assert stored.decode() in details, details
    assert "formats 1 to 3" in details, details
    assert snapshot(redis_client) == before


async def test_no_compaction_moves_envelopes_in_the_rollback_window(
    component: Callable[[str], Component], delayed_props: dict[str, str], redis_client: redis.Redis
) -> None:
    """1,100 one-shots, twenty of them (in twenty stream nodes) waiting an hour: after the rest fire, the stream is sparse enough
    that the engine compacts it, unless the app is in the rollback window (the previous release
    does not know a moved envelope and would report it lost)."""

    async def compacted(app: str, **settings: str) -> bool:
        release_1_data(redis_client, "{" + app + "-delayed}:history")
        c = component(app)
        sink = f"sink-{app}"
        with small_stream_nodes(redis_client, 10):
            await c.init({**delayed_props, "consumerID": app, **settings})
            now = int(time.time() * 1000)
            entries = [
                pubsub_pb2.BulkMessageEntry(
                    entry_id=str(i),
                    event=b"x",
                    metadata={"scheduledSendTime": _iso(now + (3_600_000 if i % 55 == 0 else 300))},
                )
                for i in range(1_100)
            ]
            assert not (await c.bulk_publish(sink, entries)).failed_entries
        await wait_until(lambda: redis_client.xlen(sink) == 1_080, "the short delays fired")
        # The density check runs in the first idle fire step after 1,000 envelopes left.
        moved = "{" + app + "-delayed}:moved"
        for _ in range(30):
            if redis_client.exists(moved):
                return True
            await asyncio.sleep(0.1)
        return False

    assert not await compacted("pinned"), "compaction moved envelopes in the rollback window"
    assert await compacted("raised", storageFormat="2"), "no compaction at the newest format"


def _iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


async def test_on_redis_cluster_every_shard_records_its_format_and_any_one_unknown_refuses_init(
    component: Callable[[str], Component], cluster: RedisCluster, admin: redis.cluster.RedisCluster
) -> None:
    admin.flushall()
    props = {**cluster_props(cluster), "delayShards": "6"}
    shards = shard_topics("app1", 6)
    # Shard 3 alone has data of the previous release: the app is in its format.
    release_1_data(admin, "{" + shards[3] + "}:history")
    await component("delayed").init(props)
    assert [admin.get("{" + s + "}:format") for s in shards] == [b"1"] * 6
    admin.set("{" + shards[5] + "}:format", "99")
    err = await refused(component("other").init(props))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert shards[5] in (err.details() or ""), err.details()
    assert [admin.get("{" + s + "}:format") for s in shards] == [b"1"] * 5 + [b"99"]


async def test_the_operator_cli_pauses_nothing_in_the_rollback_window(
    component: Callable[[str], Component],
    delayed_props: dict[str, str],
    redis_client: redis.Redis,
    redis_server: RedisServer,
) -> None:
    release_1_data(redis_client, HISTORY)
    c = component("delayed")
    await c.init(delayed_props)
    await c.publish("ticks", b"t", {"schedule": "@every 1h", "scheduleId": "tick"})
    conn = ["--redis-host", f"127.0.0.1:{redis_server.port}", "--app-id", "app1"]
    before = snapshot(redis_client)
    paused = await cli("pause", *conn, "tick")
    assert paused.code == 3, paused.out
    assert "storageFormat" in paused.err, paused.err
    assert snapshot(redis_client) == before
    # Once raised, it pauses.
    await c.init({**delayed_props, "storageFormat": "2"})
    paused = await cli("pause", *conn, "tick")
    assert (paused.code, paused.out.strip()) == (0, "paused tick"), paused.err


@pytest.mark.parametrize(
    ("stored", "old_name", "raise_to"),
    [(1, "delayed-pubsub", 2), (1, "delayed-pubsub", 3), (2, "delayed-pubsub-f2", 3)],
)
async def test_raising_is_refused_while_a_replica_of_an_older_release_is_connected(
    component: Callable[[str], Component],
    delayed_props: dict[str, str],
    redis_client: redis.Redis,
    redis_server: RedisServer,
    stored: int,
    old_name: str,
    raise_to: int,
) -> None:
    """Release 0.1.0 names its connections `delayed-pubsub:<consumerID>` (it reads format 1), 0.2.0
    `delayed-pubsub-f2:<consumerID>` (formats 1 and 2): while one of the app's is open, raising the
    format past what it reads is refused and changes nothing, and a new app whose older replica is
    already connected starts in that release's format. Another app's old replica is no reason to refuse."""
    if stored == 1:
        release_1_data(redis_client, HISTORY)
    else:
        release_2_data(redis_client)
    c = component("delayed")
    await c.init(delayed_props)
    old = redis.Redis(port=redis_server.port, client_name=f"{old_name}:app1")
    old.ping()
    other = redis.Redis(port=redis_server.port, client_name=f"{old_name}:app2")
    other.ping()
    try:
        before = snapshot(redis_client)
        err = await refused(c.init({**delayed_props, "storageFormat": str(raise_to)}))
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
        details = err.details() or ""
        assert f"{old_name}:app1" in details, details
        assert f"{old_name}:app2" not in details, details
        assert snapshot(redis_client) == before
        # Keeping the stored format is no raise: taken.
        await c.init({**delayed_props, "storageFormat": str(stored)})
        await component("fresh").init({**delayed_props, "consumerID": "app2"})
        assert redis_client.get("{app2-delayed}:format") == str(stored).encode()
    finally:
        old.close()
        other.close()
    await wait_until(
        lambda: all(cl["name"] != f"{old_name}:app1" for cl in redis_client.client_list()),
        "the old replica's connection closed",
    )
    await c.init({**delayed_props, "storageFormat": str(raise_to)})
    assert redis_client.get(FORMAT) == str(raise_to).encode()
