"""A redis.asyncio client built from Settings: single node, Redis Cluster or Sentinel."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import ssl
import tempfile
from typing import Any, TypeAlias

import redis.asyncio as aioredis
import redis.exceptions
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import ExponentialWithJitterBackoff
from redis.sentinel import MasterNotFoundError

from delayed_middleware.errors import BackendUnavailableError
from delayed_pubsub.settings import Settings

log = logging.getLogger(__name__)

RedisClient: TypeAlias = "aioredis.Redis | RedisCluster"

# Errors that mean "Redis is not there right now" rather than "Redis said no".
TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    redis.exceptions.BusyLoadingError,
    redis.exceptions.TryAgainError,
    redis.exceptions.ClusterDownError,
    MasterNotFoundError,
    OSError,
)
# Transient or not: anything Redis or the network can throw at a call.
REDIS_ERRORS: tuple[type[BaseException], ...] = (*TRANSIENT_ERRORS, redis.exceptions.RedisError)


class Connection:
    """A client and whatever it needs kept alive (TLS key files)."""

    def __init__(self, client: RedisClient, address: str, tempdir: str | None = None) -> None:
        self.client = client
        self.address = address
        self._tempdir = tempdir

    async def ping(self) -> None:
        """PING; BackendUnavailableError naming host:port if Redis does not answer."""
        try:
            await self.client.ping()
        except TRANSIENT_ERRORS as e:
            raise BackendUnavailableError(f"redis at {self.address} is unreachable: {e}") from e
        except redis.exceptions.RedisError as e:
            # AUTH failures and the like: not transient, but the operator must see the host.
            raise BackendUnavailableError(f"redis at {self.address} refused the connection: {e}") from e

    async def aclose(self) -> None:
        """Close every pooled connection and remove the TLS key files."""
        try:
            await self.client.aclose()
        finally:
            if self._tempdir is not None:
                shutil.rmtree(self._tempdir, ignore_errors=True)


def connect(settings: Settings) -> Connection:
    """Build (without connecting yet) the client the settings describe."""
    kwargs: dict[str, Any] = {
        "username": settings.username,
        "password": settings.password,
        "socket_connect_timeout": _seconds(settings.dial_timeout_ms),
        # redis-py has one socket timeout for reads and writes; the larger wins
        # so neither limit cuts the other short.
        "socket_timeout": _socket_timeout(settings),
        "retry": Retry(ExponentialWithJitterBackoff(base=0.05, cap=1.0), settings.max_retries),
        "retry_on_error": [redis.exceptions.ConnectionError, redis.exceptions.TimeoutError],
        "health_check_interval": 30,
        "client_name": f"delayed-pubsub:{settings.consumer_id}" if settings.consumer_id else "delayed-pubsub",
    }
    tempdir = None
    if settings.enable_tls:
        tempdir = _tls_kwargs(settings, kwargs)
    if settings.pool_size is not None:
        kwargs["max_connections"] = settings.pool_size

    client: RedisClient
    if settings.redis_type == "cluster":
        nodes = [ClusterNode(h, p) for h, p in settings.hosts]
        client = RedisCluster(startup_nodes=nodes, **kwargs)
    elif settings.failover:
        sentinel_kwargs = {k: kwargs[k] for k in ("username", "password", "socket_connect_timeout")}
        sentinel = Sentinel(  # type: ignore[no-untyped-call]
            list(settings.hosts), sentinel_kwargs=sentinel_kwargs, db=settings.db, **kwargs)
        client = sentinel.master_for(settings.sentinel_master_name)
    else:
        host, port = settings.hosts[0]
        client = aioredis.Redis(host=host, port=port, db=settings.db, **kwargs)
    return Connection(client, settings.address, tempdir)


def _seconds(ms: int | None) -> float | None:
    return None if ms is None else ms / 1000


def _socket_timeout(settings: Settings) -> float | None:
    if settings.read_timeout_ms is None or settings.write_timeout_ms is None:
        return None
    return max(settings.read_timeout_ms, settings.write_timeout_ms) / 1000


def _tls_kwargs(settings: Settings, kwargs: dict[str, Any]) -> str | None:
    kwargs["ssl"] = True
    if settings.insecure_skip_tls_verify:
        kwargs["ssl_cert_reqs"] = ssl.CERT_NONE
        kwargs["ssl_check_hostname"] = False
    if settings.client_cert is None or settings.client_key is None:
        return None
    # The metadata carries PEM contents (as pubsub.redis takes them) but ssl
    # loads client certificates from files only: keep private copies for the
    # connection's lifetime.
    tempdir = tempfile.mkdtemp(prefix="delayed-pubsub-tls-")
    os.chmod(tempdir, 0o700)
    for name, pem in (("client.crt", settings.client_cert), ("client.key", settings.client_key)):
        path = os.path.join(tempdir, name)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with contextlib.closing(os.fdopen(fd, "w")) as f:
            f.write(pem)
    kwargs["ssl_certfile"] = os.path.join(tempdir, "client.crt")
    kwargs["ssl_keyfile"] = os.path.join(tempdir, "client.key")
    return tempdir
