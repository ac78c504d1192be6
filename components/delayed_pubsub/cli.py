"""`delayed-pubsub` command line."""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

import prometheus_client

from delayed_middleware import storage_format
from delayed_middleware.clock import SystemClock
from delayed_pubsub import backfill_cli, logs, operate, operate_time
from delayed_pubsub.dashboard import cli as dashboard_cli
from delayed_pubsub.health_http import HealthHttpServer
from delayed_pubsub.heap import freeze_startup_heap
from delayed_pubsub.loopwatch import watched
from delayed_pubsub.metrics import Metrics
from delayed_pubsub.server import SOCKETS_FOLDER_ENV, default_socket_path, serve, socket_group_id
from delayed_pubsub.spark import cli as spark_cli
from delayed_pubsub.workers import (
    WorkerPool,
    default_workers,
    explain_default_workers,
    merged_registry,
    run_worker,
)

DISTRIBUTION = "dapr-delayed-pubsub"


def package_version() -> str:
    """The installed distribution's version (pyproject.toml's, as pip recorded it)."""
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        # Imported from a source tree that was never installed: say so rather than guess.
        return "unknown (not installed)"


def version_text() -> str:
    """`0.3.0 (storage format 3; reads formats 1 to 3)`: the release and the storage formats it
    writes and reads (CHANGELOG.md, docs/operations.md#upgrading-and-rolling-back)."""
    return (
        f"{package_version()} (storage format {storage_format.CURRENT}; "
        f"reads formats {storage_format.OLDEST} to {storage_format.CURRENT})"
    )


def tcp_port(text: str) -> int:
    """A TCP port to listen on, 1-65535 (argparse names the flag and the value otherwise)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port {port} is outside 1-65535")
    return port


def worker_count(text: str) -> int:
    """A number of worker processes, 0 or more (argparse names the flag and the value otherwise)."""
    try:
        count = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of workers: {text!r}") from None
    if count < 0:
        raise argparse.ArgumentTypeError(f"{count} workers: use 0 (no worker processes) or more")
    return count


def build_parser() -> argparse.ArgumentParser:
    """The argument parser, separate from main() so tests and docs can inspect it."""
    parser = argparse.ArgumentParser(
        prog="delayed-pubsub", description="Dapr pluggable pub/sub on Redis Streams"
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {version_text()}")
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("serve", help="serve the component on a unix socket for daprd")
    run.add_argument(
        "--socket",
        type=Path,
        default=None,
        help=f"socket path (default ${SOCKETS_FOLDER_ENV}/delayed-pubsub.sock, "
        "folder default /tmp/dapr-components-sockets)",
    )
    run.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    run.add_argument(
        "--log-format", default="text", choices=["text", "json"], help="json: one JSON object per line"
    )
    run.add_argument(
        "--metrics-port", type=int, default=None, help="serve Prometheus metrics on this port (default off)"
    )
    run.add_argument(
        "--metrics-address",
        default="127.0.0.1",
        help="address of the metrics listener (default loopback; 0.0.0.0 to let a scraper in)",
    )
    run.add_argument(
        "--health-port",
        type=tcp_port,
        default=None,
        help="serve HTTP GET /healthz (liveness: the component answers) and /readyz (readiness: every "
        "instance's Redis answers, its background loops run and no subscription is orphaned) on this "
        "port, for Kubernetes probes "
        "(default off)",
    )
    run.add_argument(
        "--health-address",
        default="127.0.0.1",
        help="address of the health listener (default loopback; 0.0.0.0 to let the kubelet in)",
    )
    run.add_argument(
        "--grace",
        type=float,
        default=5.0,
        help="seconds of a graceful stop (SIGTERM): half for messages in flight to be acked, the rest for "
        "running calls",
    )
    run.add_argument(
        "--socket-group",
        default=None,
        metavar="NAME",
        help="give the 0660 socket to this group (name or gid), e.g. the group daprd runs in",
    )
    run.add_argument(
        "--allow-insecure-socket-folder",
        action="store_true",
        help="serve even if the socket folder is owned by another user or writable by others "
        "without the sticky bit (only where every local user is trusted, e.g. a pod's emptyDir)",
    )
    run.add_argument(
        "--workers",
        type=worker_count,
        default=None,
        metavar="N",
        help="fire delayed messages in N worker processes (fire loops, history trimming, forwarder, "
        "pending gauges, the scan for due retries), supervised and restarted by serve, while this "
        "process serves daprd's calls; "
        "0: everything in this one process. Default: the cores this process may run on (its CPU "
        "affinity), capped by its cgroup CPU quota rounded up (cgroup v2 cpu.max, or v1 "
        "cpu.cfs_quota_us / cpu.cfs_period_us: what a Kubernetes CPU limit or `podman run --cpus` "
        f"sets), minus one for this process, at least 1 (here {explain_default_workers()})",
    )
    work = commands.add_parser(
        "worker", help="one worker process of `serve --workers N` (started by serve, not by hand)"
    )
    work.add_argument("--state", type=Path, required=True, help="the folder serve shares with its workers")
    work.add_argument("--index", type=int, required=True, help="this worker's place in the pool")
    work.add_argument(
        "--parent", type=int, default=None, help="the serve process's pid: stop when it is gone"
    )
    work.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    work.add_argument("--log-format", default="text", choices=["text", "json"])
    operate.register(commands)
    backfill_cli.register(commands)
    operate_time.register(commands)
    spark_cli.register(commands)
    dashboard_cli.register(commands)
    return parser


def _serve(args: argparse.Namespace, pool: WorkerPool | None) -> int:
    """`serve`: the component on its socket (with `pool` firing, if given) until SIGTERM."""
    metrics = Metrics()
    if args.metrics_port is not None:
        prometheus_client.start_http_server(
            args.metrics_port,
            addr=args.metrics_address,
            registry=metrics.registry if pool is None else merged_registry(metrics.registry, pool),
        )
    socket_path = args.socket or default_socket_path(os.environ)
    health_http = None
    if args.health_port is not None:
        # Started before the socket exists: it answers 503 until the component serves.
        try:
            health_http = HealthHttpServer(socket_path, args.health_port, args.health_address)
        except OSError as e:  # port taken, address not ours: say which, no traceback
            print(
                f"delayed-pubsub: error: cannot listen on {args.health_address}:{args.health_port} "
                f"(--health-port): {e.strerror or e}",
                file=sys.stderr,
            )
            return 2
        health_http.start()
    try:
        group = None if args.socket_group is None else socket_group_id(args.socket_group)
        # Everything imported so far lives as long as serve: out of the GC's full collections.
        freeze_startup_heap()
        asyncio.run(
            watched(
                serve(
                    socket_path,
                    SystemClock(),
                    grace=args.grace,
                    metrics=metrics,
                    socket_group=group,
                    allow_insecure_folder=args.allow_insecure_socket_folder,
                    workers=pool,
                ),
                metrics.registry,
                "serve",
            )
        )
    except (FileExistsError, PermissionError, LookupError) as e:
        # A socket path we must not or cannot take: say so, no traceback.
        print(f"delayed-pubsub: error: {e}", file=sys.stderr)
        return 2
    finally:
        if health_http is not None:
            health_http.stop()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `delayed-pubsub` console script."""
    args = build_parser().parse_args(argv)
    if getattr(args, "operate", None) is not None:
        return operate.run(args)
    if getattr(args, "handler", None) is not None:  # stats (delayed_pubsub.spark.cli), dashboard
        return int(args.handler(args))
    logs.configure(args.log_level, args.log_format)
    if args.command == "worker":
        asyncio.run(run_worker(args.state, args.index, SystemClock(), args.parent))
        return 0
    if args.command == "serve":
        count = default_workers() if args.workers is None else args.workers
        beside = args.socket or default_socket_path(os.environ)
        pool = (
            WorkerPool(count, beside, log_level=args.log_level, log_format=args.log_format)
            if count > 0
            else None
        )
        try:
            return _serve(args, pool)
        finally:
            if pool is not None:  # already removed by a clean stop; not by an early refusal
                shutil.rmtree(pool.folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
