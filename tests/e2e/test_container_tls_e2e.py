"""Redis over TLS with client certificates, from the container image run as the shipped pod runs it.

deploy/kubernetes/app.yaml gives the component a read-only root filesystem and no writable
volume but the socket folder. The client certificate and key arrive as PEM contents in the
Init metadata (from a Secret, through daprd); the server's certificate is signed by a private
CA, trusted through SSL_CERT_FILE pointing at a read-only mount (docs/tls.md). The Redis is a
real redis-server that demands client certificates (`--tls-auth-clients yes`), with an ACL
user and password.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from delayed_middleware.storage_format import client_name
from tests.components.driver import Component
from tests.e2e import harness, test_container_e2e
from tests.e2e.harness import ManagedProcess, unique
from tests.e2e.test_container_e2e import SOCKETS_FOLDER, manifest_args, podman
from tests.redis_server import TlsFiles, TlsRedisServer, free_port, make_tls_files, start_mtls_redis_with_user

pytestmark = pytest.mark.e2e

# The image, built (or found cached) by scripts/image.sh: the container tests' fixture.
image = test_container_e2e.image

PASSWORD = "pod-tls-pw-41d"
CA_MOUNT = "/etc/redis-ca"
# The client certificate as files too, as a Secret mounted read-only (clientCertFile / clientKeyFile).
CLIENT_MOUNT = "/etc/redis-client-tls"


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    return make_tls_files(tmp_path_factory.mktemp("pod-tls"))


@pytest.fixture(scope="module")
def mtls_redis(tls: TlsFiles, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsRedisServer]:
    server = start_mtls_redis_with_user(tmp_path_factory.mktemp("pod-mtls-redis"), tls, PASSWORD)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def tls_container(image: str, tls: TlsFiles, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The image under the pod's constraints; yields the socket folder it serves in."""
    with tempfile.TemporaryDirectory(prefix="dps-tls-") as d:
        sockets = Path(d) / "sockets"
        sockets.mkdir()
        sockets.chmod(0o777)
        ca = Path(d) / "ca"
        ca.mkdir()
        shutil.copy(tls.ca_cert, ca / "ca.crt")
        ca.chmod(0o755)
        (ca / "ca.crt").chmod(0o644)
        client = Path(d) / "client"
        client.mkdir()
        shutil.copy(tls.client_cert, client / "tls.crt")
        shutil.copy(tls.client_key, client / "tls.key")
        client.chmod(0o755)
        # The image's user must read them; a Secret volume's default mode is 0644 too.
        for f in client.iterdir():
            f.chmod(0o644)
        name = unique("dps-tls")
        args = [
            *(["--runtime", "/usr/sbin/runc"] if Path("/usr/sbin/runc").exists() else []),
            "run", "--name", name,
            "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=1024:1024",
            "--cap-drop", "ALL", "--security-opt", "no-new-privileges",
            # Nothing writable but the socket folder: no tmpfs on /tmp either.
            "--read-only", "--read-only-tmpfs=false",
            "--network", "host",
            "-v", f"{sockets}:{SOCKETS_FOLDER}",
            "-v", f"{ca}:{CA_MOUNT}:ro",
            "-v", f"{client}:{CLIENT_MOUNT}:ro",
            "-e", f"SSL_CERT_FILE={CA_MOUNT}/ca.crt",
            image,
            *manifest_args(free_port(), free_port()),
        ]  # fmt: skip
        exe = shutil.which("podman")
        if exe is None:
            pytest.fail(
                "podman is not installed: run scripts/setup.sh (it installs podman, runc, mmdebstrap)"
            )
        proc = ManagedProcess("podman run (tls)", [exe, *args], Path(d) / "container.log").start()
        try:
            harness.wait_until_blocking(
                (sockets / "delayed-pubsub.sock").is_socket,
                "the container's socket",
                60,
                process=proc,
            )
            yield sockets
        except harness.HarnessError as exc:
            pytest.fail(str(exc), pytrace=False)
        finally:
            podman("rm", "--force", "--time", "0", name, check=False)
            proc.stop()


def _props(server: TlsRedisServer, cert: str, key: str) -> dict[str, str]:
    # As a Component would carry them, the PEM values from a Secret (docs/tls.md).
    return {
        "redisHost": server.address,
        "redisUsername": "app",
        "redisPassword": PASSWORD,
        "enableTLS": "true",
        "clientCert": cert,
        "clientKey": key,
        "consumerID": "pod",
        "enableDelayedMessaging": "true",
        "redisMaxRetries": "0",
    }


async def test_mtls_with_a_password_works_from_the_read_only_container(
    tls_container: Path, mtls_redis: TlsRedisServer, tls: TlsFiles
) -> None:
    async with grpc.aio.insecure_channel(f"unix://{tls_container / 'delayed-pubsub.sock'}") as channel:
        c = Component(channel, "delayed")
        await c.init(_props(mtls_redis, tls.client_cert.read_text(), tls.client_key.read_text()))
        stream = await c.subscribe("orders")
        await c.publish("orders", b"over-mtls", {"scheduledSendDelay": "1s"})
        msg = await stream.next(within=15)
        await stream.ack(msg.id)
    assert msg.data == b"over-mtls"
    admin = mtls_redis.client()
    users = {cl["user"] for cl in admin.client_list() if cl["name"].startswith(client_name("pod"))}
    admin.close()
    assert users == {"app"}


async def test_a_foreign_client_certificate_is_refused_from_the_container_saying_so(
    tls_container: Path, mtls_redis: TlsRedisServer, tmp_path: Path
) -> None:
    foreign = make_tls_files(tmp_path / "foreign")
    async with grpc.aio.insecure_channel(f"unix://{tls_container / 'delayed-pubsub.sock'}") as channel:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await Component(channel, "foreign").init(
                _props(mtls_redis, foreign.client_cert.read_text(), foreign.client_key.read_text())
            )
    details = err.value.details() or ""
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE, details
    assert "client certificate" in details, details


async def test_mtls_from_certificate_files_mounted_read_only_in_the_container(
    tls_container: Path, mtls_redis: TlsRedisServer
) -> None:
    props = {k: v for k, v in _props(mtls_redis, "", "").items() if k not in ("clientCert", "clientKey")}
    props |= {"clientCertFile": f"{CLIENT_MOUNT}/tls.crt", "clientKeyFile": f"{CLIENT_MOUNT}/tls.key"}
    async with grpc.aio.insecure_channel(f"unix://{tls_container / 'delayed-pubsub.sock'}") as channel:
        c = Component(channel, "from-files")
        await c.init(props)
        stream = await c.subscribe("orders-files")
        await c.publish("orders-files", b"over-mtls-files", {"scheduledSendDelay": "1s"})
        msg = await stream.next(within=15)
        await stream.ack(msg.id)
    assert msg.data == b"over-mtls-files"
