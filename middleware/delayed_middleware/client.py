"""What the delay engine needs of a Redis client: one interface for a node and a Cluster.

The engine is handed `redis.asyncio.Redis` (a node, or Sentinel's master) or
`redis.asyncio.cluster.RedisCluster`. Both satisfy `RedisClient` structurally,
so nothing is cast and no call site needs a `type: ignore`. The Protocol lists
only the commands the engine sends, with the parameters it passes; a new call
in the engine is added here first, and mypy checks both clients still fit it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import redis.asyncio as aioredis
    from redis.asyncio.cluster import ClusterPipeline, RedisCluster


class Script(Protocol):
    """A registered Lua script (redis-py's AsyncScript): EVALSHA, loading it on NOSCRIPT."""

    def __call__(
        self, keys: Sequence[Any] | None = ..., args: Sequence[Any] | None = ...
    ) -> Awaitable[Any]: ...


class Pipeline(Protocol):
    """The non-transactional pipeline the engine batches reads and marker writes in."""

    def hget(self, name: str, key: str) -> Any: ...

    def xrange(self, name: str, min: str = ..., max: str = ..., count: int | None = ...) -> Any: ...

    def xadd(self, name: str, fields: dict[Any, Any]) -> Any: ...

    def execute(self, raise_on_error: bool = ...) -> Awaitable[list[Any]]: ...


class PubSub(Protocol):
    """The wake listener's subscription."""

    def subscribe(self, *args: Any) -> Awaitable[Any]: ...

    def get_message(
        self, ignore_subscribe_messages: bool = ..., timeout: float | None = ...
    ) -> Awaitable[Any]: ...

    def aclose(self) -> Awaitable[None]: ...


class RedisClient(Protocol):
    """The commands the delay engine sends, as `redis.asyncio.Redis` and `RedisCluster` both take them."""

    def register_script(self, script: str) -> Script: ...

    def pipeline(self, transaction: bool = ...) -> Pipeline: ...

    def pubsub(self, **kwargs: Any) -> PubSub: ...

    def ping(self, **kwargs: Any) -> Awaitable[Any]: ...

    def get(self, name: str) -> Awaitable[Any]: ...

    def set(self, name: str, value: str, *, px: int | None = ..., nx: bool = ...) -> Awaitable[Any]: ...

    def hexists(self, name: str, key: str) -> Awaitable[Any]: ...

    def hget(self, name: str, key: str) -> Awaitable[Any]: ...

    def hmget(self, name: str, keys: list[str]) -> Awaitable[Any]: ...

    def zrange(self, name: str, start: int, end: int) -> Awaitable[Any]: ...

    def zrem(self, name: str, *values: str) -> Awaitable[Any]: ...

    def xrange(
        self, name: str, min: str = ..., max: str = ..., count: int | None = ...
    ) -> Awaitable[Any]: ...

    def xrevrange(
        self, name: str, max: str = ..., min: str = ..., count: int | None = ...
    ) -> Awaitable[Any]: ...

    def xinfo_stream(self, name: str) -> Awaitable[Any]: ...

    def xtrim(self, name: str, *, minid: str | None = ..., approximate: bool = ...) -> Awaitable[Any]: ...


if TYPE_CHECKING:
    # Both clients the components hand the engine fit the Protocol (checked by mypy, never run).
    def _fits(node: aioredis.Redis, cluster: RedisCluster) -> list[RedisClient]:
        a: RedisClient = node
        b: RedisClient = cluster
        return [a, b]

    def _pipes(node: aioredis.client.Pipeline, cluster: ClusterPipeline) -> list[Pipeline]:
        a: Pipeline = node
        b: Pipeline = cluster
        return [a, b]
