"""The Lua scripts: every state change of a delayed message (the broker's own are in delayed_pubsub.lua).

Each script lives in its own file under `lua/`, opening with its KEYS/ARGV
layout; shared code (the due index, the DelayedMessage decoder, history
records) sits in library files pulled in by `--!include NAME` lines, resolved
once here at import. Callers register the text with redis-py
(`register_script`), which runs it by SHA (EVALSHA) and loads it on NOSCRIPT.

Why scripts: each runs atomically inside Redis, which is what makes firing
exactly once: a message leaves the due index in the same atomic step that
appends it to its target topic, so a second replica, a retry after a crash,
or a replay of the same batch finds it gone and writes nothing.

Key layout: see delayed_middleware.keys.EngineKeys.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import cache
from importlib.resources import files
from typing import Final

# Read as package resources, not as paths beside this file: on a Spark cluster the
# package arrives as a zip (spark.submit.pyFiles, stats --master spark://...), where
# there is no directory to open.
LUA_DIR: Final = files("delayed_middleware") / "lua"
_INCLUDE = re.compile(r"^--!include (\S+)$", re.MULTILINE)


@cache
def load(name: str) -> str:
    """The text of lua/NAME with its includes resolved (each library once)."""
    return resolve(name, lambda file: (LUA_DIR / file).read_text(encoding="utf-8"))


def resolve(name: str, read: Callable[[str], str]) -> str:
    """Script `name` with its `--!include` lines resolved, each library once, files read by `read`
    (a test reads an earlier release's from git)."""
    seen: set[str] = set()

    def expand(file: str) -> str:
        def include(m: re.Match[str]) -> str:
            lib = m.group(1)
            if lib in seen:
                return ""
            seen.add(lib)
            return expand(lib)

        return _INCLUDE.sub(include, read(file))

    return expand(name)


# Keys added to the metadata of every fired message (the public contract).
SCHEDULER: Final = "scheduler"
SCHEDULE_NEXT: Final = "scheduleNext"
PURGE: Final = "purge"

SCHEDULE: Final = load("schedule.lua")
FIRE: Final = load("fire.lua")
CANCEL: Final = load("cancel.lua")
REFILL: Final = load("refill.lua")
# schedulePause: hold or resume one pending message or schedule (engine/pause.py).
PAUSE: Final = load("pause.lua")
# scheduleTrigger / scheduleReschedule: fire now, or move, one entry (engine/timecontrol.py).
TIMECONTROL: Final = load("timecontrol.lua")
# Re-homes long-waiting envelopes to the delayed topic's tail (frees sparse stream nodes).
COMPACT: Final = load("compact.lua")
# Puts back in the due index the pending envelopes no index entry refers to (engine/recovery.py).
RECOVER: Final = load("recover.lua")
# Dead letters moved back (`retry-dead`, the dashboard): each exactly once, in one
# script where the dead-letter topic and the destination share a slot, else in two phases.
RETRY_DEAD: Final = load("retry_dead.lua")
RETRY_DEAD_APPEND: Final = load("retry_dead_append.lua")
# The forwarder's hold on the outbox entries it hands off: kept alive, or found lost.
OUTBOX_HOLD: Final = load("outbox_hold.lua")

# The two-phase fire of Redis Cluster (see engine.DelayEngine): the same steps
# as FIRE, split where the target topics leave the shard's slot.
CLAIM: Final = load("claim.lua")
APPEND: Final = load("append.lua")
RELEASE: Final = load("release.lua")
UNCANCEL: Final = load("uncancel.lua")
# The history's by-id index: the other writers' append, and the sweep after trimming.
HIST_APPEND: Final = load("hist_append.lua")
HIST_SWEEP: Final = load("hist_sweep.lua")
HIST_WALK: Final = load("hist_walk.lua")
# The storage format of a shard (storage_format.py), settled at Init.
FORMAT: Final = load("format.lua")
