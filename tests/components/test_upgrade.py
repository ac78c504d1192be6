"""Upgrade from an earlier release (0.2.0, and 0.1.0 straight to this one), roll back to it, upgrade
again, then leave the rollback window: real `delayed-pubsub serve` processes of both releases (the
earlier one installed from this repository's history, scripts/previous-release) on one real Redis,
driven over gRPC as daprd drives them. Every message is delivered (acked) once and never early,
recurring schedules stay on their grid, a retry in backoff and a dead letter cross the versions, and
what the earlier release cannot read is neither written in the window nor lost after it."""

from __future__ import annotations

import asyncio
import io
import json
import subprocess
import tarfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc
import pytest
import redis
import redis.cluster

from delayed_middleware.instants import parse_instant
from delayed_middleware.keys import shard_topics
from delayed_pubsub_pb.dapr.proto.components.v1 import pubsub_pb2
from tests.components.driver import Component, Stream, cluster_props
from tests.components.serve import ROOT, Serve, props_for
from tests.conftest import small_stream_nodes
from tests.redis_server import RedisCluster, RedisServer, stream_entries
from tests.waiting import wait_until

PREVIOUS_RELEASE = ROOT / "scripts" / "previous-release"
FORMAT = "{app1-delayed}:format"
MOVED = "{app1-delayed}:moved"
EVERY_MS = 2_000
# A batch whose short delays fire at once while its long tail (1 in 55, each in its own stream node
# of 10 entries) waits: the stream left this sparse is what the engine compacts.
BATCH, TAIL_EVERY = 1_100, 55


def release_commit(version: str) -> str:
    """The commit of release `version`, as scripts/previous-release names it."""
    for line in PREVIOUS_RELEASE.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            commit, named = line.split()
            if named == version:
                return commit
    raise AssertionError(f"{PREVIOUS_RELEASE} names no release {version}")


def _git(*args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, check=False)


def release_tree(tmp_path_factory: pytest.TempPathFactory, version: str) -> Path:
    """Release `version`'s packages (proto, middleware, components), from this repository's
    history; fetched from origin when the clone lacks it (a shallow CI clone). Never skipped."""
    commit = release_commit(version)
    if _git("cat-file", "-e", f"{commit}^{{commit}}").returncode:
        fetched = _git("fetch", "-q", "origin", commit)
        if _git("cat-file", "-e", f"{commit}^{{commit}}").returncode:
            pytest.fail(
                f"release {version} (commit {commit}, scripts/previous-release) is not in this clone's "
                f"history and `git fetch origin {commit}` did not bring it "
                f"({fetched.stderr.decode().strip() or 'no error'}): clone with full history "
                "(no --depth) to run the upgrade test"
            )
    archive = _git("archive", "--format=tar", commit, "proto", "middleware", "components")
    assert archive.returncode == 0, archive.stderr.decode()
    tree = tmp_path_factory.mktemp(f"release-{version}")
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(tree, filter="data")
    return tree


@pytest.fixture(scope="module")
def previous_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Release 0.1.0 (storage format 1, no format key): an upgrade straight from it stays in format 1."""
    return release_tree(tmp_path_factory, "0.1.0")


@pytest.fixture(scope="module")
def release_2_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Release 0.2.0 (storage format 2), the release before this one."""
    return release_tree(tmp_path_factory, "0.2.0")


@dataclass
class App:
    """The subscribing app: acks what it is given (a `flaky` message only on its second delivery,
    a `doomed` one never), and records each ack with the time it came."""

    acked: list[tuple[str, dict[str, str], int]] = field(default_factory=list)
    seen: Counter[str] = field(default_factory=Counter)
    early: list[str] = field(default_factory=list)
    # Each acked delivery's stream id by name: one id twice is a redelivery, two ids a second fire.
    ids: dict[str, list[str]] = field(default_factory=dict)

    async def consume(self, stream: Stream) -> None:
        """Take the stream's messages in turn until `STOP` (never cancelled: see `running`)."""
        while True:
            msg = await stream.received.get()
            if msg is STOP:
                return
            body = json.loads(msg.data)
            name = body["id"]
            self.seen[name] += 1
            at = int(time.time() * 1000)
            due = body["due"]
            if "scheduleNext" in msg.metadata and name.startswith("every-"):
                due = parse_instant(msg.metadata["scheduleNext"]) - EVERY_MS
            if at < due:
                self.early.append(f"{name} {due - at} ms early")
            if name == "doomed" or (name == "flaky" and self.seen[name] == 1):
                await stream.nack(msg.id)
                continue
            self.acked.append((name, dict(msg.metadata), at))
            self.ids.setdefault(name, []).append(msg.id)
            await stream.ack(msg.id)

    def count(self, prefix: str) -> Counter[str]:
        return Counter(n for n, _, _ in self.acked if n.startswith(prefix))

    def twice(self, skip: tuple[str, ...] = ()) -> dict[str, list[str]]:
        """The names acked more than once (but those starting with `skip`), with the stream id of
        each delivery."""
        counts = Counter(n for n, _, _ in self.acked)
        return {n: self.ids[n] for n, k in counts.items() if k > 1 and not n.startswith(skip)}


# Queued behind what a stream has received when its release stops: the app acks everything before
# it, then stops between two messages as daprd does. Cancelling the app's task instead could land in
# an ack's write, and grpc.aio cancels the whole call then: that ack, and any the component had not
# read yet, never arrive, and the next release redelivers messages the app recorded as acked.
STOP = pubsub_pb2.PullMessagesResponse()


def _iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _entry(name: str, due: int, **metadata: str) -> pubsub_pb2.BulkMessageEntry:
    return pubsub_pb2.BulkMessageEntry(
        entry_id=name,
        event=json.dumps({"id": name, "due": due}).encode(),
        metadata={"scheduledSendTime": _iso(due), **metadata},
    )


def _batch(prefix: str, now: int, tail_due: int) -> list[pubsub_pb2.BulkMessageEntry]:
    return [_entry(f"{prefix}{i}", tail_due if i % TAIL_EVERY == 0 else now + 300) for i in range(BATCH)]


@pytest.fixture
def nodes_of_ten(redis_client: redis.Redis) -> Iterator[None]:
    with small_stream_nodes(redis_client, 10):
        yield


@asynccontextmanager
async def running(
    folder: Path, name: str, props: dict[str, str], app: App, root: Path = ROOT
) -> AsyncIterator[Component]:
    """One serve process of the release at `root`, Init'ed, with the app subscribed to its topics;
    stopped in order (subscriptions closed, then SIGTERM) as a rolling update stops a pod."""
    serve = Serve(folder, name, "--log-level", "debug", root=root)
    try:
        async with grpc.aio.insecure_channel(f"unix://{serve.socket}") as ch:
            c = Component(ch, "delayed")
            await c.init(props)
            streams = [await c.subscribe(t) for t in ("work", "flaky", "doomed")]
            tasks = [asyncio.create_task(app.consume(s)) for s in streams]
            try:
                yield c
            finally:
                for s in streams:
                    s.received.put_nowait(STOP)
                await asyncio.wait_for(asyncio.gather(*tasks), 30)
                for s in streams:
                    await s.close()
    finally:
        serve.stop()
        log = serve.log.read_text()
        assert "Traceback" not in log, f"{name}:\n{log[-4000:]}"


async def start_schedules(c: Component, one_shots: list[pubsub_pb2.BulkMessageEntry], schedules: int) -> None:
    """One-shots due across the whole run, and `schedules` `@every` schedules (every-0, every-1, ...)."""
    assert not (await c.bulk_publish("work", one_shots)).failed_entries
    for n in range(schedules):
        await c.publish(
            "work",
            json.dumps({"id": f"every-{n}", "due": 0}).encode(),
            {"schedule": f"@every {EVERY_MS // 1000}s", "scheduleId": f"every-{n}"},
        )


async def refused_init(folder: Path, props: dict[str, str], *names: str, root: Path = ROOT) -> None:
    """A replica of the release at `root` started with `props` is refused at Init (FAILED_PRECONDITION),
    the refusal naming each of `names`."""
    raiser = Serve(folder, "raiser", root=root)
    try:
        async with grpc.aio.insecure_channel(f"unix://{raiser.socket}") as ch:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await Component(ch, "delayed").init(props)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        for name in names:
            assert name in (err.value.details() or ""), err.value.details()
    finally:
        raiser.stop()


async def refused_to_raise(folder: Path, props: dict[str, str]) -> None:
    """A replica of this release started with storageFormat 2 while 0.1.0 runs: its Init is refused,
    naming the old replica's connections."""
    await refused_init(folder, {**props, "storageFormat": "2"}, "delayed-pubsub:app1")


async def test_upgrade_rollback_within_the_window_and_upgrade_again_lose_nothing(
    previous_tree: Path,
    folder: Path,
    redis_server: RedisServer,
    redis_client: redis.Redis,
    nodes_of_ten: None,
) -> None:
    props = {
        **props_for(redis_server),
        "processingTimeout": "1s",
        "redeliverInterval": "300ms",
        "maxDeliveryAttempts": "2",
        "retryInitialInterval": "3s",
        "deadLetterTopic": "dlq",
    }
    app = App()
    t0 = int(time.time() * 1000)
    one_shots = [_entry(f"once-{i}", t0 + 1_500 + i * 150) for i in range(100)]

    # 1. The previous release: one-shots due over the whole run, recurring schedules, a message
    # that fails once (a retry in backoff) and one that always fails (a dead letter).
    async with running(folder, "old1", props, app, root=previous_tree) as c:
        await start_schedules(c, one_shots, 3)
        assert not (await c.bulk_publish("flaky", [_entry("flaky", t0 + 1_000)])).failed_entries
        assert not (await c.bulk_publish("doomed", [_entry("doomed", t0 + 1_000)])).failed_entries
        await wait_until(lambda: app.seen["flaky"] == 1, "the flaky message's first delivery")
    assert redis_client.get(FORMAT) is None  # the previous release writes no format key

    # 2. Upgrade: the app stays in the previous release's format (the rollback window). A batch
    # with a long tail fires: the stream is left sparse, yet nothing is re-homed (compaction off).
    async with running(folder, "new1", props, app) as c:
        assert redis_client.get(FORMAT) == b"1"
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await c.publish("work", b"{}", {"schedule": "@every 1s", "scheduleJitter": "200ms"})
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        now = int(time.time() * 1000)
        tail_a = now + 6_000
        assert not (await c.bulk_publish("work", _batch("a-", now, tail_a))).failed_entries
        await wait_until(lambda: sum(app.count("a-").values()) == BATCH - BATCH // TAIL_EVERY, "batch a")
        await asyncio.sleep(1.0)  # the density check comes in the next idle fire step
        assert not redis_client.exists(MOVED), "envelopes re-homed in the rollback window"

    # 3. Roll back: the previous release reads everything, the long tail included. While it runs,
    # a replica of this release cannot raise the format (it would leave 0.1.0 data it cannot read).
    async with running(folder, "old2", props, app, root=previous_tree):
        await refused_to_raise(folder, props)
        assert redis_client.get(FORMAT) == b"1"
        await wait_until(lambda: sum(app.count("a-").values()) == BATCH, "batch a's long tail", 20)

    # 4. Upgrade again, then leave the window: one setting change.
    async with running(folder, "new2", props, app):
        assert redis_client.get(FORMAT) == b"1"
    raised = {**props, "storageFormat": "2"}
    async with running(folder, "new3", raised, app) as c:
        assert redis_client.get(FORMAT) == b"2"
        await c.publish(
            "work",
            json.dumps({"id": "limited", "due": 0}).encode(),
            {
                "schedule": "@every 1s",
                "scheduleLimit": "2",
                "scheduleJitter": "200ms",
                "scheduleId": "limited",
            },
        )
        await c.publish("work", b"", {"schedulePause": "true", "scheduleId": "every-0"})
        await c.publish("work", b"", {"schedulePause": "false", "scheduleId": "every-0"})
        now = int(time.time() * 1000)
        # The tail waits long enough for the density check to find it even on a loaded machine.
        assert not (await c.bulk_publish("work", _batch("b-", now, now + 8_000))).failed_entries
        await wait_until(lambda: bool(redis_client.exists(MOVED)), "compaction at the newest format")
        await wait_until(lambda: sum(app.count("b-").values()) == BATCH, "batch b, re-homed tail included")
        await wait_until(lambda: len(app.count("once-")) == len(one_shots), "every one-shot", 20)
        await wait_until(lambda: app.count("limited")["limited"] == 2, "the limited schedule's two fires")
        await wait_until(lambda: bool(app.count("flaky")), "the flaky message's retry")
        last_run_start = int(time.time() * 1000)
        await wait_until(
            lambda: all(
                any(at > last_run_start for n, _, at in app.acked if n == f"every-{k}") for k in range(3)
            ),
            "every schedule firing after the last upgrade",
        )

    assert not app.early, app.early
    counts = Counter(n for n, _, _ in app.acked)
    twice = app.twice(skip=("every-", "limited"))
    assert not twice, f"delivered more than once (name: stream ids): {twice}"
    assert set(app.count("once-")) == {e.entry_id for e in one_shots}
    assert counts["flaky"] == 1
    assert app.seen["flaky"] == 2
    assert "doomed" not in counts
    assert redis_client.xlen("dlq") == 1
    # Recurring schedules: each occurrence once, all on the grid of their first.
    for k in range(3):
        dues = [parse_instant(md["scheduleNext"]) - EVERY_MS for n, md, _ in app.acked if n == f"every-{k}"]
        assert len(dues) == len(set(dues)), f"every-{k}: an occurrence delivered twice"
        assert all((d - dues[0]) % EVERY_MS == 0 for d in dues), f"every-{k} left its grid: {dues}"


async def test_on_redis_cluster_upgrade_rollback_and_upgrade_again_lose_nothing(
    previous_tree: Path, folder: Path, cluster: RedisCluster, admin: redis.cluster.RedisCluster
) -> None:
    """The same on Redis Cluster with four delay shards, each in its own slot with its own format
    key: one-shots due across the four runs, each fired by whichever release runs at its due time."""
    admin.flushall()
    props = {
        **cluster_props(cluster),
        "delayShards": "4",
        "processingTimeout": "1s",
        "redeliverInterval": "300ms",
    }
    formats = ["{" + s + "}:format" for s in shard_topics("app1", 4)]
    app = App()
    t0 = int(time.time() * 1000)
    one_shots = [_entry(f"once-{i}", t0 + 1_500 + i * 150) for i in range(100)]

    def acked() -> int:
        return len(app.count("once-"))

    async with running(folder, "old1", props, app, root=previous_tree) as c:
        await start_schedules(c, one_shots, 3)
        await wait_until(lambda: acked() >= 10, "one-shots fired by the previous release")
    assert [admin.get(k) for k in formats] == [None] * 4
    async with running(folder, "new1", props, app) as c:
        assert [admin.get(k) for k in formats] == [b"1"] * 4
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await c.publish("work", b"{}", {"schedule": "0 0 5 * * *", "scheduleTimeZone": "Europe/Berlin"})
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        await wait_until(lambda: acked() >= 40, "one-shots fired after the upgrade")
    async with running(folder, "old2", props, app, root=previous_tree):
        await refused_to_raise(folder, props)
        assert [admin.get(k) for k in formats] == [b"1"] * 4
        await wait_until(lambda: acked() >= 70, "one-shots fired after the rollback")
    async with running(folder, "new2", {**props, "storageFormat": "2"}, app) as c:
        assert [admin.get(k) for k in formats] == [b"2"] * 4
        await c.publish(
            "work",
            json.dumps({"id": "limited", "due": 0}).encode(),
            {"schedule": "@every 1s", "scheduleLimit": "2", "scheduleId": "limited"},
        )
        await wait_until(lambda: acked() == len(one_shots), "every one-shot", 20)
        await wait_until(lambda: app.count("limited")["limited"] == 2, "the limited schedule's two fires")
        last_run_start = int(time.time() * 1000)
        await wait_until(
            lambda: all(
                any(at > last_run_start for n, _, at in app.acked if n == f"every-{k}") for k in range(3)
            ),
            "every schedule firing after the last upgrade",
        )
    assert not app.early, app.early
    twice = app.twice(skip=("every-", "limited"))
    assert not twice, f"delivered more than once (name: stream ids): {twice}"
    for k in range(3):
        dues = [parse_instant(md["scheduleNext"]) - EVERY_MS for n, md, _ in app.acked if n == f"every-{k}"]
        assert len(dues) == len(set(dues)), f"every-{k}: an occurrence delivered twice"
        assert all((d - dues[0]) % EVERY_MS == 0 for d in dues), f"every-{k} left its grid: {dues}"


async def test_a_rollback_outside_the_window_loses_nothing_once_this_release_runs_again(
    previous_tree: Path,
    folder: Path,
    redis_server: RedisServer,
    redis_client: redis.Redis,
    nodes_of_ten: None,
) -> None:
    """Against the docs' advice, 0.1.0 is run on data whose format was raised and whose long tail
    compaction re-homed: it cannot find the re-homed envelopes, reports them lost as they fall due,
    and drops their index entries; its cancels and replaces leave their copies too. Running this
    release again delivers every dropped message once (late), and nothing cancelled or replaced."""
    props = {**props_for(redis_server), "processingTimeout": "1s", "redeliverInterval": "300ms"}
    app = App()
    tail = BATCH // TAIL_EVERY

    # 1. This release at format 2: a batch whose long tail (half of it with scheduleIds) compaction
    # re-homes, one message later cancelled and one later replaced, both re-homed too.
    async with running(folder, "new1", {**props, "storageFormat": "2"}, app) as c:
        now = int(time.time() * 1000)
        due = now + 9_000
        entries = [
            e if i % (2 * TAIL_EVERY) else _entry(e.entry_id, due, scheduleId=e.entry_id)
            for i, e in enumerate(_batch("c-", now, due))
        ]
        entries += [
            _entry("cancelled", due, scheduleId="cancelled"),
            _entry("replaced-old", due, scheduleId="replaced"),
        ]
        assert not (await c.bulk_publish("work", entries)).failed_entries
        await wait_until(lambda: sum(app.count("c-").values()) == BATCH - tail, "the short delays")
        await wait_until(lambda: redis_client.hlen(MOVED) == tail + 2, "the long tail re-homed")
    assert redis_client.get(FORMAT) == b"2"

    # 2. 0.1.0, outside the window: nothing stops it. It cancels one, replaces one (the new one
    # fires under it), and drops the index entries of the rest as they fall due.
    async with running(folder, "old", props, app, root=previous_tree) as c:
        await c.publish("work", b"", {"scheduleCancel": "true", "scheduleId": "cancelled"})
        now = int(time.time() * 1000)
        await c.publish(
            "work",
            json.dumps({"id": "replaced-new", "due": now + 500}).encode(),
            {"scheduledSendTime": _iso(now + 500), "scheduleId": "replaced"},
        )
        await wait_until(
            lambda: redis_client.get("{app1-delayed}:pending") == b"0", "0.1.0 dropping the tail", 30
        )
        await wait_until(lambda: app.count("replaced-new")["replaced-new"] == 1, "the replacement")
    assert sum(app.count("c-").values()) == BATCH - tail, "0.1.0 delivered a re-homed envelope"

    # 3. This release again: each dropped message is delivered once; nothing cancelled or replaced.
    async with running(folder, "new2", props, app):
        await wait_until(lambda: sum(app.count("c-").values()) == BATCH, "the dropped tail delivered", 20)
        await asyncio.sleep(1.0)  # a second delivery would come now
    assert not app.early, app.early
    counts = Counter(n for n, _, _ in app.acked)
    assert set(app.count("c-")) == {e.entry_id for e in entries if e.entry_id.startswith("c-")}
    assert not app.twice(), f"delivered more than once (name: stream ids): {app.twice()}"
    assert "cancelled" not in counts
    assert "replaced-old" not in counts
    assert counts["replaced-new"] == 1
    history = stream_entries(redis_client, "{app1-delayed}:history")
    recovered = [f for _, f in history if f[b"event"] == b"recovered"]
    assert len(recovered) == tail
    assert redis_client.xlen("app1-delayed") == 0, "copies left on the delayed topic"


CATCHUP_ALL = {"schedule": "@every 1s", "scheduleCatchup": "all"}


async def test_from_release_2_upgrade_rollback_and_raising_to_format_3_lose_nothing(
    release_2_tree: Path,
    folder: Path,
    redis_server: RedisServer,
    redis_client: redis.Redis,
    nodes_of_ten: None,
) -> None:
    """0.2.0 writes format 2. After the upgrade the app stays there: compaction runs (0.2.0 reads
    what it re-homes), a jittered schedule is taken, a catch-up policy (format 3) is refused. 0.2.0
    runs again on all of it and delivers the re-homed tail; while it runs, raising to 3 is refused.
    Raised to 3, the catch-up keys are taken, and 0.2.0 then refuses Init, changing nothing."""
    props = {**props_for(redis_server), "processingTimeout": "1s", "redeliverInterval": "300ms"}
    app = App()
    t0 = int(time.time() * 1000)
    one_shots = [_entry(f"once-{i}", t0 + 1_500 + i * 150) for i in range(100)]

    # 1. Release 0.2.0: a fresh app in its format, 2.
    async with running(folder, "old1", props, app, root=release_2_tree) as c:
        await start_schedules(c, one_shots, 2)
        await wait_until(lambda: len(app.count("once-")) >= 10, "one-shots fired by 0.2.0")
    assert redis_client.get(FORMAT) == b"2"

    # 2. Upgrade: format 2 kept. What format 2 holds is taken, compaction included; catch-up is not.
    async with running(folder, "new1", props, app) as c:
        assert redis_client.get(FORMAT) == b"2"
        for md in (CATCHUP_ALL, {"schedule": "@every 1s", "scheduleCatchupWindow": "1h"}):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await c.publish("work", b"{}", {**md, "scheduleId": "catchup"})
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "storageFormat: 3" in (err.value.details() or ""), err.value.details()
        assert not redis_client.hexists("{app1-delayed}:ids", "catchup")
        await c.publish(
            "work",
            json.dumps({"id": "jit", "due": 0}).encode(),
            {"schedule": "@every 1s", "scheduleJitter": "300ms", "scheduleId": "jit"},
        )
        now = int(time.time() * 1000)
        assert not (await c.bulk_publish("work", _batch("a-", now, now + 9_000))).failed_entries
        await wait_until(lambda: bool(redis_client.exists(MOVED)), "compaction at format 2")
        await wait_until(lambda: app.count("jit")["jit"] >= 1, "the jittered schedule under this release")

    # 3. Roll back to 0.2.0: it reads everything, the re-homed tail and the jittered schedule
    # included. While it runs, a replica of this release cannot raise the format to 3.
    async with running(folder, "old2", props, app, root=release_2_tree):
        jit_before = app.count("jit")["jit"]
        await refused_init(folder, {**props, "storageFormat": "3"}, "delayed-pubsub-f2:app1")
        assert redis_client.get(FORMAT) == b"2"
        await wait_until(lambda: sum(app.count("a-").values()) == BATCH, "batch a's re-homed tail", 30)
        await wait_until(lambda: app.count("jit")["jit"] > jit_before, "the jittered schedule under 0.2.0")

    # 4. Upgrade again and leave the window: the catch-up policy is taken.
    async with running(folder, "new2", {**props, "storageFormat": "3"}, app) as c:
        assert redis_client.get(FORMAT) == b"3"
        await c.publish(
            "work", json.dumps({"id": "catchup", "due": 0}).encode(), {**CATCHUP_ALL, "scheduleId": "catchup"}
        )
        await wait_until(lambda: app.count("catchup")["catchup"] >= 1, "the catch-up schedule")
        await wait_until(lambda: len(app.count("once-")) == len(one_shots), "every one-shot", 20)
        last_run_start = int(time.time() * 1000)
        await wait_until(
            lambda: all(
                any(at > last_run_start for n, _, at in app.acked if n == f"every-{k}") for k in range(2)
            ),
            "every schedule firing after the last upgrade",
        )

    # 5. 0.2.0 on format 3: refused at Init, nothing changed.
    before = {k: redis_client.dump(k) for k in (FORMAT, "{app1-delayed}:ids", "app1-delayed")}
    await refused_init(folder, props, "format 3", root=release_2_tree)
    assert {k: redis_client.dump(k) for k in before} == before

    assert not app.early, app.early
    twice = app.twice(skip=("every-", "jit", "catchup"))
    assert not twice, f"delivered more than once (name: stream ids): {twice}"
    assert set(app.count("once-")) == {e.entry_id for e in one_shots}
    assert set(app.count("a-")) == {f"a-{i}" for i in range(BATCH)}
    for k in range(2):
        dues = [parse_instant(md["scheduleNext"]) - EVERY_MS for n, md, _ in app.acked if n == f"every-{k}"]
        assert len(dues) == len(set(dues)), f"every-{k}: an occurrence delivered twice"
        assert all((d - dues[0]) % EVERY_MS == 0 for d in dues), f"every-{k} left its grid: {dues}"


async def test_a_release_stopped_mid_stream_leaves_nothing_the_app_acked_pending(
    folder: Path, redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    """What every test above counts on: `running` stops the app between messages, so each message it
    recorded as acked reached the component and was XACKed before the release went away; what it had
    not taken stays pending, for the next release to deliver (and the app to count) once."""
    app = App()
    # A wide window: the app has a backlog of received messages when its release stops.
    props = {**props_for(redis_server), "concurrency": "1000"}
    async with running(folder, "stopped", props, app) as c:
        now = int(time.time() * 1000)
        assert not (await c.bulk_publish("work", [_entry(f"m-{i}", now) for i in range(2_000)])).failed_entries
        await wait_until(lambda: len(app.acked) >= 200, "the app acking")
    recorded = {i for ids in app.ids.values() for i in ids}
    assert recorded
    rows: Any = redis_client.xpending_range("work", "app1", "-", "+", 10_000)
    lost = sorted(recorded & {r["message_id"].decode() for r in rows})
    assert not lost, f"{len(lost)} acked, yet pending: {lost[:5]}"
