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
- A duplicate is recognisable: the data is published raw (`rawPayload=true`,
  with its content type), so the original CloudEvent reaches the target byte
  for byte and its `id` is the same on every retry.
- Sidecar unreachable (UNAVAILABLE, deadline exceeded): nothing is wrong with
  the message; the same batch is retried with backoff, uncounted, until daprd
  answers (a daprd restart loses nothing).
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
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import grpc
import grpc.aio
from dapr.proto.runtime.v1 import dapr_pb2_grpc, pubsub_pb2
from redis.exceptions import RedisError, ResponseError

from delayed_middleware import history
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

# A failed gauge refresh while the sidecar is away must not end the hand-off loop.
_REDIS_FAILURES: Final = (RedisError, TimeoutError, OSError)
# gRPC codes that mean "the sidecar is not there right now", not "it said no".
_SIDECAR_DOWN: Final = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


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
    batch_size: int = 100
    # Publishes in flight at once within a batch.
    concurrency: int = 16
    block_ms: int = 1000
    call_timeout_s: float = 10.0
    # Another replica's unacked entries are taken over after this long idle;
    # longer than one publish can take (call_timeout_s), or a slow live
    # replica's entries would be published twice.
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
    """Consecutive outbox entries that go out in one publish call (one entry, or one bulk)."""

    ids: list[str]
    entries: list[OutboxEntry]
    attempt: int
    failed: list[tuple[str, str]] = field(default_factory=list)  # (stream id, why)

    @property
    def head(self) -> OutboxEntry:
        return self.entries[0]


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
        """Stop; whatever is not yet acknowledged stays pending in Redis for the next start."""
        self._stopping = True
        if self._loop is not None:
            loop, self._loop = self._loop, None
            # Bounded: a stop must never hang the instance's close behind a
            # call that ignores cancellation (Supervised.stop logs it).
            await loop.stop(timeout_s=10)
        if self._channel is not None:
            await self._channel.close(None)
            self._channel = None
            self._stub = None

    async def run(self, stop: asyncio.Event | None = None) -> None:
        """The forwarding loop; survives Redis and sidecar outages, ends only when stopped
        (close(), or `stop` set) or cancelled."""
        redis_backoff = Backoff(base_s=0.05, cap_s=2.0)
        group_ready = False
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
                log.warning("forwarder %s: %s; retrying in %.2fs", self._name, e or type(e).__name__, delay)
                await self._clock.sleep(delay)

    async def step(self) -> int:
        """One round: retry what is due for a retry, then read and hand off new entries.

        Returns how many entries were settled (acked, expired or dead-lettered).
        """
        settled = await self._handle(await self._claim_retries())
        reply: Any = await self._bounded(
            self._read_redis.xreadgroup(
                self._config.group,
                self.consumer,
                {self._keys.outbox: ">"},
                count=self._config.batch_size,
                # Retries just went out: look for new entries without waiting.
                block=None if settled else self._config.block_ms,
            ),
            extra_s=self._config.block_ms / 1000,
        )
        rows = [row for _, entries in reply or () for row in entries]
        settled += await self._handle([(row, 1) for row in rows])
        await self._report_waiting()
        return settled

    async def _report_waiting(self) -> None:
        """Set the handoff_pending gauge: what waits in the outbox (read or not; settled entries are deleted)."""
        if self._metrics is not None:
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

    async def _claim_retries(self) -> list[tuple[tuple[bytes, Any], int]]:
        """Pending entries whose next attempt is due: our own refused ones after their
        backoff, another replica's after claim_idle_ms. Returns (row, attempt) pairs."""
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
        claims: list[tuple[bytes, int, int]] = []  # (id, min idle, attempt it will be)
        for p in pending:
            deliveries = int(p["times_delivered"])
            wait = policy.delay_ms(min(deliveries, policy.max_attempts))
            consumer = text(p["consumer"])
            if consumer != self.consumer:
                wait = max(wait, cfg.claim_idle_ms)
            if int(p["time_since_delivered"]) >= wait:
                claims.append((p["message_id"], max(1, wait), deliveries + 1))
        if not claims:
            return []
        pipe = self._redis.pipeline(transaction=False)
        for entry_id, min_idle, _ in claims:
            # A min idle time per entry: whoever claims first resets it, so a
            # second replica racing for the same entry gets nothing.
            pipe.xclaim(self._keys.outbox, cfg.group, self.consumer, min_idle, [entry_id])
        results: list[Any] = await self._bounded(pipe.execute())
        out: list[tuple[tuple[bytes, Any], int]] = []
        for (_, _, attempt), rows in zip(claims, results, strict=True):
            out += [(row, attempt) for row in rows or ()]
        return out

    async def _settle(self, ids: Sequence[str], record: Mapping[str, str] | None) -> None:
        """XACK + XDEL the entries and write their history record, in one MULTI.

        Every key here carries the outbox's hash tag (one slot on Redis Cluster);
        anything in another slot (a dead letter) is written before, on its own.
        """
        pipe: Any = self._redis.pipeline(transaction=True)
        if record is not None:
            self._config.history.append(pipe, self._keys.history, record, self._clock.now_ms())
        pipe.xack(self._keys.outbox, self._config.group, *ids)
        # Done: the history keeps the record, the outbox keeps only what waits.
        pipe.xdel(self._keys.outbox, *ids)
        await self._bounded(pipe.execute())

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

    # --- one batch ---------------------------------------------------------

    async def _handle(self, rows: Sequence[tuple[tuple[bytes, Any], int]]) -> int:
        if not rows:
            return 0
        jobs, settled = await self._jobs(rows)
        live: list[_Job] = []
        for job in jobs:
            if await self._drop_expired(job):
                settled += len(job.ids)
            elif job.entries:
                live.append(job)
        sem = asyncio.Semaphore(self._config.concurrency)
        sidecar = Backoff(
            base_s=self._config.sidecar_backoff_base_s, cap_s=self._config.sidecar_backoff_cap_s
        )
        todo = live
        while todo and not self._stopping:

            async def one(job: _Job) -> bool:
                async with sem:
                    try:
                        await self._publish(job)
                    except SidecarUnavailableError:
                        return False
                    return True

            done = await asyncio.gather(*(one(j) for j in todo))
            for job, ok in zip(todo, done, strict=True):
                if ok:
                    settled += await self._after_publish(job)
            todo = [j for j, ok in zip(todo, done, strict=True) if not ok]
            if todo:
                # Uncounted: daprd restarting is no fault of these messages.
                delay = sidecar.next()
                if self._metrics is not None:
                    self._metrics.failures.labels(self._name, "unavailable").inc(len(todo))
                log.warning(
                    "forwarder %s: sidecar %s unreachable; %d hand-offs wait, retrying in %.2fs",
                    self._name,
                    self._config.address,
                    sum(len(j.ids) for j in todo),
                    delay,
                )
                # This wait may last as long as daprd is down: keep the gauge current meanwhile.
                with contextlib.suppress(*_REDIS_FAILURES):
                    await self._report_waiting()
                await self._clock.sleep(delay)
        return settled

    async def _jobs(self, rows: Sequence[tuple[tuple[bytes, Any], int]]) -> tuple[list[_Job], int]:
        """Decode rows into publish jobs (a bulk's consecutive entries together); malformed
        or deleted entries are settled at once (no retry can deliver them)."""
        jobs: list[_Job] = []
        settled = 0
        for (raw_id, fields), attempt in rows:
            entry_id = text(raw_id)
            if not fields:
                # Deleted while pending (an operator's XDEL): nothing left to send.
                await self._settle([entry_id], None)
                settled += 1
                continue
            try:
                entry = decode_outbox_entry(fields)
            except MalformedEntryError as e:
                log.error("forwarder %s: outbox entry %s: %s", self._name, entry_id, e)
                await self._dead_letter_raw(entry_id, fields, str(e))
                settled += 1
                continue
            last = jobs[-1] if jobs else None
            if last is not None and entry.bulk and last.head.bulk == entry.bulk and last.attempt == attempt:
                last.ids.append(entry_id)
                last.entries.append(entry)
            else:
                jobs.append(_Job([entry_id], [entry], attempt))
        return jobs, settled

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
            self._channel = grpc.aio.insecure_channel(self._config.address)
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
            if e.code() in _SIDECAR_DOWN:
                raise SidecarUnavailableError(e.details() or str(e.code())) from e
            why = f"{e.code().name}: {e.details()}"
            job.failed = [(i, why) for i in job.ids]

    async def _after_publish(self, job: _Job) -> int:
        failed = dict(job.failed)
        ok = [i for i in job.ids if i not in failed]
        settled = 0
        if ok:
            await self._settle(ok, self._record(history.HANDED_OFF, job, ok))
            settled += len(ok)
            if self._metrics is not None:
                self._metrics.handed_off.labels(self._name).inc(len(ok))
        if not failed:
            return settled
        why = next(iter(failed.values()))
        reason = "unknown_target" if "not found" in why.lower() else "refused"
        if self._metrics is not None:
            self._metrics.failures.labels(self._name, reason).inc(len(failed))
        policy = self._config.policy
        if job.attempt >= policy.max_attempts and policy.dead_letter_topic:
            for i, e in zip(job.ids, job.entries, strict=True):
                if i in failed:
                    await self._dead_letter(i, e, job, failed[i])
                    settled += 1
            return settled
        log.warning(
            "forwarder %s: %s/%s refused %d message(s) (attempt %d of %d%s): %s",
            self._name,
            job.head.pubsub,
            job.head.topic,
            len(failed),
            job.attempt,
            policy.max_attempts,
            "" if policy.dead_letter_topic else ", no deadLetterTopic: retried until it works",
            why,
        )
        # Restart the idle clock now, so the backoff counts from this failure,
        # not from when the entry was read (JUSTID: the delivery count stays).
        await self._bounded(
            self._redis.xclaim(
                self._keys.outbox, self._config.group, self.consumer, 0, list(failed), justid=True
            )
        )
        return settled

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


def _consumer_of(stream: str) -> str:
    """The consumerID whose delayed topic (or shard stream, `<id>~<n>-delayed`) `stream` is."""
    base = stream.removesuffix(DELAYED_SUFFIX)
    head, mark, shard = base.rpartition(SHARD_MARK)
    return head if mark and shard.isdigit() else base


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
        history=history if history is not None else Retention(),
        consumer_id=consumer_id,
    )
