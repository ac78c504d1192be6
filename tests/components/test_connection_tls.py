"""TLS with client certificates against a real redis-server that demands them
(`--tls-auth-clients yes`), its certificates from a private CA made by openssl.

The client certificate and key come as PEM contents in the metadata; they must
work where nothing can be written (the shipped pod's read-only root), and a
missing or foreign certificate must be refused in words a user can act on.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from delayed_middleware.storage_format import client_name
from delayed_pubsub.connection import connect
from delayed_pubsub.settings import parse_settings
from tests.components.driver import Component
from tests.redis_server import TlsFiles, TlsRedisServer, make_tls_files, start_mtls_redis_with_user

Factory = Callable[[str], Component]
PASSWORD = "tls-pw-5e1"

# Files opened for writing and directories made while `_AUDIT["on"]` is set.
_AUDIT: dict[str, Any] = {"on": False, "seen": []}


def _audit(event: str, args: tuple[Any, ...]) -> None:
    # An open of an int is an fd already made by a call recorded here.
    if not _AUDIT["on"] or not args or not isinstance(args[0], (str, bytes)):
        return
    writes_file = event == "open" and (
        (isinstance(args[1], str) and any(c in args[1] for c in "wax+"))
        or (isinstance(args[2], int) and args[2] & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))
    )
    if writes_file or event in ("os.mkdir", "tempfile.mkdtemp", "tempfile.mkstemp"):
        _AUDIT["seen"].append((event, args[0]))


sys.addaudithook(_audit)


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    return make_tls_files(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def mtls_redis(tls: TlsFiles, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsRedisServer]:
    server = start_mtls_redis_with_user(tmp_path_factory.mktemp("mtls-redis"), tls, PASSWORD)
    yield server
    server.stop()


@pytest.fixture
def trust_private_ca(tls: TlsFiles, monkeypatch: pytest.MonkeyPatch) -> None:
    # The documented private-CA answer (docs/tls.md): OpenSSL's default trust
    # store is read from SSL_CERT_FILE, so no insecureSkipTLSVerify is needed.
    monkeypatch.setenv("SSL_CERT_FILE", str(tls.ca_cert))


def _props(server: TlsRedisServer, cert: str, key: str) -> dict[str, str]:
    return {
        "redisHost": server.address,
        "redisUsername": "app",
        "redisPassword": PASSWORD,
        "enableTLS": "true",
        "clientCert": cert,
        "clientKey": key,
        "consumerID": "a",
        "enableDelayedMessaging": "true",
        "redisMaxRetries": "0",
    }


@pytest.mark.usefixtures("trust_private_ca")
async def test_client_certificate_from_metadata_works_with_nowhere_to_write(
    component: Factory,
    mtls_redis: TlsRedisServer,
    tls: TlsFiles,
    socket_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # No usable temporary directory, as under a read-only root; and every file
    # opened for writing or directory made meanwhile is recorded. The socket
    # folder is the one writable volume the pod gives us (Init records live there).
    monkeypatch.setattr(tempfile, "tempdir", str(Path(tempfile.gettempdir()) / "no-such-dir" / "x"))
    c = component("mtls")
    _AUDIT["seen"] = []
    _AUDIT["on"] = True
    try:
        await c.init(_props(mtls_redis, tls.client_cert.read_text(), tls.client_key.read_text()))
        stream = await c.subscribe("orders")
        await c.publish("orders", b"later", {"scheduledSendDelay": "200ms"})
        msg = await stream.next(within=10)
        await stream.ack(msg.id)
    finally:
        _AUDIT["on"] = False
    assert msg.data == b"later"
    outside = [
        (e, p) for e, p in _AUDIT["seen"] if not Path(os.fsdecode(p)).is_relative_to(socket_path.parent)
    ]
    assert outside == []
    admin = mtls_redis.client()
    users = {cl["user"] for cl in admin.client_list() if cl["name"].startswith(client_name("a"))}
    admin.close()
    assert users == {"app"}


@pytest.mark.usefixtures("trust_private_ca")
async def test_a_client_certificate_of_another_ca_is_refused_saying_so(
    component: Factory, mtls_redis: TlsRedisServer, tmp_path: Path
) -> None:
    foreign = make_tls_files(tmp_path / "foreign")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await component("foreign").init(
            _props(mtls_redis, foreign.client_cert.read_text(), foreign.client_key.read_text())
        )
    details = err.value.details() or ""
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE, details
    assert mtls_redis.address in details
    assert "client certificate" in details, details


@pytest.mark.usefixtures("trust_private_ca")
async def test_client_certificate_files_read_only_work_in_place_of_pem_values(
    component: Factory, mtls_redis: TlsRedisServer, tls: TlsFiles, tmp_path: Path
) -> None:
    # As a Secret mounted read-only: the files, in a folder nobody may write.
    mounted = tmp_path / "redis-client-tls"
    mounted.mkdir()
    (mounted / "tls.crt").write_bytes(tls.client_cert.read_bytes())
    (mounted / "tls.key").write_bytes(tls.client_key.read_bytes())
    for f in (*mounted.iterdir(), mounted):
        f.chmod(0o500 if f.is_dir() else 0o400)
    props = {k: v for k, v in _props(mtls_redis, "", "").items() if k not in ("clientCert", "clientKey")}
    props |= {"clientCertFile": str(mounted / "tls.crt"), "clientKeyFile": str(mounted / "tls.key")}
    c = component("mtls-files")
    await c.init(props)
    stream = await c.subscribe("orders-files")
    await c.publish("orders-files", b"from-files", {"scheduledSendDelay": "200ms"})
    msg = await stream.next(within=10)
    await stream.ack(msg.id)
    assert msg.data == b"from-files"


@pytest.mark.parametrize(
    ("cert", "key", "named", "says"),
    [
        ("missing.crt", "client.key", "clientCertFile", "cannot be read"),
        ("client.crt", "missing.key", "clientKeyFile", "cannot be read"),
        ("client.crt", "server.key", "clientCertFile", "not a PEM certificate and its key"),
    ],
)
async def test_unusable_client_certificate_files_are_refused_at_init_naming_the_setting(
    component: Factory, mtls_redis: TlsRedisServer, tls: TlsFiles, cert: str, key: str, named: str, says: str
) -> None:
    folder = tls.ca_cert.parent
    props = {k: v for k, v in _props(mtls_redis, "", "").items() if k not in ("clientCert", "clientKey")}
    props |= {"clientCertFile": str(folder / cert), "clientKeyFile": str(folder / key)}
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await component("bad-files").init(props)
    details = err.value.details() or ""
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, details
    assert named in details, details
    assert says in details, details


async def test_the_client_key_is_in_no_file_and_closing_frees_it(tls: TlsFiles) -> None:
    settings = parse_settings(
        {
            "redisHost": "127.0.0.1:1",
            "enableTLS": "true",
            "clientCert": tls.client_cert.read_text(),
            "clientKey": tls.client_key.read_text(),
        }
    )
    conn = connect(settings)
    pool = conn.client.connection_pool  # type: ignore[union-attr]
    paths = [pool.connection_kwargs["ssl_certfile"], pool.connection_kwargs["ssl_keyfile"]]
    assert _contents(paths) == [tls.client_cert.read_text(), tls.client_key.read_text()]
    # Reachable by path, yet linked into no directory of any filesystem.
    assert _links(paths) == [0, 0]
    await conn.aclose()
    assert _links(paths) == [None, None]


def _contents(paths: list[str]) -> list[str]:
    return [Path(p).read_text() for p in paths]


def _links(paths: list[str]) -> list[int | None]:
    """st_nlink of each path; None where nothing is there any more."""
    return [os.stat(p).st_nlink if os.path.exists(p) else None for p in paths]
