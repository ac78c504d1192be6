"""DelayEngine: one shard's engine, the concerns of this package behind today's API.

The class adds nothing of its own: each concern lives in its module (schedule,
cancel, fire, two_phase, refill, compaction, retention, loop, pause) over the shared
state of engine.core and the typed scripts of engine.scripts. The facade keeps
callers (the component, the operator CLI, tests and benches) unchanged.
"""

from __future__ import annotations

from delayed_middleware.engine.loop import Running
from delayed_middleware.engine.pause import Pausing
from delayed_middleware.engine.schedule import Scheduling


class DelayEngine(Scheduling, Running, Pausing):
    """Schedules envelopes on one delayed topic and fires them when due.

    DelayEngine(client, keys, clock, *, trim=None, config=EngineConfig(),
    on_batch=None, recurrence=None, listen_client=None, pubsub_name="",
    fault=None, on_listener_state=None):

    - client: a RedisClient (a node's or a Cluster's redis.asyncio client);
    - keys: the shard's EngineKeys; clock: the injected Clock;
    - trim: the target topics' trim (maxLenApprox / streamTTL), none by default;
    - config: EngineConfig (batch bounds, sleeps, history, two_phase...);
    - on_batch: hears a FireReport per fire call that fired or parked;
    - recurrence: the next fire time of a cron envelope (needed to schedule one);
    - listen_client: the client the wake listener parks a connection on (default: client);
    - pubsub_name: the component whose trim applies ('' = to every message);
    - fault: test hook awaited at each two-phase step; on_listener_state: the listener's state hook.
    """
