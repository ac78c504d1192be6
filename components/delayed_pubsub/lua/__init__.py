"""The broker's own Lua scripts: a subscription's atomic steps on its topic and retry keys.

Each script is a file here, opening with its KEYS/ARGV layout and its crash points, as
the delay engine's scripts in delayed_middleware/lua do. Callers pass the text to EVAL.
These scripts share no library, so `--!include` lines are refused, not resolved: a
script that needs one belongs with the engine's.
"""

from __future__ import annotations

from importlib.resources import files
from typing import Final

# Read as package resources, not as paths beside this file: the package may arrive as
# a zip (a Spark cluster's spark.submit.pyFiles), where there is no directory to open.
LUA_DIR: Final = files(__name__)


def load(name: str) -> str:
    """The text of NAME in this folder."""
    text = (LUA_DIR / name).read_text(encoding="utf-8")
    if "--!include" in text:
        raise ValueError(f"{name}: the broker's scripts take no --!include")
    return text


# Removes a closing subscription's consumer only if it holds nothing.
DELETE_IDLE_CONSUMER: Final = load("delete_idle_consumer.lua")
# Conditional redelivery (reclaim pass, retry poller) and a nack's hold, each on the topic key alone.
CLAIM_UNCHANGED: Final = load("claim_unchanged.lua")
NACK_HOLD: Final = load("nack_hold.lua")
# A closing stream's buffered, never-sent entries, given back at the count they had before.
GIVE_BACK: Final = load("give_back.lua")
# A retry record with the delivery count it is about, and the taking of due records.
RETRY_RECORD: Final = load("retry_record.lua")
RETRY_TAKE: Final = load("retry_take.lua")
# Counts an older version's taker left without their records, removed a few at a time.
RETRY_SWEEP: Final = load("retry_sweep.lua")
