"""Where a delivered message's CPU goes, stage by stage, below gRPC (bench/RESULTS.md,
"Delivery at the floor").

Each stage of our delivery path is run on its own in this process, against a private
redis-server, many times over, and timed by CPU (time.process_time: waiting for Redis or
for a core does not count, so a loaded machine matters less). The stages, per message:
  - the Redis round trip that XACKs the acks that freed slots and reads the entries that
    refill them (one per `batch` messages): redis-py's pipeline, and the subscription's own
    (SubscriptionCalls.round_trip, raw replies);
  - decode: the reply into ids and StreamEntry (the subscription's EntryReader over each
    entry's raw field list; before the second cut: the fields paired into a dict first, and
    decode_entry parsing every entry's metadata);
  - the window's bookkeeping: _push (owned, buffer), deliveries() handing it out,
    ack_nowait (slot freed, ack queued);
  - building the PullMessagesResponse and its serialisation: the message built and
    SerializeToString (before the second cut; grpc.aio called it for us), and the bytes
    built by hand (wire.Responses, as the handler does now);
  - the ack as grpc.aio hands it over: PullMessagesRequest.FromString and its fields.
What is left of a delivered message's CPU in bench/deliver.py (the event loop's wake-ups
between the fetch loop, the ack loop, the ack pump and the handler; grpc's send) is that
figure minus these.

    .venv/bin/python bench/deliver_stages.py [--messages 20000]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import redis
import redis.asyncio as aioredis

ROOT = Path(__file__).resolve().parents[1]
for sub in ("proto", "middleware", "components", "."):
    sys.path.insert(0, str(ROOT / sub))

from bench.common import PAYLOAD  # noqa: E402
from delayed_middleware.aio import text  # noqa: E402
from delayed_middleware.clock import SystemClock  # noqa: E402
from delayed_middleware.entry import StreamEntry, encode_entry  # noqa: E402
from delayed_pubsub.broker import Broker  # noqa: E402
from delayed_pubsub.fetch import _parsed  # noqa: E402
from delayed_pubsub.settings import parse_settings  # noqa: E402
from delayed_pubsub.window import Delivery  # noqa: E402
from delayed_pubsub.wire import Responses  # noqa: E402
from delayed_pubsub_pb.dapr.proto.components.v1 import pubsub_pb2  # noqa: E402
from tests.redis_server import RedisServer  # noqa: E402

TOPIC = "orders"


async def per_message(n: int, body: Callable[[int], Awaitable[None]]) -> float:
    """CPU µs per message of `body(i)` called for i in range(n)."""
    t = time.process_time()
    for i in range(n):
        await body(i)
    return (time.process_time() - t) / n * 1e6


async def response_stages(n: int, ids: list[str], one: StreamEntry) -> dict[str, float]:
    """Building and serialising the PullMessagesResponse of each of n messages, both ways."""
    out: dict[str, float] = {}
    response = pubsub_pb2.PullMessagesResponse

    async def build(i: int) -> None:
        msg = response(
            data=one.data, topic_name=TOPIC, metadata=one.metadata, content_type=one.content_type, id=ids[i]
        )
        msg.metadata["deliveryAttempt"] = "1"
        msg.SerializeToString()

    out["build + serialise PullMessagesResponse (message)"] = await per_message(n, build)
    by_hand = Responses(TOPIC)
    deliveries = [Delivery(ids[i], TOPIC, one, 1) for i in range(n)]

    async def serialise(i: int) -> None:
        by_hand(deliveries[i])

    out["build + serialise PullMessagesResponse (wire.Responses)"] = await per_message(n, serialise)
    return out


async def stages(port: int, n: int) -> dict[str, float]:
    sync = redis.Redis(port=port)
    fields = encode_entry(StreamEntry(PAYLOAD, {"cloudevent.id": "x"}))
    pipe = sync.pipeline(transaction=False)
    for _ in range(3 * n):
        pipe.xadd(TOPIC, fields)  # type: ignore[arg-type]
    pipe.execute()
    client = aioredis.Redis(port=port)
    settings = parse_settings({"redisHost": f"127.0.0.1:{port}", "consumerID": "bench"})
    sub = Broker(client, settings, SystemClock()).subscription(TOPIC, "stages")
    calls = sub._calls
    await calls.create_group()
    out: dict[str, float] = {}
    raw_replies: list[Any] = []
    acked: list[list[str]] = [["0-1"]]

    for batch in (5, 10):

        async def pipelined(_: int, batch: int = batch) -> None:
            p = client.pipeline(transaction=False)
            p.xack(TOPIC, "bench", *acked[-1])
            p.xreadgroup("bench", "stages", {TOPIC: ">"}, count=batch)
            _x, read = await p.execute(raise_on_error=False)
            acked.append([text(i) for _s, items in read for i, _f in items])

        async def own(_: int, batch: int = batch) -> None:
            _x, read = await calls.round_trip(
                ("XACK", TOPIC, "bench", *acked[-1]),
                ("XREADGROUP", "GROUP", "bench", "stages", "COUNT", batch, "STREAMS", TOPIC, ">"),
            )
            raw_replies.append(read)
            acked.append([text(i) for _s, items in _parsed(read) for i, _f in items])

        out[f"round trip, redis-py pipeline, per call (batch {batch})"] = await per_message(n // 10, pipelined)
        out[f"round trip, own, per call (batch {batch})"] = await per_message(n // 10, own)

    # Decode: raw replies (the own round trip's) into ids and entries.
    entries: list[tuple[str, Any]] = []

    async def decode(i: int) -> None:
        for _s, items in _parsed(raw_replies[i]):
            for raw_id, f in items:
                entries.append((text(raw_id), sub._decode(f)))

    count = sum(len(items) for r in raw_replies for _s, items in _parsed(r))
    out["decode (text(id), EntryReader over the raw fields)"] = (
        await per_message(len(raw_replies), decode) * len(raw_replies) / count
    )

    # The window: _push each entry, hand it out through deliveries(), ack it.
    ids = [f"{i}-0" for i in range(n)]
    flat = dict(fields)

    async def push(i: int) -> None:
        sub._push(ids[i], flat, 1, False)

    push_us = await per_message(n, push)
    out["window: _push (EntryReader included)"] = push_us
    it = sub.deliveries()
    # Handed out and acked in turn (the window holds `concurrency`): the pair, then acks alone.
    async def hand_out_and_ack(i: int) -> None:
        await anext(it)
        sub.ack_nowait(ids[i])

    pair_us = await per_message(n, hand_out_and_ack)
    acked_again = [f"{i}-0" for i in range(n, 2 * n)]
    for i in acked_again:
        sub._push(i, flat, 1, False)

    async def ack_only(i: int) -> None:
        sub._unacked[acked_again[i]] = 1  # as deliveries() leaves it
        sub.ack_nowait(acked_again[i])

    ack_us = await per_message(n, ack_only)
    out["window: deliveries() hands one out"] = pair_us - ack_us
    out["window: ack_nowait"] = ack_us
    out.update(await response_stages(n, ids, entries[0][1]))
    raw_ack = pubsub_pb2.PullMessagesRequest(ack_message_id="1795932911677-0").SerializeToString()

    async def ack_in(_: int) -> None:
        req = pubsub_pb2.PullMessagesRequest.FromString(raw_ack)
        if req.ack_message_id and req.HasField("ack_error"):
            raise AssertionError

    out["ack request: FromString + fields"] = await per_message(n, ack_in)
    sub.stop()
    await client.aclose()
    sync.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--messages", type=int, default=20_000)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="dps-stages-") as d:
        server = RedisServer(Path(d) / "redis", appendonly=False)
        server.start()
        try:
            out = asyncio.run(stages(server.port, a.messages))
        finally:
            server.stop()
    for name, us in out.items():
        print(f"{name:60s} {us:8.1f} us")


if __name__ == "__main__":
    main()
