"""Prometheus metrics of the component, in a registry of their own.

`delayed-pubsub serve --metrics-port N` exposes them. Labels are the component
instance (the YAML metadata.name) and, where it matters, how a message went;
never the topic, whose cardinality is the user's -- except the pending-per-topic
gauge, bounded to the largest topics plus one "(other)" series.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from delayed_middleware.engine import FireReport
from delayed_middleware.liveness import StateHook

# Topics beyond the largest ones share this label: bounded cardinality.
OTHER_TOPICS = "(other)"

# Lateness of a fire, from 1 ms to a minute: precision is the product.

LATENESS_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 60.0)


@dataclass(frozen=True)
class _Families:
    """Declares the metric families in one registry; each is labelled by component instance first."""

    registry: CollectorRegistry

    def counter(self, name: str, doc: str, *labels: str) -> Counter:
        return Counter(name, doc, ["instance", *labels], registry=self.registry)

    def gauge(self, name: str, doc: str, *labels: str) -> Gauge:
        return Gauge(name, doc, ["instance", *labels], registry=self.registry)

    def histogram(self, name: str, doc: str, *labels: str, buckets: tuple[float, ...]) -> Histogram:
        return Histogram(name, doc, ["instance", *labels], buckets=buckets, registry=self.registry)


class Metrics:
    """Every metric family; one per process, handed down to each instance."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        f = _Families(self.registry)
        # Declared by concern; the order is the registry's (and the exposition's) order.
        self._declare_message_flow(f)
        self._declare_operations(f)
        self._declare_health(f)
        self.forwarder = ForwarderMetrics.register(self.registry)
        self._declare_liveness(f)
        self._declare_requests(f)

    def _declare_message_flow(self, f: _Families) -> None:
        """Messages in and out: published, fired (and how late), pending, delivered, acked, nacked."""
        self.published = f.counter(
            "delayed_pubsub_published_messages",
            "Messages accepted by Publish/BulkPublish; mode=immediate or delayed",
            "mode",
        )
        self.fired = f.counter("delayed_pubsub_fired_messages", "Delayed messages moved to their topic")
        self.fire_lateness = f.histogram(
            "delayed_pubsub_fire_lateness_seconds",
            "Per fired batch: now minus the earliest due time in it (the batch's latest message)",
            buckets=LATENESS_BUCKETS,
        )
        self.pending = f.gauge(
            "delayed_pubsub_pending_messages", "Delayed messages waiting for their due time"
        )
        self.delivered = f.counter(
            "delayed_pubsub_delivered_messages", "Messages sent to daprd on PullMessages streams"
        )
        self.acked = f.counter("delayed_pubsub_acked_messages", "Messages daprd acknowledged")
        self.nacked = f.counter(
            "delayed_pubsub_nacked_messages", "Messages daprd reported failed (redelivered)"
        )

    def _declare_operations(self, f: _Families) -> None:
        """What an operator watches: retries, dead letters, parks, losses, Redis errors, streams, pending per topic."""
        self.retried = f.counter(
            "delayed_pubsub_retried_messages",
            "Nacked messages scheduled for a later redelivery by the retry policy",
        )
        self.dead_lettered = f.counter(
            "delayed_pubsub_dead_lettered_messages",
            "Messages that used up maxDeliveryAttempts; outcome=published (to deadLetterTopic) or dropped",
            "outcome",
        )
        self.parked = f.counter(
            "delayed_pubsub_parked_messages",
            "Delayed messages the engine could not deliver and kept for an operator",
        )
        self.lost = f.counter(
            "delayed_pubsub_lost_messages",
            "Pending delayed messages whose envelope was deleted outside the engine (XTRIM, XDEL, a "
            "MAXLEN publish, a release that did not know a moved envelope): reported once and removed",
        )
        self.redis_errors = f.counter(
            "delayed_pubsub_redis_errors",
            "Redis calls that failed (each failed try of a retried call counts)",
        )
        self.subscriptions = f.gauge("delayed_pubsub_open_subscriptions", "Open PullMessages streams")
        self.pending_by_topic = f.gauge(
            "delayed_pubsub_pending_by_topic_messages",
            'Delayed messages waiting, per target topic (the largest topics; the rest as topic="(other)"), '
            "refreshed by a bounded scan",
            "topic",
        )

    def _declare_health(self, f: _Families) -> None:
        """Restart safety and health (set by the registry and the server's health check)."""
        self.orphaned_subscriptions = f.gauge(
            "delayed_pubsub_orphaned_subscriptions",
            "Topics whose PullMessages stream a previous process had open and daprd has not re-opened "
            "(daprd never re-opens one: restart daprd)",
        )
        self.redis_up = f.gauge(
            "delayed_pubsub_redis_up",
            "1 if the instance's Redis answered the last health check's PING, else 0",
        )

    def _declare_liveness(self, f: _Families) -> None:
        """Liveness (delayed_middleware.liveness): every background loop is supervised."""
        self.fire_loop_up = f.gauge(
            "delayed_pubsub_fire_loop_up",
            "1 while the delay shard's fire loop runs and makes passes; 0 once it ended or stalled "
            "(it is restarted with backoff)",
            "shard",
        )
        self.fire_loop_restarts = f.counter(
            "delayed_pubsub_fire_loop_restarts",
            "Times the delay shard's fire loop ended without a stop and was restarted",
            "shard",
        )
        self.loop_restarts = f.counter(
            "delayed_pubsub_loop_restarts",
            "Times a background loop ended without a stop and was restarted; loop=wake, fetch, ack, "
            "retry, forwarder or gauge",
            "loop",
        )
        self.loops_down = f.gauge(
            "delayed_pubsub_loops_down",
            "Background loops of that kind that ended without a stop and wait for their restart",
            "loop",
        )

    def _declare_requests(self, f: _Families) -> None:
        """Control requests and admission: cancels, pauses, prefix cancels, refused publishes, TTL expiries."""
        self.cancels = f.counter(
            "delayed_pubsub_cancels",
            "scheduleCancel requests; result=cancelled (something pending was withdrawn) or unknown (nothing was)",
            "result",
        )
        self.refused = f.counter(
            "delayed_pubsub_refused_publishes",
            "Publish/BulkPublish calls refused with RESOURCE_EXHAUSTED: the instance had "
            "maxInflightPublishes calls in flight",
        )
        self.pauses = f.counter(
            "delayed_pubsub_pauses",
            "schedulePause requests; result=paused, resumed, ended (resumed after its last fire), "
            "unknown (nothing pending under that id) or unchanged (paused or running already)",
            "result",
        )
        self.time_controls = f.counter(
            "delayed_pubsub_time_controls",
            "scheduleTrigger and scheduleReschedule requests by op (trigger, reschedule); result=triggered, "
            "rescheduled, unknown (nothing pending under that id), fired (it went out already) or refused",
            "op",
            "result",
        )
        self.prefix_cancelled = f.counter(
            "delayed_pubsub_prefix_cancelled_messages",
            "Pending messages and schedules withdrawn by scheduleCancel with scheduleIdPrefix",
        )
        self.expired = f.counter(
            "delayed_pubsub_expired_messages",
            "Messages dropped unsent because their TTL (ttlInSeconds / ttl) ended before delivery",
        )

    def for_instance(self, name: str) -> InstanceMetrics:
        """The children labelled for one component instance."""
        return InstanceMetrics(
            published_immediate=self.published.labels(name, "immediate"),
            published_delayed=self.published.labels(name, "delayed"),
            fired=self.fired.labels(name),
            fire_lateness=self.fire_lateness.labels(name),
            pending=self.pending.labels(name),
            delivered=self.delivered.labels(name),
            acked=self.acked.labels(name),
            nacked=self.nacked.labels(name),
            forwarder=self.forwarder,
            cancelled=self.cancels.labels(name, "cancelled"),
            cancel_unknown=self.cancels.labels(name, "unknown"),
            expired=self.expired.labels(name),
            retried=self.retried.labels(name),
            dead_lettered=self.dead_lettered.labels(name, "published"),
            dropped=self.dead_lettered.labels(name, "dropped"),
            parked=self.parked.labels(name),
            lost=self.lost.labels(name),
            redis_errors=self.redis_errors.labels(name),
            subscriptions=self.subscriptions.labels(name),
            pending_by_topic=self.pending_by_topic,
            name=name,
            fire_loop_up=self.fire_loop_up,
            fire_loop_restarts=self.fire_loop_restarts,
            loop_restarts=self.loop_restarts,
            loops_down=self.loops_down,
            refused=self.refused.labels(name),
            pauses=self.pauses,
            time_controls=self.time_controls,
            prefix_cancelled=self.prefix_cancelled.labels(name),
        )


@dataclass(frozen=True)
class InstanceMetrics:
    """One instance's metric children (label lookups done once, not per message)."""

    published_immediate: Counter
    published_delayed: Counter
    fired: Counter
    fire_lateness: Histogram
    pending: Gauge
    delivered: Counter
    acked: Counter
    nacked: Counter
    cancelled: Counter
    cancel_unknown: Counter
    expired: Counter
    retried: Counter
    dead_lettered: Counter
    dropped: Counter
    parked: Counter
    lost: Counter
    redis_errors: Counter
    subscriptions: Gauge
    # The family, not a child: its topic label set changes with every refresh.
    pending_by_topic: Gauge
    name: str
    # Hand-offs to other pub/subs (families: the forwarder labels them by instance).
    forwarder: ForwarderMetrics | None = None
    topics_shown: set[str] = field(default_factory=set)
    # Liveness families (labelled by instance and shard or loop kind).
    fire_loop_up: Gauge | None = None
    fire_loop_restarts: Counter | None = None
    loop_restarts: Counter | None = None
    loops_down: Gauge | None = None
    # Publishes refused by admission control (admission.py).
    refused: Counter | None = None
    # schedulePause results (a family labelled by instance and result), scheduleIdPrefix cancels.
    pauses: Counter | None = None
    # scheduleTrigger / scheduleReschedule results (labelled by instance, op and result).
    time_controls: Counter | None = None
    prefix_cancelled: Counter | None = None

    def loop_state(self, loop: str) -> StateHook:
        """A liveness on_state hook for one loop of kind `loop`: counts its
        restarts and keeps `delayed_pubsub_loops_down` while it waits for one."""
        down = False

        def hook(up: bool, error: BaseException | None) -> None:
            nonlocal down
            if self.loops_down is None or self.loop_restarts is None:
                return
            if not up and not down:
                down = True
                self.loop_restarts.labels(self.name, loop).inc()
                self.loops_down.labels(self.name, loop).inc()
            elif up and down:
                down = False
                self.loops_down.labels(self.name, loop).dec()
            elif not up:
                self.loop_restarts.labels(self.name, loop).inc()

        return hook

    def drop_fire_loop(self, shard: int) -> None:
        """Remove the series of a shard's fire loop that was stopped (its instance closed)."""
        for family in (self.fire_loop_up, self.fire_loop_restarts):
            if family is not None:
                with contextlib.suppress(KeyError):
                    family.remove(self.name, str(shard))

    def fire_loop_state(self, shard: int, up: bool, error: BaseException | None) -> None:
        """The sharded engine's on_state hook: `delayed_pubsub_fire_loop_up` and its restarts."""
        if self.fire_loop_up is None or self.fire_loop_restarts is None:
            return
        self.fire_loop_up.labels(self.name, str(shard)).set(1 if up else 0)
        if not up:
            self.fire_loop_restarts.labels(self.name, str(shard)).inc()

    def set_pending_by_topic(self, counts: Mapping[str, int], top: int = 20) -> None:
        """Replace this instance's per-topic pending gauge: the `top` largest, the rest summed as (other)."""
        ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
        shown = dict(ranked[:top])
        other = sum(n for _, n in ranked[top:])
        if other:
            shown[OTHER_TOPICS] = other
        for topic in self.topics_shown - shown.keys():
            self.pending_by_topic.remove(self.name, topic)
        for topic, n in shown.items():
            self.pending_by_topic.labels(self.name, topic).set(n)
        self.topics_shown.clear()
        self.topics_shown.update(shown)

    def on_fire(self, report: FireReport) -> None:
        """The delay engine's on_batch hook."""
        self.pending.set(report.pending)
        if report.fired:
            self.fired.inc(report.fired)
            self.fire_lateness.observe(max(0, report.max_lateness_ms) / 1000)
        if report.parked:
            self.parked.inc(report.parked)
        if report.lost:
            self.lost.inc(report.lost)


@dataclass(frozen=True)
class ForwarderMetrics:
    """Hand-offs of due messages to another Dapr pub/sub (targetPubsub), labelled by instance."""

    handed_off: Counter
    # reason: unavailable (sidecar unreachable), unknown_target, refused (by daprd or the target)
    failures: Counter
    dead_lettered: Counter
    expired: Counter
    # Entries in the outbox: fired, not yet accepted by the sidecar (labelled per outbox).
    pending: Gauge

    @classmethod
    def register(cls, registry: CollectorRegistry) -> ForwarderMetrics:
        f = _Families(registry)
        return cls(
            handed_off=f.counter(
                "delayed_pubsub_handed_off_messages",
                "Due messages published through the sidecar to their targetPubsub",
            ),
            failures=f.counter(
                "delayed_pubsub_handoff_failures",
                "Failed hand-off attempts (retried); reason=unavailable (not counted as an attempt), "
                "timeout, unknown_target or refused",
                "reason",
            ),
            dead_lettered=f.counter(
                "delayed_pubsub_handoff_dead_lettered_messages",
                "Hand-offs given up after the last attempt and written to deadLetterTopic",
            ),
            expired=f.counter(
                "delayed_pubsub_handoff_expired_messages",
                "Messages bound for a targetPubsub that expired (ttl) before their hand-off",
            ),
            pending=f.gauge(
                "delayed_pubsub_handoff_pending",
                "Fired messages waiting in the outbox for the sidecar to accept them (sidecar down, "
                "target refusing, or in flight); one series per outbox (instance, or instance~shard)",
            ),
        )
