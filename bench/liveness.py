"""Firing under a small connection pool on Redis Cluster: does every accepted delayed publish arrive?

A private 3-master Redis Cluster (AOF off), one `delayed-pubsub serve` process
(16 delay shards, the Cluster default) driven over gRPC as daprd drives it.
N delayed publishes are sent at once (delays spread over 1-2 s, over T
topics); with `poolSize: 10` some are refused (UNAVAILABLE: redis-py's cluster
pools cannot wait for a free connection), and the fire's APPENDs fail now and
then the same way. Reported per pool size: publishes answered OK, how many of
them landed, how long after the last due time the last one landed, and what
is left in flight (claims whose RELEASE failed wait for their lease to end).
The peer is the same run without a pool bound.

    .venv/bin/python bench/liveness.py [--n 1000] [--topics 10] [--runs 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc

ROOT = Path(__file__).resolve().parents[1]
for sub in ("proto", "middleware", "components", "."):
    sys.path.insert(0, str(ROOT / sub))

from bench.cluster import Replica  # noqa: E402
from bench.common import MD  # noqa: E402
from delayed_middleware.keys import EngineKeys, shard_topics  # noqa: E402
from delayed_pubsub_pb.dapr.proto.components.v1 import pubsub_pb2  # noqa: E402
from tests.redis_server import RedisCluster  # noqa: E402

SHARDS = 16
WAIT_S = 60.0


async def one_run(
    folder: Path, cluster: RedisCluster, admin: Any, n: int, topics: list[str], pool: str
) -> str:
    cluster.flushall()
    props = {
        "redisType": "cluster",
        "redisHost": cluster.nodes[0].address,
        "consumerID": "bench",
        "enableDelayedMessaging": "true",
        "historyMaxLen": "0",
        **({"poolSize": pool} if pool else {}),
    }
    r = Replica(folder, f"pool{pool or 'none'}")
    try:
        await r.init(props)
        start = time.time()

        async def publish(i: int) -> bool:
            request = pubsub_pb2.PublishRequest(
                data=json.dumps({"n": i}).encode(),
                pubsub_name="bench",
                topic=topics[i % len(topics)],
                metadata={"scheduledSendDelay": f"{1000 + i % 1000}ms"},
            )
            try:
                await r.stub.Publish(request, metadata=MD)
            except grpc.aio.AioRpcError:
                return False
            return True

        ok = sum(await asyncio.gather(*(publish(i) for i in range(n))))
        last_due = start + 2.0
        landed = 0
        for _ in range(int(WAIT_S / 0.05)):
            landed = sum(admin.xlen(t) for t in topics)
            if landed >= ok:
                break
            await asyncio.sleep(0.05)
        after_s = time.time() - last_due
        done = f"{after_s:.1f}" if landed >= ok else f"> {WAIT_S:.0f} (gave up)"
        # A claim whose RELEASE failed stays in flight until its lease ends and a pass takes it over.
        inflight = 0
        for _ in range(int(WAIT_S / 0.05)):
            inflight = sum(
                admin.zcard(EngineKeys.for_topic(s).inflight) for s in shard_topics("bench", SHARDS)
            )
            if not inflight:
                break
            await asyncio.sleep(0.05)
        cleared = f"{time.time() - last_due:.1f}" if not inflight else f"{inflight} left after {WAIT_S:.0f} s"
        return f"| {pool or 'unbounded'} | {n} | {ok} | {landed} | {done} | {cleared} |"
    finally:
        await r.close()


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--topics", type=int, default=10)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    print(f"# bench/liveness.py {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, {platform.node()}, n {args.n}")
    with tempfile.TemporaryDirectory(prefix="dpsl-") as d:
        folder = Path(d)
        cluster = RedisCluster(folder / "cluster")
        cluster.start()
        try:
            admin = cluster.client()
            topics = [f"orders-{i}" for i in range(args.topics)]
            print(
                "| poolSize | published | answered OK | landed | last landing after last due, s | in-flight set empty after last due, s |"
            )
            print("|---|---|---|---|---|---|")
            for _ in range(args.runs):
                for pool in ("10", ""):
                    print(await one_run(folder, cluster, admin, args.n, topics, pool), flush=True)
            admin.close()
        finally:
            cluster.stop()


if __name__ == "__main__":
    asyncio.run(main())
