"""A redis.asyncio client built from Settings: single node, Redis Cluster or Sentinel."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import ssl
from collections.abc import Mapping
from dataclasses import KW_ONLY, dataclass
from typing import Any, Final, TypeAlias

import hiredis
import redis.asyncio as aioredis
import redis.exceptions
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool
from redis.backoff import NoBackoff

from delayed_middleware import storage_format
from delayed_middleware.backoff import REDIS_DIAL
from delayed_middleware.errors import (
    BackendAuthError,
    BackendUnavailableError,
    InvalidArgumentError,
    UnsupportedRedisError,
)

# Re-exported for the modules that import them from here (broker, dashboard).
from delayed_middleware.redis_errors import REDIS_ERRORS as REDIS_ERRORS
from delayed_middleware.redis_errors import TRANSIENT_ERRORS as TRANSIENT_ERRORS
from delayed_middleware.redis_errors import is_auth_refusal, is_dial_failure
from delayed_pubsub.settings import Settings

log = logging.getLogger(__name__)

# The redis-py client a Connection holds (a Sentinel master is an aioredis.Redis). The middleware
# types what it needs of one structurally: delayed_middleware.client.RedisClient.
RedisPyClient: TypeAlias = "aioredis.Redis | RedisCluster"


class RetryConnectOnly:
    """Retries establishing a connection, never a command.

    redis-py retries a command whose connection broke after it was sent: when
    only the reply was lost, the command runs twice. Measured here through a
    proxy that cuts the connection after forwarding an XADD: the publish was
    reported OK and stored twice. A lost reply must instead fail the call (the
    caller then knows the outcome is unknown, see RELIABILITY.md), so commands
    get no retry and `connect_retry` (redisMaxRetries) covers dialing alone.
    """

    retry: Retry

    def __init__(self, *args: Any, connect_retry: Retry | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._connect_retry = connect_retry if connect_retry is not None else Retry(NoBackoff(), 0)

    async def connect(self) -> None:
        # A connection serves one caller at a time (it is checked out of the
        # pool), so swapping the policy for the dial is seen by nobody else.
        command_retry = self.retry
        self.retry = self._connect_retry
        try:
            await super().connect()  # type: ignore[misc]
        finally:
            self.retry = command_retry


class HiredisPackingConnection(RetryConnectOnly, aioredis.Connection):
    """redis.asyncio packs commands in Python, ~20µs per XADD; hiredis packs them
    in C (redis-py's sync client already does). Bulk publish is mostly packing."""

    def pack_command(self, *args: Any) -> list[bytes]:
        return [_pack(args)]

    def pack_commands(self, commands: Any) -> list[bytes]:
        return [b"".join(_pack(tuple(c)) for c in commands)]


class TlsConnection(RetryConnectOnly, aioredis.SSLConnection):
    """TLS, with RetryConnectOnly's retry policy."""


def _pack(args: tuple[Any, ...]) -> bytes:
    # As redis-py's packer: "XGROUP CREATE" is sent as two words.
    head = args[0]
    if (isinstance(head, str) and " " in head) or (isinstance(head, bytes) and b" " in head):
        args = (*head.split(), *args[1:])
    packed: bytes = hiredis.pack_command(args)
    return packed


class BlockingSentinelConnectionPool(SentinelConnectionPool, aioredis.BlockingConnectionPool):
    """A Sentinel-managed pool that waits for a free connection instead of failing
    "Too many connections" (redis-py has the waiting pool for plain nodes only)."""


# Init's PING is bounded even when readTimeout/writeTimeout are 0 ("none"): a
# server that accepts and never answers must not hang daprd's Init.
INIT_PING_DEFAULT_S = 5.0
INIT_PING_MAX_S = 30.0


@dataclass(eq=False, repr=False)
class Connection:
    """The clients of one component instance and whatever they need kept alive (the TLS key's memory files).

    `client` carries short commands (XADD, XACK, scripts...). Its pool holds at
    most poolSize connections, and a caller that finds them all busy waits for
    one (bounded by its call timeout) instead of failing, as go-redis does.

    `blocking_client` carries reads that park a connection for a long time
    (XREADGROUP BLOCK, pub/sub listeners). It has a pool of its own, outside
    poolSize: nine subscriptions must not starve publishes of connections.

    The clients have no socket timeout: redis-py would arm one per response
    read, which costs a third of a pipelined XADD. Callers bound each call as a
    whole with `call_timeout` (readTimeout) instead.
    """

    client: RedisPyClient
    address: str
    call_timeout: float | None
    # The memory files holding the TLS key, closed with the clients.
    key_fds: list[int]
    # Said with a connection the server hangs up on (what TLS setting may be the cause).
    hang_up_hint: str
    _: KW_ONLY
    blocking_client: RedisPyClient
    ping_timeout: float = INIT_PING_DEFAULT_S

    async def ping(self) -> None:
        """PING, bounded by `ping_timeout` whatever the settings say.

        BackendAuthError if Redis refused our credentials (or the ACL user may
        not PING), BackendUnavailableError naming host:port if it does not answer.
        """
        try:
            async with asyncio.timeout(self.ping_timeout):
                await self.client.ping()
                if self.blocking_client is not self.client:
                    # A cluster client discovers the nodes on its first command.
                    # The blocking pool's first commands come all at once (every
                    # subscription opens right after Init), and redis-py's cluster
                    # client fails some of those that race its discovery with
                    # "Connection closed by server": discover before that.
                    await self.blocking_client.ping()
        except (redis.exceptions.AuthenticationError, redis.exceptions.NoPermissionError) as e:
            # AuthenticationError is a ConnectionError to redis-py, but no retry
            # or TLS setting will fix a wrong password: say what Redis said.
            raise BackendAuthError(f"redis at {self.address} refused our credentials: {e}") from e
        except redis.exceptions.ResponseError as e:
            if is_auth_refusal(e):
                raise BackendAuthError(f"redis at {self.address} refused our credentials: {e}") from e
            raise BackendUnavailableError(f"redis at {self.address} refused the connection: {e}") from e
        except TimeoutError as e:
            raise BackendUnavailableError(
                f"redis at {self.address} did not answer PING within {self.ping_timeout:g}s"
            ) from e
        except TRANSIENT_ERRORS as e:
            hint = ""
            # Connected, then hung up on without a word: a TLS-only port read
            # our plain text, or a TLS 1.3 server wanted a client certificate
            # (its alert saying so is often lost to the reset).
            if (
                self.hang_up_hint
                and isinstance(e, redis.exceptions.ConnectionError)
                and not is_dial_failure(e)
            ):
                hint = f" ({self.hang_up_hint})"
            raise BackendUnavailableError(f"redis at {self.address} is unreachable: {e}{hint}") from e
        except redis.exceptions.RedisError as e:
            raise BackendUnavailableError(f"redis at {self.address} refused the connection: {e}") from e

    async def check_version(self) -> None:
        """UnsupportedRedisError if Redis (any node of a cluster) is older than MIN_REDIS_VERSION.

        When INFO is refused (a managed Redis or an ACL user without it) the
        version cannot be known: that is logged, not refused.
        """
        try:
            async with asyncio.timeout(self.ping_timeout):
                if isinstance(self.client, RedisCluster):
                    reply: Mapping[str, Any] = await self.client.info(
                        "server", target_nodes=RedisCluster.ALL_NODES
                    )
                else:
                    reply = await self.client.info("server")
        except (redis.exceptions.RedisError, TimeoutError) as e:
            log.warning("redis at %s: version unknown (INFO server failed: %s)", self.address, e)
            return
        for version in _versions(reply):
            check_redis_version(version, self.address)

    async def aclose(self) -> None:
        """Close every pooled connection and free the TLS key's memory files."""
        try:
            clients = [self.client]
            if self.blocking_client is not self.client:
                clients.append(self.blocking_client)
            for client in clients:
                if isinstance(client, aioredis.Redis):
                    # A pool we passed in is not closed by default.
                    await client.aclose(close_connection_pool=True)
                else:
                    await client.aclose()
        finally:
            _close_all(self.key_fds)
            self.key_fds = []


# XPENDING IDLE (reclaiming abandoned messages) and XADD/XTRIM MINID (streamTTL) arrived in Redis 6.2.
MIN_REDIS_VERSION: Final = (6, 2)


def check_redis_version(version: str, address: str) -> None:
    """Refuse a Redis whose INFO redis_version is older than MIN_REDIS_VERSION.

    Only a version known to be too old is refused: text that does not start
    with numbers (a fork's own scheme) passes, since it proves nothing.
    """
    parts = []
    for part in version.strip().split(".")[:2]:
        digits = part.split("-")[0]
        if not digits.isascii() or not digits.isdigit():
            return
        parts.append(int(digits))
    if len(parts) == 2 and tuple(parts) < MIN_REDIS_VERSION:
        need = ".".join(map(str, MIN_REDIS_VERSION))
        raise UnsupportedRedisError(
            f"redis at {address} is version {version.strip()}; this component needs Redis {need} or "
            f"later (it uses XPENDING IDLE and MINID trimming, added in {need})"
        )


def _versions(reply: Mapping[str, Any]) -> list[str]:
    """The redis_version of each server in an INFO reply (one server's, or a cluster's by node)."""
    if "redis_version" in reply:
        return [str(reply["redis_version"])]
    return [
        str(v["redis_version"]) for v in reply.values() if isinstance(v, Mapping) and "redis_version" in v
    ]


def connect(settings: Settings) -> Connection:
    """Build (without connecting yet) the clients the settings describe."""
    kwargs: dict[str, Any] = {
        "username": settings.username,
        "password": settings.password,
        "socket_connect_timeout": _seconds(settings.dial_timeout_ms),
        "socket_timeout": None,  # see Connection: calls are bounded as a whole
        # No command is ever sent twice by the client (see RetryConnectOnly).
        "retry": Retry(NoBackoff(), 0),
        "health_check_interval": 30,
        # Names the formats this release reads: a replica raising storageFormat finds older ones by it.
        "client_name": storage_format.client_name(settings.consumer_id),
    }
    key_fds: list[int] = []
    if settings.enable_tls:
        key_fds = _tls_kwargs(settings, kwargs)
    timeout = call_timeout(settings)
    client = _client(settings, kwargs, settings.pool_size, timeout)
    # Blocking reads: one connection each for as long as they run, never
    # counted against poolSize (see Connection).
    blocking = _client(settings, {**kwargs, "client_name": kwargs["client_name"] + ":blocking"}, None, None)
    hint = "if the server speaks TLS only, set enableTLS"
    if settings.enable_tls:
        hint = ""
        if settings.client_cert is None and settings.client_cert_file is None:
            hint = "if the server requires client certificates (tls-auth-clients yes), set clientCert and clientKey"
        else:
            # TLS 1.3 checks the client certificate after the handshake: a
            # refused one shows up as a reset on the first read.
            hint = (
                "if the server refused our client certificate: it must be signed by a CA "
                "the server trusts (its tls-ca-cert-file) and be valid now"
            )
    return Connection(
        client,
        settings.address,
        timeout,
        key_fds,
        hint,
        blocking_client=blocking,
        ping_timeout=init_ping_timeout(settings),
    )


def init_ping_timeout(settings: Settings) -> float:
    """Seconds Init's PING may take: dial + call timeout (5 s for an unbounded
    call), never more than 30 s whatever the settings say."""
    call = call_timeout(settings)
    total = (_seconds(settings.dial_timeout_ms) or 0.0) + (INIT_PING_DEFAULT_S if call is None else call)
    return min(total, INIT_PING_MAX_S)


# poolSize 0: no limit, as documented. redis-py's own default is 100 connections,
# past which a command fails at once with "Too many connections" (a Ping too):
# 100 delayed publishes in flight, each holding a connection for its script
# call, were enough. What is in flight is bounded by admission control instead.
UNLIMITED_CONNECTIONS = 2**31 - 1


def _client(
    settings: Settings, kwargs: dict[str, Any], pool_size: int | None, wait_s: float | None
) -> RedisPyClient:
    """One client; at most `pool_size` connections (None: no limit), a caller
    finding them all busy waiting up to `wait_s` (None: until the call's own bound)."""
    if settings.redis_type == "cluster":
        # redis-py's cluster pools cannot wait for a free connection: a burst
        # beyond poolSize per node fails "Too many connections". And its cluster
        # client forces its own connection class, which finds a connection
        # closed by a restart only by failing a command on it: it keeps
        # command retries (redisMaxRetries), so there a lost reply may store a
        # write twice (RELIABILITY.md).
        nodes = [ClusterNode(h, p) for h, p in settings.hosts]
        return RedisCluster(
            startup_nodes=nodes,
            max_connections=pool_size or UNLIMITED_CONNECTIONS,
            **{
                **kwargs,
                "retry": Retry(REDIS_DIAL.redis_py(), settings.max_retries),
            },
        )
    if settings.failover:
        # As go-redis's failover client: the Sentinels get the same TLS settings as the master.
        sentinel_kwargs = {
            k: v
            for k, v in kwargs.items()
            if k in ("username", "password", "socket_connect_timeout") or k.startswith("ssl")
        }
        sentinel = Sentinel(  # type: ignore[no-untyped-call]
            list(settings.hosts), sentinel_kwargs=sentinel_kwargs, db=settings.db, **kwargs
        )
        master: aioredis.Redis
        if pool_size is None:
            master = sentinel.master_for(
                settings.sentinel_master_name,
                **_without_maint_notifications(),
                max_connections=UNLIMITED_CONNECTIONS,
            )
        else:
            master = sentinel.master_for(
                settings.sentinel_master_name,
                **_without_maint_notifications(),
                connection_pool_class=BlockingSentinelConnectionPool,
                max_connections=pool_size,
                timeout=wait_s,
            )
        return master
    host, port = settings.hosts[0]
    pool_kwargs = {**kwargs, **_without_maint_notifications()}
    pool_kwargs["connect_retry"] = Retry(REDIS_DIAL.redis_py(), settings.max_retries)
    if settings.enable_tls:
        pool_kwargs.pop("ssl")
        pool_kwargs["connection_class"] = TlsConnection
    else:
        pool_kwargs["connection_class"] = HiredisPackingConnection
    pool: aioredis.ConnectionPool
    if pool_size is None:
        pool = aioredis.ConnectionPool(
            host=host, port=port, db=settings.db, max_connections=UNLIMITED_CONNECTIONS, **pool_kwargs
        )
    else:
        pool = aioredis.BlockingConnectionPool(
            host=host, port=port, db=settings.db, max_connections=pool_size, timeout=wait_s, **pool_kwargs
        )
    return aioredis.Redis(connection_pool=pool, retry=kwargs["retry"])


def _without_maint_notifications() -> dict[str, Any]:
    """Pool kwargs turning off redis-py 8's maintenance notifications (a Redis
    Enterprise feature). While they are on ("auto" under RESP3), the pool skips
    its check that a pooled connection is still open, so the first command
    after a Redis restart fails "Connection closed by server": with no command
    retry (RetryConnectOnly) that check is what reconnects."""
    try:
        from redis.maint_notifications import MaintNotificationsConfig
    except ImportError:  # redis-py < 8: no such feature, and the check always runs
        return {}
    return {"maint_notifications_config": MaintNotificationsConfig(enabled=False)}


def _seconds(ms: int | None) -> float | None:
    return None if ms is None else ms / 1000


def call_timeout(settings: Settings) -> float | None:
    """Seconds one Redis call (write and read) may take: readTimeout + writeTimeout; None if either is off."""
    if settings.read_timeout_ms is None or settings.write_timeout_ms is None:
        return None
    return (settings.read_timeout_ms + settings.write_timeout_ms) / 1000


def _tls_kwargs(settings: Settings, kwargs: dict[str, Any]) -> list[int]:
    """Fill the ssl_* client kwargs; the file descriptors returned hold the client
    certificate and key for as long as the connection may dial (close them after)."""
    kwargs["ssl"] = True
    if settings.insecure_skip_tls_verify:
        kwargs["ssl_cert_reqs"] = ssl.CERT_NONE
        kwargs["ssl_check_hostname"] = False
    if settings.client_cert_file is not None and settings.client_key_file is not None:
        _check_key_files(settings.client_cert_file, settings.client_key_file)
        kwargs["ssl_certfile"] = settings.client_cert_file
        kwargs["ssl_keyfile"] = settings.client_key_file
        return []
    if settings.client_cert is None or settings.client_key is None:
        return []
    # The metadata carries PEM contents (as pubsub.redis takes them) but ssl
    # loads client certificates from files only, at every dial. The pod's root
    # filesystem is read-only and it has no writable volume but the socket
    # folder (deploy/kubernetes/app.yaml): keep them in anonymous memory files
    # instead, reachable by path through /proc as long as the fd is open.
    fds: list[int] = []
    try:
        for name, kwarg, pem in (
            ("client.crt", "ssl_certfile", settings.client_cert),
            ("client.key", "ssl_keyfile", settings.client_key),
        ):
            fd = os.memfd_create(f"delayed-pubsub-{name}", os.MFD_CLOEXEC)
            fds.append(fd)
            os.write(fd, pem.encode())
            kwargs[kwarg] = f"/proc/self/fd/{fd}"
    except BaseException:
        _close_all(fds)
        raise
    return fds


def _check_key_files(cert_file: str, key_file: str) -> None:
    """INVALID_ARGUMENT naming the setting when the files cannot be read or do not
    make a certificate and its key: at Init, not at the first dial."""
    for key, path in (("clientCertFile", cert_file), ("clientKeyFile", key_file)):
        try:
            with open(path, "rb"):
                pass
        except OSError as e:
            raise InvalidArgumentError(key, path, f"cannot be read: {e.strerror}") from None
    try:
        ssl.create_default_context().load_cert_chain(cert_file, key_file)
    except ssl.SSLError as e:
        raise InvalidArgumentError(
            "clientCertFile",
            cert_file,
            f"with clientKeyFile {key_file}: not a PEM certificate and its key ({e.reason})",
        ) from None


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
