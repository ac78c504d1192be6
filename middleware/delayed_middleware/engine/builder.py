"""The one place that puts a shard's engine together: its state, and each part given what it needs.

Each part receives, in its constructor, the shard's state (engine.core.
ShardState: clients, keys, clock, settings, the script layer) and the other
parts it calls; no part reaches any other. The fire path (FIRE on a single
node, CLAIM/APPEND/RELEASE on Redis Cluster) is chosen here, once, from
EngineConfig.two_phase, unless the caller passes one in (tests run one
promise through both paths on a single node).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypedDict

from delayed_middleware.client import RedisClient
from delayed_middleware.clock import Clock
from delayed_middleware.engine.cancel import Canceller
from delayed_middleware.engine.compaction import Compactor
from delayed_middleware.engine.config import DEFAULT_CONFIG, EngineConfig, FireReport, Recurrence
from delayed_middleware.engine.core import ShardState
from delayed_middleware.engine.fire import FirePath, Firer, SingleNodeFire
from delayed_middleware.engine.loop import FireLoop
from delayed_middleware.engine.pause import Pauser
from delayed_middleware.engine.recovery import Recoverer
from delayed_middleware.engine.refill import Refiller
from delayed_middleware.engine.replies import Budget
from delayed_middleware.engine.retention import HistoryTrimmer
from delayed_middleware.engine.schedule import Scheduler
from delayed_middleware.engine.script_calls import EngineScripts
from delayed_middleware.engine.timecontrol import TimeController
from delayed_middleware.engine.two_phase import TwoPhaseFire
from delayed_middleware.entry import Trim
from delayed_middleware.keys import EngineKeys
from delayed_middleware.liveness import StateHook

if TYPE_CHECKING:
    # typing.Unpack is 3.12+; only the type checker reads it (the annotations are strings).
    from typing_extensions import Unpack

# Makes a fire path for a shard's state: SingleNodeFire or TwoPhaseFire (the classes themselves).
FirePathFactory = Callable[[ShardState], FirePath]


@dataclass(frozen=True)
class EngineParts:
    """One shard's engine: its state and its parts, each built over that state."""

    state: ShardState
    canceller: Canceller
    scheduler: Scheduler
    refiller: Refiller
    compactor: Compactor
    firer: Firer
    recoverer: Recoverer
    trimmer: HistoryTrimmer
    loop: FireLoop
    pauser: Pauser
    timecontrol: TimeController


class EngineOptions(TypedDict, total=False):
    """build_engine's (and DelayEngine's) keyword arguments, each optional; DelayEngine's docstring says what each is."""

    trim: Trim | None
    config: EngineConfig
    on_batch: Callable[[FireReport], None] | None
    recurrence: Recurrence | None
    listen_client: RedisClient | None
    pubsub_name: str
    fault: Callable[[str], Awaitable[None]] | None
    on_listener_state: StateHook | None
    fire_path: FirePathFactory | None


def build_engine(
    client: RedisClient, keys: EngineKeys, clock: Clock, **options: Unpack[EngineOptions]
) -> EngineParts:
    """One shard's parts (the arguments as DelayEngine's); `fire_path` None: chosen by config.two_phase."""
    config = options.get("config", DEFAULT_CONFIG)
    listen_client = options.get("listen_client")
    state = ShardState(
        redis=client,
        listen_redis=listen_client if listen_client is not None else client,
        keys=keys,
        clock=clock,
        config=config,
        scripts=EngineScripts(client, keys, two_phase=config.two_phase),
        budget=Budget(config.batch_size, config.batch_entries, config.batch_bytes, config.fire_budget_us),
        trim=options.get("trim") or Trim(),
        on_batch=options.get("on_batch"),
        recurrence=options.get("recurrence"),
        pubsub_name=options.get("pubsub_name", ""),
        fault=options.get("fault"),
    )
    fire_path = options.get("fire_path")
    if fire_path is None:
        fire_path = TwoPhaseFire if config.two_phase else SingleNodeFire
    canceller = Canceller(state)
    refiller = Refiller(state)
    compactor = Compactor(state)
    firer = Firer(state, fire_path(state), refiller, compactor)
    # A single node appends a triggered schedule's extra occurrence in TIMECONTROL itself;
    # the two-phase path (Cluster: the target is in another slot) APPENDs it as a second step.
    two_phase = isinstance(firer.path, TwoPhaseFire)
    recoverer = Recoverer(state)
    trimmer = HistoryTrimmer(state)
    return EngineParts(
        state=state,
        canceller=canceller,
        scheduler=Scheduler(state, canceller),
        refiller=refiller,
        compactor=compactor,
        firer=firer,
        recoverer=recoverer,
        trimmer=trimmer,
        loop=FireLoop(state, firer, trimmer, recoverer, on_listener_state=options.get("on_listener_state")),
        pauser=Pauser(state, canceller),
        # A triggered schedule's scheduleSource is read as the Cluster fire reads it (another slot).
        timecontrol=TimeController(state, TwoPhaseFire(state).sample, two_phase=two_phase),
    )
