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
  the fire path (`fire.py` `SingleNodeFire`, `two_phase.py` `TwoPhaseFire`) is
  chosen once by `builder.py`; `fire.py` `Firer.fire_due` runs a step.
- a cancel: `lua/cancel.lua` (withdraw, `cancelled` record), called by
  `cancel.py` `Canceller.cancel_many`, which also stops an occurrence in flight
  on Cluster (`stop_in_flight`: the fire marker).
- a shard id: `keys.shard_index` (a scheduleId's home shard) and
  `sharded.py` `ShardedEngine.schedule` (`<stream id>@<shard>` for envelopes
  without one, written by `keys.shard_id`); `ShardedEngine._locate` reads it
  back with `keys.split_shard_id`.

Each part is a class given, in its constructor, the shard's state (`core.py`
ShardState) and the other parts it calls; `builder.py` builds them all.
Modules, each stating its invariants and crash points:

- `script_calls.py`: the typed layer over the Lua scripts (one method per
  script); nothing else packs KEYS/ARGV.
- `replies.py`: what the scripts take and answer (one result dataclass per
  script, and the readers of their raw replies); nothing else reads a reply.
- `config.py`: EngineConfig, FireReport, batch constants.
- `core.py`: ShardState, one shard's state (clients, keys, clock, settings,
  the script layer, the measured skew), and the helpers every part shares
  (clock/skew, fire reports, marker messages).
- `schedule.py`: SCHEDULE in chunks, call tokens, replaces.
- `coalesce.py`: concurrent SCHEDULE calls of one shard in one script call,
  each with its own token and answer.
- `cancel.py`: CANCEL, in-flight fire markers, UNCANCEL.
- `fire.py`: the fire path's protocol, the single-node FIRE path, and `fire_due`.
- `two_phase.py`: the Cluster fire path: CLAIM / APPEND / RELEASE, scheduleSource sampling.
- `refill.py`: cron successors (REFILL), the refill sweep.
- `compaction.py`: re-homing long-waiting envelopes (COMPACT).
- `recovery.py`: re-indexing envelopes no index entry refers to (RECOVER), once per run.
- `retention.py`: history trimming by age.
- `loop.py`: the run loop and the wake listener.
- `pause.py`: pause, resume (PAUSE) and cancel by id prefix.
- `builder.py`: builds one shard's parts, choosing its fire path once.
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
