"""One error hierarchy for the whole component.

The gRPC servicer alone maps these to status codes; everything below it raises
them with a message fit to show the user as it is.
"""

from __future__ import annotations


class DelayedPubSubError(Exception):
    """Base of every error this project raises on purpose."""


class InvalidArgumentError(DelayedPubSubError):
    """A metadata value (Init or publish) is malformed or out of range.

    The message names the key and the offending value, so the publisher can fix
    the request without reading our logs. Maps to gRPC INVALID_ARGUMENT.
    """

    def __init__(self, key: str, value: str, reason: str) -> None:
        self.key = key
        self.value = value
        self.reason = reason
        super().__init__(f"invalid metadata {key}={value!r}: {reason}")


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


class MalformedEntryError(DelayedPubSubError):
    """A stream entry the component wrote for itself (e.g. an outbox entry) cannot be read.

    Retrying cannot fix it: the reader dead-letters or drops it, and says why.
    """
