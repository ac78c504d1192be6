"""What Redis answered, read in one place: error replies by their code, script statuses as text.

Redis starts every error reply with a code word: `WRONGTYPE Operation against a
key ...`, `BUSYGROUP Consumer Group name already exists`, `NOGROUP No such key
...`. redis-py turns some codes into classes of their own (its parser's
EXCEPTION_CLASSES: NOSCRIPT is a NoScriptError, MOVED a MovedError, ...) and
cuts the code from their text; every other reply is a plain ResponseError whose
text starts with the code. `reply_code` undoes both ways to give the code, and
the predicates below ask for one code each, so no caller matches error text.

A connection that broke or timed out has no reply code: TRANSIENT_ERRORS
names those errors, REDIS_ERRORS everything Redis or the network can raise.
"""

from __future__ import annotations

import re
from typing import Final

from redis.exceptions import (
    AskError,
    AuthenticationError,
    BusyLoadingError,
    ClusterCrossSlotError,
    ClusterDownError,
    ExecAbortError,
    MasterDownError,
    MovedError,
    NoPermissionError,
    NoScriptError,
    OutOfMemoryError,
    ReadOnlyError,
    RedisClusterException,
    RedisError,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import (
    ConnectionError as RedisConnectionError,
)
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.sentinel import MasterNotFoundError

# Errors that mean "Redis is not there right now" rather than "Redis said no".
# RedisClusterException is no RedisError: redis-py raises it when no cluster
# node answers (or none has cluster mode on) while it maps the slots.
TRANSIENT_ERRORS: Final[tuple[type[BaseException], ...]] = (
    RedisConnectionError,
    RedisTimeoutError,
    BusyLoadingError,
    TryAgainError,
    ClusterDownError,
    RedisClusterException,
    MasterNotFoundError,
    OSError,
)
# Transient or not: anything Redis or the network can throw at a call.
REDIS_ERRORS: Final[tuple[type[BaseException], ...]] = (*TRANSIENT_ERRORS, RedisError)

# redis-py's classes whose text has lost its code (redis-py < 8 does not keep it
# as `status_code` either). AuthenticationError is left out: it stands for
# several codes (WRONGPASS, NOAUTH, some ERR replies).
_CODE_OF_CLASS: Final[tuple[tuple[type[RedisError], str], ...]] = (
    (NoScriptError, "NOSCRIPT"),
    (MovedError, "MOVED"),
    (AskError, "ASK"),
    (TryAgainError, "TRYAGAIN"),
    (ClusterDownError, "CLUSTERDOWN"),
    (ClusterCrossSlotError, "CROSSSLOT"),
    (BusyLoadingError, "LOADING"),
    (ReadOnlyError, "READONLY"),
    (NoPermissionError, "NOPERM"),
    (ExecAbortError, "EXECABORT"),
    (OutOfMemoryError, "OOM"),
    (MasterDownError, "MASTERDOWN"),
)

# What may stand before the reply's own text:
# - redis-py's note on an error raised out of a pipeline, "Command # 2 (XADD t *
#   ...) of pipeline caused error: ", followed by the text or, from the asyncio
#   client, by the repr of the error's args ("('NOGROUP No such key...',)");
# - Redis 6.2's wrapping of an error raised inside a script ("ERR Error running
#   script (call to f_<sha>): @user_script:1: WRONGTYPE ..."; redis-py cuts the
#   ERR). Redis 7 replies with the inner error's own code.
_PIPELINE_NOTE: Final = re.compile(r"Command # \d+ \(.*\) of pipeline caused error: \(?['\"]?", re.DOTALL)
_SCRIPT_NOTE: Final = re.compile(r"Error running script \(call to [^)]*\): @[\w:]+: ")

# Redis's error codes are upper-case words (a few with digits or underscores).
_CODE: Final = re.compile(r"[A-Z][A-Z0-9_]*")

# How far reply_code follows `raise ... from e`: our own errors carry the reply as their cause.
_MAX_CAUSES: Final = 8


def reply_code(error: BaseException | None) -> str | None:
    """The code word of the Redis error reply behind `error` ("WRONGTYPE", "NOGROUP", ...).

    `error` itself or, when it is an error we raised from a Redis error
    (`raise X(...) from e`), the first cause in its chain that Redis sent. None
    when no reply is behind it (a broken connection, a timeout, our own error).
    """
    seen = 0
    while error is not None and seen < _MAX_CAUSES:
        if isinstance(error, RedisError):
            code = _own_code(error)
            if code is not None:
                return code
        error = error.__cause__
        seen += 1
    return None


def _own_code(error: RedisError) -> str | None:
    # redis-py >= 8 keeps the code it cut as `status_code`. ERR is kept for
    # every ERR reply, including Redis 6.2's wrapping of a script's error: the
    # code that matters is then the wrapped one, in the text.
    kept = getattr(error, "status_code", None)
    status = str(kept) if kept else None
    if status is not None and status != "ERR":
        return status
    for cls, code in _CODE_OF_CLASS:
        if isinstance(error, cls):
            return code
    if not isinstance(error, ResponseError):
        return status
    text = str(error.args[0]) if error.args else ""
    note = _PIPELINE_NOTE.match(text)
    if note is not None:
        text = text[note.end() :]
    note = _SCRIPT_NOTE.match(text)
    if note is not None:
        text = text[note.end() :]
    elif status is not None:
        # An ERR reply's text (its code cut) is the message alone: its first word is no code.
        return status
    word = _CODE.fullmatch(text.split(" ", 1)[0])
    return status if word is None else word.group()


def is_wrong_type(error: BaseException | None) -> bool:
    """WRONGTYPE: the key holds another type (a topic name taken by a hash, a set...)."""
    return reply_code(error) == "WRONGTYPE"


def is_busy_group(error: BaseException | None) -> bool:
    """BUSYGROUP: XGROUP CREATE found the consumer group there already."""
    return reply_code(error) == "BUSYGROUP"


def is_no_group(error: BaseException | None) -> bool:
    """NOGROUP: the stream or its consumer group is gone (deleted, or Redis restarted empty)."""
    return reply_code(error) == "NOGROUP"


def is_no_script(error: BaseException | None) -> bool:
    """NOSCRIPT: EVALSHA of a script this server has not loaded (redis-py's scripts load it and retry)."""
    return reply_code(error) == "NOSCRIPT"


def is_moved(error: BaseException | None) -> bool:
    """MOVED: a Redis Cluster node answered for a slot it does not serve."""
    return reply_code(error) == "MOVED"


def is_auth_refusal(error: BaseException | None) -> bool:
    """Redis refused our credentials, or the ACL user may not run the command.

    redis-py maps WRONGPASS, NOAUTH and some ERR replies to AuthenticationError
    (a ConnectionError to it) and NOPERM to NoPermissionError. Replies it does
    not map come as ResponseError: "WRONGPASS ..."/"NOAUTH ..."/"NOPERM ...", and
    "ERR AUTH <password> called without any password configured" (the ERR cut).
    """
    while error is not None and not isinstance(error, RedisError):
        error = error.__cause__
    if isinstance(error, (AuthenticationError, NoPermissionError)):
        return True
    if not isinstance(error, ResponseError):
        return False
    if reply_code(error) in ("WRONGPASS", "NOAUTH", "NOPERM"):
        return True
    return "AUTH" in str(error).split(" ", 2)[:2]


def is_dial_failure(error: BaseException | None) -> bool:
    """The connection could not be made at all (refused, no route, DNS), as
    opposed to one made and then closed by the server.

    redis-py reports both as ConnectionError and tells them apart only in its
    text: "Error 111 connecting to host:port. Connection refused." against
    "Connection closed by server."
    """
    return isinstance(error, RedisConnectionError) and "connecting to" in str(error)


def describe(error: BaseException | None) -> str:
    """The text our errors give for a failed Redis call: `redis: <what Redis or
    redis-py said>`, or `redis: timed out` for an error without text (asyncio's
    TimeoutError when a call's bound passed) or without an error at all (the
    cause of a partial store that had none)."""
    text = "" if error is None else str(error)
    return f"redis: {text or 'timed out'}"


def script_status(value: object) -> str:
    """A status a Lua script returned ("dup", "err", "moved", an error text...)
    as str, whichever way the client decoded it (decode_responses on or off):
    compared against DUP and the like, never against bytes. Bytes that are not
    UTF-8 are replaced, not raised: a status is only compared or shown."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return "" if value is None else str(value)


# The status our scripts return for an operation they had already done (an
# idempotency token seen before, a letter already moved): success, nothing redone.
DUP: Final = "dup"
