"""One component instance (one YAML `metadata.name`): its settings, Redis connection and broker.

Several instances share one socket; daprd tells them apart by the
`x-component-instance` call metadata. `Instances` is that registry.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import socket
from collections.abc import Mapping, Sequence

from delayed_middleware.clock import Clock
from delayed_middleware.entry import StreamEntry
from delayed_middleware.errors import InvalidArgumentError, NotInitializedError
from delayed_pubsub.broker import Broker, BulkEntry, FailedEntry, Subscription
from delayed_pubsub.connection import Connection, connect
from delayed_pubsub.settings import Settings, parse_settings

log = logging.getLogger(__name__)


class Instance:
    """An initialized component instance. Publish routing lives here (not in the
    servicer) so the delay engine can be put in front of the broker later."""

    def __init__(self, name: str, settings: Settings, connection: Connection, clock: Clock) -> None:
        self.name = name
        self.settings = settings
        self._connection = connection
        self._clock = clock
        self.broker = Broker(connection.client, settings, clock)
        self._subscriptions: set[Subscription] = set()
        self._paused = False
        # Consumer names must be unique per stream: a consumer shared by two
        # streams would let one stream's XREADGROUP swallow the other's entries.
        self._stream_numbers = itertools.count(1)
        self._host = socket.gethostname()

    @classmethod
    async def open(cls, name: str, settings: Settings, clock: Clock) -> Instance:
        """Connect and PING; BackendUnavailableError (naming host:port) if Redis is unreachable."""
        connection = connect(settings)
        try:
            await connection.ping()
        except BaseException:
            await connection.aclose()
            raise
        return cls(name, settings, connection, clock)

    async def publish(
        self, topic: str, data: bytes, metadata: Mapping[str, str], content_type: str = ""
    ) -> None:
        """Store one message on `topic`."""
        _check_topic(topic)
        await self.broker.publish(topic, StreamEntry(data, dict(metadata), content_type))

    async def bulk_publish(
        self, topic: str, entries: Sequence[BulkEntry], metadata: Mapping[str, str]
    ) -> list[FailedEntry]:
        """Store many messages on `topic` in one round trip; returns the ones that failed.

        The request's metadata applies to every entry; an entry's own keys win.
        """
        _check_topic(topic)
        if metadata:
            entries = [
                BulkEntry(e.entry_id, StreamEntry(e.entry.data, {**metadata, **e.entry.metadata},
                                                  e.entry.content_type))
                for e in entries
            ]
        return await self.broker.bulk_publish(topic, entries)

    async def subscribe(self, topic: str, metadata: Mapping[str, str]) -> Subscription:
        """Open a started subscription for one PullMessages stream."""
        _check_topic(topic)
        if not self.settings.consumer_id:
            raise InvalidArgumentError("consumerID", "", "required to subscribe (daprd sets it to the app-id)")
        consumer = f"{self.settings.consumer_id}:{self._host}:{os.getpid()}:{next(self._stream_numbers)}"
        sub = self.broker.subscription(topic, consumer, paused=self._paused)
        self._subscriptions.add(sub)
        try:
            await sub.start()
        except BaseException:
            self._subscriptions.discard(sub)
            raise
        log.info("instance %r: subscribed to %r as %s", self.name, topic, consumer)
        return sub

    async def unsubscribe(self, sub: Subscription) -> None:
        """Close a subscription (its unacked entries stay pending in Redis)."""
        self._subscriptions.discard(sub)
        await sub.close()

    def pause(self) -> None:
        """Stop sending new messages on every stream of this instance (idempotent)."""
        self._paused = True
        for sub in self._subscriptions:
            sub.pause()

    def resume(self) -> None:
        """Start sending again (idempotent)."""
        self._paused = False
        for sub in self._subscriptions:
            sub.resume()

    async def ping(self) -> None:
        """Redis PING."""
        await self.broker.ping()

    async def close(self) -> None:
        """Close every subscription, then the Redis connection."""
        subs = list(self._subscriptions)
        self._subscriptions.clear()
        await asyncio.gather(*(s.close() for s in subs), return_exceptions=True)
        await self._connection.aclose()


class Instances:
    """The component instances served on one socket, by name."""

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._instances: dict[str, Instance] = {}
        self._lock = asyncio.Lock()

    async def init(self, name: str, props: Mapping[str, str]) -> Instance:
        """Parse, connect and register `name`, replacing (and closing) any previous Init of it.

        On failure the previous instance, if any, stays as it was.
        """
        settings = parse_settings(props)
        instance = await Instance.open(name, settings, self._clock)
        async with self._lock:
            old = self._instances.get(name)
            self._instances[name] = instance
        if old is not None:
            log.info("instance %r re-initialized; closing the previous one", name)
            await old.close()
        log.info("instance %r initialized: redis %s, consumerID %r", name, settings.address,
                 settings.consumer_id)
        return instance

    def get(self, name: str) -> Instance:
        """The instance named `name`; NotInitializedError if daprd has not called Init for it."""
        try:
            return self._instances[name]
        except KeyError:
            raise NotInitializedError(name) from None

    async def close(self) -> None:
        """Close every instance."""
        instances = list(self._instances.values())
        self._instances.clear()
        await asyncio.gather(*(i.close() for i in instances), return_exceptions=True)


def _check_topic(topic: str) -> None:
    if not topic:
        raise InvalidArgumentError("topic", topic, "must not be empty")
