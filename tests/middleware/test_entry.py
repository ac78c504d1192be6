"""The stream entry format: what decode_entry makes of entries it did not write."""

from __future__ import annotations

import json
import tracemalloc

import pytest

from delayed_middleware.entry import READER_CACHE, EntryReader, StreamEntry, decode_entry, encode_entry


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
        # Lone surrogates (escaped, or as bytes) are no UTF-8 text: U+FFFD, as Go's JSON reads them.
        (b'{"k":"a\\ud800b","\\uDFFF":"v","p":"\\ud83d\\ude00"}', {"k": "a\ufffdb", "\ufffd": "v", "p": "\U0001f600"}),
        (b'{"k":"\xed\xa0\x80"}', {"k": "\ufffd"}),
        (b'{"k":"\\\\ud800"}', {"k": "\\ud800"}),  # an escaped backslash: no surrogate
    ],
)
def test_malformed_metadata_is_dropped_and_the_data_kept(raw: bytes, metadata: dict[str, str]) -> None:
    entry = decode_entry({b"data": b"payload", b"metadata": raw})
    assert entry == StreamEntry(b"payload", metadata)
    # The same from a raw reply's flat field list, and through a subscription's reader.
    assert decode_entry([b"data", b"payload", b"metadata", raw]) == entry
    assert EntryReader()([b"metadata", raw, b"data", b"payload"]) == entry


def test_expiry_round_trips_and_is_absent_without_ttl() -> None:
    from delayed_middleware.entry import EXPIRES_AT, StreamEntry, decode_entry, encode_entry

    assert EXPIRES_AT not in encode_entry(StreamEntry(b"x"))
    fields = encode_entry(StreamEntry(b"x", {"a": "b"}, "text/plain", expires_at_ms=1_700_000_000_123))
    assert fields[EXPIRES_AT] == b"1700000000123"
    assert decode_entry(fields).expires_at_ms == 1_700_000_000_123
    assert decode_entry({**fields, EXPIRES_AT: b"garbage"}).expires_at_ms == 0


def flat(entry: StreamEntry) -> list[bytes]:
    """The entry's fields as a raw XREADGROUP reply carries them: [field, value, ...]."""
    return [part for k, v in encode_entry(entry).items() for part in (k.encode(), v)]


def test_a_reader_decodes_each_entry_as_decode_entry_does_and_parses_repeated_metadata_once() -> None:
    read = EntryReader()
    sent = [
        StreamEntry(b"a", {"cloudevent.id": "x", "ü": "ß"}),
        StreamEntry(b"b", {"cloudevent.id": "x", "ü": "ß"}, "text/plain", expires_at_ms=1_700_000_000_123),
        StreamEntry(b"c", {"cloudevent.id": "y"}),
        StreamEntry(b"d"),
        StreamEntry(b"e", {"cloudevent.id": "x", "ü": "ß"}),
    ]
    got = [read(flat(e)) for e in sent]
    assert got == sent == [decode_entry(flat(e)) for e in sent] == [decode_entry(encode_entry(e)) for e in sent]
    # Entries whose metadata field is the same bytes share one decoded map.
    assert got[0].metadata is got[1].metadata is got[4].metadata
    assert got[2].metadata is not got[0].metadata
    # Layouts written by others: pubsub.redis (no contentType, metadata last), an unreadable expiry.
    assert read([b"data", b"x", b"metadata", b'{"k":"v"}']) == StreamEntry(b"x", {"k": "v"})
    assert read([b"expiresAt", b"soon", b"data", b"x"]) == StreamEntry(b"x")


def test_a_reader_past_its_cache_of_distinct_metadata_still_decodes_every_entry() -> None:
    read = EntryReader()
    sent = [StreamEntry(b"x", {"n": str(i % (READER_CACHE + 7))}) for i in range(3 * READER_CACHE)]
    assert [read(flat(e)) for e in sent] == sent


def test_a_reader_keeps_no_big_metadata_alive_once_its_entries_are_gone() -> None:
    # Metadata of 256 KiB, distinct per message (an id in it): once the entries are handled and
    # dropped, the reader holds none of it (before: its 256-map cache kept the raw field and the
    # map of each, 32 MiB here, up to 256 x 64 MiB per stream).
    read = EntryReader()
    blob = "x" * 2**18
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(64):
            entry = read([b"data", b"x", b"metadata", json.dumps({"n": str(i), "blob": blob}).encode()])
            assert entry.metadata["n"] == str(i)
            del entry
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert held < 2**20, held
