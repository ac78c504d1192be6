"""The names of pausing that the component, the operator CLI and the inspector read.

Pause, resume and cancel by prefix live in delayed_middleware.engine.pause;
this module only re-exports its public names under the import path those
callers use.
"""

from delayed_middleware.engine.pause import (
    ALREADY,
    ENDED,
    PARKED,
    PAUSED,
    PAUSED_FLAG,
    RESUMED,
    UNKNOWN,
    PauseResult,
    glob_escape,
    is_paused_ref,
    paused_at_ms,
    scan_prefix,
)

__all__ = [
    "ALREADY",
    "ENDED",
    "PARKED",
    "PAUSED",
    "PAUSED_FLAG",
    "RESUMED",
    "UNKNOWN",
    "PauseResult",
    "glob_escape",
    "is_paused_ref",
    "paused_at_ms",
    "scan_prefix",
]
