"""The grpc.aio server daprd discovers: unix socket, PubSub, reflection v1alpha, health."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import stat
from collections.abc import Mapping
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from delayed_middleware.clock import Clock
from delayed_pubsub.instance import Instances
from delayed_pubsub.metrics import Metrics
from delayed_pubsub.servicer import PubSubServicer
from delayed_pubsub_pb.dapr.proto.components.v1 import pubsub_pb2, pubsub_pb2_grpc

log = logging.getLogger(__name__)

SOCKETS_FOLDER_ENV = "DAPR_COMPONENTS_SOCKETS_FOLDER"
DEFAULT_SOCKETS_FOLDER = "/tmp/dapr-components-sockets"
# daprd derives the component type from the file name: pubsub.delayed-pubsub.
SOCKET_NAME = "delayed-pubsub.sock"
SOCKET_MODE = 0o660

PUBSUB_SERVICE = pubsub_pb2.DESCRIPTOR.services_by_name["PubSub"].full_name

# How often grpc.health.v1 is brought up to date with Redis reachability.
HEALTH_INTERVAL_S = 2.0

# daprd's bulk publishes can exceed gRPC's 4 MiB default.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
GRPC_OPTIONS = (
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
)


def default_socket_path(environ: Mapping[str, str]) -> Path:
    """`$DAPR_COMPONENTS_SOCKETS_FOLDER/delayed-pubsub.sock` (folder default /tmp/dapr-components-sockets)."""
    folder = environ.get(SOCKETS_FOLDER_ENV) or DEFAULT_SOCKETS_FOLDER
    return Path(folder) / SOCKET_NAME


class ComponentServer:
    """The component's gRPC server bound to one unix socket."""

    def __init__(self, socket_path: Path, clock: Clock, metrics: Metrics | None = None) -> None:
        self.socket_path = socket_path
        self.metrics = metrics or Metrics()
        self.instances = Instances(clock, self.metrics)
        self._clock = clock
        self._health_task: asyncio.Task[None] | None = None
        self._health = health.aio.HealthServicer()  # type: ignore[attr-defined]
        self._server = grpc.aio.server(options=GRPC_OPTIONS)
        pubsub_pb2_grpc.add_PubSubServicer_to_server(  # type: ignore[no-untyped-call]
            PubSubServicer(self.instances), self._server
        )
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        reflection.enable_server_reflection(
            (PUBSUB_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), self._server
        )

    async def start(self) -> None:
        """Bind the socket (replacing a stale one) with mode 0660 and start serving."""
        self.socket_path.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_socket(self.socket_path)
        # The umask makes the socket 0660 from birth: no window where daprd's
        # group cannot connect, or where others can.
        old_umask = os.umask(0o117)
        try:
            self._server.add_insecure_port(f"unix://{self.socket_path}")
            await self._server.start()
        finally:
            os.umask(old_umask)
        os.chmod(self.socket_path, SOCKET_MODE)
        await self._health.set("", health_pb2.HealthCheckResponse.SERVING)
        await self._health.set(PUBSUB_SERVICE, health_pb2.HealthCheckResponse.SERVING)
        self._health_task = asyncio.create_task(self._watch_redis(), name="health")
        log.info("serving %s on unix://%s", PUBSUB_SERVICE, self.socket_path)

    async def _watch_redis(self) -> None:
        """NOT_SERVING while any initialized instance cannot reach its Redis; SERVING again after."""
        serving = True
        while True:
            await self._clock.sleep(HEALTH_INTERVAL_S)
            try:
                down = await self.instances.unreachable()
            except Exception:
                log.exception("health check failed")
                continue
            if bool(down) == serving:
                serving = not down
                status = (
                    health_pb2.HealthCheckResponse.SERVING
                    if serving
                    else health_pb2.HealthCheckResponse.NOT_SERVING
                )
                for service in ("", PUBSUB_SERVICE):
                    await self._health.set(service, status)
                if serving:
                    log.info("redis reachable again: health SERVING")
                else:
                    log.warning("redis unreachable for instance(s) %s: health NOT_SERVING", ", ".join(down))

    async def stop(self, grace: float = 5.0) -> None:
        """Refuse new calls, give running ones `grace` seconds, close every instance, remove the socket.

        Open PullMessages streams end; their unacked messages stay pending in
        Redis and come back after processingTimeout.
        """
        if self._health_task is not None:
            self._health_task.cancel()
            await asyncio.gather(self._health_task, return_exceptions=True)
        await self._health.enter_graceful_shutdown()
        await self._server.stop(grace)
        await self.instances.close()
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()
        log.info("stopped; removed %s", self.socket_path)


def _remove_stale_socket(path: Path) -> None:
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        # Never delete something that is not ours to delete.
        raise FileExistsError(f"{path} exists and is not a socket")
    # Stale means nobody answers. A live socket belongs to a running server
    # (a second `serve` by mistake): taking its path would cut daprd off it.
    with socket.socket(socket.AF_UNIX) as probe:
        try:
            probe.connect(str(path))
        except OSError:
            pass
        else:
            raise FileExistsError(f"{path} is in use by a running server; stop it or choose another --socket")
    log.info("removing stale socket %s", path)
    path.unlink()


async def serve(
    socket_path: Path,
    clock: Clock,
    stop: asyncio.Event | None = None,
    grace: float = 5.0,
    metrics: Metrics | None = None,
) -> None:
    """Serve until SIGTERM/SIGINT (or `stop` is set), then shut down cleanly."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    server = ComponentServer(socket_path, clock, metrics)
    await server.start()
    try:
        await stop.wait()
        log.info("shutting down")
    finally:
        await server.stop(grace)
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
