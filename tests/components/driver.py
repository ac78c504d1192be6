"""Drives the component over its unix socket the way daprd does.

Every call carries `x-component-instance`; PullMessages sends the topic first,
then one ack per message, and never re-opens a stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from delayed_middleware.instants import format_instant
from delayed_middleware.keys import EngineKeys, shard_topics
from delayed_pubsub_pb.dapr.proto.components.v1 import common_pb2, pubsub_pb2, pubsub_pb2_grpc
from tests.redis_server import RedisCluster


class Component:
    """One component instance as daprd sees it."""

    def __init__(self, channel: grpc.aio.Channel, name: str) -> None:
        self.name = name
        self.stub = pubsub_pb2_grpc.PubSubStub(channel)  # type: ignore[no-untyped-call]
        self.md = (("x-component-instance", name),)

    async def init(self, props: Mapping[str, str]) -> None:
        await self.stub.Init(
            pubsub_pb2.PubSubInitRequest(metadata=common_pb2.MetadataRequest(properties=dict(props))),
            metadata=self.md,
        )

    async def features(self) -> list[str]:
        reply = await self.stub.Features(common_pb2.FeaturesRequest(), metadata=self.md)
        return list(reply.features)

    async def publish(self, topic: str, data: bytes, metadata: Mapping[str, str] | None = None) -> None:
        # daprd never sets content_type on Publish.
        await self.stub.Publish(
            pubsub_pb2.PublishRequest(data=data, pubsub_name=self.name, topic=topic, metadata=metadata or {}),
            metadata=self.md,
        )

    async def bulk_publish(
        self,
        topic: str,
        entries: list[pubsub_pb2.BulkMessageEntry],
        metadata: Mapping[str, str] | None = None,
    ) -> pubsub_pb2.BulkPublishResponse:
        reply: pubsub_pb2.BulkPublishResponse = await self.stub.BulkPublish(
            pubsub_pb2.BulkPublishRequest(
                entries=entries, pubsub_name=self.name, topic=topic, metadata=metadata or {}
            ),
            metadata=self.md,
        )
        return reply

    async def ping(self) -> None:
        await self.stub.Ping(common_pb2.PingRequest(), metadata=self.md)

    async def pause(self) -> None:
        await self.stub.Pause(pubsub_pb2.PauseRequest(), metadata=self.md)

    async def resume(self) -> None:
        await self.stub.Resume(pubsub_pb2.ResumeRequest(), metadata=self.md)

    async def subscribe(self, topic: str, metadata: Mapping[str, str] | None = None) -> Stream:
        call = self.stub.PullMessages(metadata=self.md)
        # The component may end the stream before it reads the topic (an instance never Init'ed):
        # then the write fails with the stream's own status, which Stream.status() reports.
        with contextlib.suppress(grpc.aio.AioRpcError):
            await call.write(
                pubsub_pb2.PullMessagesRequest(topic=pubsub_pb2.Topic(name=topic, metadata=metadata or {}))
            )
        return Stream(call)


class Stream:
    """One PullMessages stream; a background reader queues what the component sends."""

    def __init__(self, call: Any) -> None:
        self.call = call
        self.received: asyncio.Queue[pubsub_pb2.PullMessagesResponse] = asyncio.Queue()
        self.ended = asyncio.Event()
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        try:
            while True:
                msg = await self.call.read()
                if msg is grpc.aio.EOF:  # type: ignore[attr-defined]
                    return
                self.received.put_nowait(msg)
        except (grpc.aio.AioRpcError, asyncio.CancelledError):
            return
        finally:
            self.ended.set()

    async def next(self, within: float = 5.0) -> pubsub_pb2.PullMessagesResponse:
        """The next message; fails the test if none arrives within `within` seconds."""
        try:
            return await asyncio.wait_for(self.received.get(), within)
        except TimeoutError:
            raise AssertionError(
                f"no message within {within}s (stream ended: {self.ended.is_set()})"
            ) from None

    async def nothing_for(self, seconds: float) -> bool:
        """True if no message arrives for `seconds`."""
        await asyncio.sleep(seconds)
        return self.received.empty()

    async def ack(self, msg_id: str) -> None:
        await self.call.write(pubsub_pb2.PullMessagesRequest(ack_message_id=msg_id))

    async def nack(self, msg_id: str, error: str = "app failed") -> None:
        await self.call.write(
            pubsub_pb2.PullMessagesRequest(
                ack_message_id=msg_id, ack_error=pubsub_pb2.AckMessageError(message=error)
            )
        )

    async def status(self) -> tuple[grpc.StatusCode, str]:
        """How the component ended the stream."""
        await asyncio.wait_for(self.ended.wait(), 5)
        return await self.call.code(), await self.call.details()

    async def close(self) -> grpc.StatusCode:
        """daprd's orderly end: half-close, then the component ends the stream."""
        await self.call.done_writing()
        await asyncio.wait_for(self.ended.wait(), 5)
        code: grpc.StatusCode = await self.call.code()
        return code

    async def cancel(self) -> None:
        """An abrupt end (daprd killed): the stream is cancelled mid-flight."""
        self.call.cancel()
        await asyncio.wait_for(self.ended.wait(), 5)


# --- the `delayed-pubsub` command line, run as a real process ------------------

EXE = Path(sys.executable).with_name("delayed-pubsub")


@dataclass(frozen=True)
class Result:
    """What a finished `delayed-pubsub` process left: exit code, stdout, stderr."""

    code: int
    out: str
    err: str

    def json(self) -> Any:
        return json.loads(self.out)


async def cli(*args: str, env: Mapping[str, str] | None = None, within: float = 60) -> Result:
    """Run the installed `delayed-pubsub` with `args` (and `env` over ours) to its end.

    Past `within` seconds the process is killed (and waited for) and TimeoutError raised.
    """
    proc = await asyncio.create_subprocess_exec(
        str(EXE),
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "COLUMNS": "250", **(env or {})},
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), within)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    assert proc.returncode is not None
    return Result(proc.returncode, out.decode(), err.decode())


def now_ms() -> int:
    """The wall clock in ms, as a publisher computes a scheduledSendTime."""
    return time.time_ns() // 1_000_000


def delayed_entries(n: int, first_due: int, spread_ms: int) -> list[pubsub_pb2.BulkMessageEntry]:
    """n messages, each its own envelope, due evenly over [first_due, first_due + spread_ms)."""
    return [
        pubsub_pb2.BulkMessageEntry(
            entry_id=str(i),
            event=json.dumps({"n": i}).encode(),
            metadata={"scheduledSendTime": format_instant(first_due + i * spread_ms // n)},
        )
        for i in range(n)
    ]


# The delayShards of the app the cluster tests deploy: more shards than masters, so some
# master holds two and every master holds one.
DELAY_SHARDS = 6


def cluster_conn(c: RedisCluster, app_id: str = "app1", shards: int = DELAY_SHARDS) -> list[str]:
    """The operator CLI's connection flags for `app_id`'s messages on cluster `c`."""
    return [
        "--redis-host",
        c.nodes[1].address,
        "--redis-type",
        "cluster",
        "--delay-shards",
        str(shards),
        "--app-id",
        app_id,
    ]


# The shard count of the two-replica Cluster runs (test_cluster_delayed, test_cluster_schedule_limits, pause).
CLUSTER_SHARDS = 16


def cluster_props(c: RedisCluster) -> dict[str, str]:
    """Init metadata of app1 on the Cluster `c`, delayed messaging on."""
    return {
        "redisHost": c.nodes[0].address,
        "redisType": "cluster",
        "consumerID": "app1",
        "enableDelayedMessaging": "true",
    }


def engine_left(admin: Any) -> dict[str, int]:
    """What the engine still holds over every shard: pending, in flight, envelopes."""
    keys = [EngineKeys.for_topic(t) for t in shard_topics("app1", CLUSTER_SHARDS)]
    return {
        "pending": sum(int(admin.get(k.count) or 0) for k in keys),
        "inflight": sum(admin.zcard(k.inflight) for k in keys),
        "envelopes": sum(admin.xlen(k.stream) for k in keys),
    }
