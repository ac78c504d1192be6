"""The grpc.aio server daprd discovers: unix socket, PubSub, reflection v1alpha, health."""

from __future__ import annotations

import asyncio
import contextlib
import grp
import inspect
import logging
import os
import signal
import socket
import stat
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2_grpc

from delayed_middleware.clock import Clock
from delayed_middleware.errors import DelayedPubSubError
from delayed_pubsub.admission import AdmissionControl, HeldCalls
from delayed_pubsub.instance import Instance, Instances
from delayed_pubsub.metrics import Metrics
from delayed_pubsub.records import RecordStore, records_folder
from delayed_pubsub.servicer import PubSubServicer
from delayed_pubsub.workers import WorkerPool
from delayed_pubsub_pb.dapr.proto.components.v1 import pubsub_pb2, pubsub_pb2_grpc

log = logging.getLogger(__name__)

SOCKETS_FOLDER_ENV = "DAPR_COMPONENTS_SOCKETS_FOLDER"
DEFAULT_SOCKETS_FOLDER = "/tmp/dapr-components-sockets"
# daprd derives the component type from the file name: pubsub.delayed-pubsub.
SOCKET_NAME = "delayed-pubsub.sock"
SOCKET_MODE = 0o660

PUBSUB_SERVICE = pubsub_pb2.DESCRIPTOR.services_by_name["PubSub"].full_name
# grpc.health.v1 names: "" (and PUBSUB_SERVICE) is NOT_SERVING while an
# instance's Redis does not answer or a background loop is down (ended or stalled); this one is NOT_SERVING while subscriptions
# are orphaned (only a daprd restart resumes them: for alerts and for whatever
# supervises daprd; see docs/operations.md, "Restarts and upgrades").
SUBSCRIPTIONS_HEALTH_SERVICE = "delayed-pubsub.subscriptions"
# NOT_SERVING while a worker process of `serve --workers N` has been down for longer than its
# restarts take (workers.DEAD_AFTER_S): the firing is not coming back by itself, so liveness
# (/healthz) fails and the container is restarted. Always SERVING without workers.
WORKERS_HEALTH_SERVICE = "delayed-pubsub.workers"
# How often each instance's Redis is PINGed for the health status, and how long a PING may take.
HEALTH_INTERVAL_S = 5.0
HEALTH_PING_TIMEOUT_S = 2.0

# daprd's bulk publishes can exceed gRPC's 4 MiB default.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
# Streams one connection may hold at once, advertised as SETTINGS_MAX_CONCURRENT_STREAMS.
# Without it a client opens every call's stream at once (3,000 callers: 3,000 streams), and
# grpc.aio takes them from gRPC's core one per loop pass: the rest wait in the core's queue of
# calls nobody has requested yet, where the core cancels some of them (CANCELLED, measured:
# 371 of 3,000 delayed publishes, 638 of 3,000 Pings) before any of our code sees them. With the
# limit, gRPC's overload protection (grpc.http.overload_protection, on by default) refuses a
# stream past it with RST_STREAM REFUSED_STREAM: the caller gets UNAVAILABLE, nothing was read,
# nothing stored, and retrying is safe. Twice the default maxInflightPublishes, so that
# admission control's refusals (RESOURCE_EXHAUSTED, growing from the bound to certainty at twice
# it) still come first; a subscription's PullMessages stream counts among these too.
MAX_CONCURRENT_STREAMS = 512
GRPC_OPTIONS = (
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    # Admission control reads the calls held from channelz (on by default; said here because it relies on it).
    ("grpc.enable_channelz", 1),
    ("grpc.max_concurrent_streams", MAX_CONCURRENT_STREAMS),
)


class UnsafeSocketFolderError(PermissionError):
    """The socket folder lets someone else replace our socket (and so stand in
    for the component before daprd). `serve` refuses it unless told otherwise."""


def socket_folder_problems(st: os.stat_result, link: os.stat_result | None, euid: int) -> list[str]:
    """Why a socket folder with status `st` (and `link`, the lstat of its path
    when that is a symlink) is unsafe for a process running as `euid`; [] if safe.

    Safe: owned by us or root, and not writable by others unless the sticky bit
    keeps them from removing what is not theirs (as /tmp does).
    """
    problems = []
    trusted = (euid, 0)
    if link is not None and link.st_uid not in trusted:
        problems.append(f"it is a symlink owned by uid {link.st_uid}, who can point it elsewhere")
    if st.st_uid not in trusted:
        problems.append(f"it is owned by uid {st.st_uid}, not by us (uid {euid}) or root")
    if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
        problems.append(
            f"it is writable by others without the sticky bit (mode {stat.S_IMODE(st.st_mode):04o})"
        )
    return problems


def check_socket_folder(folder: Path, allow_insecure: bool = False) -> None:
    """Refuse (UnsafeSocketFolderError) a folder where someone else could replace
    our socket; with `allow_insecure`, log a warning instead."""
    link = folder.lstat()
    problems = socket_folder_problems(
        folder.stat(), link if stat.S_ISLNK(link.st_mode) else None, os.geteuid()
    )
    if not problems:
        if folder.stat().st_mode & stat.S_IWGRP:
            log.warning(
                "socket folder %s is group-writable: members of its group can replace the socket", folder
            )
        return
    text = f"socket folder {folder} is unsafe: {'; '.join(problems)}"
    if allow_insecure:
        log.warning("%s (serving anyway: --allow-insecure-socket-folder)", text)
        return
    raise UnsafeSocketFolderError(
        f"{text}. Use a folder only this user can write (e.g. chmod o-w or chmod +t), "
        "or pass --allow-insecure-socket-folder if every local user is trusted "
        "(e.g. a pod's emptyDir shared with daprd)"
    )


def socket_group_id(name: str) -> int:
    """The gid of group `name` (or a decimal gid); LookupError naming it if unknown."""
    if name.isascii() and name.isdigit():
        return int(name)
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        raise LookupError(f"unknown group {name!r} for --socket-group") from None


class _Malformed:
    """Stands in for a request whose bytes did not decode."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


if TYPE_CHECKING:
    _GenericRpcHandler = grpc.GenericRpcHandler[Any, Any]
else:  # generic in the stubs only
    _GenericRpcHandler = grpc.GenericRpcHandler


class _WrappedHandlers(_GenericRpcHandler):
    """A generic handler whose method handlers are wrapped, each once (not per call)."""

    def __init__(
        self,
        inner: _GenericRpcHandler,
        wrap: Callable[[grpc.RpcMethodHandler[Any, Any]], grpc.RpcMethodHandler[Any, Any]],
    ) -> None:
        self._inner = inner
        self._wrap = wrap
        self._wrapped: dict[grpc.RpcMethodHandler[Any, Any], grpc.RpcMethodHandler[Any, Any]] = {}

    def service(
        self, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = self._inner.service(handler_call_details)
        if handler is None:
            return None
        wrapped = self._wrapped.get(handler)
        if wrapped is None:
            wrapped = self._wrapped[handler] = self._wrap(handler)
        return wrapped


class _Registrar:
    """Stands in for the grpc.aio server where services are added: every method handler is
    wrapped once as it is registered, so that no interceptor runs on every call.

    Unary methods answer a malformed request INVALID_ARGUMENT; streaming methods other than
    the servicer's own (PullMessages counts itself) count as open streams for admission control,
    and the servicer's own sends the responses it serialised itself as they are.
    """

    def __init__(self, server: grpc.aio.Server, admission: AdmissionControl, counted: bool) -> None:
        self._server = server
        self._admission = admission
        self._counted = counted

    def add_generic_rpc_handlers(self, handlers: Sequence[_GenericRpcHandler]) -> None:
        self._server.add_generic_rpc_handlers([_WrappedHandlers(h, self._wrap) for h in handlers])

    def add_registered_method_handlers(
        self, service_name: str, method_handlers: dict[str, grpc.RpcMethodHandler[Any, Any]]
    ) -> None:
        self._server.add_registered_method_handlers(  # type: ignore[attr-defined]  # not in the stubs
            service_name, {name: self._wrap(h) for name, h in method_handlers.items()}
        )

    def _wrap(self, handler: grpc.RpcMethodHandler[Any, Any]) -> grpc.RpcMethodHandler[Any, Any]:
        if handler.unary_unary is not None and handler.request_deserializer is not None:
            return _answer_malformed(handler)
        if self._counted and (handler.request_streaming or handler.response_streaming):
            return _counted_stream(handler, self._admission)
        if handler.response_streaming and handler.response_serializer is not None:
            return _passing_bytes(handler)
        return handler


def _passing_bytes(handler: grpc.RpcMethodHandler[Any, Any]) -> grpc.RpcMethodHandler[Any, Any]:
    """`handler` (the servicer's PullMessages) with a serializer that sends a response already
    serialised (bytes: delayed_pubsub.wire) as it is, and serialises any other as before."""
    serialize = handler.response_serializer

    def serializer(response: Any) -> bytes:
        return response if type(response) is bytes else serialize(response)  # type: ignore[misc]

    return handler._replace(response_serializer=serializer)  # type: ignore[attr-defined,no-any-return]


def _counted_stream(
    handler: grpc.RpcMethodHandler[Any, Any], admission: AdmissionControl
) -> grpc.RpcMethodHandler[Any, Any]:
    """`handler` (streaming) counted among the open streams until its call's task ends."""

    def count() -> None:
        task = asyncio.current_task()
        if task is not None:
            admission.stream_started()
            task.add_done_callback(admission.stream_ended)

    for kind in ("unary_stream", "stream_stream", "stream_unary"):
        behaviour = getattr(handler, kind)
        if behaviour is None:
            continue
        if inspect.isasyncgenfunction(behaviour):

            async def generator(request: Any, context: Any, behaviour: Any = behaviour) -> Any:
                count()
                async for response in behaviour(request, context):
                    yield response

            return handler._replace(**{kind: generator})  # type: ignore[attr-defined,no-any-return]

        async def coroutine(request: Any, context: Any, behaviour: Any = behaviour) -> Any:
            count()
            return await behaviour(request, context)

        return handler._replace(**{kind: coroutine})  # type: ignore[attr-defined,no-any-return]
    return handler


def _answer_malformed(handler: grpc.RpcMethodHandler[Any, Any]) -> grpc.RpcMethodHandler[Any, Any]:
    """`handler` (unary) with a deserializer that passes a malformed request on as _Malformed,
    and a behaviour that answers it INVALID_ARGUMENT."""
    decode = handler.request_deserializer
    behaviour = handler.unary_unary
    # Both checked by the caller.
    assert decode is not None
    assert behaviour is not None

    def deserializer(raw: bytes) -> Any:
        try:
            return decode(raw)
        except DecodeError as e:
            return _Malformed(str(e))

    async def unary_unary(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        if isinstance(request, _Malformed):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed request: {request.reason}")
        return await behaviour(request, context)  # type: ignore[arg-type]

    return handler._replace(request_deserializer=deserializer, unary_unary=unary_unary)  # type: ignore[attr-defined,no-any-return]


def default_socket_path(environ: Mapping[str, str]) -> Path:
    """`$DAPR_COMPONENTS_SOCKETS_FOLDER/delayed-pubsub.sock` (folder default /tmp/dapr-components-sockets)."""
    folder = environ.get(SOCKETS_FOLDER_ENV) or DEFAULT_SOCKETS_FOLDER
    return Path(folder) / SOCKET_NAME


class ComponentServer:
    """The component's gRPC server bound to one unix socket."""

    def __init__(
        self,
        socket_path: Path,
        clock: Clock,
        metrics: Metrics | None = None,
        records: RecordStore | None = None,
        health_interval: float = HEALTH_INTERVAL_S,
        orphan_grace: float = 30.0,
        *,
        socket_group: int | None = None,
        allow_insecure_folder: bool = False,
        workers: WorkerPool | None = None,
    ) -> None:
        self.socket_path = socket_path
        # With workers, this process serves calls and the workers fire (workers.py).
        self.workers = workers
        self._socket_group = socket_group
        self._allow_insecure_folder = allow_insecure_folder
        self.metrics = metrics or Metrics()
        self.records = records or RecordStore(records_folder(socket_path))
        self.instances = Instances(
            clock, self.metrics, self.records, orphan_grace_s=orphan_grace, background=workers is None
        )
        if workers is not None:
            self.instances.on_live_change = workers.publish
        self._clock = clock
        self._health_interval = health_interval
        self._health_changed = asyncio.Event()
        self.instances.on_change = self._health_changed.set
        if workers is not None:
            workers.on_change = self._health_changed.set
        self._health_task: asyncio.Task[None] | None = None
        self._redis_down: frozenset[str] = frozenset()
        self._dead_loops: dict[str, list[str]] = {}
        self._health = health.aio.HealthServicer()  # type: ignore[attr-defined]
        # No interceptors: each costs every call a coroutine chain in grpc.aio. Admission is
        # checked by the servicer, and the handlers are wrapped once as they are registered.
        self._server = grpc.aio.server(options=GRPC_OPTIONS)
        self.admission = admission = AdmissionControl(HeldCalls(socket_path))
        pubsub_pb2_grpc.add_PubSubServicer_to_server(  # type: ignore[no-untyped-call]
            PubSubServicer(self.instances, admission), _Registrar(self._server, admission, counted=False)
        )
        others = _Registrar(self._server, admission, counted=True)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, others)
        # What reflection.enable_server_reflection does for a grpc.aio server.
        reflection_pb2_grpc.add_ServerReflectionServicer_to_server(
            # reflection.aio: in the module's __all__, not in its stubs.
            reflection.aio.ReflectionServicer(  # type: ignore[attr-defined]
                (PUBSUB_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME)
            ),
            others,
        )

    async def start(self) -> None:
        """Check the folder, bind the socket (replacing a stale one) with mode 0660
        (group `socket_group` if given) and start serving."""
        self.socket_path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        check_socket_folder(self.socket_path.parent, self._allow_insecure_folder)
        _remove_stale_socket(self.socket_path)
        # The umask makes the socket 0660 from birth: no window where daprd's
        # group cannot connect, or where others can.
        old_umask = os.umask(0o117)
        try:
            self._server.add_insecure_port(f"unix://{self.socket_path}")
            await self._server.start()
        finally:
            os.umask(old_umask)
        try:
            if self._socket_group is not None:
                # daprd connects as a member of this group: 0660 lets it in, nobody else.
                os.chown(self.socket_path, -1, self._socket_group)
            os.chmod(self.socket_path, SOCKET_MODE)
        except OSError:
            await self._server.stop(0)
            with contextlib.suppress(FileNotFoundError):
                self.socket_path.unlink()
            raise
        await self._health.set("", health_pb2.HealthCheckResponse.SERVING)
        await self._health.set(PUBSUB_SERVICE, health_pb2.HealthCheckResponse.SERVING)
        await self._health.set(SUBSCRIPTIONS_HEALTH_SERVICE, health_pb2.HealthCheckResponse.SERVING)
        await self._health.set(WORKERS_HEALTH_SERVICE, health_pb2.HealthCheckResponse.SERVING)
        self.instances.start()
        if self.workers is not None:
            self.workers.start()
            log.info("firing in %d worker process(es)", self.workers.count)
        self._health_task = asyncio.create_task(self._watch_health(), name="health")
        log.info("serving %s on unix://%s", PUBSUB_SERVICE, self.socket_path)

    async def _watch_health(self) -> None:
        """Keep grpc.health.v1 current: Redis of every instance every interval, orphans at once."""
        while True:
            try:
                await self.check_health()
            except Exception:  # a bug here must not end health reporting for good
                log.exception("health check failed")
            changed = asyncio.create_task(self._health_changed.wait())
            tick = asyncio.create_task(self._clock.sleep(self._health_interval))
            try:
                await asyncio.wait((changed, tick), return_when=asyncio.FIRST_COMPLETED)
            finally:
                changed.cancel()
                tick.cancel()
            self._health_changed.clear()

    async def check_health(self) -> None:
        """PING every instance's Redis, look at every supervised background loop, and set the
        health statuses (also run by the periodic check). NOT_SERVING while an instance's Redis
        does not answer or one of its background loops has ended (waiting for its restart) or
        stalled."""
        instances = self.instances.items()
        down = await self._check_redis(instances)
        # A loop that ended (waiting for its restart) or stalled: delayed messages
        # are not fired, or a stream not fed, whatever Redis says.
        dead = self._check_loops(instances)
        serving = health_pb2.HealthCheckResponse.SERVING
        not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
        if self.workers is not None:
            failed = self._check_workers(self.workers, dead)
            await self._health.set(WORKERS_HEALTH_SERVICE, not_serving if failed else serving)
        self._dead_loops = dead
        await self._health.set("", not_serving if down or dead else serving)
        await self._health.set(PUBSUB_SERVICE, not_serving if down or dead else serving)
        orphaned = self.instances.orphaned()
        await self._health.set(SUBSCRIPTIONS_HEALTH_SERVICE, not_serving if orphaned else serving)

    async def _check_redis(self, instances: list[tuple[str, Instance]]) -> frozenset[str]:
        """PING every instance's Redis; set redis_up and log each change. The instances whose Redis
        does not answer."""
        results = await asyncio.gather(*(_ping(i.ping) for _, i in instances))
        down = frozenset(name for (name, _), error in zip(instances, results, strict=True) if error)
        for (name, instance), error in zip(instances, results, strict=True):
            self.metrics.redis_up.labels(name).set(0 if error else 1)
            if error:
                instance.metrics.redis_errors.inc()
            if error and name not in self._redis_down:
                log.warning("instance %r: redis does not answer (%s); health NOT_SERVING", name, error)
            elif not error and name in self._redis_down:
                log.info("instance %r: redis answers again", name)
        self._redis_down = down
        return down

    def _check_loops(self, instances: list[tuple[str, Instance]]) -> dict[str, list[str]]:
        """Every instance's background loops that ended or stalled, by instance (logged on a change);
        sets each fire loop's fire_loop_up."""
        dead: dict[str, list[str]] = {}
        for name, instance in instances:
            loops = instance.dead_loops()
            if loops:
                dead[name] = loops
            if loops and loops != self._dead_loops.get(name):
                log.error("instance %r: %s; health NOT_SERVING", name, ", ".join(loops))
            elif not loops and name in self._dead_loops:
                log.info("instance %r: every background loop runs again", name)
            if instance.engine is not None:
                for n, loop in enumerate(instance.engine.loops):
                    self.metrics.fire_loop_up.labels(name, str(n)).set(1 if loop.healthy else 0)
        return dead

    def _check_workers(self, workers: WorkerPool, dead: dict[str, list[str]]) -> list[str]:
        """Adds the worker processes' problems to `dead` (under "workers", logged on a change); the
        workers that are not coming back (they fail liveness)."""
        problems = workers.problems()
        if problems:
            dead["workers"] = problems
        if problems and problems != self._dead_loops.get("workers"):
            log.error("workers: %s; health NOT_SERVING", ", ".join(problems))
        elif not problems and "workers" in self._dead_loops:
            log.info("every worker runs again")
        failed = workers.failed()
        if failed:
            log.error("workers not coming back: %s; liveness fails", ", ".join(failed))
        return failed

    async def stop(self, grace: float = 5.0) -> None:
        """Stop gracefully within about `grace` seconds, then close every instance and remove the socket.

        First the streams: nothing new is sent, messages daprd is processing
        get up to half the grace to be acked, then every stream ends (publishes
        are still served meanwhile). Then new calls are refused and running
        ones get the rest of the grace. Unacked messages stay pending in Redis
        and come back after processingTimeout; the Init records stay for the
        next process.
        """
        await self._health.enter_graceful_shutdown()
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
        loop = asyncio.get_running_loop()
        started = loop.time()
        await self.instances.drain(grace / 2)
        await self._server.stop(max(0.1, grace - (loop.time() - started)))
        await self.instances.close()
        if self.workers is not None:
            await self.workers.stop(max(1.0, grace / 2))
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()
        log.info("stopped; removed %s", self.socket_path)


async def _ping(ping: Callable[[], Awaitable[None]]) -> str:
    """Why Redis did not answer within HEALTH_PING_TIMEOUT_S; the empty string if it did."""
    try:
        async with asyncio.timeout(HEALTH_PING_TIMEOUT_S):
            await ping()
    except TimeoutError:
        return f"no answer within {HEALTH_PING_TIMEOUT_S:g}s"
    except DelayedPubSubError as e:
        return str(e) or type(e).__name__
    return ""


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
    *,
    socket_group: int | None = None,
    allow_insecure_folder: bool = False,
    workers: WorkerPool | None = None,
) -> None:
    """Serve until SIGTERM/SIGINT (or `stop` is set), then shut down cleanly (with `workers`
    firing in worker processes, stopped last)."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    server = ComponentServer(
        socket_path,
        clock,
        metrics,
        socket_group=socket_group,
        allow_insecure_folder=allow_insecure_folder,
        workers=workers,
    )
    try:
        await server.start()
    except BaseException:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        if workers is not None:
            await workers.stop(1.0)
        raise
    try:
        await stop.wait()
        log.info("shutting down")
    finally:
        await server.stop(grace)
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
