"""Stream entries -> Arrow record batches with the data sources' typed columns.

Both schemas are declared once here (as Spark DDL and as Arrow), and the
decoders build whole columns at a time: a million rows cross into Spark as a
few hundred Arrow batches, never as a million pickled tuples.

History entries are decoded with delayed_middleware.history.decode_record, the
format's own reader. Envelopes with DelayedMessage from the generated stubs;
fields 11-17 (which recurring, expiring and retried messages carry: kind, schedule, expiresAtMs,
scheduleSource, scheduleTtlMs, targetPubsub, deliveryAttempt) are read by name
when the stubs know them, else from the unknown fields, so this reader works
with envelopes written by an older or newer engine than itself.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final, NamedTuple

import pyarrow as pa
import pyarrow.compute as pc
from google.protobuf.message import DecodeError as ProtoDecodeError
from google.protobuf.unknown_fields import UnknownFieldSet

from delayed_middleware import history as hist
from delayed_middleware.entry import DATA
from delayed_middleware.history import FIRED, decode_record, record_problem
from delayed_middleware.kinds import Kind
from delayed_pubsub_pb.delayedpubsub.v1 import delayed_pb2

# Spark's TimestampType crosses Arrow as microseconds in UTC.
_TS: Final = pa.timestamp("us", tz="UTC")

HISTORY_COLUMNS: Final[tuple[tuple[str, str, pa.DataType], ...]] = (
    ("delayed_topic", "STRING", pa.string()),
    ("history_id", "STRING", pa.string()),
    ("event", "STRING", pa.string()),
    ("at", "TIMESTAMP", _TS),
    ("id", "STRING", pa.string()),
    ("schedule_id", "STRING", pa.string()),
    ("topic", "STRING", pa.string()),
    ("kind", "STRING", pa.string()),
    ("schedule", "STRING", pa.string()),
    ("due_at", "TIMESTAMP", _TS),
    ("fired_at", "TIMESTAMP", _TS),
    ("lateness_ms", "BIGINT", pa.int64()),
    ("size_bytes", "BIGINT", pa.int64()),
    ("attempt", "BIGINT", pa.int64()),
    ("reason", "STRING", pa.string()),
    # Why the record does not follow the history format (history.record_problem), null when it
    # does. A malformed record is no event: its `event` and `fired_at` are null.
    ("malformed", "STRING", pa.string()),
)

PENDING_COLUMNS: Final[tuple[tuple[str, str, pa.DataType], ...]] = (
    ("delayed_topic", "STRING", pa.string()),
    ("stream_id", "STRING", pa.string()),
    ("id", "STRING", pa.string()),
    ("schedule_id", "STRING", pa.string()),
    ("topic", "STRING", pa.string()),
    ("kind", "STRING", pa.string()),
    ("schedule", "STRING", pa.string()),
    ("status", "STRING", pa.string()),
    ("reason", "STRING", pa.string()),
    ("scheduled_at", "TIMESTAMP", _TS),
    ("due_at", "TIMESTAMP", _TS),
    ("next_due_at", "TIMESTAMP", _TS),
    ("expires_at", "TIMESTAMP", _TS),
    ("size_bytes", "BIGINT", pa.int64()),
    ("entries", "INT", pa.int32()),
    ("attempt", "BIGINT", pa.int64()),
    ("content_type", "STRING", pa.string()),
    ("pubsub_name", "STRING", pa.string()),
    ("target_pubsub", "STRING", pa.string()),
    ("schedule_source", "STRING", pa.string()),
)

# Values of the status column of delayed-pending.
PENDING: Final = "pending"
PARKED: Final = "parked"
UNDECODABLE: Final = "undecodable"


def ddl(columns: Sequence[tuple[str, str, pa.DataType]]) -> str:
    """The Spark DDL schema string of a column list."""
    return ", ".join(f"{name} {sql}" for name, sql, _ in columns)


def arrow_schema(columns: Sequence[tuple[str, str, pa.DataType]]) -> pa.Schema:
    return pa.schema([pa.field(name, typ) for name, _, typ in columns])


HISTORY_SCHEMA: Final = arrow_schema(HISTORY_COLUMNS)
PENDING_SCHEMA: Final = arrow_schema(PENDING_COLUMNS)


# Spark's timestamps span years 1-9999; int64 columns span int64. A value outside
# (a hostile or corrupt record) becomes null instead of failing the whole read.
_TS_MIN_MS: Final = -62_135_596_800_000
_TS_MAX_MS: Final = 253_402_300_799_999
_I64_MIN: Final = -(2**63)
_I64_MAX: Final = 2**63 - 1


def _ms_to_ts(values: list[int | None]) -> pa.Array:
    bounded = [v if v is not None and _TS_MIN_MS <= v <= _TS_MAX_MS else None for v in values]
    # ms -> us in Arrow: one C loop instead of a million Python multiplications.
    return pa.compute.multiply(pa.array(bounded, pa.int64()), 1000).cast(_TS)


def _column(values: list[Any], typ: pa.DataType) -> pa.Array:
    if typ == _TS:
        return _ms_to_ts(values)
    if typ == pa.int64():
        values = [v if v is None or _I64_MIN <= v <= _I64_MAX else None for v in values]
    return pa.array(values, typ)


def history_batch(delayed_topic: str, entries: Sequence[tuple[Any, Mapping[Any, Any]]]) -> pa.RecordBatch:
    """One Arrow batch from XRANGE output of a history stream (see delayed_middleware.history).

    Column at a time in Arrow (~10x faster than a record at a time); the values
    are exactly decode_record's (a property test holds the two together), and a
    batch the fast path cannot take (text keys, a value Arrow parses differently
    from int()) goes through decode_record itself.
    """
    if entries and not all(isinstance(k, bytes) for k in entries[0][1]):
        return _history_batch_by_record(delayed_topic, entries)
    dicts = [f for _, f in entries]
    n = len(entries)

    def raw(field: str) -> list[Any]:
        key = field.encode()
        return [d.get(key) for d in dicts]

    values = {name: raw(name) for name in hist.FIELDS}
    checked = {name: _utf8(values[name]) for name in hist.FIELDS}
    text = {name: column for name, column in checked.items() if column is not None}
    if len(text) < len(checked):
        # Bytes that are not UTF-8 (a malformed record): this batch record by record.
        return _history_batch_by_record(delayed_topic, entries)
    malformed, at_ok, plain = _problems(text)
    well_formed = pc.is_null(malformed)

    def words(name: str) -> pa.Array:
        return pc.fill_null(text[name], "")

    def number(name: str, default: int | None) -> pa.Array:
        return _number_text(text[name], plain[name], values[name], default)

    event = words("event")
    # Not a time (missing, not a number, not after the epoch): null, never 1970-01-01.
    at = pc.if_else(at_ok, number("at", 0), pa.scalar(None, pa.int64()))
    kind = words("kind")
    attempt = number("attempt", 1)
    no_event = pa.scalar(None, pa.string())
    columns: dict[str, pa.Array] = {
        "delayed_topic": pa.array([delayed_topic] * n, pa.string()),
        "history_id": pa.array([_text_id(i) for i, _ in entries], pa.string()),
        "event": pc.if_else(well_formed, event, no_event),
        "at": _ts(at),
        "id": words("id"),
        "schedule_id": words("sid"),
        "topic": words("topic"),
        # decode_record: `kind or oneshot`, `attempt or 1`
        "kind": pc.if_else(pc.equal(kind, ""), ONESHOT_LABEL, kind),
        "schedule": words("schedule"),
        "due_at": _ts(number("due", None)),
        "fired_at": _ts(
            pc.if_else(pc.and_(well_formed, pc.equal(event, FIRED)), at, pa.scalar(None, pa.int64()))
        ),
        "lateness_ms": number("late", None),
        "size_bytes": number("size", 0),
        "attempt": pc.if_else(pc.equal(attempt, 0), 1, attempt),
        "reason": words("reason"),
        "malformed": malformed,
    }
    return pa.RecordBatch.from_arrays(
        [columns[name] for name, _, _ in HISTORY_COLUMNS], schema=HISTORY_SCHEMA
    )


def _utf8(values: list[Any]) -> pa.Array | None:
    """A field's values as text (null where missing), or None when one is not UTF-8."""
    try:
        return pa.array(values, pa.binary()).cast(pa.string())
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        return None


def _problems(text: Mapping[str, pa.Array]) -> tuple[pa.Array, pa.Array, dict[str, pa.Array]]:
    """history.record_problem over whole columns: the first problem of each record (null when
    none), whether its `at` is a time (history.parse_at), and per number field whether each
    value is a plain number.

    The same checks in the same order (a property test holds the two together)."""
    present = {name: pc.fill_null(pc.not_equal(text[name], ""), False) for name in ("event", "at", "kind")}
    plain = {
        name: pc.fill_null(pc.match_substring_regex(text[name], hist.NUMBER_PATTERN), False)
        for name in ("at", *hist.NUMBER_FIELDS)
    }
    for name in hist.NUMBER_FIELDS:
        present[name] = pc.fill_null(pc.not_equal(text[name], ""), False)
    at_number = plain["at"]
    at_ms = pc.cast(pc.if_else(at_number, text["at"], pa.scalar(None, pa.string())), pa.int64())
    at_in_range = pc.fill_null(pc.and_(pc.greater(at_ms, 0), pc.less_equal(at_ms, hist.AT_MAX_MS)), False)
    checks: list[tuple[pa.Array, str]] = [
        (pc.invert(present["event"]), hist.NO_EVENT),
        (pc.invert(pc.is_in(text["event"], pa.array(hist.EVENTS))), hist.UNKNOWN_EVENT),
        (pc.invert(present["at"]), hist.NO_AT),
        (pc.invert(pc.and_(at_number, at_in_range)), hist.AT_NOT_A_TIME),
        *(
            (pc.and_(present[name], pc.invert(plain[name])), hist.not_a_number(name))
            for name in hist.NUMBER_FIELDS
        ),
        (
            pc.and_(present["kind"], pc.invert(pc.is_in(text["kind"], pa.array(hist.KINDS)))),
            hist.UNKNOWN_KIND,
        ),
    ]
    # Nearly every batch is well formed: one any() then, instead of a case_when.
    if not pc.any(_any_of([c for c, _ in checks])).as_py():
        problems = pa.nulls(len(text["event"]), pa.string())
    else:
        names = [str(i) for i in range(len(checks))]
        conditions = pc.make_struct(*(c for c, _ in checks), field_names=names)
        problems = pc.case_when(conditions, *(pa.scalar(r, pa.string()) for _, r in checks))
    return problems, pc.and_(at_number, at_in_range), plain


def _any_of(conditions: list[pa.Array]) -> pa.Array:
    out = conditions[0]
    for c in conditions[1:]:
        out = pc.or_(out, c)
    return out


def _number_text(text: pa.Array, plain: pa.Array, values: list[Any], default: int | None) -> pa.Array:
    """_number on a column already checked: its text and which values are plain numbers."""
    present = pc.fill_null(pc.not_equal(text, ""), False)
    if not pc.all(pc.or_(pc.invert(present), plain)).as_py():
        return pa.array([_py_int(v, default) for v in values], pa.int64())
    arr = pc.cast(pc.if_else(present, text, pa.scalar(None, pa.string())), pa.int64())
    return arr if default is None else pc.fill_null(arr, default)


def _text_id(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _text_column(values: list[Any], default: str) -> pa.Array:
    try:
        arr = pa.array(values, pa.binary()).cast(pa.string())  # the cast validates UTF-8
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        arr = pa.array([None if v is None else _str(v) for v in values], pa.string())
    return pc.fill_null(arr, default)


def _str(value: Any) -> str:
    return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else str(value)


# Numbers Arrow and int() read alike: optional minus, 1-18 digits (always within int64).
_PLAIN_INT: Final = r"^-?[0-9]{1,18}$"


def _number(values: list[Any], default: int | None) -> pa.Array:
    """decode_record's _int on a column: '' or missing -> default; unparseable -> default."""
    try:
        text = pa.array(values, pa.binary()).cast(pa.string())
        present = pc.and_kleene(pc.is_valid(text), pc.not_equal(text, ""))
        plain = pc.match_substring_regex(text, _PLAIN_INT)
        if not pc.all(pc.or_kleene(pc.invert(present), plain)).as_py():
            raise ValueError("a value needs int()")
        arr = pc.cast(pc.if_else(present, text, pa.scalar(None, pa.string())), pa.int64())
    except (pa.ArrowInvalid, pa.ArrowTypeError, ValueError):
        return pa.array([_py_int(v, default) for v in values], pa.int64())
    return arr if default is None else pc.fill_null(arr, default)


def _py_int(value: Any, default: int | None) -> int | None:
    text = "" if value is None else _str(value)
    try:
        n = int(text) if text != "" else default
    except ValueError:
        return default
    # Out of int64 (a corrupt or hostile record): null rather than a failed read.
    return n if n is None or _I64_MIN <= n <= _I64_MAX else None


def _ts(ms: pa.Array) -> pa.Array:
    """Epoch ms -> Spark timestamps (us, UTC); outside years 1-9999 -> null."""
    ok = pc.and_(pc.greater_equal(ms, _TS_MIN_MS), pc.less_equal(ms, _TS_MAX_MS))
    bounded = pc.if_else(ok, ms, pa.scalar(None, pa.int64()))
    return pc.multiply(bounded, 1000).cast(_TS)


def _history_batch_by_record(
    delayed_topic: str, entries: Sequence[tuple[Any, Mapping[Any, Any]]]
) -> pa.RecordBatch:
    cols: dict[str, list[Any]] = {name: [] for name, _, _ in HISTORY_COLUMNS}
    for stream_id, fields in entries:
        r = decode_record(stream_id, fields)
        problem = record_problem(fields)
        cols["history_id"].append(r.stream_id)
        cols["event"].append(r.event if problem is None else None)
        at = fields.get(b"at", fields.get("at"))
        at_ms = hist.parse_at(_str(at)) if at is not None else None
        cols["at"].append(at_ms)
        cols["id"].append(r.id)
        cols["schedule_id"].append(r.schedule_id)
        cols["topic"].append(r.topic)
        cols["kind"].append(r.kind)
        cols["schedule"].append(r.schedule)
        cols["due_at"].append(r.due_ms)
        cols["fired_at"].append(at_ms if r.event == FIRED and problem is None else None)
        cols["lateness_ms"].append(r.lateness_ms)
        cols["size_bytes"].append(r.size_bytes)
        cols["attempt"].append(r.attempt)
        cols["reason"].append(r.reason)
        cols["malformed"].append(problem)
    cols["delayed_topic"] = [delayed_topic] * len(entries)
    arrays = [_column(cols[name], typ) for name, _, typ in HISTORY_COLUMNS]
    return pa.RecordBatch.from_arrays(arrays, schema=HISTORY_SCHEMA)


# --- envelopes -------------------------------------------------------------------

_DESCRIPTOR = delayed_pb2.DelayedMessage.DESCRIPTOR
# Field numbers of fields 11-17, by the names the proto gives them.
EXTENDED_FIELDS: Final = {
    "kind": 11,
    "schedule": 12,
    "expiresAtMs": 13,
    "scheduleSource": 14,
    "scheduleTtlMs": 15,
    "targetPubsub": 16,
    "deliveryAttempt": 17,
}
_KNOWN_EXTENDED = frozenset(name for name in EXTENDED_FIELDS if name in _DESCRIPTOR.fields_by_name)
# An enum `kind` as an unknown varint: the order the engine declares them in.
_KIND_BY_NUMBER: Final = {k.value: k.label for k in Kind}
ONESHOT_LABEL: Final = Kind.ONESHOT.label
RECURRING_LABEL: Final = Kind.RECURRING.label
_DATA_FIELD: Final = DATA.encode()


class EnvelopeRow(NamedTuple):
    """What one envelope contributes to a delayed-pending row (before the ids/parked lookups).

    A NamedTuple, not a frozen dataclass: as immutable, and built ~5x faster,
    which a million envelopes per read notice.
    """

    id: str
    schedule_id: str
    topic: str
    kind: str
    schedule: str
    published_at_ms: int | None
    due_ms: int | None
    expires_at_ms: int | None
    size_bytes: int
    entries: int
    attempt: int
    content_type: str
    pubsub_name: str
    target_pubsub: str
    schedule_source: str


def _kind_text(value: Any) -> str:
    if isinstance(value, int):
        field = _DESCRIPTOR.fields_by_name.get("kind")
        if field is not None and field.enum_type is not None:
            name: str = (
                field.enum_type.values_by_number[value].name
                if value in field.enum_type.values_by_number
                else ""
            )
            # KIND_RECURRING / RECURRING -> recurring
            return name.lower().removeprefix("kind_") or ONESHOT_LABEL
        return _KIND_BY_NUMBER.get(value, str(value))
    return str(value) or ONESHOT_LABEL


def _extended_fields(msg: delayed_pb2.DelayedMessage) -> dict[str, Any]:
    out: dict[str, Any] = {name: getattr(msg, name) for name in _KNOWN_EXTENDED}
    if len(_KNOWN_EXTENDED) < len(EXTENDED_FIELDS):
        by_number = {num: name for name, num in EXTENDED_FIELDS.items() if name not in _KNOWN_EXTENDED}
        unknown = UnknownFieldSet(msg)
        for i in range(len(unknown)):
            f = unknown[i]
            name = by_number.get(f.field_number)
            if name is None:
                continue
            data = f.data
            out[name] = data.decode("utf-8", errors="replace") if isinstance(data, bytes) else data
    return out


def decode_envelope_row(raw: bytes) -> EnvelopeRow:
    """Parse DelayedMessage bytes into row values; ValueError if they are not one."""
    msg = delayed_pb2.DelayedMessage()
    try:
        msg.ParseFromString(raw)
    except ProtoDecodeError as e:
        raise ValueError(f"not a DelayedMessage: {e}") from None
    if not msg.topic:
        raise ValueError("DelayedMessage has no topic")
    extended = _extended_fields(msg)
    size, entries = len(msg.message), 1
    if msg.bulkPublish:
        bulk = delayed_pb2.DelayedBulk()
        try:
            bulk.ParseFromString(msg.message)
        except ProtoDecodeError as e:
            raise ValueError(f"bulk DelayedMessage has a bad body: {e}") from None
        size, entries = sum(len(e.event) for e in bulk.entries), len(bulk.entries)
    schedule = str(extended.get("schedule", "") or "")
    kind = _kind_text(extended["kind"]) if "kind" in extended else (RECURRING_LABEL if schedule else ONESHOT_LABEL)
    return EnvelopeRow(
        id=msg.id,
        schedule_id=msg.scheduleId,
        topic=msg.topic,
        kind=kind,
        schedule=schedule,
        published_at_ms=msg.publishedAtMs or None,
        due_ms=msg.dueTimeMs or None,
        expires_at_ms=int(extended.get("expiresAtMs") or 0) or None,
        size_bytes=size,
        entries=entries,
        attempt=int(extended.get("deliveryAttempt") or 0) or 1,
        content_type=msg.contentType,
        pubsub_name=msg.pubsubName,
        target_pubsub=str(extended.get("targetPubsub", "") or ""),
        schedule_source=str(extended.get("scheduleSource", "") or ""),
    )


def _text(value: Any) -> str:
    return value.decode("utf-8", errors="replace") if isinstance(value, bytes) else str(value)


def parse_ids_value(value: Any) -> tuple[str, int | None, int | None]:
    """An ids-hash value, "<stream id> <due ms> <next due ms or ''>", as (stream id, due, next)."""
    parts = _text(value).split(" ")
    parts += [""] * (3 - len(parts))

    def num(p: str) -> int | None:
        return int(p) if p.isascii() and p.isdigit() else None

    return parts[0], num(parts[1]), num(parts[2])


def decode_pending(entries: Sequence[tuple[Any, Mapping[Any, Any]]]) -> list[tuple[str, EnvelopeRow | str]]:
    """(envelope id, fields of its stream entry) pairs -> (envelope id, row values or the reason
    it does not decode).

    An envelope's id is the stream id it was first stored at. For a copy that compaction
    re-homed to the stream's tail the caller passes that id, not the copy's: only the moved
    hash tells a genuine copy from an entry that merely carries an `origin` field, so this
    decoder never reads that field.
    """
    out: list[tuple[str, EnvelopeRow | str]] = []
    for raw_id, fields in entries:
        data = fields.get(_DATA_FIELD)
        if data is None:
            out.append((_text(raw_id), "entry has no data field"))
            continue
        try:
            out.append((_text(raw_id), decode_envelope_row(data)))
        except ValueError as e:
            out.append((_text(raw_id), str(e)))
    return out


def recurring_keys(decoded: Sequence[tuple[str, EnvelopeRow | str]]) -> list[str]:
    """The ids-hash fields to look up: recurring envelopes keep their current due time there."""
    return [
        row.id or stream_id
        for stream_id, row in decoded
        if isinstance(row, EnvelopeRow) and row.kind == RECURRING_LABEL
    ]


def pending_batch(
    delayed_topic: str,
    decoded: Sequence[tuple[str, EnvelopeRow | str]],
    current_due: Mapping[str, tuple[str, int | None, int | None]],
    parked: Mapping[str, str],
) -> pa.RecordBatch:
    """One Arrow batch of delayed-pending rows.

    `current_due` maps a recurring envelope's key in the ids hash (its id, else
    its stream id) to the parsed ids value: its current due time lives there,
    not in the envelope. `parked` maps stream ids to the parked reason. An entry
    that does not decode is kept as status "undecodable" with the error as its
    reason: an operator must see it, not lose it.
    """
    # One tuple per row in PENDING_COLUMNS order, transposed at the end.
    rows: list[tuple[Any, ...]] = []
    for stream_id, row in decoded:
        if isinstance(row, str):
            rows.append(
                (
                    delayed_topic,
                    stream_id,
                    stream_id,
                    "",
                    "",
                    "",
                    "",
                    UNDECODABLE,
                    row,
                    None,
                    None,
                    None,
                    None,
                    0,
                    0,
                    0,
                    "",
                    "",
                    "",
                    "",
                )
            )
            continue
        key = row.id or stream_id
        due, next_due = row.due_ms, None
        if row.kind == RECURRING_LABEL:
            tracked = current_due.get(key)
            # The ids entry must point at this very envelope: a replaced one has moved on.
            if tracked is not None and tracked[0] == stream_id:
                due = tracked[1] if tracked[1] is not None else due
                next_due = tracked[2]
        reason = parked.get(stream_id) if parked else None
        rows.append(
            (
                delayed_topic,
                stream_id,
                key,
                row.schedule_id,
                row.topic,
                row.kind,
                row.schedule,
                PENDING if reason is None else PARKED,
                reason or "",
                row.published_at_ms,
                due,
                next_due,
                row.expires_at_ms,
                row.size_bytes,
                row.entries,
                row.attempt,
                row.content_type,
                row.pubsub_name,
                row.target_pubsub,
                row.schedule_source,
            )
        )
    columns = list(zip(*rows, strict=True)) if rows else [() for _ in PENDING_COLUMNS]
    arrays = [
        _column(list(values), typ) for values, (_, _, typ) in zip(columns, PENDING_COLUMNS, strict=True)
    ]
    return pa.RecordBatch.from_arrays(arrays, schema=PENDING_SCHEMA)
