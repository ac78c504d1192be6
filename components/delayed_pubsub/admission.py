"""Admission control: a bound on the publishes waiting or running in the component process.

Past the bound a publish is refused with RESOURCE_EXHAUSTED instead of
queueing. grpc.aio itself never refuses (its only limit, maximum_concurrent_rpcs,
would also refuse Ping, health checks and the PullMessages streams), and it
takes new calls from gRPC's core one per event-loop pass: past what the process
can serve, calls wait inside gRPC's core, unseen by any Python code, each a
little longer with every new caller, until clients time out or cancel, with
nothing said about why. A refusal is cheap, stores nothing, names the bound, and
tells daprd's resiliency policy and the SDKs' retries to back off.

What is bounded is the number of calls gRPC holds for this process (streams
started and not finished on its connections, read from gRPC's channelz
counters), less the open streams:
nearly all of them publishes under overload, since only publishes come in
numbers. Past the bound a publish is refused with a probability that grows
with the excess (random early detection), so that some work is still admitted
while callers that do not back off keep the queue full. A publish is also
refused when its own instance already runs `limit` publishes (counted by the
servicer as the call starts, in the call's own task).
Only Publish and BulkPublish are refused; Init, Features, Ping, the health
service and the PullMessages streams never are, so probes keep their answers
and delivery keeps draining.
"""

from __future__ import annotations

import json
import logging
import random
import time
from collections.abc import Callable
from pathlib import Path

from grpc._cython import cygrpc  # type: ignore[attr-defined]  # channelz: no public Python API
from prometheus_client import Counter

log = logging.getLogger(__name__)

# The metadata key that sets the bound (metadata.yaml).
SETTING = "maxInflightPublishes"

# How old the count of calls held by gRPC may be: reading it costs ~0.35 ms
# (gRPC renders channelz as JSON), so at most 20 reads a second, under 1 % of a core.
QUEUE_SAMPLE_S = 0.05
# While the last reading was at most half the bound: read again only this late, after this many calls.
QUIET_SAMPLE_S = 0.2
QUIET_CALLS = 16


class Admission:
    """The publishes in flight on one instance, and its bound (maxInflightPublishes).

    A bulk counts as one call, whatever its size. Not a semaphore: nobody
    waits for a slot, a call past the bound is refused.
    """

    __slots__ = ("_instance", "_refused", "held", "in_flight", "limit")

    def __init__(self, limit: int, instance: str, refused: Counter | None = None) -> None:
        self.limit = limit
        self.in_flight = 0
        # Calls held for the process at the last refusal, for its message.
        self.held = 0
        self._instance = instance
        self._refused = refused

    def try_enter(self, held: int, draw: Callable[[], float] = random.random) -> bool:
        """Take a slot (True), or count a refusal (False).

        `held` is the number of calls gRPC holds for the process, this one
        included. Refused: when `limit` publishes of this instance run, or,
        with a probability growing from 0 at `limit` calls held to 1 at twice
        that, when more than `limit` are held.
        """
        excess = held - self.limit
        if self.in_flight >= self.limit or (excess > 0 and draw() * self.limit < excess):
            self.held = held
            if self._refused is not None:
                self._refused.inc()
            return False
        self.in_flight += 1
        return True

    def leave(self, _: object = None) -> None:
        """Give a slot back (a done callback of the call's task)."""
        self.in_flight -= 1

    def refusal(self) -> str:
        """What a refused caller is told: the bound, its setting, and that nothing was stored."""
        held = max(self.held, self.in_flight)
        return (
            f"component instance {self._instance!r} is overloaded: {held} calls in flight, past its "
            f"bound of {self.limit} ({SETTING}); nothing was stored: retry with backoff, or raise {SETTING}"
        )


class HeldCalls:
    """How many calls gRPC holds for one server: started and not finished, whether
    running in Python or still waiting in gRPC's core for grpc.aio to take them.

    Read from gRPC's channelz counters (on by default; the server must have
    been started, listening on `socket_path`), at most every QUEUE_SAMPLE_S;
    while the last reading was well below the bound, only every
    QUIET_SAMPLE_S and QUIET_CALLS calls: a queue builds only when calls come
    fast, and publishes at an ordinary pace should not pay for readings. 0
    when channelz cannot be read (logged once): then only the per-instance
    count bounds the publishes.
    """

    def __init__(self, socket_path: Path, sample_s: float = QUEUE_SAMPLE_S) -> None:
        # channelz names the listener "chttp2 listener unix:" + the path with any number of slashes.
        self._path = str(socket_path).lstrip("/")
        self._sample_s = sample_s
        self._server_id: int | None = None
        self._held = 0
        self._read_at = float("-inf")
        self._calls = QUIET_CALLS
        self._broken = False

    def count(self, now: float, quiet: int) -> int:
        """Calls held, as read at most `sample_s` before `now` (a loop.time()) when the last
        reading was above `quiet`, else at most QUIET_SAMPLE_S before; for one more call."""
        self._calls += 1
        age = now - self._read_at
        if (
            age >= self._sample_s
            and (self._held > quiet or (age >= QUIET_SAMPLE_S and self._calls >= QUIET_CALLS))
            and not self._broken
        ):
            self._read_at = now
            self._calls = 0
            try:
                self._held = self._read()
            except Exception as e:  # a private API: never let it fail a publish
                self._broken = True
                self._held = 0
                log.warning(
                    "admission control: gRPC's channelz cannot be read (%r); bounding per instance only", e
                )
        return self._held

    def _read(self) -> int:
        # The sockets' stream counters, not the server's call counters: a call that gRPC's
        # core cancels while it waits to be taken counts as neither succeeded nor failed
        # among the server's calls (the count would only grow), but as a failed stream.
        if self._server_id is None:
            self._server_id = self._find()
        held = 0
        start = 0
        while True:
            page = json.loads(cygrpc.channelz_get_server_sockets(self._server_id, start, 100))
            refs = page.get("socketRef", ())
            for ref in refs:
                start = int(ref["socketId"]) + 1
                data = json.loads(cygrpc.channelz_get_socket(start - 1))["socket"].get("data", {})
                held += int(data.get("streamsStarted", 0))
                held -= int(data.get("streamsSucceeded", 0)) + int(data.get("streamsFailed", 0))
            if page.get("end", True) or not refs:
                return held

    def _find(self) -> int:
        start = 0
        while True:
            page = json.loads(cygrpc.channelz_get_servers(start))
            for server in page.get("server", ()):
                names = (s.get("name", "") for s in server.get("listenSocket", ()))
                if any(name.partition("unix:")[2].lstrip("/") == self._path for name in names):
                    return int(server["ref"]["serverId"])
                start = int(server["ref"]["serverId"]) + 1
            if page.get("end", True) or not page.get("server"):
                raise LookupError(f"no gRPC server listening on /{self._path} in channelz")


class AdmissionControl:
    """Admission for one server: the calls gRPC holds for it, less its open streams, against
    each instance's bound. Checked by the servicer in the publish's own task: no interceptor
    runs for every call of every method.
    """

    __slots__ = ("_held", "streams")

    def __init__(self, held: HeldCalls | None = None) -> None:
        self._held = held
        # Streams running (PullMessages, health Watch, reflection): held by gRPC, but no queue.
        self.streams = 0

    def admit(self, admission: Admission) -> bool:
        """Take a slot of `admission` for one publish (True; give it back with admission.leave()),
        or count a refusal (False: answer it with admission.refusal())."""
        if self._held is None:
            return admission.try_enter(0)
        streams = self.streams
        held = self._held.count(time.monotonic(), admission.limit // 2 + streams) - streams
        return admission.try_enter(held)

    def stream_started(self) -> None:
        """One more stream runs."""
        self.streams += 1

    def stream_ended(self, _: object = None) -> None:
        """A stream ended (also a done callback of its task)."""
        self.streams -= 1
