"""Log formats of `delayed-pubsub serve`: text for people, JSON lines for collectors.

Nothing here sees a message body, a password or a client key: the component
never logs them (ids, topics, counts and Redis addresses only), and the JSON
form adds no field from a log record's arguments beyond the formatted message.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time (RFC3339 UTC), level, logger, message, and the exception if any."""

    def format(self, record: logging.LogRecord) -> str:
        seconds = int(record.created)
        millis = int((record.created - seconds) * 1000)
        entry: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + f".{millis:03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        # ensure_ascii: a stray control or non-UTF-8 character cannot break the line.
        return json.dumps(entry, ensure_ascii=True)


def configure(level: str, fmt: str) -> None:
    """Route every log record to stderr as `fmt` (text | json) at `level`."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
