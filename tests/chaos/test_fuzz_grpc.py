"""Hypothesis over the gRPC socket: Init metadata and publish metadata, topics
and payloads, at the edges (2^63, year 9999, 10^12 seconds, 16 KB values,
control characters, the engine's own keys, other apps' delayed topics).

Each input is accepted and stored as documented, or refused with
INVALID_ARGUMENT (or, for Init, UNAVAILABLE/PERMISSION_DENIED when the
settings point at something that is not there). Never INTERNAL or UNKNOWN,
never a hang (every call has a deadline), never a partial write: a refused
publish leaves Redis exactly as it was.
"""

from __future__ import annotations

import asyncio
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import redis
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from delayed_middleware.clock import SystemClock
from delayed_middleware.publish_keys import DELAY_KEYS, TTL, TTL_IN_SECONDS
from delayed_pubsub.server import ComponentServer
from delayed_pubsub.settings import KNOWN_KEYS
from delayed_pubsub_pb.dapr.proto.components.v1 import common_pb2, pubsub_pb2, pubsub_pb2_grpc
from tests.redis_server import RedisServer

pytestmark = pytest.mark.slow

# Seconds any one call may take before it counts as a hang. Init's own bound
# is 30 s whatever the settings say; the rest answer in milliseconds.
DEADLINE_S = 40.0
MD = (("x-component-instance", "fuzz"),)

EDGES = [
    "",
    " ",
    "0",
    "-0",
    "1",
    "-1",
    str(2**31),
    str(2**63 - 1),
    str(2**63),
    str(-(2**63)),
    str(2**64),
    "1e3",
    "0x10",
    "1_000",
    "٣",
    "²",
    "NaN",
    "inf",
    "true",
    "false",
    "1ns",
    "10ms",
    "-1s",
    "2562047h",
    "2562048h",
    "1000000000000",
    "1000000000000s",
    "9999-12-31T23:59:59Z",
    "9999-12-31T23:59:59.999999999+14:00",
    "0001-01-01T00:00:00Z",
    "1970-01-01T00:00:00Z",
    "2045-11-05T08:15:30-05:00",
    "2045-11-05T08:15:30",
    "@every 1s",
    "* * * * * *",
    "a\x00b",
    "a\nb",
    "\ud7ff\ue000",
    "{app1-delayed}:due",
    "9" * 16_384,
    "x" * 16_384,
]
VALUES = st.one_of(
    st.sampled_from(EDGES),
    st.integers(-(2**70), 2**70).map(str),
    st.text(max_size=40),
)
TOPICS = st.one_of(
    st.sampled_from(
        [
            "orders",
            "",
            "app1-delayed",
            "other-app-delayed",
            "{app1-delayed}:due",
            "{app1-delayed}:stream",
            "{other-delayed}:x",
            "t" * 10_240,
            "orders\x00",
        ]
    ),
    st.text(min_size=1, max_size=20),
)
PUBLISH_KEYS = st.sampled_from([*DELAY_KEYS, TTL, TTL_IN_SECONDS, "rawPayload", "traceid", "x" * 300])


@pytest.fixture(scope="module")
def live_socket(redis_server: RedisServer) -> Iterator[Path]:
    """The component server on its own event loop in a thread, and a blocking stub to it:
    hypothesis drives plain functions."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="component", daemon=True)
    thread.start()
    with tempfile.TemporaryDirectory(prefix="dps-") as d:

        async def start() -> ComponentServer:
            srv = ComponentServer(Path(d) / "delayed-pubsub.sock", SystemClock())
            await srv.start()
            return srv

        srv = asyncio.run_coroutine_threadsafe(start(), loop).result(15)
        yield srv.socket_path
        asyncio.run_coroutine_threadsafe(srv.stop(grace=1), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


@pytest.fixture(scope="module")
def live(live_socket: Path) -> Iterator[pubsub_pb2_grpc.PubSubStub]:
    with grpc.insecure_channel(f"unix://{live_socket}") as channel:
        yield pubsub_pb2_grpc.PubSubStub(channel)  # type: ignore[no-untyped-call]


def call(method: Any, request: Any) -> tuple[grpc.StatusCode, str]:
    try:
        method(request, metadata=MD, timeout=DEADLINE_S)
    except grpc.RpcError as e:
        return e.code(), e.details() or ""
    return grpc.StatusCode.OK, ""


def init(stub: pubsub_pb2_grpc.PubSubStub, props: dict[str, str]) -> tuple[grpc.StatusCode, str]:
    return call(
        stub.Init, pubsub_pb2.PubSubInitRequest(metadata=common_pb2.MetadataRequest(properties=props))
    )


OUTBOX = b"{app1-delayed}:outbox"


def snapshot(admin: redis.Redis) -> dict[bytes, tuple[bytes, int]]:
    """Every key with its type and size: what a partial write would change."""
    out: dict[bytes, tuple[bytes, int]] = {}
    for key in admin.scan_iter(count=1000):
        if key == OUTBOX and not admin.xlen(key):
            continue  # the forwarder (re)creates its empty outbox whenever it likes
        kind: Any = admin.type(key)
        size = {b"stream": admin.xlen, b"zset": admin.zcard, b"hash": admin.hlen, b"list": admin.llen}.get(
            kind, lambda k: 1
        )(key)
        out[key] = (kind, int(size))
    return out


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(props=st.dictionaries(st.sampled_from(sorted(KNOWN_KEYS - {"redisHost"})), VALUES, max_size=6))
def test_init_metadata_is_accepted_or_refused_never_internal_never_hanging(
    live: pubsub_pb2_grpc.PubSubStub, redis_server: RedisServer, props: dict[str, str]
) -> None:
    code, details = init(live, {**props, "redisHost": redis_server.address})
    event(f"Init {code.name}")
    assert code in (
        grpc.StatusCode.OK,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.UNAVAILABLE,  # TLS, Sentinel or cluster settings against a plain node
        grpc.StatusCode.PERMISSION_DENIED,  # a password the server does not expect
    ), (code, details[:300])
    assert len(details) <= 2100
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        assert any(k in details for k in (*props, "redisHost")), details[:300]


@pytest.fixture(scope="module")
def delayed_instance(
    live: pubsub_pb2_grpc.PubSubStub, redis_server: RedisServer
) -> pubsub_pb2_grpc.PubSubStub:
    code, details = init(
        live, {"redisHost": redis_server.address, "consumerID": "app1", "enableDelayedMessaging": "true"}
    )
    assert code == grpc.StatusCode.OK, details
    return live


@settings(max_examples=600, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    topic=TOPICS,
    data=st.binary(max_size=256),
    metadata=st.dictionaries(PUBLISH_KEYS, VALUES, max_size=4),
)
def test_publish_is_stored_as_documented_or_refused_with_nothing_written(
    delayed_instance: pubsub_pb2_grpc.PubSubStub,
    redis_client: redis.Redis,
    topic: str,
    data: bytes,
    metadata: dict[str, str],
) -> None:
    redis_client.flushall()
    before = snapshot(redis_client)
    code, details = call(
        delayed_instance.Publish,
        pubsub_pb2.PublishRequest(topic=topic, data=data, metadata=metadata, pubsub_name="fuzz"),
    )
    event(f"Publish {code.name}")
    assert code in (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT), (code, details[:300])
    assert len(details) <= 2100
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        assert snapshot(redis_client) == before, "a refused publish wrote something"
    elif set(metadata).isdisjoint(DELAY_KEYS):
        entries: Any = redis_client.xrange(topic)
        assert [f[b"data"] for _, f in entries] == [data]


def test_a_16_mb_payload_round_trips_byte_exact(
    delayed_instance: pubsub_pb2_grpc.PubSubStub, redis_client: redis.Redis
) -> None:
    redis_client.flushall()
    data = bytes(range(256)) * (16 * 1024 * 1024 // 256)
    code, details = call(
        delayed_instance.Publish, pubsub_pb2.PublishRequest(topic="big", data=data, pubsub_name="fuzz")
    )
    assert code == grpc.StatusCode.OK, details
    entries: Any = redis_client.xrange("big")
    assert entries[0][1][b"data"] == data


def test_ten_thousand_metadata_keys_are_stored_verbatim(
    delayed_instance: pubsub_pb2_grpc.PubSubStub, redis_client: redis.Redis
) -> None:
    redis_client.flushall()
    md = {f"k{i}": f"v{i}" for i in range(10_000)}
    code, details = call(
        delayed_instance.Publish,
        pubsub_pb2.PublishRequest(topic="many", data=b"x", metadata=md, pubsub_name="fuzz"),
    )
    assert code == grpc.StatusCode.OK, details
    assert redis_client.xlen("many") == 1


@pytest.mark.parametrize("method", ["Init", "Publish", "BulkPublish"])
def test_malformed_protobuf_gets_a_status_and_the_server_keeps_serving(
    live_socket: Path, delayed_instance: pubsub_pb2_grpc.PubSubStub, redis_client: redis.Redis, method: str
) -> None:
    redis_client.flushall()
    with grpc.insecure_channel(f"unix://{live_socket}") as channel:
        raw = channel.unary_unary(
            f"/dapr.proto.components.v1.PubSub/{method}", request_serializer=None, response_deserializer=None
        )
        for garbage in (b"\xff\xff\xff\xff", b"\x0a\xff\xff\xff\xff\x0f", bytes(range(256))):
            with pytest.raises(grpc.RpcError) as err:
                raw(garbage, metadata=MD, timeout=DEADLINE_S)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "malformed request" in (err.value.details() or "")
    assert snapshot(redis_client) == {}  # nothing written
    code, details = call(
        delayed_instance.Publish, pubsub_pb2.PublishRequest(topic="after", data=b"x", pubsub_name="fuzz")
    )
    assert code == grpc.StatusCode.OK, details
