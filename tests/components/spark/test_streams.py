"""Stream-id arithmetic and the id-range split that partitions a read."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from delayed_pubsub.spark.streams import MAX_SEQ, next_id, parse_id, split_range


def test_next_id() -> None:
    assert next_id("5-0") == "5-1"
    assert next_id(f"5-{MAX_SEQ}") == "6-0"
    assert next_id("0-0") == "0-1"


@pytest.mark.parametrize("bad", ["", "-", "a-1", "1-b", "1--2", " 1-2"])
def test_parse_id_refuses(bad: str) -> None:
    with pytest.raises(ValueError, match="stream id"):
        parse_id(bad)


def test_split_examples() -> None:
    assert split_range("100-3", "103-7", 2) == [("100-3", f"101-{MAX_SEQ}"), ("102-0", "103-7")]
    # One millisecond cannot be cut: one range.
    assert split_range("5-1", "5-9", 4) == [("5-1", "5-9")]
    assert split_range("9-0", "5-0", 3) == []


@given(
    lo=st.integers(0, 2**45),
    span=st.integers(0, 10**6),
    lo_seq=st.integers(0, 5),
    hi_seq=st.integers(0, 5),
    parts=st.integers(1, 64),
)
def test_split_covers_exactly_once(lo: int, span: int, lo_seq: int, hi_seq: int, parts: int) -> None:
    first, last = f"{lo}-{lo_seq}", f"{lo + span}-{hi_seq}"
    if parse_id(first) > parse_id(last):
        return
    ranges = split_range(first, last, parts)
    assert 1 <= len(ranges) <= parts
    assert ranges[0][0] == first
    assert ranges[-1][1] == last
    for start, end in ranges:
        assert parse_id(start) <= parse_id(end)
    # Contiguous: each range starts right after the previous one ends.
    for (_, end), (start, _) in itertools.pairwise(ranges):
        assert next_id(end) == start
