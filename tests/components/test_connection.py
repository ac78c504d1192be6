"""connection.py against a real Redis: pool limits that wait instead of failing,
blocking reads kept off the bounded pool, and an Init that is bounded and says
plainly when Redis refuses our credentials or is too old."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import time
from collections.abc import Callable, Iterator

import grpc
import prometheus_client
import pytest
import redis

from delayed_middleware.errors import UnsupportedRedisError
from delayed_pubsub.connection import check_redis_version, connect
from delayed_pubsub.server import ComponentServer
from delayed_pubsub.settings import parse_settings
from tests.chaos.proxy import VersionProxy
from tests.components.driver import Component
from tests.redis_server import RedisCluster, RedisSentinel, RedisServer, TlsRedisServer, make_tls_files

Factory = Callable[[str], Component]


async def test_nine_subscriptions_leave_a_pool_of_ten_to_publishes_and_fires(
    component: Factory, props: dict[str, str], redis_client: redis.Redis
) -> None:
    c = component("delayed")
    await c.init({**props, "poolSize": "10", "enableDelayedMessaging": "true"})
    topics = [f"t{i}" for i in range(9)]
    streams = [await c.subscribe(t) for t in topics]
    # Let every subscription park its XREADGROUP BLOCK.
    await asyncio.sleep(0.5)
    results = await asyncio.gather(
        *(c.publish(topics[i % 9], b"m%d" % i) for i in range(100)), return_exceptions=True
    )
    assert [r for r in results if isinstance(r, BaseException)] == []
    await c.publish(topics[0], b"later", {"scheduledSendDelay": "1s"})
    got = set()
    for _ in range(13):  # 12 publishes (i % 9 == 0) and the delayed one
        msg = await streams[0].next(within=10)
        got.add(msg.data)
        await streams[0].ack(msg.id)
    assert b"later" in got
    assert len(got) == 13
    assert sum(redis_client.xlen(t) for t in topics) == 101


async def test_a_full_pool_makes_callers_wait_instead_of_failing(
    redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    settings = parse_settings({"redisHost": redis_server.address, "poolSize": "2"})
    conn = connect(settings)
    try:
        # Two connections held for 0.3 s each by BLPOP; 20 short calls queue behind them.
        hold = [conn.client.blpop(["nothing"], timeout=0.3) for _ in range(2)]
        shorts = [conn.client.xadd("s", {"i": str(i)}) for i in range(20)]
        results = await asyncio.gather(*hold, *shorts, return_exceptions=True)
        assert [r for r in results if isinstance(r, BaseException)] == []
        assert redis_client.xlen("s") == 20
        clients = [c for c in redis_client.client_list() if c["name"] == "delayed-pubsub-f3"]
        assert len(clients) <= 2
    finally:
        await conn.aclose()


async def test_blocking_reads_use_their_own_pool_outside_pool_size(
    redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    settings = parse_settings({"redisHost": redis_server.address, "poolSize": "1", "readTimeout": "1s"})
    conn = connect(settings)
    try:
        blocked = asyncio.gather(*(conn.blocking_client.blpop(["nothing"], timeout=1) for _ in range(5)))
        await asyncio.sleep(0.2)
        started = time.monotonic()
        await conn.client.set("k", "v")
        assert time.monotonic() - started < 0.5  # not queued behind the five blocked reads
        await blocked
    finally:
        await conn.aclose()


# --- Init: bounded, and plain about credentials ----------------------------------


@pytest.fixture
def silent_server() -> Iterator[int]:
    """A TCP server that accepts connections and never says a word."""
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(16)
        yield srv.getsockname()[1]


@pytest.mark.parametrize("timeouts", [{"readTimeout": "0"}, {"readTimeout": "0", "dialTimeout": "0"}])
async def test_init_against_a_server_that_never_answers_returns_unavailable_within_a_bound(
    component: Factory, silent_server: int, timeouts: dict[str, str]
) -> None:
    c = component("delayed")
    started = time.monotonic()
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await c.init({"redisHost": f"127.0.0.1:{silent_server}", "consumerID": "a", **timeouts})
    elapsed = time.monotonic() - started
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert f"127.0.0.1:{silent_server}" in (err.value.details() or "")
    # The bound: dialTimeout (5 s by default) + 5 s for the unbounded read.
    assert elapsed < 15, elapsed


@pytest.fixture(scope="module")
def acl_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A Redis with a password on the default user, an ACL user `app` and a
    user `weak` that may run no command at all."""
    workdir = tmp_path_factory.mktemp("acl")
    conf = workdir / "acl.conf"
    conf.write_text(
        "requirepass default-pw-0b7\n"
        "user app on >app-pw-91c ~* &* +@all\n"
        "user weak on >weak-pw-3d2 ~* -@all\n"
    )
    server = RedisServer(workdir, appendonly=False, config_file=conf)
    # RedisServer's readiness probe has no password: start it here and probe with one.
    server.proc = subprocess.Popen(server.args(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = server.client(password="default-pw-0b7", socket_connect_timeout=0.2, socket_timeout=1)
    deadline = time.monotonic() + 10
    while True:
        try:
            client.ping()
            break
        except (redis.ConnectionError, redis.TimeoutError):
            assert time.monotonic() < deadline, f"acl redis did not start; see {workdir / 'redis.log'}"
            time.sleep(0.05)
    client.close()
    yield server
    server.stop()


SECRETS = ("default-pw-0b7", "app-pw-91c", "weak-pw-3d2", "wrong-pw-77e")


@pytest.mark.parametrize(
    ("creds", "reason"),
    [
        ({"redisPassword": "wrong-pw-77e"}, "invalid username-password pair"),
        ({"redisUsername": "app", "redisPassword": "wrong-pw-77e"}, "invalid username-password pair"),
        ({"redisUsername": "nobody", "redisPassword": "app-pw-91c"}, "invalid username-password pair"),
        ({}, "authentication required"),
        ({"redisUsername": "weak", "redisPassword": "weak-pw-3d2"}, "no permissions to run"),
    ],
)
async def test_refused_credentials_are_permission_denied_with_the_plain_reason_and_no_secret(
    component: Factory,
    acl_server: RedisServer,
    creds: dict[str, str],
    reason: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    c = component("delayed")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await c.init({"redisHost": acl_server.address, "consumerID": "a", "redisMaxRetries": "0", **creds})
    details = err.value.details() or ""
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, details
    assert reason in details.lower()
    assert "TLS" not in details
    for secret in SECRETS:
        assert secret not in details
        assert secret not in caplog.text


async def test_an_acl_user_with_its_password_publishes_and_subscribes_and_no_log_holds_the_password(
    component: Factory, acl_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    admin = acl_server.client(password="default-pw-0b7")
    admin.flushall()
    c = component("delayed")
    caplog.set_level("DEBUG")
    await c.init(
        {
            "redisHost": acl_server.address,
            "redisUsername": "app",
            "redisPassword": "app-pw-91c",
            "consumerID": "a",
            "enableDelayedMessaging": "true",
        }
    )
    stream = await c.subscribe("orders")
    await c.publish("orders", b"now")
    await c.publish("orders", b"soon", {"scheduledSendDelay": "200ms"})
    got = []
    for _ in range(2):
        msg = await stream.next(within=10)
        got.append(msg.data)
        await stream.ack(msg.id)
    assert sorted(got) == [b"now", b"soon"]
    names = {cl["user"] for cl in admin.client_list() if cl["name"].startswith("delayed-pubsub")}
    assert names == {"app"}
    for secret in SECRETS:
        assert secret not in caplog.text
    admin.close()


# --- no secret in any status, log or metric ------------------------------------------

CLIENT_KEY_BODY = "MIGHAgEAMBMGByqGSM49AgEGCCqGSM49AwEHBG0wawIBAQQgSECRETKEYMATERIAL"


@pytest.mark.parametrize(
    "props",
    [
        {"redisHost": "redis://app:app-pw-91c@127.0.0.1:6379"},
        {"redisHost": "app:app-pw-91c@127.0.0.1"},
        {"redisHost": "rediss://:app-pw-91c@127.0.0.1:6379,127.0.0.1:6380"},
        {
            "redisHost": "127.0.0.1",
            "enableTLS": "true",
            "clientCert": "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n",
            "clientKey": CLIENT_KEY_BODY,
        },
    ],
)
async def test_refused_init_metadata_never_echoes_a_password_or_key(
    component: Factory, server: ComponentServer, props: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("DEBUG")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await component("delayed").init({"consumerID": "a", **props})
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    seen = "\n".join([err.value.details() or "", caplog.text, _metrics_text(server)])
    for secret in ("app-pw-91c", CLIENT_KEY_BODY[:8], "SECRETKEY"):
        assert secret not in seen


async def test_a_working_authenticated_instance_leaves_no_password_in_metrics(
    component: Factory, server: ComponentServer, acl_server: RedisServer
) -> None:
    c = component("delayed")
    await c.init({"redisHost": acl_server.address, "redisUsername": "app", "redisPassword": "app-pw-91c"})
    await c.publish("orders", b"x")
    text = _metrics_text(server)
    assert 'instance="delayed"' in text
    assert "app-pw-91c" not in text


def _metrics_text(server: ComponentServer) -> str:
    return prometheus_client.generate_latest(server.metrics.registry).decode()


# --- poolSize on TLS (client certificates) and Sentinel ---------------------------------


@pytest.fixture(scope="module")
def tls_sentinel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisSentinel]:
    """A TLS-only master and Sentinel, both requiring a client certificate of a fresh CA."""
    tls = make_tls_files(tmp_path_factory.mktemp("tls"))
    s = RedisSentinel(tmp_path_factory.mktemp("tls-sentinel"), tls=tls)
    s.start()
    yield s
    s.stop()


@pytest.mark.parametrize("via", ["tls", "sentinel-tls"])
async def test_pool_size_holds_under_tls_with_client_certificates_and_sentinel(
    component: Factory, tls_sentinel: RedisSentinel, via: str
) -> None:
    master = tls_sentinel.master
    assert isinstance(master, TlsRedisServer)
    admin = master.client()
    admin.flushall()
    props = {
        "redisHost": master.address,
        "enableTLS": "true",
        "insecureSkipTLSVerify": "true",
        "clientCert": master.tls.client_cert.read_text(),
        "clientKey": master.tls.client_key.read_text(),
        "consumerID": "app1",
        "poolSize": "3",
        "enableDelayedMessaging": "true",
    }
    if via == "sentinel-tls":
        props |= {"redisHost": tls_sentinel.address, "failover": "true", "sentinelMasterName": "mymaster"}
    c = component("delayed")
    await c.init(props)
    streams = [await c.subscribe(f"t{i}") for i in range(4)]
    await asyncio.sleep(0.3)
    results = await asyncio.gather(*(c.publish(f"t{i % 4}", b"m") for i in range(40)), return_exceptions=True)
    assert [r for r in results if isinstance(r, BaseException)] == []
    await c.publish("t0", b"later", {"scheduledSendDelay": "300ms"})
    got = []
    for _ in range(11):
        msg = await streams[0].next(within=10)
        got.append(msg.data)
        await streams[0].ack(msg.id)
    assert got.count(b"later") == 1
    short = [cl for cl in admin.client_list() if cl["name"] == "delayed-pubsub-f3:app1"]
    assert len(short) <= 3
    admin.close()


# --- the oldest Redis: 6.2 (XPENDING IDLE, MINID) ----------------------------------------------


@pytest.mark.parametrize(
    "version", ["6.2.0", "6.2.14", "6.3.4", "7.0.15", "7.2.4", "8.0.1", "10.0.0", "255.255.255", "6.2.0-rc1"]
)
def test_redis_6_2_and_later_are_accepted(version: str) -> None:
    check_redis_version(version, "redis:6379")


@pytest.mark.parametrize("version", ["6.0.16", "6.1.9", "5.0.14", "4.0.14", "2.8.24", "6.0.0-rc1", "0.9"])
def test_redis_older_than_6_2_is_refused_saying_what_it_is_and_needs(version: str) -> None:
    with pytest.raises(UnsupportedRedisError) as caught:
        check_redis_version(version, "redis:6379")
    message = str(caught.value)
    assert f"redis at redis:6379 is version {version}" in message
    assert "needs Redis 6.2 or later" in message
    assert "XPENDING IDLE" in message


@pytest.mark.parametrize("version", ["", "unknown", "v7", "7"])
def test_a_version_that_proves_nothing_is_not_refused(version: str) -> None:
    check_redis_version(version, "redis:6379")


def real_version(server: RedisServer) -> str:
    return str(server.client().info("server")["redis_version"])


async def test_init_against_the_real_redis_here_is_accepted(
    component: Factory, props: dict[str, str], redis_server: RedisServer
) -> None:
    major, minor = (int(p) for p in real_version(redis_server).split(".")[:2])
    assert (major, minor) >= (6, 2)
    c = component("current")
    await c.init(props)
    await c.publish("orders", b"x")


async def test_init_against_redis_6_0_fails_with_failed_precondition_and_stores_nothing(
    component: Factory, props: dict[str, str], redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    real = real_version(redis_server)
    shown = "6.0." + "9" * (len(real) - 4)  # as long as the real one: 7.0.15 reads 6.0.99
    proxy = VersionProxy(redis_server.port, real, shown)
    await proxy.start()
    try:
        c = component("old")
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await c.init({**props, "redisHost": f"127.0.0.1:{proxy.port}", "enableDelayedMessaging": "true"})
        assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert caught.value.details() == (
            f"redis at 127.0.0.1:{proxy.port} is version {shown}; this component needs Redis 6.2 or "
            "later (it uses XPENDING IDLE and MINID trimming, added in 6.2)"
        )
        assert proxy.rewritten >= 1
        # Not initialized: a publish is refused as before any Init, and Redis holds nothing.
        with pytest.raises(grpc.aio.AioRpcError) as publish:
            await c.publish("orders", b"x")
        assert publish.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert redis_client.dbsize() == 0
    finally:
        await proxy.stop()


async def test_a_cluster_instance_takes_hundreds_of_first_commands_at_once_on_both_of_its_pools(
    cluster: RedisCluster,
) -> None:
    # daprd opens every subscription at once after Init, so the blocking pool's
    # first commands all arrive together. redis-py's cluster client fails some
    # of the first commands that race its node discovery ("Connection closed by
    # server", "Connection lost"): dozens in 20 fresh instances before Init
    # discovered the nodes of both pools. A single seed address, as behind a
    # Kubernetes service, is the common setting.
    settings = parse_settings({"redisHost": cluster.addresses[0], "redisType": "cluster"})
    failures: list[str] = []
    for _ in range(20):
        conn = connect(settings)
        try:
            await conn.ping()
            for client in (conn.client, conn.blocking_client):
                results = await asyncio.gather(
                    *(client.set(f"first-{i}", i) for i in range(300)), return_exceptions=True
                )
                failures += [repr(r) for r in results if isinstance(r, BaseException)]
        finally:
            await conn.aclose()
    assert failures == []
