"""Overload: past maxInflightPublishes a publish is refused at once with RESOURCE_EXHAUSTED.

Never CANCELLED for a call the client did not cancel, never a connection-pool
error, Ping answered throughout, and every publish answered OK delivered once.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from delayed_middleware.entry import decode_entry
from delayed_middleware.keys import delayed_topic
from delayed_pubsub.admission import QUEUE_SAMPLE_S, Admission
from delayed_pubsub.server import ComponentServer
from delayed_pubsub_pb.dapr.proto.components.v1 import pubsub_pb2, pubsub_pb2_grpc
from tests.chaos.proxy import LateReplyProxy
from tests.components.conftest import Ghz, running
from tests.components.driver import Component
from tests.components.serve import Serve
from tests.redis_server import RedisServer, stream_entries
from tests.waiting import wait_until


class HeldWrites:
    """Holds every write to Redis (CLIENT PAUSE WRITE) between hold() and release(): publishes that
    reached Redis stay in flight, while reads and PING go on."""

    def __init__(self, client: redis.Redis) -> None:
        self._client = client

    def hold(self) -> None:
        self._client.client_pause(30_000, all=False)

    def release(self) -> None:
        self._client.client_unpause()


@pytest.fixture
def writes(redis_client: redis.Redis) -> Iterator[HeldWrites]:
    held = HeldWrites(redis_client)
    try:
        yield held
    finally:
        held.release()


@pytest.mark.parametrize(
    ("held", "running", "draw", "admitted"),
    [
        (1, 0, 0.0, True),  # idle
        (100, 0, 0.0, True),  # at the bound: held counts this call too
        (101, 0, 0.0, False),  # just past it, an unlucky draw
        (101, 0, 0.02, True),  # just past it: refused 1 time in 100
        (150, 0, 0.49, False),  # half way to twice the bound: refused half the time
        (150, 0, 0.51, True),
        (200, 0, 0.999, False),  # twice the bound: always refused
        (5_000, 0, 0.999, False),
        (1, 100, 0.999, False),  # the instance itself runs `limit` publishes
        (1, 99, 0.999, True),
    ],
)
def test_past_the_bound_a_publish_is_refused_with_a_probability_growing_to_certainty_at_twice_the_bound(
    held: int, running: int, draw: float, admitted: bool
) -> None:
    admission = Admission(100, "orders")
    admission.in_flight = running
    assert admission.try_enter(held, lambda: draw) is admitted
    assert admission.in_flight == running + admitted
    if not admitted:
        assert "bound of 100 (maxInflightPublishes)" in admission.refusal()


async def test_a_publish_past_the_bound_is_refused_at_once_naming_the_setting_and_nothing_is_stored(
    server: ComponentServer,
    component: Callable[[str], Component],
    props: dict[str, str],
    redis_client: redis.Redis,
    writes: HeldWrites,
) -> None:
    c = component("bounded")
    await c.init({**props, "maxInflightPublishes": "2"})
    writes.hold()
    admission = server.instances.get("bounded").admission
    held = [asyncio.create_task(c.publish("orders", f"held {i}".encode())) for i in range(2)]
    await wait_until(lambda: admission.in_flight == 2, "two publishes in flight", within_s=5)

    started = time.monotonic()
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await c.publish("orders", b"one too many")
    with pytest.raises(grpc.aio.AioRpcError) as refused_bulk:
        await c.bulk_publish("orders", [pubsub_pb2.BulkMessageEntry(entry_id="1", event=b"bulk too")])
    # Refused at once: not after the held calls' Redis timeout (readTimeout, 3 s).
    assert time.monotonic() - started < 1.0
    for error in (refused.value, refused_bulk.value):
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "bound of 2 (maxInflightPublishes)" in (error.details() or "")
        assert "maxInflightPublishes" in (error.details() or "")
    refused_total = server.metrics.registry.get_sample_value(
        "delayed_pubsub_refused_publishes_total", {"instance": "bounded"}
    )
    assert refused_total == 2
    # Not bounded: Ping and Features answer while publishers are refused.
    await asyncio.wait_for(c.ping(), 1.0)
    assert "BULK_PUBSUB" in await asyncio.wait_for(c.features(), 1.0)

    writes.release()
    await asyncio.gather(*held)
    assert sorted(f[b"data"] for _, f in stream_entries(redis_client, "orders")) == [b"held 0", b"held 1"]
    # The slots are free again: a publish is admitted once gRPC's count of calls held has been
    # read again (every QUEUE_SAMPLE_S; gRPC counts a finished call a moment after its answer).
    assert admission.in_flight == 0
    codes = []
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        await asyncio.sleep(QUEUE_SAMPLE_S)
        try:
            await c.publish("orders", b"after")
        except grpc.aio.AioRpcError as e:
            codes.append(e.code())
            continue
        codes.append(grpc.StatusCode.OK)
        break
    assert codes[-1] == grpc.StatusCode.OK, codes
    assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}
    assert redis_client.xlen("orders") == 3


async def test_open_streams_do_not_count_as_queued_publishes_and_publishes_are_admitted_beside_them(
    server: ComponentServer,
    component: Callable[[str], Component],
    channel: grpc.aio.Channel,
    props: dict[str, str],
    redis_client: redis.Redis,
) -> None:
    c = component("streams")
    await c.init({**props, "maxInflightPublishes": "2"})
    # Nine streams held open by gRPC, past twice the bound: three of each kind the server runs.
    health = health_pb2_grpc.HealthStub(channel)
    watches = [health.Watch(health_pb2.HealthCheckRequest(service="")) for _ in range(3)]
    for watch in watches:
        await watch.read()
    reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
    reflections = [reflection.ServerReflectionInfo() for _ in range(3)]
    for r in reflections:
        await r.write(reflection_pb2.ServerReflectionRequest(list_services=""))
        await r.read()
    subscriptions = [await c.subscribe(f"topic{i}") for i in range(3)]
    await wait_until(lambda: server.admission.streams == 9, "nine streams counted", within_s=5)

    # Sequential publishes for several of gRPC's readings of the calls it holds: none is refused.
    for i in range(40):
        await c.publish("orders", f"beside streams {i}".encode())
        await asyncio.sleep(QUEUE_SAMPLE_S / 2)
    assert redis_client.xlen("orders") == 40

    for watch in watches:
        watch.cancel()
    for r in reflections:
        r.cancel()
    for sub in subscriptions:
        await sub.cancel()
    await wait_until(lambda: server.admission.streams == 0, "every stream uncounted", within_s=5)


async def test_150_delayed_publishes_held_by_a_stalled_redis_fail_none_for_want_of_a_connection_and_ping_answers(
    server: ComponentServer,
    component: Callable[[str], Component],
    props: dict[str, str],
    redis_client: redis.Redis,
    writes: HeldWrites,
) -> None:
    # poolSize left at 0 ("no limit"): each delayed publish holds a connection until Redis answers.
    c = component("delayed")
    await c.init({**props, "enableDelayedMessaging": "true", "maxInflightPublishes": "1000"})
    writes.hold()
    admission = server.instances.get("delayed").admission
    held = [
        asyncio.create_task(c.publish("orders", f"{i}".encode(), {"scheduledSendDelay": "1h"}))
        for i in range(150)
    ]
    await wait_until(
        lambda: admission.in_flight == 150 or any(t.done() for t in held), "150 publishes in flight", 5
    )
    await asyncio.wait_for(c.ping(), 1.0)
    writes.release()
    results = await asyncio.gather(*held, return_exceptions=True)
    assert [r for r in results if r is not None] == []
    assert redis_client.xlen("app1-delayed") == 150


def _delivered(client: redis.Redis, topic: str) -> Counter[str]:
    """How many times each publish (by its metadata `n`) landed on `topic`."""
    return Counter(decode_entry(f).metadata["n"] for _, f in stream_entries(client, topic))


@pytest.fixture
def serve_props(redis_server: RedisServer, redis_client: redis.Redis) -> dict[str, str]:
    """Init metadata of a delayed instance on the test Redis (flushed: redis_client is requested
    for that), with the component's own timings, as the serve process runs it."""
    return {
        "redisHost": f"127.0.0.1:{redis_server.port}",
        "consumerID": "app1",
        "enableDelayedMessaging": "true",
    }


@pytest.fixture
def serve_process() -> Iterator[Serve]:
    with tempfile.TemporaryDirectory(prefix="dps-") as d:  # short: socket paths max 107 bytes
        s = Serve(Path(d), "overload")
        try:
            yield s
        finally:
            s.stop()


@pytest.mark.slow
async def test_500_callers_at_4x_the_sustainable_rate_get_only_ok_resource_exhausted_or_a_refused_stream_and_every_ok_is_delivered_once(
    serve_process: Serve, serve_props: dict[str, str], redis_client: redis.Redis, ghz: Ghz
) -> None:
    sock = serve_process.socket
    async with grpc.aio.insecure_channel(f"unix://{sock}") as ch:
        c = Component(ch, "delayed")
        await c.init(serve_props)
        # The sustainable rate, here and now: 64 callers back to back (a Go client, as daprd is).
        sustainable = await ghz.publish(sock, "delayed", "calibrate", requests=3000, callers=64)
        assert sustainable.codes == {"OK": 3000}, sustainable.errors
        rate = 4 * sustainable.rps

        pings: list[float] = []
        done = asyncio.Event()

        async def ping_meanwhile() -> None:
            while not done.is_set():
                t = time.monotonic()
                await c.ping()
                pings.append(time.monotonic() - t)
                await asyncio.sleep(0.1)

        pinger = asyncio.create_task(ping_meanwhile())
        # 500 callers sharing 4x that rate, for about 5 s.
        overload = await ghz.publish(sock, "delayed", "orders", requests=int(rate * 5), callers=500, rps=rate)
        done.set()
        await pinger

    print(
        f"sustainable {sustainable.rps:.0f}/s, offered {rate:.0f}/s, got {overload.rps:.0f}/s: {overload.codes}, slowest Ping {max(pings):.3f} s"
    )
    # Admission control refuses the excess (RESOURCE_EXHAUSTED naming maxInflightPublishes). 500
    # callers sit near the connection's stream limit (MAX_CONCURRENT_STREAMS, 512), and a stream
    # the server has not yet seen closed still counts, so a new one may be refused by gRPC itself
    # (REFUSED_STREAM: UNAVAILABLE, nothing read). Neither stores anything: checked below.
    assert "OK" in overload.codes, overload.codes
    assert "ResourceExhausted" in overload.codes, overload.codes
    assert set(overload.codes) <= {"OK", "ResourceExhausted", "Unavailable"}, overload.errors
    refused = [e for e in overload.errors if "maxInflightPublishes" not in e]
    assert all("Unavailable" in e for e in refused), refused[:5]
    assert overload.codes.get("Unavailable", 0) <= overload.codes["ResourceExhausted"], overload.codes
    ok = overload.codes["OK"]
    await wait_until(lambda: redis_client.xlen("orders") >= ok, f"{ok} delivered", within_s=60)
    await asyncio.sleep(1.5)  # anything fired twice, or a refused one fired, would land by now
    delivered = _delivered(redis_client, "orders")
    assert [n for n, times in delivered.items() if times > 1] == []
    assert len(delivered) == ok
    assert all(0 <= int(n) < overload.requests for n in delivered)
    # Ping stayed answerable: never refused or cancelled, each answer well inside daprd's timeouts.
    assert len(pings) >= 10
    assert max(pings) < 2.0


@pytest.mark.slow
async def test_after_3000_callers_on_one_connection_publishes_are_admitted_again(
    serve_process: Serve, serve_props: dict[str, str], redis_client: redis.Redis, ghz: Ghz
) -> None:
    """At 3,000 callers gRPC's core itself cancels calls that wait too long to be taken (before
    any of our code sees them); the bound must not count those as held for ever."""
    sock = serve_process.socket
    async with grpc.aio.insecure_channel(f"unix://{sock}") as ch:
        await Component(ch, "delayed").init(serve_props)
        flood = await ghz.publish(sock, "delayed", "flood", requests=9000, callers=3000)
        assert flood.codes.get("ResourceExhausted", 0) > 0, flood.codes
        calm = await ghz.publish(sock, "delayed", "calm", requests=1000, callers=4)
    print(f"3,000 callers: {flood.codes}; then 4 callers: {calm.codes}")
    assert calm.codes == {"OK": 1000}, calm.errors[:3]


# What a caller may be told when thousands of calls are in flight on its connection: served,
# refused by admission control, or its stream refused by gRPC (never read). Never CANCELLED.
ANSWERS = {"OK", "RESOURCE_EXHAUSTED", "UNAVAILABLE"}
FLOOD = 3000
DEADLINE_S = 10.0


async def publish_flood(channel: grpc.aio.Channel, instance: str, topic: str, n: int) -> list[str]:
    """`n` concurrent delayed publishes (due in 1 s, each with its number as metadata `n`) on
    `channel`, each with a DEADLINE_S deadline: the status code name of each, by number."""
    stub = pubsub_pb2_grpc.PubSubStub(channel)  # type: ignore[no-untyped-call]
    md = (("x-component-instance", instance),)

    async def one(i: int) -> str:
        request = pubsub_pb2.PublishRequest(
            pubsub_name=instance, topic=topic, data=b"{}", metadata={"scheduledSendDelay": "1s", "n": str(i)}
        )
        try:
            await stub.Publish(request, metadata=md, timeout=DEADLINE_S)
        except grpc.aio.AioRpcError as e:
            return str(e.code().name)
        return "OK"

    return list(await asyncio.gather(*(one(i) for i in range(n))))


@pytest.mark.slow
async def test_3000_publishes_in_flight_on_one_connection_end_ok_refused_or_unavailable_never_cancelled(
    serve_process: Serve, serve_props: dict[str, str], redis_client: redis.Redis
) -> None:
    async with grpc.aio.insecure_channel(f"unix://{serve_process.socket}") as ch:
        await Component(ch, "delayed").init(serve_props)
        codes = await publish_flood(ch, "delayed", "orders", FLOOD)
    counts = Counter(codes)
    print(f"{FLOOD} publishes on one connection: {dict(counts)}")
    assert set(counts) <= ANSWERS, counts
    # Every OK fires once, nothing refused fires.
    ok = {str(n) for n, code in enumerate(codes) if code == "OK"}
    await wait_until(lambda: redis_client.xlen("orders") >= len(ok), f"{len(ok)} delivered", within_s=60)
    await asyncio.sleep(1.5)  # anything fired twice, or a refused one fired, would land by now
    delivered = _delivered(redis_client, "orders")
    assert [n for n, times in delivered.items() if times > 1] == []
    assert set(delivered) == ok


@pytest.mark.slow
async def test_3000_publishes_from_a_go_client_on_one_connection_are_never_cancelled(
    serve_process: Serve, serve_props: dict[str, str], redis_client: redis.Redis, ghz: Ghz
) -> None:
    """grpc-go, daprd's client: the same flood, the same three answers."""
    sock = serve_process.socket
    async with grpc.aio.insecure_channel(f"unix://{sock}") as ch:
        await Component(ch, "delayed").init(serve_props)
    flood = await ghz.publish(sock, "delayed", "orders", requests=FLOOD, callers=FLOOD, timeout_s=DEADLINE_S)
    print(f"{FLOOD} Go callers on one connection: {flood.codes}")
    assert set(flood.codes) <= {"OK", "ResourceExhausted", "Unavailable"}, flood.errors[:5]
    ok = flood.codes.get("OK", 0)
    await wait_until(lambda: redis_client.xlen("orders") >= ok, f"{ok} delivered", within_s=60)
    await asyncio.sleep(1.5)
    delivered = _delivered(redis_client, "orders")
    assert [n for n, times in delivered.items() if times > 1] == []
    assert len(delivered) == ok


async def test_a_publish_its_caller_cancelled_may_be_stored_and_retried_with_its_schedule_id_fires_once(
    component: Callable[[str], Component],
    props: dict[str, str],
    redis_server: RedisServer,
    redis_client: redis.Redis,
) -> None:
    """A CANCELLED the caller caused (its own cancel or deadline, once the call reached the
    component) does not mean "not stored": here Redis has run the component's write and its reply
    is held back on the wire when the caller cancels. A caller that retries gives the publish a
    scheduleId: the retry replaces what the first try stored, and the message fires once."""
    body = b"stored-then-cancelled"
    # Due after the held reply (and so the retry) is through: a retry after the message fired is
    # a new message, whatever its scheduleId.
    send = {"scheduledSendDelay": "15s", "scheduleId": "job-cancelled"}
    async with running(LateReplyProxy(redis_server.port, body, delay_s=6.0)) as proxy:
        c = component("delayed")
        await c.init({**props, "redisHost": f"127.0.0.1:{proxy.port}", "enableDelayedMessaging": "true"})
        # Redis knows the schedule script by now: the held call is the write itself.
        await c.publish("warm-up", b"x", {"scheduledSendDelay": "1h"})
        proxy.armed = True
        request = pubsub_pb2.PublishRequest(pubsub_name="delayed", topic="orders", data=body, metadata=send)
        call = c.stub.Publish(request, metadata=c.md)
        await wait_until(lambda: proxy.held == 1, "the publish's write sent to Redis", within_s=10)
        await wait_until(lambda: redis_client.xlen(delayed_topic("app1")) == 2, "it stored", within_s=4)
        call.cancel()
        assert await call.code() == grpc.StatusCode.CANCELLED
        # Stored, though its caller heard CANCELLED: the retry must not make it fire twice.
        await c.publish("orders", body, send)
        # (The component reaches Redis through the proxy: it fires while the proxy runs.)
        await wait_until(lambda: redis_client.xlen("orders") >= 1, "it fired", within_s=45)
        await asyncio.sleep(1.5)  # a second copy, had the retry not replaced the first try
    assert [f[b"data"] for _, f in stream_entries(redis_client, "orders")] == [body]
