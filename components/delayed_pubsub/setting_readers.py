"""How one component setting's text becomes its value: integers, booleans, Go durations,
host lists, PEM contents and file paths. Each reader is (key, text) → value and refuses a bad
text with InvalidArgumentError naming the key and the value (a secret redacted); the table that
says which key is read by which reader, with its bounds, is settings.RULES."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final

from delayed_middleware.durations import parse_go_duration
from delayed_middleware.errors import InvalidArgumentError

# Go's time.Duration is int64 nanoseconds: daprd and go-redis cannot express
# more, and Redis takes every millisecond count up to it (XPENDING IDLE, XCLAIM min-idle).
MAX_DURATION_MS: Final = (2**63 - 1) // 1_000_000

_TRUE = frozenset({"true", "t", "yes", "y", "on", "1"})
_FALSE = frozenset({"false", "f", "no", "n", "off", "0", ""})

# A reader turns a key's given text (unstripped) into its field's value, or raises
# InvalidArgumentError naming the key and the value.
Reader = Callable[[str, str], Any]


def stripped(read: Reader) -> Reader:
    """`read` given the text without the blanks around it."""
    return lambda key, raw: read(key, raw.strip())


def integer(minimum: int, maximum: int) -> Reader:
    """An integer from `minimum` to `maximum`, in ASCII decimal digits."""
    return lambda key, raw: read_int(key, raw.strip(), minimum, maximum)


def go_duration(maximum: int = MAX_DURATION_MS) -> Reader:
    """A Go duration (500ms, 90s, 1h30m) in milliseconds, from 0 to `maximum`."""
    return lambda key, raw: duration(key, raw.strip(), maximum)


def text(key: str, raw: str) -> str:
    """The text as given."""
    return raw


def text_or_none(key: str, raw: str) -> str | None:
    """The text as given; empty: None."""
    return raw or None


def file_path(key: str, path: str) -> str:
    """An absolute file path (clientCertFile, clientKeyFile), not PEM contents."""
    # Whether the file is there is checked at Init (connection.py), where a pod's
    # volume is mounted; here only that it is a path.
    if "-----BEGIN" in path or not path.startswith("/"):
        shown = path if "-----BEGIN" not in path else f"<{len(path)} characters, redacted>"
        raise InvalidArgumentError(
            key, shown, "must be an absolute file path (PEM contents go in " + key[:-4] + ")"
        )
    return path


def pem(key: str, contents: str) -> str:
    """PEM contents (clientCert, clientKey), not a path; a key's text is never echoed."""
    # Only the shape is checked here; a wrong key fails at connect, naming the host.
    if "-----BEGIN" not in contents:
        # A private key must not be echoed, not even its first characters.
        shown = _redact(contents) if key == "clientCert" else f"<{len(contents)} characters, redacted>"
        raise InvalidArgumentError(key, shown, "must be PEM contents, not a path")
    return contents


def address(key: str, value: str) -> str:
    """host:port or unix:///path: no blanks inside."""
    if any(c.isspace() for c in value):
        raise InvalidArgumentError(key, value, "not host:port (or unix:///path)")
    return value


def format_host(host: str, port: int) -> str:
    """`host:port`, an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def redis_hosts(raw: str, default_port: int) -> tuple[tuple[str, int], ...]:
    """redisHost: `host[:port]`, comma-separated, `[ipv6]:port`; a URL's credentials never echoed."""
    if not raw:
        raise InvalidArgumentError("redisHost", raw, "required (host or host:port)")
    # A URL-form `redis://user:password@host` is refused, and its credentials
    # must not travel back in the error (nor into daprd's logs).
    shown = _without_userinfo(raw)
    hosts: list[tuple[str, int]] = []
    for part in shown.split(","):
        item = part.strip()
        host, port_text = item, ""
        if item.startswith("["):  # [ipv6]:port
            end = item.find("]")
            if end < 0:
                raise InvalidArgumentError("redisHost", shown, f"unclosed '[' in {item!r}")
            host, rest = item[1:end], item[end + 1 :]
            if rest and not rest.startswith(":"):
                raise InvalidArgumentError("redisHost", shown, f"garbage after ']' in {item!r}")
            port_text = rest[1:]
        elif item.count(":") == 1:
            host, port_text = item.split(":")
        if not host or any(c.isspace() or c in "/@" for c in host):
            raise InvalidArgumentError("redisHost", shown, f"bad host {item!r}")
        port = default_port
        if port_text:
            if not _is_decimal(port_text) or not 1 <= int(port_text) <= 65535:
                raise InvalidArgumentError("redisHost", shown, f"bad port in {item!r}")
            port = int(port_text)
        hosts.append((host, port))
    return tuple(hosts)


def _without_userinfo(raw: str) -> str:
    """`raw` with everything before its last `@` (a URL's user:password, which
    may itself hold commas or colons) replaced by `***`."""
    if "@" not in raw:
        return raw
    return "***@" + raw.rsplit("@", 1)[1]


def read_int(key: str, text: str, minimum: int, maximum: int) -> int:
    """The integer `text` (stripped), from `minimum` to `maximum`."""
    # int() alone would also take "5_000", "+5" and non-ASCII digits.
    if not _is_decimal(text.removeprefix("-")):
        raise InvalidArgumentError(key, text, "not an integer")
    value = _decimal(text)
    if not minimum <= value <= maximum:
        raise InvalidArgumentError(key, text, f"must be between {minimum} and {maximum}")
    return value


def boolean(key: str, raw: str) -> bool:
    """true/false and their spellings (yes/no, on/off, 1/0, t/f, y/n), any case."""
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise InvalidArgumentError(key, raw, "not a boolean (true/false)")


def duration(key: str, text: str, maximum: int) -> int:
    """A non-negative Go duration in milliseconds, at most `maximum`."""
    try:
        ms = parse_go_duration(text)
    except ValueError:
        raise InvalidArgumentError(key, text, "not a Go duration (e.g. 500ms, 30s, 1h)") from None
    if ms < 0:
        raise InvalidArgumentError(key, text, "must not be negative")
    return _at_most(key, text, ms, maximum)


def legacy_ms(key: str, text: str) -> int:
    """A Go duration, or a bare integer meaning milliseconds (pubsub.redis's legacy form)."""
    if _is_decimal(text):
        return _at_most(key, text, _decimal(text), MAX_DURATION_MS)
    return duration(key, text, MAX_DURATION_MS)


def _at_most(key: str, raw: str, ms: int, maximum: int) -> int:
    if ms > maximum:
        raise InvalidArgumentError(key, raw, f"must be at most {maximum}ms ({maximum // 86_400_000} days)")
    return ms


def _decimal(text: str) -> int:
    """int(text) of a checked decimal; past 30 digits a stand-in of the same sign
    that every range refuses (int() itself raises ValueError past 4300 digits)."""
    if len(text.lstrip("-").lstrip("0")) > 30:
        return -(10**30) if text.startswith("-") else 10**30
    return int(text)


def _is_decimal(text: str) -> bool:
    # str.isdigit() is also true for "²" and other digits int() refuses.
    return text.isascii() and text.isdigit()


def _redact(value: str) -> str:
    return value if len(value) <= 16 else value[:16] + "…"
