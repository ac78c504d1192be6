"""The Inspector stays split by concern: each reader a class of its own, within the size bounds."""

from __future__ import annotations

from tests.shape import ROOT, oversized_classes, too_complex

PACKAGE = ROOT / "middleware" / "delayed_middleware"
# The facade and the readers it is made of.
INSPECTOR_FILES = [
    PACKAGE / name
    for name in (
        "inspector.py",
        "inspection.py",
        "stream_walk.py",
        "pending_reader.py",
        "retry_reader.py",
        "handoff_reader.py",
        "message_lookup.py",
        "history_reader.py",
        "deadletter_reader.py",
        "history.py",
        "deadletters.py",
    )
]


def test_the_inspector_files_keep_the_size_and_complexity_bounds() -> None:
    # No class over 25 methods or 450 lines, no function over McCabe 15.
    assert oversized_classes(INSPECTOR_FILES) + too_complex(INSPECTOR_FILES) == []
