"""The stream entry format: what decode_entry makes of entries it did not write."""

from __future__ import annotations

import pytest

from delayed_middleware.entry import StreamEntry, decode_entry, encode_entry


def test_round_trip() -> None:
    entry = StreamEntry(b"\x00data", {"a": "1", "ü": "ß"}, "application/json")
    assert decode_entry(encode_entry(entry)) == entry


@pytest.mark.parametrize(
    ("raw", "metadata"),
    [
        (b"[" * 100_000, {}),  # nested past the recursion limit: RecursionError, not ValueError
        (b'{"a":' * 100_000, {}),
        (b"not json", {}),
        (b"\xff\xfe", {}),
        (b'["a"]', {}),
        (b"1" * 5000, {}),  # past Python's int digit limit
        (b'{"n":1,"l":[1],"s":"x"}', {"n": "1", "l": "[1]", "s": "x"}),
    ],
)
def test_malformed_metadata_is_dropped_and_the_data_kept(raw: bytes, metadata: dict[str, str]) -> None:
    entry = decode_entry({b"data": b"payload", b"metadata": raw})
    assert entry == StreamEntry(b"payload", metadata)


def test_expiry_round_trips_and_is_absent_without_ttl() -> None:
    from delayed_middleware.entry import EXPIRES_AT, StreamEntry, decode_entry, encode_entry

    assert EXPIRES_AT not in encode_entry(StreamEntry(b"x"))
    fields = encode_entry(StreamEntry(b"x", {"a": "b"}, "text/plain", expires_at_ms=1_700_000_000_123))
    assert fields[EXPIRES_AT] == b"1700000000123"
    assert decode_entry(fields).expires_at_ms == 1_700_000_000_123
    assert decode_entry({**fields, EXPIRES_AT: b"garbage"}).expires_at_ms == 0
