"""Redis frozen (SIGSTOP) and Redis killed and restarted with AOF `appendfsync
always`, under publishes and an open PullMessages stream.

What a user checks: a publish during the outage fails fast with UNAVAILABLE
(daprd's resiliency can retry it), the open stream is still open afterwards and
delivers again, no accepted publish is lost, and how long recovery takes.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable

import grpc
import pytest

from delayed_middleware.entry import decode_entry
from tests.chaos.conftest import figure
from tests.components.driver import Component, Stream
from tests.redis_server import RedisServer

Factory = Callable[[str], Component]

# readTimeout + writeTimeout = 1 s: the bound on any one Redis call.
PROPS = {
    "consumerID": "app1",
    "readTimeout": "500ms",
    "writeTimeout": "500ms",
    "dialTimeout": "500ms",
    "processingTimeout": "2s",
    "redeliverInterval": "500ms",
    "enableDelayedMessaging": "true",
}


class Ledger:
    """Publishes and their outcome: accepted (OK), failed (with the code), and what arrived."""

    def __init__(self, c: Component) -> None:
        self.c = c
        self.accepted: set[bytes] = set()
        self.accepted_at: list[float] = []
        self.accepted_when: dict[bytes, float] = {}
        self.failed: dict[bytes, grpc.StatusCode] = {}
        self.slowest_failure_s = 0.0
        self.received: list[bytes] = []
        self._n = 0

    async def publish(self, tag: str, metadata: dict[str, str] | None = None) -> bool:
        self._n += 1
        data = f"{tag}-{self._n}".encode()
        started = time.monotonic()
        try:
            await self.c.publish("orders", data, metadata)
        except grpc.aio.AioRpcError as e:
            self.failed[data] = e.code()
            self.slowest_failure_s = max(self.slowest_failure_s, time.monotonic() - started)
            return False
        self.accepted.add(data)
        self.accepted_at.append(time.monotonic())
        self.accepted_when[data] = self.accepted_at[-1]
        return True

    async def drain(self, stream: Stream, within: float, expected: set[bytes] | None = None) -> None:
        """Receive (and ack) until every accepted message (or every one of `expected`) arrived."""
        want = self.accepted if expected is None else expected
        deadline = time.monotonic() + within
        while not want <= set(self.received):
            left = deadline - time.monotonic()
            assert left > 0, f"lost: {sorted(want - set(self.received))[:10]}"
            msg = await stream.next(within=left)
            self.received.append(msg.data)
            await stream.ack(msg.id)
        # Whatever else is in flight (failed publishes that landed after all).
        while not await stream.nothing_for(1.0):
            while not stream.received.empty():
                msg = stream.received.get_nowait()
                self.received.append(msg.data)
                await stream.ack(msg.id)

    def duplicates(self) -> list[bytes]:
        return [d for d in set(self.received) if self.received.count(d) > 1]


async def test_frozen_redis_fails_publishes_fast_and_the_stream_resumes_losing_nothing(
    component: Factory, own_redis: RedisServer
) -> None:
    c = component("delayed")
    await c.init({**PROPS, "redisHost": own_redis.address})
    stream = await c.subscribe("orders")
    ledger = Ledger(c)
    for _ in range(20):
        assert await ledger.publish("before")
    # Due in the middle of the freeze: must fire once Redis thaws.
    assert await ledger.publish("delayed", {"scheduledSendDelay": "1500ms"})
    assert own_redis.proc is not None
    pid = own_redis.proc.pid

    os.kill(pid, signal.SIGSTOP)
    frozen_at = time.monotonic()
    try:
        while time.monotonic() - frozen_at < 3.0:
            results = await asyncio.gather(*(ledger.publish("frozen") for _ in range(5)))
            assert not any(results), "a publish succeeded against a frozen Redis"
    finally:
        os.kill(pid, signal.SIGCONT)
    thawed_at = time.monotonic()

    assert set(ledger.failed.values()) == {grpc.StatusCode.UNAVAILABLE}
    # Fast: bounded by readTimeout + writeTimeout (1 s), plus scheduling slack.
    assert ledger.slowest_failure_s < 2.5, ledger.slowest_failure_s

    while not await ledger.publish("after"):
        assert time.monotonic() - thawed_at < 10, "publishes did not recover"
    figure("frozen 3s: first accepted publish after SIGCONT", time.monotonic() - thawed_at, "s")
    first_after = max(d for d in ledger.accepted if d.startswith(b"after"))
    for _ in range(20):
        assert await ledger.publish("after")

    await ledger.drain(stream, within=20)
    figure("frozen 3s: every accepted message delivered after SIGCONT", time.monotonic() - thawed_at, "s")
    assert stream.ended.is_set() is False, "the PullMessages stream ended"
    assert first_after in ledger.received
    assert ledger.duplicates() == []
    # A publish reported failed may still have landed: its XADD sat in Redis's
    # socket buffer and ran on SIGCONT. Counted, never delivered twice.
    landed = [d for d in ledger.failed if d in ledger.received]
    figure("frozen 3s: publishes reported failed that landed anyway", len(landed), "msgs")
    figure("frozen 3s: publishes reported failed", len(ledger.failed), "msgs")


@pytest.mark.parametrize(
    ("signal_name", "fsync", "down_s"),
    [("SIGKILL", "always", 10.0), ("SIGTERM", "always", 2.0), ("SIGKILL", "everysec", 2.0)],
)
async def test_redis_killed_under_load_and_restarted_with_aof_delivers_every_publish_redis_kept(
    component: Factory, own_redis: RedisServer, signal_name: str, fsync: str, down_s: float
) -> None:
    """Every publish Redis still holds after the restart is delivered, once, on
    the stream that stayed open, and publishes go on being accepted.

    With `always` that is every accepted publish: Redis fsyncs before it replies.
    With `everysec` Redis itself may lose acknowledged writes when only its
    process dies: while a background fsync is slow (a busy disk) it postpones
    its AOF write() for up to 2 s and replies meanwhile, so a SIGKILL in that
    window drops what it acknowledged. Measured on the loaded dev machine: 16 runs
    in 165, up to ~480 publishes. Those never reach any subscriber (they
    are not in Redis); the figure counts them, and they are all from before the
    kill."""
    admin = own_redis.client()
    admin.config_set("appendfsync", fsync)
    admin.close()
    own_redis.extra_args = (*own_redis.extra_args, "--appendfsync", fsync)  # kept across the restart
    c = component("delayed")
    await c.init({**PROPS, "redisHost": own_redis.address})
    stream = await c.subscribe("orders")
    ledger = Ledger(c)
    stop = asyncio.Event()

    async def writer() -> None:
        while not stop.is_set():
            if not await ledger.publish("load"):
                await asyncio.sleep(0.05)

    writers = [asyncio.create_task(writer()) for _ in range(8)]
    await asyncio.sleep(0.7)
    assert own_redis.proc is not None
    own_redis.proc.send_signal(getattr(signal, signal_name))
    own_redis.proc.wait(timeout=10)
    own_redis.proc = None
    down_at = time.monotonic()
    await asyncio.sleep(down_s)  # down: every publish fails, fast
    failed_while_down = len(ledger.failed)
    own_redis.start()
    restarted_at = time.monotonic()
    await asyncio.sleep(1.0)
    stop.set()
    await asyncio.gather(*writers)

    assert ledger.accepted, "nothing was accepted before the kill"
    assert failed_while_down > 0
    assert set(ledger.failed.values()) == {grpc.StatusCode.UNAVAILABLE}
    assert ledger.slowest_failure_s < 2.5, ledger.slowest_failure_s
    first_after = min(t for t in ledger.accepted_at if t > restarted_at)
    accepted_after = {d for d, t in ledger.accepted_when.items() if t > restarted_at}
    with own_redis.client() as r:
        kept = {decode_entry(fields).data for _, fields in r.xrange("orders")}
    lost_by_redis = ledger.accepted - kept
    if fsync == "always":
        assert lost_by_redis == set(), f"Redis lost {len(lost_by_redis)} acknowledged writes"
    # Whatever Redis lost, it lost before the kill: nothing accepted since.
    assert not lost_by_redis & accepted_after
    await ledger.drain(stream, within=30, expected=ledger.accepted & kept)
    name = f"redis {signal_name} + restart, appendfsync {fsync}"
    figure(
        f"{name}: accepted publishes that Redis lost (SIGKILL mid-postponed AOF write)",
        len(lost_by_redis),
        "msgs",
    )
    figure(f"{name}: accepted publishes (all Redis kept delivered)", len(ledger.accepted), "msgs")
    figure(f"{name}: drained after restart", time.monotonic() - restarted_at, "s")
    figure(f"{name}: down", restarted_at - down_at, "s")
    # own_redis.start() returns once Redis answers PING: this is the component's part of the recovery.
    figure(f"{name}: first accepted publish after Redis answers again", first_after - restarted_at, "s")
    assert stream.ended.is_set() is False
    assert ledger.duplicates() == []
