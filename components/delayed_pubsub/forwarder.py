"""The forwarder: hands due messages bound for another Dapr pub/sub to the sidecar, at least once.

A delayed publish with `targetPubsub` (or the component's `defaultTargetPubsub`)
fires into the engine's outbox stream (delayed_middleware.outbox) instead of a
topic of ours. The forwarder reads that stream through a consumer group and
publishes each message through the sidecar's gRPC API (the `dapr` SDK's
generated stubs on a plain grpc.aio channel: the SDK's DaprClient would first
wait for daprd's HTTP health port, and only the gRPC address is known here).

Delivery guarantees
- At least once: an entry is XACKed (and deleted) only after daprd accepted
  the publish, in one MULTI with its `handedoff` history record. A replica that
  dies holding entries leaves them pending; any replica claims them after
  `claim_idle_ms` (XPENDING + XCLAIM with a min idle time, so two replicas
  never both take one).
- Slow is not dead: a forwarder keeps what it holds. While an entry is in its
  hands (a call in flight, or waiting out a sidecar outage) a keeper resets
  the entry's idle time every claim_idle_ms / 3 (lua/outbox_hold.lua, which
  does so only while the entry is still pending under our name at the count
  we took it at), so no other replica takes it over as abandoned. Before each
  attempt the holder makes sure the entry is still its own (confirmed less
  than claim_idle_ms / 2 ago, else asked of Redis at that moment): an entry
  another replica took over after all (this one stalled past claim_idle_ms)
  is dropped here, never published by both.
- A duplicate is recognisable: the data is published raw (`rawPayload=true`,
  with its content type), so the original CloudEvent reaches the target byte
  for byte and its `id` is the same on every retry.
- Sidecar unreachable (UNAVAILABLE: the call never reached daprd): nothing is
  wrong with the message; it is retried with backoff, uncounted and held,
  until daprd answers (a daprd restart loses nothing, and doubles nothing).
- A call that reached daprd and got no answer in time (DEADLINE_EXCEEDED on a
  connected channel: daprd may have published it) is a counted attempt, like
  a refusal.
- Each hand-off is its own task (up to `batch_size` entries held, `concurrency`
  calls at once): a slow call holds up only its own entries, the reading of
  new entries and the others' calls go on.
- Only the Redis side is shared: hand-offs that end in the same moment settle
  in one MULTI (_SettleBatcher; each still learns whether its own settle
  landed), and new entries are read a useful number at a time, not one per
  freed slot (see step()).
- Refused by daprd or the target (unknown pub/sub, broker error): a counted
  attempt. The entry stays pending and is retried with backoff (the attempt
  number is the entry's delivery count in Redis, so it survives restarts);
  after the last attempt it is dead-lettered to `deadLetterTopic` (a topic of
  ours) or, without one, kept and retried at the longest interval, reported
  in the log and the metrics: nothing is dropped.
- Dead letters are written as the subscriber retries write theirs (one writer,
  delayed_middleware.deadletters.write_dead_letter, one vocabulary of `deadLetter*`
  metadata), so `delayed-pubsub dead` lists them and `retry-dead` puts them
  back in the outbox. The dead letter is written first, the entry settled
  after, in two steps: on Redis Cluster the dead-letter topic lives in another
  slot than the outbox. A crash in between leaves the entry pending; it is
  dead-lettered again: twice at most, never zero times.
- History records obey `historyMaxLen` / `historyMaxAge` (0: none written).
- Expired (`expiresAt` passed): dropped with an `expired` history record; a
  live one carries its remaining TTL on as `ttlInSeconds`.

The retry and dead-letter policy is HandOffPolicy (delayed_middleware.outbox),
which the operator's listing reads too.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import secrets
import socket
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Final

import grpc
import grpc.aio
from dapr.proto.runtime.v1 import dapr_pb2_grpc, pubsub_pb2
from redis.exceptions import ResponseError

from delayed_middleware import history, scripts
from delayed_middleware.aio import text
from delayed_middleware.backoff import Backoff
from delayed_middleware.clock import Clock
from delayed_middleware.deadletters import GaveUp, write_dead_letter
from delayed_middleware.delay import TTL_IN_SECONDS
from delayed_middleware.entry import StreamEntry
from delayed_middleware.errors import MalformedEntryError
from delayed_middleware.history import Retention
from delayed_middleware.keys import DELAYED_SUFFIX, SHARD_MARK, EngineKeys, delayed_topic
from delayed_middleware.liveness import StateHook, Supervised
from delayed_middleware.outbox import OUTBOX_GROUP, HandOffPolicy, OutboxEntry, decode_outbox_entry
from delayed_middleware.target import forwarded_metadata
from delayed_pubsub.connection import RedisClient
from delayed_pubsub.metrics import ForwarderMetrics
from delayed_pubsub.settings import Settings

log = logging.getLogger(__name__)

DEFAULT_DAPR_GRPC_ADDRESS: Final = "127.0.0.1:50001"
# daprd publishes the bytes as they are (no second CloudEvent around ours).
RAW_PAYLOAD: Final = "rawPayload"
CLOUDEVENT_CONTENT_TYPE: Final = "application/cloudevents+json"
__all__ = ["Forwarder", "ForwarderConfig", "HandOffPolicy", "forwarder_config", "resolve_dapr_address"]

# Entries per OUTBOX_HOLD call: a script must not block Redis for long.
_HOLD_CHUNK: Final = 100
# While daprd stays away, one warning per this many seconds (each hand-off retries on its own).
_DOWN_LOG_EVERY_S: Final = 10.0
# How long close() lets the calls already on their way finish (at most handoffTimeout): a call
# cut off may still be carried out by daprd while its entry stays pending, and whoever takes
# it over after the takeover time publishes it a second time.
_CLOSE_GRACE_S: Final = 2.5
# The handoff_pending gauge (an XLEN) is refreshed at most this often: a step can
# run every few milliseconds under load, and a gauge is scraped every few seconds.
_GAUGE_EVERY_S: Final = 0.5
# While other calls are in flight, a settle waits this long for theirs to share its MULTI
# (grpc.aio hands back about one answer per loop pass: without it most MULTIs held one or
# two settles). It only delays the XACK of an entry daprd already took.
_SETTLE_LINGER_S: Final = 0.002


def resolve_dapr_address(configured: str, env: Mapping[str, str]) -> str:
    """The sidecar's gRPC address: `daprGrpcAddress`, else $DAPR_GRPC_PORT on loopback, else 127.0.0.1:50001.

    `http://host:port` (the SDKs' endpoint form) is accepted and means host:port.
    """
    address = configured.strip()
    if address:
        return address.removeprefix("http://")
    port = env.get("DAPR_GRPC_PORT", "").strip()
    if port:
        return f"127.0.0.1:{port}"
    return DEFAULT_DAPR_GRPC_ADDRESS


@dataclass(frozen=True)
class ForwarderConfig:
    """Where to hand off and how hard to try; defaults suit most deployments."""

    address: str = DEFAULT_DAPR_GRPC_ADDRESS
    api_token: str = ""
    policy: HandOffPolicy = field(default_factory=HandOffPolicy)
    # The outbox's consumer group: one per app, shared by every replica.
    group: str = OUTBOX_GROUP
    # Entries held (read or claimed, not yet settled) at once.
    batch_size: int = 100
    # Publish calls in flight at once.
    concurrency: int = 16
    block_ms: int = 1000
    # One publish call (handoffTimeout); past it the call counts as a failed attempt.
    call_timeout_s: float = 10.0
    # Another replica's unacked entries are taken over after this long idle. A
    # live holder resets the idle time of what it holds every claim_idle_ms / 3,
    # so only a holder that is gone (or stalled that long) loses its entries.
    claim_idle_ms: int = 60_000
    # Redis calls are bounded as a whole (the client has no socket timeout).
    redis_timeout_s: float = 10.0
    sidecar_backoff_base_s: float = 0.1
    sidecar_backoff_cap_s: float = 5.0
    # historyMaxLen / historyMaxAge for the `handedoff`, `expired`, `deadlettered` records.
    history: Retention = field(default_factory=Retention)
    # The app (consumerID) whose dead-letter set lists our dead letters; '' = read from the keys.
    consumer_id: str = ""


class SidecarUnavailableError(Exception):
    """daprd's gRPC API cannot be reached (internal: retried without counting)."""


@dataclass
class _Job:
    """Consecutive outbox entries that go out in one publish call (one entry, or one bulk).

    Held by this forwarder from its read (or claim) until settled or released:
    `confirmed` is the loop time just before the Redis call that last showed
    every entry pending under our name at `attempt`, so Redis's idle time for
    them is at most `now - confirmed`.
    """

    ids: list[str]
    entries: list[OutboxEntry]
    attempt: int
    confirmed: float = 0.0
    # Every id the job was read with (ids shrinks as entries expire or are lost).
    read: list[str] = field(default_factory=list)
    failed: list[tuple[str, str]] = field(default_factory=list)  # (stream id, why)
    # Entries the keeper found taken over (or gone): never published from here.
    lost: set[str] = field(default_factory=set)

    @property
    def head(self) -> OutboxEntry:
        return self.entries[0]

    def keep_only(self, ids: Sequence[str]) -> list[str]:
        """Drop every entry not in `ids`; returns the dropped ids."""
        keep = set(ids)
        dropped = [i for i in self.ids if i not in keep]
        if dropped:
            pairs = [(i, e) for i, e in zip(self.ids, self.entries, strict=True) if i in keep]
            self.ids[:] = [i for i, _ in pairs]
            self.entries[:] = [e for _, e in pairs]
        return dropped


class Forwarder:
    """Reads one app's outbox and publishes each entry through the sidecar; start() / close()."""

    def __init__(
        self,
        client: RedisClient,
        keys: EngineKeys,
        clock: Clock,
        config: ForwarderConfig,
        metrics: ForwarderMetrics | None = None,
        *,
        name: str = "",
        read_client: RedisClient | None = None,
        on_state: StateHook | None = None,
    ) -> None:
        self._redis = client
        # Blocking reads park a connection: on their own client they cannot
        # starve short commands of a bounded pool (poolSize).
        self._read_redis = read_client if read_client is not None else client
        self._keys = keys
        self._clock = clock
        self._config = config
        self._metrics = metrics
        self._name = name or keys.stream
        self._consumer_id = config.consumer_id or _consumer_of(keys.stream)
        self.consumer = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
        self._channel: grpc.aio.Channel | None = None
        self._stub: Any = None
        self._loop: Supervised | None = None
        self._on_state = on_state
        # Our own stop flag, checked by every loop (see delayed_middleware.liveness):
        # a library that swallows one CancelledError (seen under grpc.aio +
        # redis-py 8) must not keep the loop alive after close().
        self._stopping = False
        self._call_md: tuple[tuple[str, str], ...] = (
            (("dapr-api-token", config.api_token),) if config.api_token else ()
        )
        # What this forwarder holds: entry id -> the hand-off it is in. Each hand-off
        # runs as its own task; the keeper keeps their entries ours meanwhile.
        self._held: dict[str, _Job] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._room = asyncio.Event()
        # A read waits for this much room, as long as `concurrency` hand-offs are held (see step()).
        self._min_room = max(1, config.batch_size // 4)
        # Hand-offs (jobs) held: a bulk's entries are one.
        self._jobs_held = 0
        self._calls = asyncio.Semaphore(config.concurrency)
        # The hand-offs whose call is on its way (or being settled): close() lets them end.
        self._calling: set[asyncio.Task[Any]] = set()
        # Publish calls on the wire now (a settle lingers for theirs: _SettleBatcher).
        self._in_calls = 0
        self._settles = _SettleBatcher(client, keys, config, clock, self._bounded, lambda: self._in_calls)
        self._gauge_at = -math.inf
        # When the sidecar stopped answering (loop time), for one warning per while.
        self._down_since: float | None = None
        self._down_logged = 0.0

    @classmethod
    def from_settings(
        cls,
        client: Any,
        settings: Settings,
        clock: Clock,
        metrics: ForwarderMetrics | None,
        *,
        name: str,
        env: Mapping[str, str] | None = None,
        read_client: Any = None,
        on_state: StateHook | None = None,
    ) -> Forwarder:
        """The forwarder of one component instance (its consumerID's outbox)."""
        config = forwarder_config(
            dapr_grpc_address=settings.dapr_grpc_address,
            dead_letter_topic=settings.dead_letter_topic,
            claim_idle_ms=settings.processing_timeout_ms,
            call_timeout_ms=settings.handoff_timeout_ms,
            env=env,
            history=Retention(settings.history_max_len, settings.history_max_age_ms),
            consumer_id=settings.consumer_id,
        )
        keys = EngineKeys.for_topic(delayed_topic(settings.consumer_id))
        return cls(
            client, keys, clock, config, metrics, name=name, read_client=read_client, on_state=on_state
        )

    @property
    def config(self) -> ForwarderConfig:
        return self._config

    @property
    def keys(self) -> EngineKeys:
        return self._keys

    # --- lifecycle ---------------------------------------------------------

    @property
    def loop(self) -> Supervised | None:
        """The supervised forwarding loop, while started."""
        return self._loop

    def start(self) -> None:
        """Start forwarding (entries written while nobody ran go first), as a supervised loop."""
        if self._loop is None:
            self._loop = Supervised(f"forwarder {self._name}", self.run, on_state=self._on_state)
            self._loop.start()

    async def close(self) -> None:
        """Stop; whatever is not yet acknowledged stays pending in Redis for the next start.

        A publish call already on its way is given up to _CLOSE_GRACE_S (at most the call
        timeout) to be answered and settled: cut off, daprd could still carry it out while
        the entry stays pending, and the replica that takes it over would publish it again.
        """
        self._stopping = True
        if self._calling:
            # Nothing new starts now (each hand-off checks _stopping before its call); the
            # loop and the keeper go on meanwhile, so what these calls publish is settled.
            await asyncio.wait(set(self._calling), timeout=self._close_grace_s())
        if self._loop is not None:
            loop, self._loop = self._loop, None
            # Bounded: a stop must never hang the instance's close behind a
            # call that ignores cancellation (Supervised.stop logs it).
            await loop.stop(timeout_s=10)
        if self._channel is not None:
            await self._channel.close(None)
            self._channel = None
            self._stub = None

    def _close_grace_s(self) -> float:
        return min(self._config.call_timeout_s, _CLOSE_GRACE_S)

    async def run(self, stop: asyncio.Event | None = None) -> None:
        """The forwarding loop; survives Redis and sidecar outages, ends only when stopped
        (close(), or `stop` set) or cancelled. Hand-offs in flight end with it (a call on its
        way first gets close()'s grace): their entries stay pending in Redis."""
        redis_backoff = Backoff(base_s=0.05, cap_s=2.0)
        group_ready = False
        keeper = asyncio.create_task(self._keep_held())
        try:
            while not self._stopping and not (stop is not None and stop.is_set()):
                try:
                    if not group_ready:
                        await self._ensure_group()
                        group_ready = True
                    await self.step()
                    redis_backoff.reset()
                except asyncio.CancelledError:
                    raise
                except Exception as e:
                    # NOGROUP after someone deleted the outbox key: create it again.
                    if isinstance(e, ResponseError) and "NOGROUP" in str(e):
                        group_ready = False
                    delay = redis_backoff.next()
                    log.warning(
                        "forwarder %s: %s; retrying in %.2fs", self._name, e or type(e).__name__, delay
                    )
                    await self._clock.sleep(delay)
        finally:
            try:
                if self._calling:
                    # Stopped by close(): the calls on their way are let finish and settled
                    # (close() waits for them too), the keeper holding their entries meanwhile.
                    await asyncio.wait(set(self._calling), timeout=self._close_grace_s())
            finally:
                keeper.cancel()
                tasks = [keeper, *self._tasks]
                for t in tasks:
                    t.cancel()
                # Each ends at its next await; none may hold up the stop. The settles under
                # way or queued go out (the calls they follow were accepted), within the same bound.
                flushing = self._settles.flusher
                await asyncio.wait([*tasks, *([flushing] if flushing else [])], timeout=5)
                flushing = self._settles.flusher
                if flushing is not None:
                    flushing.cancel()
                    await asyncio.wait([flushing])

    async def step(self) -> int:
        """One round: start what is due for a retry, then new entries, each as its own
        hand-off; waits for room when `batch_size` entries are held already.

        Returns how many hand-offs it started.
        """
        # Cleared before looking: a hand-off that ends from here on wakes the wait.
        self._room.clear()
        room = self._config.batch_size - len(self._held)
        if not self._worth_reading():
            # Under load slots free one at a time; a read (and a claim pass) per freed
            # slot cost two Redis calls per hand-off. A read waits for a quarter of
            # batch_size to be free only while at least `concurrency` hand-offs are held:
            # every call slot has a hand-off to carry, so the wait delays no call (a new
            # entry would queue behind the held ones for a slot anyway). Bounded by
            # block_ms, as the blocking read is.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._config.block_ms / 1000):
                    await self._room.wait()
            room = self._config.batch_size - len(self._held)
            if room <= 0:
                await self._report_waiting()
                return 0
        started = await self._start(*await self._claim_retries(room))
        room = self._config.batch_size - len(self._held)
        if room > 0:
            asked = asyncio.get_running_loop().time()
            reply: Any = await self._bounded(
                self._read_redis.xreadgroup(
                    self._config.group,
                    self.consumer,
                    {self._keys.outbox: ">"},
                    count=room,
                    # Retries just went out: look for new entries without waiting.
                    block=None if started else self._config.block_ms,
                ),
                extra_s=self._config.block_ms / 1000,
            )
            rows = [(row, 1) for _, entries in reply or () for row in entries]
            started += await self._start(rows, asked)
        await self._report_waiting()
        return started

    def _worth_reading(self) -> bool:
        room = self._config.batch_size - len(self._held)
        return room >= self._min_room or (room > 0 and self._jobs_held < self._config.concurrency)

    async def _report_waiting(self) -> None:
        """Set the handoff_pending gauge: what waits in the outbox (read or not; settled entries are deleted).

        At most every _GAUGE_EVERY_S; an idle forwarder's step runs every block_ms, so
        the gauge is never older than about max(block_ms, _GAUGE_EVERY_S)."""
        now = asyncio.get_running_loop().time()
        if self._metrics is not None and now - self._gauge_at >= _GAUGE_EVERY_S:
            self._gauge_at = now
            waiting = await self._bounded(self._redis.xlen(self._keys.outbox))
            self._metrics.pending.labels(self._name).set(waiting)

    # --- Redis side --------------------------------------------------------

    async def _bounded(self, call: Awaitable[Any], extra_s: float = 0.0) -> Any:
        async with asyncio.timeout(self._config.redis_timeout_s + extra_s):
            return await call

    async def prepare(self) -> None:
        """Create the outbox and its consumer group now (run() does it too, and after a loss)."""
        await self._ensure_group()

    async def _ensure_group(self) -> None:
        try:
            # From the start of the stream: entries fired before any forwarder
            # ever ran must go out too.
            await self._bounded(
                self._redis.xgroup_create(self._keys.outbox, self._config.group, id="0", mkstream=True)
            )
        except ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise

    async def _claim_retries(self, room: int) -> tuple[list[tuple[tuple[bytes, Any], int]], float]:
        """Pending entries whose next attempt is due, at most `room`: our own refused ones
        after their backoff, another replica's after claim_idle_ms; never one we hold.
        Returns (row, attempt) pairs and the loop time the claim was asked at."""
        # XPENDING + XCLAIM rather than XAUTOCLAIM: the delivery count is the
        # attempt number (it survives restarts and replicas), and XAUTOCLAIM
        # does not return it. Only the oldest batch_size*4 pending entries are
        # looked at per round; they are retried (or dead-lettered) in id order.
        policy, cfg = self._config.policy, self._config
        floor = min(policy.delay_ms(1), cfg.claim_idle_ms)
        pending: list[dict[str, Any]] = await self._bounded(
            self._redis.xpending_range(
                self._keys.outbox, cfg.group, min="-", max="+", count=cfg.batch_size * 4, idle=floor
            )
        )
        claims: list[tuple[str, int, int]] = []  # (id, min idle, attempt it will be)
        for p in pending:
            entry_id = text(p["message_id"])
            if entry_id in self._held:
                # In our hands (the keeper refreshes it): claiming it again would publish it twice.
                continue
            deliveries = int(p["times_delivered"])
            wait = policy.delay_ms(min(deliveries, policy.max_attempts))
            consumer = text(p["consumer"])
            if consumer != self.consumer:
                wait = max(wait, cfg.claim_idle_ms)
            if int(p["time_since_delivered"]) >= wait:
                claims.append((entry_id, max(1, wait), deliveries + 1))
                if len(claims) >= room:
                    break
        asked = asyncio.get_running_loop().time()
        if not claims:
            return [], asked
        pipe = self._redis.pipeline(transaction=False)
        for entry_id, min_idle, _ in claims:
            # A min idle time per entry: whoever claims first resets it, so a
            # second replica racing for the same entry gets nothing.
            pipe.xclaim(self._keys.outbox, cfg.group, self.consumer, min_idle, [entry_id])
        results: list[Any] = await self._bounded(pipe.execute())
        out: list[tuple[tuple[bytes, Any], int]] = []
        for (_, _, attempt), rows in zip(claims, results, strict=True):
            out += [(row, attempt) for row in rows or ()]
        return out, asked

    async def _hold(self, held: Sequence[tuple[str, int]]) -> tuple[set[str], float]:
        """Reset the idle time of (entry id, attempt) pairs still pending under our name at
        that attempt (lua/outbox_hold.lua); returns those ids and the loop time asked at."""
        asked = asyncio.get_running_loop().time()
        kept: set[str] = set()
        for at in range(0, len(held), _HOLD_CHUNK):
            args = [x for i, n in held[at : at + _HOLD_CHUNK] for x in (i, n)]
            reply: Any = await self._bounded(
                self._redis.eval(
                    scripts.OUTBOX_HOLD, 1, self._keys.outbox, self._config.group, self.consumer, *args
                )
            )
            kept.update(text(i) for i in reply or ())
        return kept, asked

    async def _keep_held(self) -> None:
        """The keeper: every claim_idle_ms / 3, reset the idle time of everything this
        forwarder holds, so no other replica takes a live holder's entries over; marks
        what was taken over after all (we stalled past claim_idle_ms) as lost."""
        # Loop time, not the injected clock: it is measured against Redis's own idle time.
        every = self._config.claim_idle_ms / 3000
        while not self._stopping:
            await asyncio.sleep(every)
            jobs = list({id(j): j for j in self._held.values()}.values())
            if not jobs:
                continue
            try:
                kept, asked = await self._hold([(i, j.attempt) for j in jobs for i in j.ids])
            except Exception as e:
                # Never the keeper's end: each hand-off asks again itself before its next attempt.
                log.warning("forwarder %s: cannot keep its hand-offs: %s", self._name, e or type(e).__name__)
                continue
            for j in jobs:
                j.lost.update(i for i in j.ids if i not in kept)
                if not j.lost:
                    j.confirmed = max(j.confirmed, asked)

    async def _settle(self, ids: Sequence[str], record: Mapping[str, str] | None) -> None:
        """XACK + XDEL the entries and write their history record, in one MULTI (shared
        with the settles of other hand-offs that end in the same moment: _SettleBatcher).

        Returns once that MULTI is done; raises as it did. Every key here carries the
        outbox's hash tag (one slot on Redis Cluster); anything in another slot (a
        dead letter) is written before, on its own.
        """
        await self._settles.settle(ids, record)

    def _record(self, event: str, job: _Job, ids: Sequence[str], reason: str = "") -> dict[str, str]:
        head = job.head
        entries = [e for i, e in zip(job.ids, job.entries, strict=True) if i in ids]
        return {
            "event": event,
            "at": str(self._clock.now_ms()),
            "id": head.bulk or head.id,
            "sid": "",
            "topic": head.topic,
            "kind": "",
            "due": "",
            "late": "",
            "size": str(sum(len(e.data) for e in entries)),
            "attempt": str(job.attempt),
            "reason": reason,
            "schedule": "",
            # Beyond history.FIELDS (readers ignore unknown fields): where it went.
            "pubsub": head.pubsub,
        }

    # --- hand-offs -----------------------------------------------------------

    async def _start(self, rows: Sequence[tuple[tuple[bytes, Any], int]], asked: float) -> int:
        """Start a hand-off task per job of `rows` (read or claimed at loop time `asked`);
        returns how many were started."""
        if not rows:
            return 0
        jobs = await self._jobs(rows)
        for job in jobs:
            job.confirmed = asked
            job.read = list(job.ids)
            for i in job.ids:
                self._held[i] = job
            self._jobs_held += 1
            task = asyncio.create_task(self._carry(job))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return len(jobs)

    async def _carry(self, job: _Job) -> None:
        """One hand-off, from its read to its end: settled, counted as failed (and left
        pending for its retry), dead-lettered, expired, or found taken over."""
        sidecar = Backoff(
            base_s=self._config.sidecar_backoff_base_s, cap_s=self._config.sidecar_backoff_cap_s
        )
        task = asyncio.current_task()
        try:
            while not self._stopping:
                async with self._calls:
                    # Checked once a call slot is ours: the wait for it can be long (a
                    # message may expire meanwhile, or be taken over, or we stop). Ownership
                    # first: what another replica holds now is not ours to settle as expired.
                    if self._stopping or not await self._still_ours(job):
                        return
                    if await self._drop_expired(job):
                        return
                    if task is not None:
                        self._calling.add(task)
                    self._in_calls += 1
                    try:
                        await self._publish(job)
                    except SidecarUnavailableError as e:
                        failed: SidecarUnavailableError | None = e
                    else:
                        failed = None
                    finally:
                        self._in_calls -= 1
                if failed is None:
                    self._sidecar_answered()
                    await self._after_publish(job)
                    return
                # Uncounted and held (the keeper keeps it ours): daprd restarting is
                # no fault of this message, and nobody else should take it meanwhile.
                self._calling.discard(task)
                self._sidecar_unreachable(len(job.ids), failed)
                await self._clock.sleep(sidecar.next())
        except asyncio.CancelledError:
            raise
        except Exception as e:
            # Left pending under our name: retried after its backoff, one attempt higher.
            log.warning(
                "forwarder %s: hand-off of %s interrupted: %s", self._name, job.ids[0] if job.ids else "?", e
            )
        finally:
            self._calling.discard(task)
            self._release(job)

    def _release(self, job: _Job) -> None:
        # Every id the job was read with (some may have expired or been lost since).
        for i in job.read:
            if self._held.get(i) is job:
                del self._held[i]
        self._jobs_held -= 1
        # Wakes a step waiting for room only once a read is worth it (see step()).
        if self._worth_reading():
            self._room.set()

    async def _still_ours(self, job: _Job) -> bool:
        """Whether anything of `job` is still ours to publish; drops what is not.

        Trusted without asking when confirmed less than claim_idle_ms / 2 ago:
        nobody takes an entry over before it is claim_idle_ms idle. Otherwise
        asked of Redis now (which also resets the idle time)."""
        if asyncio.get_running_loop().time() - job.confirmed >= self._config.claim_idle_ms / 2000:
            kept, asked = await self._hold([(i, job.attempt) for i in job.ids])
            job.lost.update(i for i in job.ids if i not in kept)
            job.confirmed = asked
        if job.lost:
            lost = job.keep_only([i for i in job.ids if i not in job.lost])
            if lost:
                log.warning(
                    "forwarder %s: %d hand-off(s) taken over by another replica (%s): not published here",
                    self._name,
                    len(lost),
                    ", ".join(lost[:5]),
                )
        return bool(job.ids)

    def _sidecar_unreachable(self, entries: int, e: Exception) -> None:
        if self._metrics is not None:
            self._metrics.failures.labels(self._name, "unavailable").inc(entries)
        now = asyncio.get_running_loop().time()
        if self._down_since is None:
            self._down_since = now
        if now - self._down_logged >= _DOWN_LOG_EVERY_S:
            self._down_logged = now
            log.warning(
                "forwarder %s: sidecar %s unreachable for %.0fs (%s); %d hand-offs wait and are retried",
                self._name,
                self._config.address,
                now - self._down_since,
                e,
                len(self._held),
            )

    def _sidecar_answered(self) -> None:
        if self._down_since is not None:
            log.info(
                "forwarder %s: sidecar %s answers again after %.0fs",
                self._name,
                self._config.address,
                asyncio.get_running_loop().time() - self._down_since,
            )
            self._down_since = None
            self._down_logged = 0.0

    async def _jobs(self, rows: Sequence[tuple[tuple[bytes, Any], int]]) -> list[_Job]:
        """Decode rows into publish jobs (a bulk's consecutive entries together); malformed
        or deleted entries are settled at once (no retry can deliver them)."""
        jobs: list[_Job] = []
        for (raw_id, fields), attempt in rows:
            entry_id = text(raw_id)
            if not fields:
                # Deleted while pending (an operator's XDEL): nothing left to send.
                await self._settle([entry_id], None)
                continue
            try:
                entry = decode_outbox_entry(fields)
            except MalformedEntryError as e:
                log.error("forwarder %s: outbox entry %s: %s", self._name, entry_id, e)
                await self._dead_letter_raw(entry_id, fields, str(e))
                continue
            last = jobs[-1] if jobs else None
            if last is not None and entry.bulk and last.head.bulk == entry.bulk and last.attempt == attempt:
                last.ids.append(entry_id)
                last.entries.append(entry)
            else:
                jobs.append(_Job([entry_id], [entry], attempt))
        return jobs

    async def _drop_expired(self, job: _Job) -> bool:
        now = self._clock.now_ms()
        expired = [
            i for i, e in zip(job.ids, job.entries, strict=True) if e.expires_at_ms and e.expires_at_ms <= now
        ]
        if not expired:
            return False
        await self._settle(expired, self._record(history.EXPIRED, job, expired, "ttl"))
        if self._metrics is not None:
            self._metrics.expired.labels(self._name).inc(len(expired))
        keep = [(i, e) for i, e in zip(job.ids, job.entries, strict=True) if i not in expired]
        job.ids[:] = [i for i, _ in keep]
        job.entries[:] = [e for _, e in keep]
        return not keep

    # --- the sidecar side --------------------------------------------------

    def _dapr(self) -> Any:
        if self._stub is None:
            cap_ms = int(self._config.sidecar_backoff_cap_s * 1000)
            self._channel = grpc.aio.insecure_channel(
                self._config.address,
                # gRPC's own reconnect backoff grows to 120 s: after a long daprd
                # restart hand-offs would wait that long for it. Ours is the cap.
                options=[
                    ("grpc.initial_reconnect_backoff_ms", min(1000, cap_ms)),
                    ("grpc.max_reconnect_backoff_ms", cap_ms),
                ],
            )
            self._stub = dapr_pb2_grpc.DaprStub(self._channel)  # type: ignore[no-untyped-call]
        return self._stub

    def _message_metadata(self, entry: OutboxEntry, now_ms: int) -> dict[str, str]:
        metadata = forwarded_metadata(entry.metadata)
        if entry.expires_at_ms:
            metadata[TTL_IN_SECONDS] = str(max(1, math.ceil((entry.expires_at_ms - now_ms) / 1000)))
        return metadata

    async def _publish(self, job: _Job) -> None:
        """Publish one job; fills job.failed with what daprd refused; raises
        SidecarUnavailableError when daprd cannot be reached at all."""
        stub, now = self._dapr(), self._clock.now_ms()
        head = job.head
        job.failed = []
        try:
            if len(job.entries) == 1 and not head.bulk:
                metadata = self._message_metadata(head, now)
                metadata[RAW_PAYLOAD] = "true"
                await stub.PublishEvent(
                    pubsub_pb2.PublishEventRequest(
                        pubsub_name=head.pubsub,
                        topic=head.topic,
                        data=head.data,
                        data_content_type=_content_type(head),
                        metadata=metadata,
                    ),
                    timeout=self._config.call_timeout_s,
                    metadata=self._call_md,
                )
                return
            request = pubsub_pb2.BulkPublishRequest(
                pubsub_name=head.pubsub,
                topic=head.topic,
                entries=[
                    pubsub_pb2.BulkPublishRequestEntry(
                        # The outbox stream id: unique within the call, and the
                        # key by which a partial failure names its entries.
                        entry_id=i,
                        event=e.data,
                        content_type=_content_type(e),
                        metadata=self._message_metadata(e, now),
                    )
                    for i, e in zip(job.ids, job.entries, strict=True)
                ],
                metadata={RAW_PAYLOAD: "true"},
            )
            reply = await stub.BulkPublishEventAlpha1(
                request, timeout=self._config.call_timeout_s, metadata=self._call_md
            )
            job.failed = [(f.entry_id, f.error) for f in reply.failedEntries]
        except grpc.aio.AioRpcError as e:
            code = e.code()
            # UNAVAILABLE: the call never reached daprd. A deadline that passed on a
            # connected channel did reach it, and daprd may have published: that is an
            # attempt, counted like a refusal (else a sidecar that answers late would
            # get the same message again and again, never counted, never dead-lettered).
            # A deadline that passed while still connecting is the sidecar not being there.
            if code == grpc.StatusCode.UNAVAILABLE or (
                code == grpc.StatusCode.DEADLINE_EXCEEDED and not self._connected()
            ):
                raise SidecarUnavailableError(e.details() or str(code)) from e
            why = f"{code.name}: {e.details()}"
            job.failed = [(i, why) for i in job.ids]

    def _connected(self) -> bool:
        channel = self._channel
        return channel is not None and channel.get_state() == grpc.ChannelConnectivity.READY

    async def _after_publish(self, job: _Job) -> None:
        failed = dict(job.failed)
        ok = [i for i in job.ids if i not in failed]
        if ok:
            await self._settle(ok, self._record(history.HANDED_OFF, job, ok))
            if self._metrics is not None:
                self._metrics.handed_off.labels(self._name).inc(len(ok))
        if not failed:
            return
        why = next(iter(failed.values()))
        reason = _failure_reason(why)
        if self._metrics is not None:
            self._metrics.failures.labels(self._name, reason).inc(len(failed))
        policy = self._config.policy
        if job.attempt >= policy.max_attempts and policy.dead_letter_topic:
            for i, e in zip(job.ids, job.entries, strict=True):
                if i in failed:
                    await self._dead_letter(i, e, job, failed[i])
            return
        log.warning(
            "forwarder %s: %s/%s did not take %d message(s) (attempt %d of %d%s): %s",
            self._name,
            job.head.pubsub,
            job.head.topic,
            len(failed),
            job.attempt,
            policy.max_attempts,
            "" if policy.dead_letter_topic else ", no deadLetterTopic: retried until it works",
            why,
        )
        # Restart the idle clock now, so the backoff counts from this failure, not
        # from when the entry was read; only where it is still ours (a plain XCLAIM
        # would take back an entry another replica has taken over meanwhile).
        await self._hold([(i, job.attempt) for i in failed])

    async def _dead_letter(self, entry_id: str, entry: OutboxEntry, job: _Job, why: str) -> None:
        topic = self._config.policy.dead_letter_topic
        log.error(
            "forwarder %s: %s/%s refused %s after %d attempts, dead-lettered to %r: %s",
            self._name,
            entry.pubsub,
            entry.topic,
            entry.id or entry_id,
            job.attempt,
            topic,
            why,
        )
        message = StreamEntry(
            entry.data, forwarded_metadata(entry.metadata), entry.content_type, entry.expires_at_ms
        )
        gave_up = GaveUp(why, job.attempt, entry.topic, self._consumer_id, self._clock.now_ms(), entry.pubsub)
        # First the dead letter (its own slots), then the settle: a crash in
        # between leaves the entry pending, dead-lettered again on its next try.
        await self._bounded(write_dead_letter(self._redis, self._consumer_id, topic, message, gave_up))
        await self._settle([entry_id], self._record(history.DEAD_LETTERED, job, [entry_id], why[:500]))
        if self._metrics is not None:
            self._metrics.dead_lettered.labels(self._name).inc()

    async def _dead_letter_raw(self, entry_id: str, fields: Mapping[Any, Any], why: str) -> None:
        """A malformed entry: dead-letter its bytes as they are when a topic is set; else drop it, loudly."""
        topic = self._config.policy.dead_letter_topic
        data = bytes(fields.get(b"data", fields.get("data", b"")) or b"")
        now = self._clock.now_ms()
        record = {
            "event": history.DEAD_LETTERED,
            "at": str(now),
            "id": entry_id,
            "reason": why,
        }
        if topic:
            # No target to put it back to: listed by `dead`, skipped by `retry-dead`.
            gave_up = GaveUp(why, 1, "", self._consumer_id, now)
            await self._bounded(
                write_dead_letter(self._redis, self._consumer_id, topic, StreamEntry(data), gave_up)
            )
        await self._settle([entry_id], record)
        if self._metrics is not None:
            self._metrics.dead_lettered.labels(self._name).inc()


class _SettleBatcher:
    """Settles the hand-offs that end in the same moment in one MULTI.

    A settle is queued and a flush task started if none runs: it goes out once
    the loop has run what was ready, after _SETTLE_LINGER_S while other calls
    are in flight (the hand-offs whose calls come back meanwhile queue theirs).
    Settles queued while a MULTI is on the wire go out together right after it.
    One MULTI holds every record's history append, one age trim, one XACK and
    one XDEL of all the ids. When it fails (an error reply, the connection
    lost, the Redis timeout) every settle in it fails, as a single settle would
    have: the hand-off ends "interrupted" and its entries stay pending under
    our name, retried one attempt higher after their backoff.
    """

    def __init__(
        self,
        client: RedisClient,
        keys: EngineKeys,
        config: ForwarderConfig,
        clock: Clock,
        bounded: Callable[[Awaitable[Any]], Awaitable[Any]],
        calls_in_flight: Callable[[], int],
    ) -> None:
        self._redis = client
        self._keys = keys
        self._group = config.group
        self._history = config.history
        # Every record but the last of a MULTI is appended without the age trim: one does for all.
        self._untrimmed = replace(config.history, max_age_ms=0)
        self._linger_below = config.concurrency
        self._clock = clock
        self._bounded = bounded
        self._calls_in_flight = calls_in_flight
        self._queue: list[tuple[Sequence[str], Mapping[str, str] | None, asyncio.Future[None]]] = []
        self._flusher: asyncio.Task[None] | None = None

    @property
    def flusher(self) -> asyncio.Task[None] | None:
        """The flush under way, if any."""
        return self._flusher

    async def settle(self, ids: Sequence[str], record: Mapping[str, str] | None) -> None:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queue.append((ids, record, future))
        if self._flusher is None:
            self._flusher = asyncio.create_task(self._flush(), name="forwarder settles")
        # Cancelled (the forwarder closing): the settle still goes out with its batch;
        # an entry daprd took is better settled than handed off again.
        await future

    async def _flush(self) -> None:
        batch: list[tuple[Sequence[str], Mapping[str, str] | None, asyncio.Future[None]]] = []
        try:
            while self._queue:
                if self._calls_in_flight() and len(self._queue) < self._linger_below:
                    await asyncio.sleep(_SETTLE_LINGER_S)
                batch, self._queue = self._queue, []
                failed: Exception | None = None
                try:
                    await self._write(batch)
                except Exception as e:
                    failed = e
                for *_, future in batch:
                    if future.done():
                        continue
                    if failed is None:
                        future.set_result(None)
                    else:
                        future.set_exception(failed)
                batch = []
        except asyncio.CancelledError:
            # Stopped with settles on the wire or queued: whether they landed is not known;
            # their entries stay pending (at least once).
            for *_, future in [*batch, *self._queue]:
                future.cancel()
            self._queue = []
            raise
        finally:
            self._flusher = None

    async def _write(self, batch: Sequence[tuple[Sequence[str], Mapping[str, str] | None, Any]]) -> None:
        pipe: Any = self._redis.pipeline(transaction=True)
        records = [record for _, record, _ in batch if record is not None]
        now_ms = self._clock.now_ms()
        for n, record in enumerate(records):
            retention = self._history if n == len(records) - 1 else self._untrimmed
            retention.append(pipe, self._keys.history, record, now_ms)
        ids = [i for entry_ids, _, _ in batch for i in entry_ids]
        pipe.xack(self._keys.outbox, self._group, *ids)
        # Done: the history keeps the record, the outbox keeps only what waits.
        pipe.xdel(self._keys.outbox, *ids)
        await self._bounded(pipe.execute())


def _consumer_of(stream: str) -> str:
    """The consumerID whose delayed topic (or shard stream, `<id>~<n>-delayed`) `stream` is."""
    base = stream.removesuffix(DELAYED_SUFFIX)
    head, mark, shard = base.rpartition(SHARD_MARK)
    return head if mark and shard.isdigit() else base


def _failure_reason(why: str) -> str:
    """The `reason` label of a failed attempt, from what the call ended with."""
    if why.startswith(grpc.StatusCode.DEADLINE_EXCEEDED.name):
        return "timeout"
    return "unknown_target" if "not found" in why.lower() else "refused"


def _content_type(entry: OutboxEntry) -> str:
    """The content type to publish with: the one given at publish, else a CloudEvent's."""
    if entry.content_type:
        return entry.content_type
    # daprd hands a pluggable component its CloudEvents with no content type.
    if entry.data[:1] == b"{":
        try:
            doc = json.loads(entry.data)
        except (ValueError, RecursionError, UnicodeDecodeError):
            return ""
        if isinstance(doc, dict) and "specversion" in doc:
            return CLOUDEVENT_CONTENT_TYPE
    return ""


def forwarder_config(
    *,
    dapr_grpc_address: str,
    dead_letter_topic: str,
    claim_idle_ms: int,
    call_timeout_ms: int = 10_000,
    env: Mapping[str, str] | None = None,
    history: Retention | None = None,
    consumer_id: str = "",
) -> ForwarderConfig:
    """A ForwarderConfig from component settings and the environment (DAPR_GRPC_PORT, DAPR_API_TOKEN)."""
    environ = os.environ if env is None else env
    return ForwarderConfig(
        address=resolve_dapr_address(dapr_grpc_address, environ),
        api_token=environ.get("DAPR_API_TOKEN", ""),
        policy=HandOffPolicy(dead_letter_topic=dead_letter_topic),
        claim_idle_ms=max(claim_idle_ms, 15_000),
        call_timeout_s=call_timeout_ms / 1000,
        history=history if history is not None else Retention(),
        consumer_id=consumer_id,
    )
