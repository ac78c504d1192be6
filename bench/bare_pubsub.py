"""The floor of a Python pluggable pub/sub through daprd: the smallest grpc.aio component that drains.

    python -m bench.bare_pubsub SOCKET N

Serves the PubSub service of proto/ (with reflection, which daprd's discovery asks) on the unix
socket SOCKET (daprd names the component type after the file: `bare-pubsub.sock` is
`pubsub.bare-pubsub`). Init, Features and Ping answer at once; PullMessages sends N messages
built and serialized before the stream opens (the same CloudEvent as bench/drain.py's backlogs),
then reads daprd's acks and drops them; every other call is unimplemented. No Redis, no
bookkeeping: what daprd takes from it is what any grpc.aio component costs at the least, so
`python -m bench drain --bare` gives the best pace a Python component can reach through daprd.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "proto"))

import grpc  # noqa: E402
from grpc_reflection.v1alpha import reflection  # noqa: E402

from bench.common import PAYLOAD  # noqa: E402
from delayed_pubsub_pb.dapr.proto.components.v1 import common_pb2, pubsub_pb2  # noqa: E402

SERVICE = pubsub_pb2.DESCRIPTOR.services_by_name["PubSub"].full_name


def prebuilt(n: int, topic: str) -> list[bytes]:
    """N serialized PullMessagesResponse, ids 1..N."""
    return [
        pubsub_pb2.PullMessagesResponse(
            data=PAYLOAD, topic_name=topic, id=str(i), content_type="application/cloudevents+json"
        ).SerializeToString()
        for i in range(1, n + 1)
    ]


def handlers(n: int) -> grpc.GenericRpcHandler[Any, Any]:
    async def pull(requests: AsyncIterator[Any], context: Any) -> None:
        first = await anext(aiter(requests))
        messages = prebuilt(n, first.topic.name)

        async def drop_acks() -> None:
            async for _ in requests:
                pass

        acks = asyncio.create_task(drop_acks())
        for raw in messages:
            await context.write(raw)
        await acks

    async def init(_request: Any, _context: Any) -> Any:
        return pubsub_pb2.PubSubInitResponse()

    async def features(_request: Any, _context: Any) -> Any:
        return common_pb2.FeaturesResponse()

    async def ping(_request: Any, _context: Any) -> Any:
        return common_pb2.PingResponse()

    def unary(fn: Any, request: Any, response: Any) -> Any:
        return grpc.unary_unary_rpc_method_handler(
            fn, request_deserializer=request.FromString, response_serializer=response.SerializeToString
        )

    return grpc.method_handlers_generic_handler(
        SERVICE,
        {
            # No response serializer: the prebuilt bytes go out as they are.
            "PullMessages": grpc.stream_stream_rpc_method_handler(
                pull, request_deserializer=pubsub_pb2.PullMessagesRequest.FromString
            ),
            "Init": unary(init, pubsub_pb2.PubSubInitRequest, pubsub_pb2.PubSubInitResponse),
            "Features": unary(features, common_pb2.FeaturesRequest, common_pb2.FeaturesResponse),
            "Ping": unary(ping, common_pb2.PingRequest, common_pb2.PingResponse),
        },
    )


async def serve(socket: Path, n: int) -> None:
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handlers(n),))
    reflection.enable_server_reflection((SERVICE, reflection.SERVICE_NAME), server)
    server.add_insecure_port(f"unix://{socket}")
    await server.start()
    await server.wait_for_termination()


def main() -> None:
    socket = Path(sys.argv[1])
    socket.unlink(missing_ok=True)
    asyncio.run(serve(socket, int(sys.argv[2])))


if __name__ == "__main__":
    main()
