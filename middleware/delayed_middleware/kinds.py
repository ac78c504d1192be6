"""What a delayed message is: a one-shot, a recurring schedule, or a subscriber retry.

One enum for both spellings a kind has: its number is `DelayedMessage.kind` in
the envelope (and the index lua/history.lua's KIND_NAMES maps), its label is
what history records, the inspector's listings and the Spark rows carry.
"""

from __future__ import annotations

import enum


class _Labelled(enum.IntEnum):
    """A number stored in the envelope with a text form (its name in lower case)."""

    @property
    def label(self) -> str:
        """The text form: `oneshot`, `recurring`, `retry`; `one`, `all`, `none`."""
        return self.name.lower()


class Kind(_Labelled):
    """A delayed message's kind; the value is DelayedMessage.kind, `label` the text form."""

    ONESHOT = 0
    RECURRING = 1
    RETRY = 2


# Every label, in number order (history records are checked against it).
LABELS: tuple[str, ...] = tuple(k.label for k in Kind)


class Catchup(_Labelled):
    """A recurring schedule's catch-up policy (scheduleCatchup): what fires of the occurrences it
    missed while nothing ran. The value is DelayedMessage.scheduleCatchup (0, the default, is
    also what a release without the field does)."""

    ONE = 0
    ALL = 1
    NONE = 2


# scheduleCatchupWindow's default: missed occurrences older than this are skipped.
DEFAULT_CATCHUP_WINDOW_MS = 24 * 3600 * 1000
