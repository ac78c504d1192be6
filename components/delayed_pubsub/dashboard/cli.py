"""`delayed-pubsub dashboard`: the operator web UI, on the operator CLI's connection flags.

Imports the web stack only when the command runs: the rest of the CLI works
without the `dashboard` extra installed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Mapping
from typing import Any

from delayed_pubsub import operate

DEFAULT_PORT = 8089
DEFAULT_ADDRESS = "127.0.0.1"


def register(subparsers: Any) -> None:
    """Add `dashboard` to the `delayed-pubsub` parser."""
    from delayed_pubsub.cli import tcp_port  # the CLI's own port check (imported late: no cycle)

    p = subparsers.add_parser(
        "dashboard",
        parents=[operate.connection_arguments()],
        help="serve the operator dashboard (web UI) for one app's delayed messages",
        description="A web UI of what waits, what fired late and what died, live by Server-Sent Events. "
        "Read-only unless --allow-actions is given.",
    )
    p.add_argument("--port", type=tcp_port, default=DEFAULT_PORT, help=f"HTTP port (default {DEFAULT_PORT})")
    p.add_argument(
        "--address",
        default=DEFAULT_ADDRESS,
        help=f"address to listen on (default {DEFAULT_ADDRESS}: this machine only)",
    )
    p.add_argument(
        "--allow-actions",
        action="store_true",
        help="enable cancel, pause and resume, and retry and delete of dead letters (needs --token-env)",
    )
    p.add_argument(
        "--token-env",
        metavar="NAME",
        help="environment variable holding the token an operator logs in with to act (16+ characters)",
    )
    p.add_argument(
        "--interval",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="poll Redis at most this often (default 5; never faster than the last poll took)",
    )
    p.add_argument(
        "--history-records",
        type=int,
        default=5_000,
        metavar="N",
        help="newest history records read per poll for fires and lateness (default 5000)",
    )
    p.add_argument(
        "--allowed-host",
        action="append",
        default=[],
        metavar="NAME",
        help="a further host name browsers reach it by (default: loopback names and --address)",
    )
    p.set_defaults(handler=run)


def action_token(args: argparse.Namespace, environ: Mapping[str, str]) -> str | None:
    """The token actions need, or None when actions are off; UsageError when it is missing or weak."""
    from delayed_pubsub.dashboard.guard import MIN_TOKEN_LENGTH

    if not args.allow_actions:
        if args.token_env:
            raise operate.UsageError("--token-env is given without --allow-actions")
        return None
    if not args.token_env:
        raise operate.UsageError("--allow-actions needs --token-env NAME (the variable holding the token)")
    token = environ.get(args.token_env, "")
    if len(token) < MIN_TOKEN_LENGTH:
        raise operate.UsageError(
            f"--token-env {args.token_env}: the variable is unset or shorter than {MIN_TOKEN_LENGTH} characters"
        )
    return token


def run(args: argparse.Namespace) -> int:
    """Serve the dashboard until interrupted; the exit code."""
    try:
        import uvicorn

        from delayed_pubsub.dashboard.app import DashboardConfig, build_app
        from delayed_pubsub.dashboard.guard import Guard
        from delayed_pubsub.dashboard.source import Source
    except ImportError as e:
        print(
            f"delayed-pubsub dashboard: error: {e.name} is missing; "
            "install the extra: pip install '.[dashboard]' in a checkout of dapr-delayed-pubsub",
            file=sys.stderr,
        )
        return operate.EXIT_USAGE
    try:
        if args.interval <= 0 or args.history_records < 0:
            raise operate.UsageError("--interval must be above 0 and --history-records 0 or more")
        token = action_token(args, os.environ)
        settings = operate.load_settings(args, os.environ)
    except operate.UsageError as e:
        print(f"delayed-pubsub dashboard: error: {e}", file=sys.stderr)
        return operate.EXIT_USAGE
    hosts = ["127.0.0.1", "localhost", "::1", "[::1]", args.address, *args.allowed_host]
    config = DashboardConfig(
        interval_s=args.interval, history_records=args.history_records, allowed_hosts=tuple(hosts)
    )

    async def serve() -> int:
        from delayed_pubsub.connection import connect

        connection = connect(settings)
        try:
            app = build_app(Source(connection, settings), Guard(token), config)
            server = uvicorn.Server(
                uvicorn.Config(
                    app,
                    host=args.address,
                    port=args.port,
                    log_level="warning",
                    # Open live pages hold a stream each: do not wait for them on a stop.
                    timeout_graceful_shutdown=1,
                )
            )
            print(
                f"delayed-pubsub dashboard: http://{_url_host(args.address)}:{args.port}/ "
                f"({'actions on' if token else 'read-only'}) for {settings.consumer_id}",
                file=sys.stderr,
                flush=True,
            )
            await server.serve()
            return 0 if server.started else operate.EXIT_USAGE
        finally:
            await connection.aclose()

    return asyncio.run(serve())


def _url_host(address: str) -> str:
    return f"[{address}]" if ":" in address else address
