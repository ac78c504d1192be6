"""Fixtures of the middleware tests that need Redis."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import pytest
import redis
import redis.asyncio as aioredis


@pytest.fixture
async def aredis(redis_client: redis.Redis) -> AsyncIterator[Callable[[], aioredis.Redis]]:
    port = redis_client.connection_pool.connection_kwargs["port"]
    made: list[aioredis.Redis] = []

    def make() -> aioredis.Redis:
        c = aioredis.Redis(port=port, socket_timeout=5, socket_connect_timeout=2)
        made.append(c)
        return c

    yield make
    for c in made:
        await c.aclose()
