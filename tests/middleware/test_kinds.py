"""One Kind enum: its numbers and labels are the ones the Lua scripts and the history use."""

from __future__ import annotations

import re
from importlib.resources import files

from delayed_middleware.envelope import ONESHOT, RECURRING, RETRY, Envelope, decode_envelope, encode_envelope
from delayed_middleware.history import KINDS, decode_record
from delayed_middleware.kinds import Kind


def test_the_history_script_names_each_kind_number_as_the_enum_labels_it() -> None:
    lua = (files("delayed_middleware") / "lua" / "history.lua").read_text()
    table = re.search(r"KIND_NAMES = \{(.*?)\}", lua)
    assert table is not None
    names = {int(n): label for n, label in re.findall(r"\[(\d+)\] = '(\w+)'", table.group(1))}
    assert names == {k.value: k.label for k in Kind}
    assert KINDS == ("oneshot", "recurring", "retry")


def test_an_envelope_kind_survives_encoding_and_reads_as_the_enum() -> None:
    for kind in Kind:
        env = Envelope(id="", topic="t", due_ms=1, published_at_ms=1, kind=kind, schedule="@every 1s")
        back = decode_envelope(encode_envelope(env))
        assert back.kind == kind
        assert back.is_recurring is (kind is Kind.RECURRING)


def test_envelope_kinds_are_plain_ints_a_script_argument_can_carry() -> None:
    # The engine hands Envelope.kind to its scripts as it is; hiredis refuses an IntEnum member.
    assert all(type(k) is int for k in (ONESHOT, RECURRING, RETRY, Envelope("", "t", 1, 1).kind))
    assert tuple(Kind) == (ONESHOT, RECURRING, RETRY)


def test_a_record_without_a_kind_reads_as_a_oneshot() -> None:
    assert decode_record(b"1-0", {b"event": b"fired", b"id": b"x"}).kind == Kind.ONESHOT.label
