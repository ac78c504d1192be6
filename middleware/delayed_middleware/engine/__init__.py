"""The delay engine: durable scheduling and exactly-once, failure-atomic firing on Redis.

State lives only in Redis (see keys.EngineKeys): the component keeps nothing
per message in memory. Firing never polls on a fixed tick: the loop sleeps
until the earliest due time and is woken early through a pub/sub channel when
any replica schedules an earlier one. Every state change is one Lua script
(lua/*.lua) that also appends its lifecycle record (history.py) in the same
atomic step.

Where to look:

- a fire decision (due? expired? gone? parked? recurring successor known?):
  `lua/batch.lua` `decide`, run by FIRE (single node) and CLAIM (Cluster);
  `fire.py` `Firing._fire_once` picks which, `Firing.fire_due` runs a step.
- a cancel: `lua/cancel.lua` (withdraw, `cancelled` record), called by
  `cancel.py` `Cancelling.cancel_many`, which also stops an occurrence in flight
  on Cluster (`_stop_in_flight`: the fire marker).
- a shard id: `keys.shard_index` (a scheduleId's home shard) and
  `sharded.py` `ShardedEngine.schedule` (`<stream id>@<shard>` for envelopes
  without one, written by `keys.shard_id`); `ShardedEngine._locate` reads it
  back with `keys.split_shard_id`.

Modules, each stating its invariants and crash points:

- `scripts.py`: the typed layer over the Lua scripts (one method per
  script); nothing else packs KEYS/ARGV.
- `replies.py`: what the scripts take and answer (one result dataclass per
  script, and the readers of their raw replies); nothing else reads a reply.
- `config.py`: EngineConfig, FireReport, batch constants.
- `core.py`: one shard's state and the clock/skew helpers.
- `schedule.py`: SCHEDULE in chunks, call tokens, replaces.
- `coalesce.py`: concurrent SCHEDULE calls of one shard in one script call,
  each with its own token and answer.
- `cancel.py`: CANCEL, in-flight fire markers, UNCANCEL.
- `fire.py`: the single-node FIRE and `fire_due`.
- `two_phase.py`: CLAIM / APPEND / RELEASE (Redis Cluster), scheduleSource sampling.
- `refill.py`: cron successors (REFILL), the refill sweep.
- `compaction.py`: re-homing long-waiting envelopes (COMPACT).
- `recovery.py`: re-indexing envelopes no index entry refers to (RECOVER), once per run.
- `retention.py`: history trimming by age.
- `loop.py`: the run loop and the wake listener.
- `delay_engine.py`: DelayEngine, the facade over the above.
- `sharded.py`: ShardedEngine, one DelayEngine per shard stream.

Replication (Sentinel and Cluster failover): Redis replicates asynchronously.
Writes a master acknowledged but had not yet sent to the replica that gets
promoted are lost in a failover, for the engine as for any Redis user: a lost
SCHEDULE loses that publish; a lost FIRE is undone whole, so it fires again;
for Cluster see two_phase.py. The window is the replication lag, normally
milliseconds (`WAIT` is not used: a round trip to a replica per call).
"""

from delayed_middleware.engine.config import (
    CANCEL_BATCH,
    MARKER_REASON,
    REFILL_BATCH,
    SPREAD_MEMORY,
    EngineConfig,
    FireReport,
    Recurrence,
)
from delayed_middleware.engine.delay_engine import DelayEngine
from delayed_middleware.engine.sharded import ShardedEngine

__all__ = [
    "CANCEL_BATCH",
    "MARKER_REASON",
    "REFILL_BATCH",
    "SPREAD_MEMORY",
    "DelayEngine",
    "EngineConfig",
    "FireReport",
    "Recurrence",
    "ShardedEngine",
]
