"""The registry of the component instances served on one socket (`Instances`).

Several instances share one socket; daprd tells them apart by the
`x-component-instance` call metadata. The registry also restores an instance
from its Init record after a restart of `serve` under a running daprd, and
reports the subscriptions such a restart orphaned.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime

from delayed_middleware.backoff import RESTART, Backoff
from delayed_middleware.clock import Clock
from delayed_middleware.errors import (
    BackendUnavailableError,
    DelayedPubSubError,
    NotInitializedError,
    RestoreFailedError,
)
from delayed_pubsub.instance.component import Instance
from delayed_pubsub.metrics import Metrics
from delayed_pubsub.records import InitRecord, RecordRefusedError, RecordStore
from delayed_pubsub.settings import parse_settings, unknown_keys
from delayed_pubsub.subscription import Subscription

# The name logs have always carried (log queries and alerts key on it), whichever file of the package writes.
log = logging.getLogger("delayed_pubsub.instance")


class Instances:
    """The component instances served on one socket, by name.

    With a RecordStore it also makes a restart of `serve` survivable under a
    running daprd (which calls Init only once, at its own start):

    - every successful Init is recorded (records.py), and a call for an
      instance this process has not seen Init'ed restores it from its record
      first: once, under that instance's lock, while concurrent callers wait;
    - the topics with open PullMessages streams are recorded too. daprd never
      re-opens a stream, so topics a previous process had open are *orphaned*
      until daprd re-opens them (it restarted) or re-Inits the instance. They
      are logged at ERROR once each, counted in a gauge, and reported to
      `on_change` (the server turns its subscriptions health NOT_SERVING).

    A topic from a record is only *suspect* at first: if daprd restarted too,
    its Init arrives within seconds and clears it. It turns orphaned when a
    call for the instance arrives without an Init (proof that the daprd which
    opened the streams is alive and will not re-open them) or when
    `orphan_grace_s` passes with neither. But when daprd Init'ed *other*
    instances in this process and, `orphan_grace_s` later, neither Init'ed nor
    called this one, its component is gone from daprd (its YAML was removed
    before daprd restarted): its topics are dropped, not reported.
    """

    def __init__(
        self,
        clock: Clock,
        metrics: Metrics,
        records: RecordStore | None = None,
        orphan_grace_s: float = 30.0,
        *,
        background: bool = True,
    ) -> None:
        self._clock = clock
        self._metrics = metrics
        # False under `serve --workers N`: the workers run the instances' background loops.
        self._background = background
        # Called with live_properties() whenever an instance is opened, replaced or closed.
        self.on_live_change: Callable[[dict[str, dict[str, str]]], None] | None = None
        self._instances: dict[str, Instance] = {}
        self._lock = asyncio.Lock()
        self._records = records
        self._orphan_grace_s = orphan_grace_s
        # One lock per instance name: Init and restore of one name are serialized,
        # and a slow Redis behind one instance does not hold up the others.
        self._name_locks: dict[str, asyncio.Lock] = {}
        # The Init metadata each live instance was built from (rewritten into
        # its record whenever its topics change).
        self._props: dict[str, dict[str, str]] = {}
        # Open PullMessages streams: name -> topic -> count, and stream -> (name, topic).
        self._open: dict[str, dict[str, int]] = {}
        self._streams: dict[Subscription, tuple[str, str]] = {}
        self._suspect: dict[str, set[str]] = {}
        self._orphaned: dict[str, set[str]] = {}
        self._told: set[tuple[str, str]] = set()
        self._restore_failures: dict[str, _RestoreFailure] = {}
        self._grace_task: asyncio.Task[None] | None = None
        self._after_init_task: asyncio.Task[None] | None = None
        self._daprd_inited = False
        # The records read at start, for rewriting those of instances daprd no longer has.
        self._found: dict[str, InitRecord] = {}
        self._closing = False
        self.on_change: Callable[[], None] | None = None
        """Called when the set of orphaned subscriptions changes."""

    def start(self) -> None:
        """Read the records a previous process left; arm the orphan timer for their topics."""
        if self._records is None:
            return
        for record in self._records.load_all():
            if record.topics and record.instance not in self._instances:
                self._suspect[record.instance] = set(record.topics)
                self._found[record.instance] = record
        if self._suspect:
            log.warning(
                "a previous process had subscriptions open: %s; unless daprd Inits them again (it restarted "
                "too) they are orphaned, at once when daprd calls them or after %gs",
                _describe(self._suspect),
                self._orphan_grace_s,
            )
            self._grace_task = asyncio.create_task(self._settle_later(), name="orphan grace")

    async def _settle_later(self) -> None:
        await self._clock.sleep(self._orphan_grace_s)
        self._settle()

    def _settle(self) -> None:
        """Decide about the recorded topics nobody has claimed `orphan_grace_s` after the start
        (or after daprd's last Init): orphaned, or dropped if daprd no longer has the instance."""
        for name in list(self._suspect):
            if not self._daprd_inited:
                self._orphan(name, self._suspect.pop(name))
        if not self._daprd_inited:
            return
        for name in sorted(set(self._suspect) | set(self._orphaned)):
            if name in self._instances:
                continue  # called or Init'ed in this process: daprd has it
            topics = self._suspect.pop(name, set()) | self._orphaned.pop(name, set())
            log.info(
                "instance %r: daprd Init'ed other instances but has not called this one for %gs: its "
                "component is gone from daprd; its recorded subscriptions (%s) are dropped, not orphaned",
                name,
                self._orphan_grace_s,
                ", ".join(sorted(topics)),
            )
            found = self._found.pop(name, None)
            if found is not None and self._records is not None:
                with contextlib.suppress(OSError, RecordRefusedError):
                    self._records.save(InitRecord(name, found.properties, (), self._clock.now_ms()))
            self._orphans_changed(name)

    def _name_lock(self, name: str) -> asyncio.Lock:
        return self._name_locks.setdefault(name, asyncio.Lock())

    async def init(self, name: str, props: Mapping[str, str]) -> Instance:
        """Parse, connect and register `name`, replacing (and closing) any previous Init of it.

        On failure the previous instance, if any, stays as it was. On success
        the Init is recorded, and subscriptions a previous process had open for
        `name` are no longer counted orphaned: daprd re-Inits a component when
        it (re)starts or reloads it, and then opens whatever it subscribes.
        """
        # Before parsing: a misspelt key may be why the parse fails (redisHots: "redisHost required").
        for warning in unknown_keys(props):
            log.warning("instance %r: %s", name, warning)
        settings = parse_settings(props)
        async with self._name_lock(name):
            instance = await Instance.open(
                name, settings, self._clock, self._metrics.for_instance(name), background=self._background
            )
            async with self._lock:
                old = self._instances.get(name)
                self._instances[name] = instance
            self._props[name] = dict(props)
            self._live_changed()
            self._restore_failures.pop(name, None)
            cleared = self._suspect.pop(name, set()) | self._orphaned.pop(name, set())
            self._found.pop(name, None)
            self._write_record(name)
            # A daprd (re)started or reloaded: the instances it has are Init'ed in a
            # burst; recorded ones it does not Init are settled once the burst is over.
            self._daprd_inited = True
            if self._suspect or self._orphaned:
                if self._after_init_task is not None:
                    self._after_init_task.cancel()
                self._after_init_task = asyncio.create_task(self._settle_later(), name="orphan settle")
        if cleared:
            log.info("instance %r: daprd Init'ed it again; it re-opens its subscriptions itself", name)
            self._orphans_changed(name)
        if old is not None:
            log.info("instance %r re-initialized; closing the previous one", name)
            await old.close()
        log.info(
            "instance %r initialized: redis %s, consumerID %r", name, settings.address, settings.consumer_id
        )
        return instance

    def find(self, name: str) -> Instance | None:
        """The instance named `name` if this process has it (Init'ed or restored), else None."""
        return self._instances.get(name)

    def get(self, name: str) -> Instance:
        """The instance named `name`; NotInitializedError if daprd has not called Init for it."""
        try:
            return self._instances[name]
        except KeyError:
            raise NotInitializedError(name) from None

    async def ready(self, name: str) -> Instance:
        """The instance named `name`, restored from its Init record if this process has not seen its Init.

        NotInitializedError if there is no record; RestoreFailedError (also a
        NotInitializedError) if the record is refused or its Init fails for
        good; BackendUnavailableError if Redis is unreachable (a later call
        tries again, after a backoff during which calls fail at once).
        """
        instance = self._instances.get(name)
        if instance is not None:
            return instance
        if self._records is None or not self._records.has(name):
            # Nothing to restore (and no lock kept for names nobody Init'ed).
            raise NotInitializedError(name)
        async with self._name_lock(name):
            # Whoever held the lock may have restored it (or daprd Init'ed it).
            instance = self._instances.get(name)
            if instance is not None:
                return instance
            failure = self._restore_failures.get(name)
            if failure is not None and self._clock.now_ms() < failure.retry_at_ms:
                raise failure.error
            try:
                instance = await self._restore(name)
            except NotInitializedError as e:
                if not isinstance(e, RestoreFailedError):
                    raise  # never Init'ed, nothing recorded: the plain "call Init first"
                self._failed_restore(name, e, failure)
                raise
            except BackendUnavailableError as e:
                self._failed_restore(name, e, failure)
                raise
            self._restore_failures.pop(name, None)
            return instance

    def _failed_restore(self, name: str, error: DelayedPubSubError, previous: _RestoreFailure | None) -> None:
        backoff = previous.backoff if previous is not None else RESTART.backoff()
        retry_at_ms = self._clock.now_ms() + int(backoff.next() * 1000)
        self._restore_failures[name] = _RestoreFailure(error, retry_at_ms, backoff)
        log.error("%s", error)

    async def _restore(self, name: str) -> Instance:
        assert self._records is not None
        try:
            record = self._records.load(name)
        except (RecordRefusedError, OSError) as e:
            raise RestoreFailedError(name, f"its record was refused: {e}") from e
        if record is None:
            raise NotInitializedError(name)
        try:
            settings = parse_settings(record.properties)
            instance = await Instance.open(
                name, settings, self._clock, self._metrics.for_instance(name), background=self._background
            )
        except BackendUnavailableError as e:
            raise BackendUnavailableError(
                f"component instance {name!r} restarting from its Init record {record.path}: {e}"
            ) from e
        except DelayedPubSubError as e:
            raise RestoreFailedError(name, f"Init from {record.path} failed: {e}") from e
        async with self._lock:
            self._instances[name] = instance
        self._props[name] = dict(record.properties)
        self._live_changed()
        log.warning(
            "instance %r: called without an Init in this process (the component restarted under a "
            "running daprd); re-initialized from its Init record %s of %s: redis %s, consumerID %r",
            name,
            record.path,
            _iso(record.written_at_ms),
            settings.address,
            settings.consumer_id,
        )
        # The daprd that opened this instance's streams is alive and did not
        # re-Init it: those streams died with the previous process for good.
        self._found.pop(name, None)
        self._orphan(name, self._suspect.pop(name, set()) | set(record.topics))
        return instance

    async def subscribe(
        self, name: str, instance: Instance, topic: str, metadata: Mapping[str, str]
    ) -> Subscription:
        """Open a subscription on `instance` for one PullMessages stream, and record its topic."""
        sub = await instance.subscribe(topic, metadata)
        counts = self._open.setdefault(name, {})
        counts[topic] = counts.get(topic, 0) + 1
        self._streams[sub] = (name, topic)
        resumed = False
        for known in (self._suspect.get(name), self._orphaned.get(name)):
            if known is not None and topic in known:
                known.discard(topic)
                resumed = True
        if resumed:
            log.info("instance %r: daprd opened topic %r again; it is no longer orphaned", name, topic)
            self._orphans_changed(name)
        if counts[topic] == 1 or resumed:
            self._write_record(name)
        return sub

    async def unsubscribe(self, instance: Instance, sub: Subscription) -> None:
        """Close a stream's subscription. Unless this process is shutting down
        (then daprd loses the stream for good, and the record must keep it),
        its topic leaves the record once no stream of it is open."""
        where = self._streams.pop(sub, None)
        await instance.unsubscribe(sub)
        if where is None or self._closing:
            return
        name, topic = where
        counts = self._open.get(name, {})
        counts[topic] = counts.get(topic, 1) - 1
        if counts[topic] <= 0:
            del counts[topic]
            self._write_record(name)

    def orphaned(self) -> dict[str, frozenset[str]]:
        """instance -> topics whose streams a previous process had open and daprd has not re-opened."""
        return {name: frozenset(t) for name, t in self._orphaned.items() if t}

    def live_properties(self) -> dict[str, dict[str, str]]:
        """The Init metadata of every live instance, by name."""
        return {name: dict(self._props[name]) for name in self._instances if name in self._props}

    def _live_changed(self) -> None:
        if self.on_live_change is not None:
            self.on_live_change(self.live_properties())

    def items(self) -> list[tuple[str, Instance]]:
        """The live instances (a snapshot)."""
        return list(self._instances.items())

    def _orphan(self, name: str, topics: set[str]) -> None:
        topics = topics - set(self._open.get(name, ()))
        if not topics:
            return
        self._orphaned.setdefault(name, set()).update(topics)
        for topic in sorted(topics):
            if (name, topic) in self._told:
                continue
            self._told.add((name, topic))
            log.error(
                "instance %r: the subscription to topic %r was open before this component restarted and "
                "daprd never re-opens a subscription stream: nothing is delivered on it until daprd is "
                "restarted. Restart daprd (in Kubernetes: the pod) to resume it; its messages wait in "
                "Redis meanwhile, none is lost",
                name,
                topic,
            )
        self._orphans_changed(name)

    def _orphans_changed(self, name: str) -> None:
        self._metrics.orphaned_subscriptions.labels(name).set(len(self._orphaned.get(name, ())))
        if self.on_change is not None:
            self.on_change()

    def _write_record(self, name: str) -> None:
        if self._records is None or name not in self._props:
            return
        topics = (
            set(self._open.get(name, ())) | self._suspect.get(name, set()) | self._orphaned.get(name, set())
        )
        record = InitRecord(name, self._props[name], tuple(sorted(topics)), self._clock.now_ms())
        try:
            self._records.save(record)
        except (OSError, RecordRefusedError) as e:
            # The call itself succeeded; only restart safety is lost: say so loudly.
            log.error(
                "instance %r: cannot write its Init record in %s (%s): a restart of this component will "
                "need a restart of daprd",
                name,
                self._records.folder,
                e,
            )

    async def drain(self, within_s: float) -> None:
        """First step of a graceful stop: send nothing new on any stream, give the
        messages daprd is processing up to `within_s` seconds to be acked, then end
        every stream. Unacked messages stay pending in Redis; the streams' topics
        stay recorded, so the next process reports them orphaned."""
        self._closing = True
        for _, instance in self.items():
            instance.pause()
        subs = list(self._streams)
        waited = 0.0
        while any(s.in_flight for s in subs) and waited < within_s:
            await self._clock.sleep(0.05)
            waited += 0.05
        left = sum(s.in_flight for s in subs)
        if left:
            log.warning(
                "%d delivered messages not acked within %gs; they stay pending in Redis", left, within_s
            )
        for sub in subs:
            sub.stop()

    async def close(self) -> None:
        """Close every instance (recorded topics stay recorded)."""
        self._closing = True
        for task in (self._grace_task, self._after_init_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._grace_task = self._after_init_task = None
        instances = list(self._instances.values())
        self._instances.clear()
        self._live_changed()
        await asyncio.gather(*(i.close() for i in instances), return_exceptions=True)


@dataclass(frozen=True)
class _RestoreFailure:
    error: DelayedPubSubError
    retry_at_ms: int
    backoff: Backoff


def _describe(topics: Mapping[str, set[str]]) -> str:
    return "; ".join(f"{name!r}: {', '.join(sorted(t))}" for name, t in sorted(topics.items()))


def _iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat(timespec="seconds")
