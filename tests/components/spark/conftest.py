"""One real local SparkSession per test run (its start-up takes ~15 s), and history/envelope writers.

History entries are written here with XADD in the documented format
(delayed_middleware.history) because the engine on main does not write its
lifecycle history yet (engine v2, issue 7); pending envelopes come from the
real component, published over its gRPC socket.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import pytest
import redis

from delayed_middleware.keys import EngineKeys, delayed_topic
from delayed_pubsub.spark.session import build_session
from tests.redis_server import RedisServer

APP = "app1"  # the consumerID the component fixtures (tests/components/conftest.py) use


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    session = build_session("local[2]", app_name="delayed-pubsub tests")
    yield session
    session.stop()


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
