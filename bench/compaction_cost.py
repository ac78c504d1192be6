"""What compaction's density check costs Redis, and what its pass does to readers.

Compaction (lua/compact.lua) checks a delayed topic's density with XINFO STREAM
once per 1,000 envelopes that leave it. This measures that call's Redis time
(INFO commandstats, usec_per_call over 200 calls) on a private redis-server:

- a dense stream of 1,000,000 live entries (300 B bodies);
- a sparse one: 1,000,000 written, 99 of every 100 deleted (10,000 live, one per node).

    .venv/bin/python bench/compaction_cost.py [--entries 1000000]
"""

from __future__ import annotations

import argparse
import platform
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, cast

import redis

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.redis_server import RedisServer  # noqa: E402

CALLS = 200


def fill(client: redis.Redis, key: str, n: int) -> None:
    body = b"x" * 300
    for start in range(0, n, 10_000):
        pipe = client.pipeline(transaction=False)
        for _ in range(min(10_000, n - start)):
            pipe.xadd(key, {"data": body})
        pipe.execute()


def thin(client: redis.Redis, key: str) -> None:
    """Deletes 99 of every 100 entries (as after the short ones of the issue's mix fired)."""
    start = "-"
    while True:
        rows = cast("list[tuple[bytes, Any]]", client.xrange(key, start, "+", count=10_000))
        if not rows:
            return
        start = "(" + rows[-1][0].decode()
        client.xdel(key, *[i for n, (i, _) in enumerate(rows) if n % 100])


def xinfo_us(client: redis.Redis, key: str) -> tuple[float, int, int]:
    client.config_resetstat()
    for _ in range(CALLS):
        info = client.xinfo_stream(key)
    stats = client.info("commandstats")["cmdstat_xinfo|stream"]
    return float(stats["usec_per_call"]), int(info["length"]), int(info["radix-tree-keys"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--entries", type=int, default=1_000_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        server = RedisServer(Path(folder), appendonly=False)
        server.start()
        try:
            client = redis.Redis(port=server.port)
            fill(client, "dense", args.entries)
            fill(client, "sparse", args.entries)
            thin(client, "sparse")
            version = client.info("server")["redis_version"]
            print(
                f"machine {platform.node()}, {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, redis-server {version}, "
                f"XINFO STREAM Redis time over {CALLS} calls"
            )
            print("| stream | live entries | nodes | XINFO STREAM us/call |")
            print("|---|---|---|---|")
            for key in ("dense", "sparse"):
                us, length, nodes = xinfo_us(client, key)
                print(f"| {key} | {length:,} | {nodes:,} | {us:.2f} |")
        finally:
            server.stop()


if __name__ == "__main__":
    main()
