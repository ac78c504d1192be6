"""Entries -> Arrow rows: envelopes (with or without fields 11-17: kind, schedule, expiry, retry) and history records."""

from __future__ import annotations

from hypothesis import example, given
from hypothesis import strategies as st

from delayed_middleware.envelope import BulkEntry, Envelope, encode_envelope
from delayed_middleware.history import EVENTS, FIELDS, KINDS, decode_record, parse_at, record_problem
from delayed_pubsub.spark.rows import (
    PARKED,
    PENDING,
    UNDECODABLE,
    decode_pending,
    history_batch,
    parse_ids_value,
    pending_batch,
    recurring_keys,
)
from tests.components.spark.envelopes import extended_envelope


def test_v2_fields_are_read_from_unknown_fields() -> None:
    raw = extended_envelope(
        kind=1,
        schedule="@every 2s",
        expiresAtMs=9_000,
        scheduleSource="prices",
        targetPubsub="kafka",
        deliveryAttempt=3,
    )
    [(sid, row)] = decode_pending([(b"7-0", {b"data": raw, b"metadata": b"{}"})])
    assert sid == "7-0"
    assert not isinstance(row, str)
    assert (row.kind, row.schedule, row.expires_at_ms, row.attempt) == ("recurring", "@every 2s", 9_000, 3)
    assert (row.schedule_source, row.target_pubsub, row.size_bytes) == ("prices", "kafka", 5)


def test_recurring_due_comes_from_the_ids_hash_only_for_its_own_envelope() -> None:
    raw = extended_envelope(kind=1, schedule="@every 2s")
    decoded = decode_pending([(b"7-0", {b"data": raw}), (b"8-0", {b"data": raw})])
    assert recurring_keys(decoded) == ["rem", "rem"]
    current = {"rem": parse_ids_value(b"7-0 4000 6000")}
    batch = pending_batch("app1-delayed", decoded, current, {}).to_pylist()
    due = [r["due_at"].timestamp() * 1000 for r in batch]
    nxt = [r["next_due_at"] for r in batch]
    # 7-0 is the envelope the ids hash points at; 8-0 is a stale copy and keeps its own due time.
    assert due == [4000, 1000]
    assert nxt[0].timestamp() * 1000 == 6000
    assert nxt[1] is None


def test_bulk_parked_and_undecodable_rows() -> None:
    bulk = encode_envelope(
        Envelope(
            id="",
            topic="orders",
            due_ms=2_000,
            published_at_ms=1_000,
            bulk_entries=(BulkEntry("e1", b"abc"), BulkEntry("e2", b"defgh")),
        )
    )
    entries = [
        (b"1-0", {b"data": bulk}),
        (b"2-0", {b"data": b"\xff\xfe not a proto"}),
        (b"3-0", {b"metadata": b"{}"}),
    ]
    rows = pending_batch("app1-delayed", decode_pending(entries), {}, {"1-0": "no such pubsub"}).to_pylist()
    assert [r["status"] for r in rows] == [PARKED, UNDECODABLE, UNDECODABLE]
    assert rows[0]["reason"] == "no such pubsub"
    assert (rows[0]["entries"], rows[0]["size_bytes"], rows[0]["id"], rows[0]["kind"]) == (
        2,
        8,
        "1-0",
        "oneshot",
    )
    assert "DelayedMessage" in rows[1]["reason"]
    assert rows[2]["reason"] == "entry has no data field"
    plain = encode_envelope(Envelope(id="x", topic="t", due_ms=5, published_at_ms=1, message=b""))
    [row] = pending_batch("d", decode_pending([(b"4-0", {b"data": plain})]), {}, {}).to_pylist()
    assert row["status"] == PENDING


text = st.text(alphabet=st.characters(exclude_categories=["Cs"]), max_size=12)
value = st.one_of(
    text,
    st.integers(-(2**70), 2**70).map(str),
    st.just(""),
    st.sampled_from([*EVENTS, *KINDS]),
    st.integers(1, 2**45).map(str),
)
I64 = range(-(2**63), 2**63)
TS_MS = range(-62_135_596_800_000, 253_402_300_800_000)


def _in(v: int | None, bounds: range) -> int | None:
    """What the row holds for a decoded number: out of Spark's range becomes null."""
    return v if v is not None and v in bounds else None


@given(st.dictionaries(st.sampled_from(FIELDS), value))
@example({"at": "+5", "due": " 7", "late": "1_000", "size": "\u0663", "attempt": "0"})
@example({"at": "1e3", "due": "-0", "late": "007", "size": "99999999999999999999", "attempt": "-1"})
@example({"event": "fired", "topic": "caf\u00e9", "reason": "\U0001f600", "kind": ""})
@example({"event": "fired", "at": "253402300799999", "late": "-5", "kind": "retry"})
@example({"event": "fired", "at": "253402300800000"})
@example({"event": "fired", "at": "0"})
def test_history_rows_equal_decode_record(fields: dict[str, str]) -> None:
    raw = {k.encode(): v.encode() for k, v in fields.items()}
    [fast] = history_batch("app1-delayed", [(b"9-1", raw)]).to_pylist()
    # The record-by-record path (text keys) must read it exactly as the column path does.
    [slow] = history_batch("app1-delayed", [("9-1", fields)]).to_pylist()
    assert fast == slow
    row = fast
    rec = decode_record(b"9-1", raw)
    problem = record_problem(raw)
    assert row["malformed"] == problem
    assert row["history_id"] == "9-1"
    # A malformed record is no event.
    assert row["event"] == (rec.event if problem is None else None)
    assert (row["id"], row["schedule_id"], row["topic"]) == (rec.id, rec.schedule_id, rec.topic)
    assert (row["kind"], row["schedule"], row["reason"]) == (rec.kind, rec.schedule, rec.reason)
    assert row["lateness_ms"] == _in(rec.lateness_ms, I64)
    assert (row["size_bytes"], row["attempt"]) == (_in(rec.size_bytes, I64), _in(rec.attempt, I64))
    at = parse_at(fields.get("at", ""))
    assert (row["at"] is None) if at is None else (round(row["at"].timestamp() * 1000) == at)
    assert (row["due_at"] is None) == (_in(rec.due_ms, TS_MS) is None)
    assert (row["fired_at"] is None) == (rec.event != "fired" or problem is not None or at is None)


def test_history_bytes_that_are_not_utf8_read_as_decode_record_reads_them() -> None:
    raw = {b"event": b"fired", b"topic": b"caf\xff", b"late": b"12", b"at": b"1000"}
    [row] = history_batch("d", [(b"1-0", raw)]).to_pylist()
    assert row["topic"] == decode_record(b"1-0", raw).topic == "caf\ufffd"
    assert row["lateness_ms"] == 12
    # Bytes that are not UTF-8 do not follow the format: the record is malformed, no event.
    assert row["malformed"] == "not UTF-8"
    assert row["event"] is None
    assert row["fired_at"] is None
