"""What every part of a subscription is given: who it is on Redis, the state the parts
share, and its Redis calls, each retried until it works or the subscription stops.

daprd never re-opens a PullMessages stream that ended, so no Redis error may end one:
transient errors back off and retry, a consumer group gone (Redis restarted empty) is
recreated, and only our own stop flag ends the retrying.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import redis.exceptions
from redis.asyncio.cluster import RedisCluster

from delayed_middleware.aio import retrying
from delayed_middleware.backoff import REDIS_RECONNECT
from delayed_middleware.clock import Clock
from delayed_middleware.redis_errors import is_busy_group, is_no_group
from delayed_pubsub.connection import REDIS_ERRORS, TRANSIENT_ERRORS, RedisPyClient
from delayed_pubsub.metrics import InstanceMetrics
from delayed_pubsub.settings import Settings
from delayed_pubsub.window import Window

log = logging.getLogger("delayed_pubsub.broker")

T = TypeVar("T")

@dataclass(frozen=True, eq=False)
class SubscriptionCalls:
    """Who a subscription is on Redis (its client, topic, group and consumer), the parts it
    shares (window, clock, metrics, settings), and its calls retried until they work: the
    one thing each part of a subscription is given."""

    client: RedisPyClient
    # XREADGROUP BLOCK parks a connection: outside poolSize (connection.Connection).
    blocking_client: RedisPyClient
    settings: Settings
    topic: str
    consumer: str
    window: Window
    clock: Clock
    metrics: InstanceMetrics
    # Per call, a blocking read's block time included.
    timeout: float | None

    @property
    def group(self) -> str:
        """The consumer group: the app's consumerID."""
        return self.settings.consumer_id

    async def retrying(self, what: str, call: Callable[[], Awaitable[T]]) -> T:
        """Run `call` until it succeeds: transient errors back off and retry, a
        missing group (Redis restarted empty) is recreated. Other Redis errors
        (e.g. WRONGTYPE) are retried with backoff too, logged as errors, except
        for XACK where they are the caller's to handle. Gives up (CancelledError)
        once the subscription is stopped: by its own flag, never by a
        cancellation request left on the task (see delayed_middleware.aio)."""
        backoff = REDIS_RECONNECT.backoff()
        window = self.window
        result = await retrying(
            call,
            retried=(redis.exceptions.ResponseError, *TRANSIENT_ERRORS),
            on_error=functools.partial(self._on_redis_error, what),
            stopped=lambda: window.closed,
            sleep=self.clock.sleep,
            backoff=backoff,
            call_timeout=self.timeout,
        )
        if backoff.failures:
            log.info("%s on %s: redis is back", what, self.topic)
        return result

    async def round_trip(self, *commands: tuple[Any, ...]) -> list[Any]:
        """`commands` sent together on one of the client's connections, and their raw
        replies in order (RESP as parsed, no response callbacks); an error reply comes
        back as its ResponseError, not raised.

        The delivery path's own pipeline: redis-py's costs ~100 us of CPU per call on top
        of the round trip itself (connection checks, callbacks, hooks), and a busy stream
        makes one every few messages. A connection that fails or is cancelled mid-call is
        closed, never handed back with a reply still owed on it. Not on Cluster (see
        `lean`): its client routes commands itself.
        """
        client = self.client
        assert not isinstance(client, RedisCluster)  # callers check `lean`
        pool = client.connection_pool
        conn = await pool.get_connection()  # type: ignore[no-untyped-call]
        try:
            await conn.send_packed_command(conn.pack_commands(commands), check_health=False)
            replies: list[Any] = []
            for _ in commands:
                try:
                    replies.append(await conn.read_response())
                except redis.exceptions.ResponseError as e:
                    replies.append(e)
        except BaseException:
            await conn.disconnect(nowait=True)
            raise
        finally:
            await pool.release(conn)
        return replies

    @property
    def lean(self) -> bool:
        """Whether round_trip() serves this client (a node or Sentinel, not Cluster)."""
        return not isinstance(self.client, RedisCluster)

    async def _on_redis_error(self, what: str, e: BaseException) -> None:
        self.metrics.redis_errors.inc()
        if not isinstance(e, redis.exceptions.ResponseError):
            log.warning("%s on %s: redis unavailable (%s); retrying", what, self.topic, e)
        elif is_no_group(e):
            log.warning(
                "%s on %s: consumer group gone (Redis restarted empty?), recreating", what, self.topic
            )
            with contextlib.suppress(*REDIS_ERRORS):
                await self.create_group()
        elif what == "XACK":
            raise e
        else:
            log.error("%s on %s failed: %s; retrying", what, self.topic, e)

    async def create_group(self) -> None:
        """XGROUP CREATE ... MKSTREAM from the start of the stream; a group already there is fine."""
        try:
            await self.client.xgroup_create(self.topic, self.group, id="0", mkstream=True)
        except redis.exceptions.ResponseError as e:
            if not is_busy_group(e):
                raise
