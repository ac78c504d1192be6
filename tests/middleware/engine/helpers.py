"""Plain helpers of the engine tests: envelopes as the planner builds them, the scripts called
alone (a replica that stops between two steps), and what a user reads back from Redis."""

from __future__ import annotations

import json
from typing import Any, cast

import pytest
import redis

from delayed_middleware import lua_scripts
from delayed_middleware.engine import DelayEngine
from delayed_middleware.engine.two_phase import TwoPhaseFire
from delayed_middleware.entry import decode_entry
from delayed_middleware.envelope import RECURRING, Envelope, encode_envelope
from delayed_middleware.history import HistoryRecord, decode_record
from delayed_middleware.keys import EngineKeys, delayed_topic
from tests.redis_server import stream_entries

T0 = 1_800_000_000_000
KEYS = EngineKeys.for_topic(delayed_topic("app"))


def engine_libraries(*names: str) -> str:
    """Library files (index.lua, common.lua, ...) run on their own, as a test's script: preceded
    by the locals an engine script names at its top (the engine's KEYS, ARGV[1] the bucket prefix)."""
    prelude = (
        "local STREAM, INDEX_TOP, IDS, BUCKET_SEQ, PENDING, HISTORY, PARKED, CALLS, REFILL_SET, OUTBOX ="
        " KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8], KEYS[9], KEYS[10]\n"
        "local MOVED = KEYS[#KEYS]\nlocal BUCKET_PREFIX = ARGV[1]\n"
    )
    return prelude + "\n".join(lua_scripts.load(n) for n in names)


def env(n: int, due: int, topic: str = "orders", sid: str = "", **kw: object) -> Envelope:
    """A one-shot message `{"n": n}` due at `due`, with a scheduleId when `sid` is given."""
    return Envelope(
        id=sid or f"m{n}",
        topic=topic,
        due_ms=due,
        published_at_ms=T0,
        message=f'{{"n":{n}}}'.encode(),
        metadata={"k": f"v{n}", "cloudevent.id": str(n)},
        schedule_id=sid,
        **kw,  # type: ignore[arg-type]
    )


def every(e: Envelope, after: int) -> int | None:
    """Test-only recurrence: `@test <ms>` fires at published_at + k * interval."""
    interval = int(e.schedule.split()[1])
    return e.published_at_ms + ((after - e.published_at_ms) // interval + 1) * interval


def recurring(n: int, interval: int, sid: str = "", topic: str = "orders", **kw: object) -> Envelope:
    """A recurring `@test <interval>` schedule (successors from `every`), first due at T0 + interval."""
    return Envelope(
        id=sid,
        topic=topic,
        due_ms=T0 + interval,
        published_at_ms=T0,
        message=f'{{"n":{n}}}'.encode(),
        metadata={"k": f"v{n}"},
        schedule_id=sid,
        kind=RECURRING,
        schedule=f"@test {interval}",
        **kw,  # type: ignore[arg-type]
    )


def named_recurring(sid: str, due: int, published: int, interval: int, n: int) -> Envelope:
    """A recurring `@test <interval>` schedule with its due and acceptance times given."""
    return Envelope(
        id=sid,
        topic="orders",
        due_ms=due,
        published_at_ms=published,
        message=f'{{"n":{n}}}'.encode(),
        schedule_id=sid,
        kind=RECURRING,
        schedule=f"@test {interval}",
    )


def every_env(interval: int, sid: str = "", published: int = T0, **kw: object) -> Envelope:
    """A real @every envelope, as plan.py builds it: the interval rides in every_ms."""
    return Envelope(
        id=sid,
        topic="orders",
        due_ms=published + interval,
        published_at_ms=published,
        message=b'{"n":1}',
        schedule_id=sid,
        kind=RECURRING,
        schedule=f"@every {interval}ms",
        every_ms=interval,
        **kw,  # type: ignore[arg-type]
    )


def target(redis_client: redis.Redis, topic: str = "orders") -> list[tuple[str, dict[bytes, bytes]]]:
    """Every entry of a stream (a target topic, or the delayed topic itself)."""
    return stream_entries(redis_client, topic)


def payloads(client: redis.Redis, topic: str = "orders") -> list[int]:
    """The `n` of each message delivered to `topic`, in stream order."""
    return [json.loads(decode_entry(f).data)["n"] for _, f in target(client, topic)]


def history(client: redis.Redis, event: str = "") -> list[HistoryRecord]:
    """The lifecycle history in order; only the records of `event` when one is given."""
    records = [decode_record(i, f) for i, f in stream_entries(client, KEYS.history)]
    return [r for r in records if r.event == event] if event else records


async def drain(engine: DelayEngine) -> None:
    """Fire steps until one fires nothing."""
    while (await engine.fire_due())[0]:
        pass


def index_buckets(client: redis.Redis) -> list[tuple[float, list[tuple[bytes, float]]]]:
    """The due index as (bucket start, its members with their due), in bucket order."""
    out = []
    tops = cast("list[tuple[bytes, float]]", client.zrange(KEYS.due, 0, -1, withscores=True))
    for b, start in tops:
        key = f"{KEYS.buckets}{b.decode()}"
        out.append((start, cast("list[tuple[bytes, float]]", client.zrange(key, 0, -1, withscores=True))))
    return out


def raw_schedule(client: redis.Redis, e: Envelope, now: int, nxt: int | str) -> None:
    """The SCHEDULE script alone, with the next due time a replica computed (or '-')."""
    client.eval(
        lua_scripts.SCHEDULE, len(KEYS.script_keys), *KEYS.script_keys,
        *(KEYS.buckets, "nowake", now, 100, 120_000, 1, f"tok-{e.schedule_id}", 1),
        *(encode_envelope(e), e.due_ms, e.schedule_id, e.kind, e.topic, e.size, e.schedule, nxt, "-"),
    )  # fmt: skip


def bare_fire(client: redis.Redis, now: int) -> list[object]:
    """The FIRE script alone: a replica that fires and dies before its REFILL step."""
    args = (KEYS.buckets, now, 500, 2000, 1 << 20, "", "", 100)
    return list(client.eval(lua_scripts.FIRE, len(KEYS.script_keys), *KEYS.script_keys, *args))


def two_phase_engines(module: Any, monkeypatch: pytest.MonkeyPatch) -> list[DelayEngine]:
    """Makes every DelayEngine the test `module` builds take the two-phase fire path (passed to its
    constructor as `fire_path`), whatever its config says; returns the engines built, as they are."""
    built: list[DelayEngine] = []

    class TwoPhaseEngine(DelayEngine):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.setdefault("fire_path", TwoPhaseFire)
            super().__init__(*args, **kwargs)
            built.append(self)

    monkeypatch.setattr(module, "DelayEngine", TwoPhaseEngine)
    return built
