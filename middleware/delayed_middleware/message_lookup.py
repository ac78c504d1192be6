"""The Inspector's lookup of one message, wherever it waits: by scheduleId, envelope id, retry or outbox id."""

from __future__ import annotations

from typing import Any

from delayed_middleware.envelope import EnvelopeDecodeError, decode_envelope
from delayed_middleware.errors import InvalidArgumentError
from delayed_middleware.handoff_reader import HandoffReader
from delayed_middleware.history_reader import HistoryReader
from delayed_middleware.inspection import MessageInfo, Progress, Scope, shown
from delayed_middleware.keys import is_stream_id, shard_index, split_shard_id
from delayed_middleware.pending_reader import PendingReader, parse_ref
from delayed_middleware.retry_reader import RetryReader
from delayed_middleware.stream_walk import public_id


class MessageLookup:
    """One message of one app with its history: on the delayed topic (any shard), waiting for a
    retry, or waiting in an outbox; each place read by the reader passed in."""

    def __init__(
        self,
        scope: Scope,
        pending: PendingReader,
        retries: RetryReader,
        handoffs: HandoffReader,
        history: HistoryReader,
    ) -> None:
        self._scope = scope
        self._redis = scope.redis
        self._pending = pending
        self._retries = retries
        self._handoffs = handoffs
        self._history = history

    async def get(self, id: str, progress: Progress | None = None) -> MessageInfo | None:
        """One message by scheduleId or envelope id (its id on the delayed topic, `<id>@<shard>` with
        several shards); None if not there.

        InvalidArgumentError when a bare stream id names envelopes on several shards.
        """
        info = await self._waiting(id, strict=True)
        if info is None:
            # Last resort: an envelope whose own id field is `id` (an
            # envelope may carry one) or a parked one whose ids entry is gone.
            info = await self._find(id, progress)
        return await self._with_history(info)

    async def get_bounded(self, id: str) -> MessageInfo | None:
        """As `get` finds it, less its last resort (a scan of the whole delayed topic), so that a
        page request never costs O(pending); a bare stream id on several shards names none."""
        return await self._with_history(await self._waiting(id, strict=False))

    async def _with_history(self, info: MessageInfo | None) -> MessageInfo | None:
        if info is None:
            return None
        records = await self._history.message_history(info)
        return MessageInfo(info.message, info.envelope, info.state, info.parked_reason, tuple(records))

    async def _waiting(self, id: str, *, strict: bool) -> MessageInfo | None:
        """The message `id` names on the delayed topic, waiting for a retry, or in an outbox."""
        info = await self._delayed(id, strict=strict)
        if info is None and is_stream_id(id):
            info = await self._retries.info(id)
        if info is None:
            info = await self._handoffs.info(id)
        return info

    async def _delayed(self, id: str, *, strict: bool) -> MessageInfo | None:
        """The envelope `id` names on the delayed topic: `<id>@<shard>`, a key of an ids hash,
        or a bare stream id found on exactly one shard (on several: InvalidArgumentError when
        `strict`, else None)."""
        shards = len(self._scope.shards)
        named = split_shard_id(id, shards)
        if named is not None:
            return await self._load(*named)
        info = await self._by_key(id)
        if info is None and is_stream_id(id):
            found = [i for i in [await self._load(n, id) for n in range(shards)] if i]
            if len(found) > 1 and strict:
                raise InvalidArgumentError(
                    "id", id, f"on {len(found)} shards; name one as {id}@<shard> (see `pending`)"
                )
            info = found[0] if len(found) == 1 else None
        return info

    async def _by_key(self, key: str) -> MessageInfo | None:
        """The envelope a scheduleId (or a recurring envelope's id) names in an ids hash.

        Its home shard (keys.shard_index, where ShardedEngine puts it) first,
        then the others: a bare recurring envelope id lives where it was spread.
        """
        shards = len(self._scope.shards)
        home = shard_index(key, shards)
        for shard in [home, *(n for n in range(shards) if n != home)]:
            ref = await self._redis.hget(self._scope.shards[shard].ids, key)
            if ref is not None:
                return await self._load(shard, parse_ref(ref)[0])
        return None

    async def _load(self, shard: int, stream_id: str) -> MessageInfo | None:
        # Compaction may have re-homed the envelope: the moved hash says where it is now.
        keys = self._scope.shards[shard]
        at = await self._redis.hget(keys.moved, stream_id)
        stored = stream_id if at is None else shown(at)
        rows: Any = await self._redis.xrange(keys.stream, stored, stored)
        if not rows:
            return None
        return await self._info(shard, stream_id, rows[0][1])

    async def _info(self, shard: int, stream_id: str, fields: Any) -> MessageInfo | None:
        try:
            env = decode_envelope(fields.get(b"data", fields.get("data")) or b"")
        except EnvelopeDecodeError:
            return None
        keys = self._scope.shards[shard]
        pipe = self._redis.pipeline(transaction=False)
        pipe.hget(keys.ids, env.schedule_id or stream_id)
        pipe.hget(keys.parked, stream_id)
        ref, parked = await pipe.execute()
        message = self._pending.message(shard, stream_id, env, ref)
        if parked is not None:
            return MessageInfo(message, env, "parked", shown(parked))
        return MessageInfo(message, env, "paused" if message.paused else "pending")

    async def _find(self, id: str, progress: Progress | None) -> MessageInfo | None:
        total = await self._pending.stream_length() if progress is not None else 0
        scanned = 0
        for shard, keys in enumerate(self._scope.shards):
            async for rows in self._scope.pages(keys.stream):
                scanned += len(rows)
                for raw_id, fields in rows:
                    raw_id = public_id(raw_id, fields)
                    try:
                        env = decode_envelope(fields.get(b"data", fields.get("data")) or b"")
                    except EnvelopeDecodeError:
                        continue
                    if id in (env.id, env.schedule_id):
                        return await self._info(shard, shown(raw_id), fields)
                if progress is not None:
                    progress(scanned, max(total, scanned))
        return None
