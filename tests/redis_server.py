"""Real Redis deployments on private loopback ports, for tests and benchmarks.

`RedisServer` is one redis-server; `TlsRedisServer` the same behind TLS only;
`RedisCluster` three cluster masters; `RedisSentinel` a master watched by one
Sentinel. Missing redis-server (or openssl for the TLS certificates) is an
error, never a skip: CI must prove the real thing.
"""

from __future__ import annotations

import contextlib
import functools
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, cast

import redis

from tests.waiting import wait_until_blocking

START_TIMEOUT_S = 10.0


def free_port() -> int:
    """A loopback TCP port free at this instant (the OS picks it); see RedisServer.start for the race."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _which(tool: str) -> str:
    exe = shutil.which(tool)
    if exe is None:
        raise RuntimeError(
            f"{tool} is not installed: run `make test` (it installs it) or `apt-get install -y redis-server`"
        )
    return exe


def _wait_for(what: str, check: Callable[[], bool]) -> None:
    """Until `check` holds (a server still starting counts as "not yet"); RuntimeError naming `what`."""
    wait_until_blocking(
        check, what, START_TIMEOUT_S, tolerate=(redis.RedisError, OSError), error=RuntimeError
    )


class RedisServer:
    """One redis-server process; restartable on the same port and data dir.

    `extra_args` go after the defaults (later options win); `config_file`, if
    given, is passed first, as redis-server wants it (Sentinel needs one).
    """

    def __init__(
        self,
        workdir: Path,
        port: int | None = None,
        appendonly: bool = True,
        extra_args: Sequence[str] = (),
        config_file: Path | None = None,
    ) -> None:
        self.exe = _which("redis-server")
        self.workdir = workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self._port_given = port is not None
        self._started = False
        self.appendonly = appendonly
        self.extra_args = tuple(extra_args)
        self.config_file = config_file
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    @property
    def address(self) -> str:
        """`127.0.0.1:port`, as redisHost takes it."""
        return f"127.0.0.1:{self.port}"

    def args(self) -> list[str]:
        """The redis-server command line."""
        return [
            self.exe,
            *([str(self.config_file)] if self.config_file is not None else []),
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.workdir),
            "--save",
            "",
            "--appendonly",
            "yes" if self.appendonly else "no",
            "--appendfsync",
            "everysec",
            "--daemonize",
            "no",
            "--loglevel",
            "warning",
            "--logfile",
            str(self.workdir / "redis.log"),
            *self.extra_args,
        ]

    def start(self) -> None:
        """Start, and wait until this very process answers PING.

        free_port() only picked a port that was free then: if another process
        took it since, a fresh one is picked (unless the port was given, or this
        server ran before: a restart keeps its port).
        """
        for _ in range(3):
            if self._start_once():
                self._started = True
                return
            if self._port_given or self._started:
                break
            self.pick_ports()
        raise RuntimeError(f"redis-server could not bind port {self.port}: another process holds it")

    def pick_ports(self) -> None:
        """Pick fresh free ports (after a clash with another process)."""
        self.port = free_port()

    def _start_once(self) -> bool:
        """True once our process answers; False if another process holds a port we need."""
        log = self.workdir / "redis.log"
        log_start = log.stat().st_size if log.exists() else 0
        self.proc = subprocess.Popen(self.args(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + START_TIMEOUT_S
        client = self.client(socket_connect_timeout=0.2, socket_timeout=1)
        try:
            while True:
                try:
                    if client.ping():
                        if int(client.info("server")["process_id"]) == self.proc.pid:
                            return True
                        # Someone else's server answered: ours could not bind.
                        self.stop(kill=True)
                        return False
                except (redis.ConnectionError, redis.TimeoutError):
                    if self.proc.poll() is not None or time.monotonic() > deadline:
                        self.stop(kill=True)
                        with contextlib.suppress(OSError), log.open("rb") as f:
                            f.seek(log_start)
                            if b"Address already in use" in f.read():
                                return False
                        raise RuntimeError(
                            f"redis-server did not start on port {self.port}; see {log}"
                        ) from None
                    time.sleep(0.05)
        finally:
            client.close()

    def stop(self, kill: bool = False) -> None:
        if self.proc is None:
            return
        if kill:
            self.proc.kill()
        else:
            self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def client(self, **kwargs: Any) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, **kwargs)


# --- TLS ----------------------------------------------------------------------


@dataclass(frozen=True)
class TlsFiles:
    """PEM files of a private CA, a server certificate for 127.0.0.1 and a client certificate."""

    ca_cert: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def make_tls_files(directory: Path) -> TlsFiles:
    """A fresh CA, a server certificate (SAN IP:127.0.0.1) and a client certificate, signed by it."""
    openssl = _which("openssl")
    directory.mkdir(parents=True, exist_ok=True)
    d = directory

    def run(*args: str) -> None:
        done = subprocess.run([openssl, *args], cwd=d, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"openssl {' '.join(args)} failed: {done.stderr.strip()}")

    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    run(
        "req",
        "-x509",
        *ec,
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
        "-days",
        "2",
        "-subj",
        "/CN=dps-test-ca",
        "-addext",
        "basicConstraints=critical,CA:TRUE",
        "-addext",
        "keyUsage=critical,keyCertSign,cRLSign",
    )
    for name, ext in (
        ("server", "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n"),
        ("client", "extendedKeyUsage=clientAuth\n"),
    ):
        (d / f"{name}.ext").write_text("basicConstraints=CA:FALSE\nkeyUsage=digitalSignature\n" + ext)
        run("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN=dps-test-{name}")
        run(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            f"{name}.crt",
            "-days",
            "2",
            "-extfile",
            f"{name}.ext",
        )
    return TlsFiles(d / "ca.crt", d / "server.crt", d / "server.key", d / "client.crt", d / "client.key")


class TlsRedisServer(RedisServer):
    """A redis-server that speaks TLS only (`--port 0 --tls-port P`).

    `auth_clients` is redis's tls-auth-clients: "yes" refuses clients without a
    certificate signed by the CA, "optional" checks one only if given.
    """

    def __init__(
        self,
        workdir: Path,
        tls: TlsFiles,
        auth_clients: Literal["yes", "optional", "no"] = "optional",
        extra_args: Sequence[str] = (),
        config_file: Path | None = None,
    ) -> None:
        super().__init__(workdir, appendonly=False, extra_args=extra_args, config_file=config_file)
        self.tls = tls
        self.auth_clients = auth_clients

    @property
    def url(self) -> str:
        return f"rediss://127.0.0.1:{self.port}"

    def args(self) -> list[str]:
        args = super().args()
        args[args.index("--port") + 1] = "0"
        return [
            *args,
            "--tls-port",
            str(self.port),
            "--tls-cert-file",
            str(self.tls.server_cert),
            "--tls-key-file",
            str(self.tls.server_key),
            "--tls-ca-cert-file",
            str(self.tls.ca_cert),
            # What it presents when it is the client (a Sentinel to its master):
            # the server certificate is for serverAuth only.
            "--tls-client-cert-file",
            str(self.tls.client_cert),
            "--tls-client-key-file",
            str(self.tls.client_key),
            "--tls-auth-clients",
            self.auth_clients,
        ]

    def client(self, **kwargs: Any) -> redis.Redis:
        """A client that trusts the test CA and presents the client certificate."""
        return redis.Redis(
            host="127.0.0.1",
            port=self.port,
            ssl=True,
            ssl_ca_certs=str(self.tls.ca_cert),
            ssl_certfile=str(self.tls.client_cert),
            ssl_keyfile=str(self.tls.client_key),
            **kwargs,
        )


# --- Redis Cluster ------------------------------------------------------------


class ClusterNode(RedisServer):
    """A redis-server with cluster mode on and an explicit bus port (the default,
    port + 10000, fails for ports above 55535)."""

    def __init__(self, workdir: Path, node_timeout_ms: int = 5000) -> None:
        super().__init__(workdir, appendonly=False)
        self.bus_port = free_port()
        self.node_timeout_ms = node_timeout_ms

    def pick_ports(self) -> None:
        super().pick_ports()
        self.bus_port = free_port()

    def args(self) -> list[str]:
        return [
            *super().args(),
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            "nodes.conf",
            "--cluster-port",
            str(self.bus_port),
            "--cluster-node-timeout",
            str(self.node_timeout_ms),
        ]


class RedisCluster:
    """Three cluster masters on private ports, slots split by `redis-cli --cluster create`;
    `replicas` per master (for failover tests), each with a short node timeout then."""

    def __init__(self, workdir: Path, masters: int = 3, replicas: int = 0) -> None:
        self.redis_cli = _which("redis-cli")
        self.replicas = replicas
        timeout = 1000 if replicas else 5000
        self.nodes = [ClusterNode(workdir / f"node{i}", timeout) for i in range(masters * (1 + replicas))]

    @property
    def addresses(self) -> list[str]:
        return [n.address for n in self.nodes]

    def start(self) -> None:
        try:
            for node in self.nodes:
                node.start()
            done = subprocess.run(
                [
                    self.redis_cli,
                    "--cluster",
                    "create",
                    *self.addresses,
                    "--cluster-replicas",
                    str(self.replicas),
                    "--cluster-yes",
                ],
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
            if done.returncode != 0:
                raise RuntimeError(f"redis-cli --cluster create failed: {done.stdout}\n{done.stderr}")
            self.wait_ready()
        except BaseException:
            self.stop()
            raise

    def wait_ready(self) -> None:
        """Until every node reports cluster_state:ok, knows every other and sees all slots served,
        and every replica has synced with its master (a replica that never did will not fail over)."""
        for node in self.nodes:
            _wait_for(f"cluster_state:ok on node {node.address}", functools.partial(self._ready, node))
        for node in self.nodes:
            _wait_for(f"replica {node.address} in sync", functools.partial(self._synced, node))

    def _synced(self, node: RedisServer) -> bool:
        with node.client(decode_responses=True) as c:
            info: Any = c.info("replication")
        return str(info.get("role")) == "master" or str(info.get("master_link_status")) == "up"

    def restart(self, down_for: float = 0.0) -> None:
        """Stop every node, wait `down_for` seconds, start them again (slots kept in nodes.conf, data lost)."""
        self.stop()
        time.sleep(down_for)
        try:
            for node in self.nodes:
                node.start()
            self.wait_ready()
        except BaseException:
            self.stop()
            raise

    def _ready(self, node: RedisServer) -> bool:
        with node.client(decode_responses=True) as c:
            info: Any = c.cluster("INFO")
            return (
                str(info.get("cluster_state")) == "ok"
                and int(info.get("cluster_known_nodes", 0)) == len(self.nodes)
                and int(info.get("cluster_slots_ok", 0)) == 16384
            )

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def client(self) -> redis.cluster.RedisCluster:
        """A cluster-aware sync client."""
        return redis.cluster.RedisCluster(host="127.0.0.1", port=self.nodes[0].port)

    def flushall(self) -> None:
        for node in self.nodes:
            with node.client() as c:
                c.flushall()

    def keyslot(self, key: str) -> int:
        with self.nodes[0].client() as c:
            return int(c.execute_command("CLUSTER KEYSLOT", key))

    def owner(self, key: str) -> RedisServer:
        """The master that serves `key`'s slot, by CLUSTER SLOTS."""
        slot = self.keyslot(key)
        with self.nodes[0].client() as c:
            ranges: Any = c.execute_command("CLUSTER SLOTS")
        # Raw reply: [[first, last, [host, port, id, ...], replicas...], ...]
        for first, last, primary, *_ in ranges:
            if int(first) <= slot <= int(last):
                port = int(primary[1])
                return next(n for n in self.nodes if n.port == port)
        raise LookupError(f"no master serves slot {slot} of {key!r}")


# --- Sentinel -----------------------------------------------------------------


class RedisSentinel:
    """A master RedisServer and one Sentinel monitoring it as `master_name` (quorum 1).

    With `tls`, both speak TLS only and require a client certificate, and the
    Sentinel reaches the master over TLS too.
    """

    def __init__(
        self, workdir: Path, master_name: str = "mymaster", tls: TlsFiles | None = None, replica: bool = False
    ) -> None:
        self.master_name = master_name
        self.master = (
            RedisServer(workdir / "master", appendonly=False)
            if tls is None
            else TlsRedisServer(workdir / "master", tls, auth_clients="yes")
        )
        # With `replica` (plain only): one replica, and a quick failover for failover tests.
        self.replica = (
            RedisServer(
                workdir / "replica",
                appendonly=False,
                extra_args=("--replicaof", "127.0.0.1", str(self.master.port)),
            )
            if replica
            else None
        )
        conf = workdir / "sentinel" / "sentinel.conf"
        conf.parent.mkdir(parents=True, exist_ok=True)
        down_ms = 1000 if replica else 5000
        # Sentinel rewrites its config file, so it gets a private writable one.
        conf.write_text(
            f"bind 127.0.0.1\nsentinel monitor {master_name} 127.0.0.1 {self.master.port} 1\n"
            f"sentinel down-after-milliseconds {master_name} {down_ms}\n"
            f"sentinel failover-timeout {master_name} 10000\n"
        )
        self.sentinel = (
            RedisServer(conf.parent, appendonly=False, config_file=conf, extra_args=("--sentinel",))
            if tls is None
            else TlsRedisServer(
                conf.parent,
                tls,
                auth_clients="yes",
                config_file=conf,
                extra_args=("--sentinel", "--tls-replication", "yes"),
            )
        )

    @property
    def address(self) -> str:
        """The Sentinel's `127.0.0.1:port` (what redisHost lists with failover: true)."""
        return self.sentinel.address

    def start(self) -> None:
        try:
            self.master.start()
            if self.replica is not None:
                self.replica.start()
                _wait_for("the replica in sync", self._replica_synced)
            self.sentinel.start()
            _wait_for(f"sentinel reporting master {self.master_name}", self._reports_master)
        except BaseException:
            self.stop()
            raise

    def _replica_synced(self) -> bool:
        assert self.replica is not None
        with self.replica.client(decode_responses=True) as c:
            info: Any = c.info("replication")
        return str(info.get("master_link_status")) == "up"

    def _reports_master(self) -> bool:
        with self.sentinel.client(decode_responses=True) as c:
            state: Any = c.execute_command("SENTINEL MASTER", self.master_name)
        if isinstance(state, list):
            state = dict(zip(state[::2], state[1::2], strict=True))
        flags = set(str(state.get("flags", "")).split(","))
        return (
            int(state.get("port", 0)) == self.master.port
            and "master" in flags
            and not flags & {"s_down", "o_down", "disconnected"}
            and int(state.get("role-reported-time", 0)) >= 0
            and str(state.get("role-reported")) == "master"
        )

    def stop(self) -> None:
        self.sentinel.stop()
        self.master.stop()
        if self.replica is not None:
            self.replica.stop()


def stream_entries(
    client: redis.Redis | redis.cluster.RedisCluster, key: str
) -> list[tuple[str, dict[bytes, bytes]]]:
    """XRANGE key - + as (id, fields): redis-py's own return type is too loose to use."""
    raw = cast("list[tuple[bytes, dict[bytes, bytes]]]", client.xrange(key))
    return [(i.decode(), f) for i, f in raw]


def start_mtls_redis_with_user(workdir: Path, tls: TlsFiles, password: str) -> TlsRedisServer:
    """A started redis-server that demands client certificates and knows the ACL user `app`
    with `password`; the default user stays open for readiness probes and the tests' checks."""
    conf = workdir / "acl.conf"
    conf.write_text(f"user app on >{password} ~* &* +@all\n")
    server = TlsRedisServer(workdir, tls, auth_clients="yes", config_file=conf)
    server.start()
    return server
