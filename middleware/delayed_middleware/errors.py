"""One error hierarchy for the whole component.

The gRPC servicer alone maps these to status codes; everything below it raises
them with a message fit to show the user as it is.
"""

from __future__ import annotations


class DelayedPubSubError(Exception):
    """Base of every error this project raises on purpose."""


# How much of a key or value an error message echoes: enough to recognise it,
# never so much that the status outgrows gRPC's 8 KiB trailer limit (a 16 KB bad
# value must still come back as INVALID_ARGUMENT, not RESOURCE_EXHAUSTED).
MAX_ECHO_CHARS = 200


def echo(text: str, limit: int = MAX_ECHO_CHARS) -> str:
    """`text` as repr() shows it, cut to `limit` characters plus "...(N bytes)"."""
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}...({_size(text)} bytes)"


def cut(text: str, limit: int = MAX_ECHO_CHARS) -> str:
    """`text` as it is, cut to `limit` characters plus "...(N bytes)"."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}...({_size(text)} bytes)"


def _size(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


class InvalidArgumentError(DelayedPubSubError):
    """A metadata value (Init or publish) is malformed or out of range.

    The message names the key and the offending value (long ones cut, see
    `echo`), so the publisher can fix the request without reading our logs.
    `value` keeps the whole value. Maps to gRPC INVALID_ARGUMENT.
    """

    def __init__(self, key: str, value: str, reason: str) -> None:
        self.key = key
        self.value = value
        self.reason = reason
        # A reason may quote the value again (e.g. one bad host of a list).
        super().__init__(f"invalid metadata {cut(key)}={echo(value)}: {cut(reason, 4 * MAX_ECHO_CHARS)}")


class NotInitializedError(DelayedPubSubError):
    """A call reached an instance that daprd has not (yet) initialized.

    Maps to gRPC FAILED_PRECONDITION.
    """

    def __init__(self, instance: str) -> None:
        self.instance = instance
        super().__init__(f"component instance {instance!r} is not initialized: call Init first")


class BackendUnavailableError(DelayedPubSubError):
    """Redis cannot be reached or answered with a transient error.

    Maps to gRPC UNAVAILABLE: daprd and its resiliency policies may retry.
    """


class PartiallyStoredError(BackendUnavailableError):
    """Redis failed part way through a store done in several steps: the first
    `stored` items are stored (and will be delivered), the rest are not.

    A caller reports only the rest as failed: a retry of everything would store
    the first ones twice. Maps to gRPC UNAVAILABLE like its base.
    """

    def __init__(self, stored: int, message: str) -> None:
        self.stored = stored
        super().__init__(message)


class FailedPreconditionError(DelayedPubSubError):
    """The request is well-formed but the state of Redis refuses it (e.g. a topic
    whose key holds a hash, not a stream). Maps to gRPC FAILED_PRECONDITION."""


class UnsupportedRedisError(FailedPreconditionError):
    """Redis is too old for this component (it needs MIN_REDIS_VERSION).

    Not transient: Init fails with FAILED_PRECONDITION, and daprd reports the
    component as failed to initialize, with this message.
    """


class RestoreFailedError(NotInitializedError):
    """A restarted component could not re-Init an instance from its Init record.

    daprd Init'ed the instance in an earlier process; this one tried the
    record and failed (or found none usable). Maps to gRPC FAILED_PRECONDITION,
    like any call before Init: restarting daprd Inits it afresh.
    """

    def __init__(self, instance: str, reason: str) -> None:
        super().__init__(instance)
        self.reason = reason
        self.args = (
            f"component instance {instance!r} was not initialized in this process (the component "
            f"restarted under a running daprd) and could not be restored from its Init record: {reason}; "
            "restart daprd to Init it again",
        )


class BackendAuthError(DelayedPubSubError):
    """Redis refused our credentials (wrong password, unknown or disabled ACL
    user, a user without the commands we need).

    Not transient: retrying with the same settings cannot help. Maps to gRPC
    PERMISSION_DENIED, with Redis's own reason and no secret in the message.
    """


class MalformedEntryError(DelayedPubSubError):
    """A stream entry the component wrote for itself (e.g. an outbox entry) cannot be read.

    Retrying cannot fix it: the reader dead-letters or drops it, and says why.
    """
