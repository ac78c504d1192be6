"""Redis Cluster benchmarks: the two-phase fire over shards, through real component processes.

A private 3-master Redis Cluster (AOF off), R `delayed-pubsub serve` processes
(replicas of one app) on unix sockets, driven over gRPC as daprd drives them;
for each shard count S and replica count R:
  - burst drain: N messages to T topics spread over every master, all due at
    one instant; time from the due instant to the last one landing, and the
    firing throughput that gives (N / drain);
Then, once: Redis bytes per pending message over the cluster (M pending,
6 shards) and per fire marker (the markers live fire_marker_ttl_ms after a fire);
and the single-node one-script FIRE as the peer, same burst, same machine.

Landing times are the target entries' stream ids (Redis's clock, ms).

    .venv/bin/python bench/cluster.py [--burst 20000] [--topics 30] [--pending 100000]
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import sys
import tempfile
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc
import redis.asyncio as aioredis
import redis.asyncio.cluster as acluster

ROOT = Path(__file__).resolve().parents[1]
for sub in ("proto", "middleware", "components", "."):
    sys.path.insert(0, str(ROOT / sub))

from bench.common import MD, PAYLOAD, bench_engine, start_serve, stop  # noqa: E402
from delayed_middleware.clock import SystemClock  # noqa: E402
from delayed_middleware.envelope import Envelope  # noqa: E402
from delayed_middleware.keys import fire_marker_prefix  # noqa: E402
from delayed_pubsub_pb.dapr.proto.components.v1 import common_pb2, pubsub_pb2, pubsub_pb2_grpc  # noqa: E402
from tests.redis_server import RedisCluster, RedisServer  # noqa: E402


def now_ms() -> int:
    return time.time_ns() // 1_000_000


class Replica:
    def __init__(self, folder: Path, name: str) -> None:
        self.socket = folder / f"{name}.sock"
        self.proc = start_serve(self.socket, folder / f"{name}.log")
        self.channel = grpc.aio.insecure_channel(f"unix://{self.socket}")
        self.stub = pubsub_pb2_grpc.PubSubStub(self.channel)  # type: ignore[no-untyped-call]

    async def init(self, props: dict[str, str]) -> None:
        await self.stub.Init(
            pubsub_pb2.PubSubInitRequest(metadata=common_pb2.MetadataRequest(properties=props)), metadata=MD
        )

    async def close(self) -> None:
        await self.channel.close(None)
        stop(self.proc)
        self.socket.unlink(missing_ok=True)


async def schedule_burst(client: Any, props: dict[str, str], topics: list[str], n: int, due: int) -> None:
    """n envelopes over `topics`, due at `due`, stored straight through the engine the replicas
    build from `props` (no fire loop runs)."""
    # History off, as in the replicas' props: memory is the envelope, its index entry, nothing else.
    engines = bench_engine(client, SystemClock(), {**props, "historyMaxLen": "0"})
    envs = [
        Envelope(id="", topic=topics[i % len(topics)], due_ms=due, published_at_ms=due, message=PAYLOAD)
        for i in range(n)
    ]
    await engines.schedule(envs)


def landings_ms(admin: Any, topics: list[str], n: int, timeout_s: float) -> tuple[int, int]:
    """(first, last) landing ms of the n messages on `topics`, once all landed (and no more)."""
    deadline = time.monotonic() + timeout_s
    while (got := sum(admin.xlen(t) for t in topics)) < n:
        if time.monotonic() > deadline:
            raise SystemExit(f"only {got} of {n} landed in {timeout_s}s")
        time.sleep(0.02)
    time.sleep(0.5)
    got = sum(admin.xlen(t) for t in topics)
    assert got == n, f"{got} landed for {n} published: duplicates"
    first, last = 2**63, 0
    for t in topics:
        last = max(last, int(admin.xrevrange(t, count=1)[0][0].split(b"-")[0]))
        first = min(first, int(admin.xrange(t, count=1)[0][0].split(b"-")[0]))
    return first, last


async def drain(
    folder: Path, props: dict[str, str], client: Any, admin: Any, topics: list[str], n: int, replicas: int
) -> tuple[float, float]:
    """(start-up s: Init to the first landing, drain s: first to last landing) of n overdue messages."""
    await schedule_burst(client, props, topics, n, now_ms())
    rs = [Replica(folder, f"r{i}") for i in range(replicas)]
    try:
        t0 = now_ms()
        await asyncio.gather(*(r.init(props) for r in rs))
        first, last = landings_ms(admin, topics, n, timeout_s=300)
        return (first - t0) / 1000, (last - first) / 1000
    finally:
        for r in rs:
            await r.close()


async def redis_us_per_message(single: RedisServer, topics: list[str], n: int, two_phase: bool) -> float:
    """Redis time (EVALSHA usec, INFO commandstats) per message of draining n due messages in-process."""
    with single.client() as admin:
        admin.flushall()
        client = aioredis.Redis(port=single.port)
        try:
            # Fire path forced either way on one node: the two-phase path's own Redis cost.
            props = {"consumerID": "bench", "historyMaxLen": "0"}
            engine = bench_engine(client, SystemClock(), props, config={"two_phase": two_phase})
            now = now_ms()
            await engine.schedule(
                [
                    Envelope(
                        id="", topic=topics[i % len(topics)], due_ms=now, published_at_ms=now, message=PAYLOAD
                    )
                    for i in range(n)
                ]
            )
            await engine.fire_due()  # loads the scripts
            admin.config_resetstat()
            while (await engine.fire_due())[0]:
                pass
            stats: Any = admin.info("commandstats")
            return int(stats["cmdstat_evalsha"]["usec"]) / n
        finally:
            await client.aclose()


def used_memory(nodes: Sequence[RedisServer]) -> int:
    total = 0
    for node in nodes:
        with node.client() as c:
            info: Any = c.info("memory")
            total += int(info["used_memory"])
    return total


def topics_over(c: RedisCluster, n: int) -> list[str]:
    topics = [f"bench-{i}" for i in range(n)]
    assert len({c.owner(t).port for t in topics}) == len(c.nodes)
    return topics


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--burst", type=int, default=20_000)
    ap.add_argument("--topics", type=int, default=30)
    ap.add_argument("--pending", type=int, default=100_000)
    ap.add_argument("--shards", default="1,3,6")
    ap.add_argument("--replicas", default="1,2,3")
    args = ap.parse_args()
    print(f"# bench/cluster.py {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, {platform.node()}, burst {args.burst}")
    with tempfile.TemporaryDirectory(prefix="dpsc-") as d:
        folder = Path(d)
        cluster = RedisCluster(folder / "cluster")
        cluster.start()
        single = RedisServer(folder / "single", appendonly=False)
        single.start()
        try:
            admin = cluster.client()
            client = acluster.RedisCluster(host="127.0.0.1", port=cluster.nodes[0].port)
            topics = topics_over(cluster, args.topics)
            base = {
                "redisType": "cluster",
                "redisHost": cluster.nodes[0].address,
                "consumerID": "bench",
                "enableDelayedMessaging": "true",
                "historyMaxLen": "0",
            }

            # The peer: a single node's one-script FIRE, one replica, same burst.
            sadmin = single.client()
            sclient = aioredis.Redis(port=single.port)
            sprops = {**base, "redisType": "node", "redisHost": single.address, "delayShards": "1"}
            up, secs = await drain(folder, sprops, sclient, sadmin, topics, args.burst, 1)
            print(
                f"single node, FIRE, 1 shard, 1 replica: Init to first fire {up:.2f} s, drain {secs:.2f} s, "
                f"{args.burst / secs:,.0f} msg/s"
            )
            await sclient.aclose()

            print("| shards | replicas | Init to first fire s | drain s (first to last) | fires/s |")
            print("|---|---|---|---|---|")
            for shards in (int(x) for x in args.shards.split(",")):
                for replicas in (int(x) for x in args.replicas.split(",")):
                    cluster.flushall()
                    props = {**base, "delayShards": str(shards)}
                    up, secs = await drain(folder, props, client, admin, topics, args.burst, replicas)
                    print(
                        f"| {shards} | {replicas} | {up:.2f} | {secs:.2f} | {args.burst / secs:,.0f} |",
                        flush=True,
                    )

            # Memory: pending messages over 6 shards, and fire markers.
            cluster.flushall()
            before = used_memory(cluster.nodes)
            await schedule_burst(
                client, {**base, "delayShards": "6"}, topics, args.pending, now_ms() + 86_400_000
            )
            per = (used_memory(cluster.nodes) - before) / args.pending
            print(
                f"pending: {per:.1f} B per pending message ({args.pending:,} over 6 shards, {len(PAYLOAD)} B payload)"
            )
            cluster.flushall()
            # Markers of the real shape, in bench-0's slot: measured on its master.
            prefix = fire_marker_prefix("bench-0", "bench~3-delayed")
            owner = cluster.owner("bench-0")
            with owner.client() as c:
                before = used_memory([owner])
                pipe = c.pipeline(transaction=False)
                for i in range(args.pending):
                    pipe.set(f"{prefix}{1_800_000_000_000 + i}-0:{1_800_000_000_000 + i}", "1", px=900_000)
                    if i % 5000 == 4999:
                        pipe.execute()
                pipe.execute()
                per = (used_memory([owner]) - before) / args.pending
            print(f"fire marker: {per:.1f} B each (kept fire_marker_ttl_ms = 15 min after its fire)")
            for two in (False, True):
                us = await redis_us_per_message(single, topics, args.burst, two)
                print(f"Redis time per message, {'two-phase' if two else 'FIRE'} (one node): {us:.1f} us")
            admin.close()
            await client.aclose()
        finally:
            single.stop()
            cluster.stop()


if __name__ == "__main__":
    asyncio.run(main())
