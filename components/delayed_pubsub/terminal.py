"""What the commands print to a terminal: names and reasons from Redis, made safe to show.

A topic name, a schedule id or an app's error text can carry anything, terminal
escape sequences included (`\\x1b]0;...\\x07` retitles the window, `\\x1b[2J`
clears it). Every command that prints them (`history`, `pending`, `stats`)
passes them through `printable`.
"""

from __future__ import annotations


def printable(text: str) -> str:
    """`text` with control and other unprintable characters escaped (\\x1b): a record's reason
    comes from apps and may carry terminal escape sequences."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
