"""One real local SparkSession per test run (its start-up takes ~15 s), and history/envelope writers.

History entries are written here with XADD in the documented format
(delayed_middleware.history), so that each test holds exactly the records it
reads; pending envelopes come from the real component, published over its gRPC
socket.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis

from delayed_middleware import lua_scripts
from delayed_middleware.clock import ManualClock
from delayed_middleware.engine import DelayEngine
from delayed_middleware.envelope import Envelope
from delayed_middleware.keys import EngineKeys, delayed_topic
from delayed_pubsub.spark.session import build_session
from tests.redis_server import RedisServer
from tests.spark_cluster import StandaloneCluster, bare_python

APP = "app1"  # the consumerID the component fixtures (tests/components/conftest.py) use


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    session = build_session("local[2]", app_name="delayed-pubsub tests")
    yield session
    session.stop()


@pytest.fixture(scope="session")
def standalone(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StandaloneCluster]:
    """One standalone master and worker (2 cores) for the whole run: each takes ~20 s to start."""
    cluster = StandaloneCluster(tmp_path_factory.mktemp("spark-standalone"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def worker_python(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The Python the cluster's workers run: the venv's packages without this project, which
    must reach them the documented way (delayed_pubsub.spark.ship)."""
    return str(bare_python(tmp_path_factory.mktemp("worker-python")))


@pytest.fixture
def options(redis_server: RedisServer, redis_client: redis.Redis) -> dict[str, str]:
    """Data source options for the test Redis (flushed: redis_client is requested for that)."""
    return {"redisHost": f"127.0.0.1:{redis_server.port}", "consumerID": APP}


def history_key(app: str = APP) -> str:
    return EngineKeys.for_topic(delayed_topic(app)).history


def add_history(client: redis.Redis, records: list[Mapping[str, Any]], app: str = APP) -> list[str]:
    """XADD lifecycle records (the fields of delayed_middleware.history) in one pipeline."""
    pipe = client.pipeline(transaction=False)
    for rec in records:
        fields = {
            "event": "fired",
            "at": 0,
            "id": "",
            "sid": "",
            "topic": "",
            "kind": "oneshot",
            "due": "",
            "late": "",
            "size": 0,
            "attempt": 1,
            "reason": "",
            "schedule": "",
            **rec,
        }
        pipe.xadd(history_key(app), {k: str(v) for k, v in fields.items()})
    return [i.decode() for i in pipe.execute()]


def fired(topic: str, due_ms: int, late_ms: int, **extra: Any) -> dict[str, Any]:
    """A `fired` record as the engine writes it: at = due + lateness."""
    return {
        "event": "fired",
        "topic": topic,
        "due": due_ms,
        "at": due_ms + late_ms,
        "late": late_ms,
        "size": 10,
        **extra,
    }


class CompactionPass:
    """Compaction of the app's delayed topic, run a slice at a time by the engine's own script
    (lua/compact.lua), so a test can move envelopes between a reader's pages."""

    def __init__(self, client: redis.Redis, chunk: int, app: str = APP) -> None:
        self._client = client
        self._keys = EngineKeys.for_topic(delayed_topic(app))
        self._script = client.register_script(lua_scripts.COMPACT)
        self._chunk = chunk
        self._cursor: str | None = None
        self._end = ""

    def step(self) -> int:
        """Re-homes up to `chunk` envelopes to the tail; when no pass is under way, starts one
        over the stream as it is now. Returns how many moved."""
        if self._cursor is None:
            top: Any = self._client.xrevrange(self._keys.stream, count=1)
            if not top:
                return 0
            self._cursor, self._end = "-", top[0][0].decode()
        cursor, moved = self._script(
            keys=self._keys.script_keys, args=[self._cursor, self._end, self._chunk, 0]
        )
        self._cursor = cursor.decode() or None
        return int(moved)

    def whole_pass(self) -> int:
        """Runs a pass from the start to its end; how many envelopes it re-homed."""
        total = self.step()
        while self._cursor is not None:
            total += self.step()
        return total


def schedule_waiting(port: int, rounds: int, per_round: int, due_ms: int) -> list[str]:
    """Schedules rounds x per_round envelopes due at `due_ms` through the real engine, a few
    milliseconds apart (so the stream spans several partitions); their ids, in order."""

    async def run() -> list[str]:
        client = aioredis.Redis(port=port)
        engine = DelayEngine(
            client, EngineKeys.for_topic(delayed_topic(APP)), ManualClock(due_ms - 3_600_000)
        )
        env = Envelope(id="", topic="later", due_ms=due_ms, published_at_ms=due_ms - 3_600_000, message=b"{}")
        ids: list[str] = []
        try:
            for _ in range(rounds):
                ids += await engine.schedule([env] * per_round)
                await asyncio.sleep(0.003)
        finally:
            await client.aclose()
        return ids

    return asyncio.run(run())
