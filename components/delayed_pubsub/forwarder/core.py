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
  in one MULTI (settles.SettleBatcher; each still learns whether its own settle
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
import logging
import math
import os
import secrets
import socket
from collections.abc import Awaitable, Mapping, Sequence
from typing import Any, Final

from redis.exceptions import ResponseError

from delayed_middleware import history
from delayed_middleware.aio import text
from delayed_middleware.backoff import REDIS_RECONNECT
from delayed_middleware.clock import Clock
from delayed_middleware.errors import MalformedEntryError
from delayed_middleware.history import Retention
from delayed_middleware.keys import DELAYED_SUFFIX, SHARD_MARK, EngineKeys, delayed_topic
from delayed_middleware.liveness import StateHook, Supervised
from delayed_middleware.outbox import decode_outbox_entry
from delayed_middleware.redis_errors import is_busy_group, is_no_group
from delayed_pubsub.connection import RedisPyClient
from delayed_pubsub.forwarder.config import ForwarderConfig, forwarder_config
from delayed_pubsub.forwarder.holding import Holdings, Job
from delayed_pubsub.forwarder.outcomes import Outcomes
from delayed_pubsub.forwarder.settles import SettleBatcher
from delayed_pubsub.forwarder.sidecar import Sidecar, SidecarUnavailableError
from delayed_pubsub.metrics import ForwarderMetrics
from delayed_pubsub.settings import Settings

# The name logs have always carried (log queries and alerts key on it), whichever file of the package writes.
log = logging.getLogger("delayed_pubsub.forwarder")

# How long close() lets the calls already on their way finish (at most handoffTimeout): a call
# cut off may still be carried out by daprd while its entry stays pending, and whoever takes
# it over after the takeover time publishes it a second time.
_CLOSE_GRACE_S: Final = 2.5
# The handoff_pending gauge (an XLEN) is refreshed at most this often: a step can
# run every few milliseconds under load, and a gauge is scraped every few seconds.
_GAUGE_EVERY_S: Final = 0.5


class Forwarder:
    """Reads one app's outbox and publishes each entry through the sidecar; start() / close()."""

    def __init__(
        self,
        client: RedisPyClient,
        keys: EngineKeys,
        clock: Clock,
        config: ForwarderConfig,
        metrics: ForwarderMetrics | None = None,
        *,
        name: str = "",
        read_client: RedisPyClient | None = None,
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
        self._loop: Supervised | None = None
        self._on_state = on_state
        # Our own stop flag, checked by every loop (see delayed_middleware.liveness):
        # a library that swallows one CancelledError (seen under grpc.aio +
        # redis-py 8) must not keep the loop alive after close().
        self._stopping = False
        self._holdings = Holdings(
            client, keys, config, consumer=self.consumer, name=self._name, bounded=self._bounded
        )
        # What this forwarder holds: entry id -> the hand-off it is in (holding.py).
        self._held = self._holdings.held
        self._sidecar = Sidecar(config, clock, metrics, name=self._name)
        self._tasks: set[asyncio.Task[None]] = set()
        self._room = asyncio.Event()
        # A read waits for this much room, as long as `concurrency` hand-offs are held (see step()).
        self._min_room = max(1, config.batch_size // 4)
        # Hand-offs (jobs) held: a bulk's entries are one.
        self._jobs_held = 0
        self._calls = asyncio.Semaphore(config.concurrency)
        # The hand-offs whose call is on its way (or being settled): close() lets them end.
        self._calling: set[asyncio.Task[Any]] = set()
        # Publish calls on the wire now (a settle lingers for theirs: settles.SettleBatcher).
        self._in_calls = 0
        self._settles = SettleBatcher(client, keys, config, clock, self._bounded, lambda: self._in_calls)
        # Settled through self._settle, so what a hand-off's ending settles shares the batcher.
        self._outcomes = Outcomes(
            client,
            config,
            clock,
            metrics,
            name=self._name,
            consumer_id=self._consumer_id,
            settle=self._settle,
            hold=self._holdings.hold,
            bounded=self._bounded,
        )
        self._gauge_at = -math.inf

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
        await self._sidecar.close()

    def _close_grace_s(self) -> float:
        return min(self._config.call_timeout_s, _CLOSE_GRACE_S)

    async def run(self, stop: asyncio.Event | None = None) -> None:
        """The forwarding loop; survives Redis and sidecar outages, ends only when stopped
        (close(), or `stop` set) or cancelled. Hand-offs in flight end with it (a call on its
        way first gets close()'s grace): their entries stay pending in Redis."""
        redis_backoff = REDIS_RECONNECT.backoff()
        group_ready = False
        keeper = asyncio.create_task(self._holdings.keep(lambda: self._stopping))
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
                    if isinstance(e, ResponseError) and is_no_group(e):
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
        started = await self._start(*await self._holdings.claim_retries(room))
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
            if not is_busy_group(e):
                raise

    async def _settle(self, ids: Sequence[str], record: Mapping[str, str] | None) -> None:
        """XACK + XDEL the entries and write their history record, in one MULTI (shared
        with the settles of other hand-offs that end in the same moment: settles.SettleBatcher).

        Returns once that MULTI is done; raises as it did. Every key here carries the
        outbox's hash tag (one slot on Redis Cluster); anything in another slot (a
        dead letter) is written before, on its own.
        """
        await self._settles.settle(ids, record)

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

    async def _carry(self, job: Job) -> None:
        """One hand-off, from its read to its end: settled, counted as failed (and left
        pending for its retry), dead-lettered, expired, or found taken over."""
        sidecar = self._config.sidecar_profile().backoff()
        task = asyncio.current_task()
        try:
            while not self._stopping:
                async with self._calls:
                    # Checked once a call slot is ours: the wait for it can be long (a
                    # message may expire meanwhile, or be taken over, or we stop). Ownership
                    # first: what another replica holds now is not ours to settle as expired.
                    if self._stopping or not await self._holdings.still_ours(job):
                        return
                    if await self._drop_expired(job):
                        return
                    if task is not None:
                        self._calling.add(task)
                    self._in_calls += 1
                    try:
                        await self._sidecar.publish(job)
                    except SidecarUnavailableError as e:
                        failed: SidecarUnavailableError | None = e
                    else:
                        failed = None
                    finally:
                        self._in_calls -= 1
                if failed is None:
                    self._sidecar.answered()
                    await self._outcomes.after_publish(job)
                    return
                # Uncounted and held (the keeper keeps it ours): daprd restarting is
                # no fault of this message, and nobody else should take it meanwhile.
                self._calling.discard(task)
                self._sidecar.unreachable(len(job.ids), len(self._held), failed)
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

    def _release(self, job: Job) -> None:
        # Every id the job was read with (some may have expired or been lost since).
        for i in job.read:
            if self._held.get(i) is job:
                del self._held[i]
        self._jobs_held -= 1
        # Wakes a step waiting for room only once a read is worth it (see step()).
        if self._worth_reading():
            self._room.set()

    async def _jobs(self, rows: Sequence[tuple[tuple[bytes, Any], int]]) -> list[Job]:
        """Decode rows into publish jobs (a bulk's consecutive entries together); malformed
        or deleted entries are settled at once (no retry can deliver them)."""
        jobs: list[Job] = []
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
                await self._outcomes.dead_letter_raw(entry_id, fields, str(e))
                continue
            last = jobs[-1] if jobs else None
            if last is not None and entry.bulk and last.head.bulk == entry.bulk and last.attempt == attempt:
                last.ids.append(entry_id)
                last.entries.append(entry)
            else:
                jobs.append(Job([entry_id], [entry], attempt))
        return jobs

    async def _drop_expired(self, job: Job) -> bool:
        now = self._clock.now_ms()
        expired = [
            i for i, e in zip(job.ids, job.entries, strict=True) if e.expires_at_ms and e.expires_at_ms <= now
        ]
        if not expired:
            return False
        await self._settle(expired, self._outcomes.record(history.EXPIRED, job, expired, "ttl"))
        if self._metrics is not None:
            self._metrics.expired.labels(self._name).inc(len(expired))
        keep = [(i, e) for i, e in zip(job.ids, job.entries, strict=True) if i not in expired]
        job.ids[:] = [i for i, _ in keep]
        job.entries[:] = [e for _, e in keep]
        return not keep


def _consumer_of(stream: str) -> str:
    """The consumerID whose delayed topic (or shard stream, `<id>~<n>-delayed`) `stream` is."""
    base = stream.removesuffix(DELAYED_SUFFIX)
    head, mark, shard = base.rpartition(SHARD_MARK)
    return head if mark and shard.isdigit() else base
