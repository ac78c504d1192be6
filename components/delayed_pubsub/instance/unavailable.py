"""The one text of a Redis failure met on an instance's own calls (the publish path, Init)."""

from __future__ import annotations

from delayed_middleware.errors import BackendUnavailableError
from delayed_middleware.redis_errors import describe


def redis_unavailable(doing: str, error: BaseException) -> BackendUnavailableError:
    """BackendUnavailableError for `error` met while `doing` (a timeout has no text of its own)."""
    return BackendUnavailableError(f"{doing}: {describe(error)}")
