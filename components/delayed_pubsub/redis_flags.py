"""The flags that say where an app's messages live, shared by the operator commands (operate.py)
and `stats` (spark/cli.py), so both read them alike.

Light on purpose: registering `stats` must import nothing of operate.py's.
"""

from __future__ import annotations

import argparse
from typing import Final

# The Redis password when --redis-password is not given (a flag shows in ps).
PASSWORD_ENV: Final = "DELAYED_PUBSUB_REDIS_PASSWORD"


def add_redis_flags(
    group: argparse.ArgumentParser | argparse._ArgumentGroup, *, app_id_required: bool = False
) -> None:
    """--redis-host, --redis-password, --app-id, --redis-type and --delay-shards; each but the
    password overrides what --component's YAML says."""
    group.add_argument("--redis-host", metavar="HOST:PORT", help="Redis address (the component's redisHost)")
    group.add_argument(
        "--redis-password", help=f"Redis password (default ${PASSWORD_ENV}; the flag shows in ps)"
    )
    group.add_argument(
        "--app-id",
        required=app_id_required,
        help="the app id (the component's consumerID) whose messages to read",
    )
    group.add_argument(
        "--redis-type",
        choices=["node", "cluster"],
        help="the component's redisType (default: the YAML's, else node)",
    )
    group.add_argument(
        "--delay-shards",
        metavar="N",
        help="the component's delayShards: how many shard streams to read (default: the YAML's; 16 on a cluster, else 1)",
    )
