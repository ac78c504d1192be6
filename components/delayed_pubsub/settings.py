"""Init metadata → Settings: one component instance's configuration.

The keys and defaults are pubsub.redis's, so a YAML written for Dapr's built-in
Redis pub/sub works unchanged after switching `type:`; our own keys sit beside
them. Parsing is pure: every malformed value raises InvalidArgumentError naming
the key and the value, before any connection is attempted.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final, Literal

from delayed_middleware.durations import parse_go_duration
from delayed_middleware.errors import InvalidArgumentError
from delayed_middleware.keys import check_consumer_id, is_delayed_topic, is_engine_key
from delayed_middleware.retry import RetryPolicy, parse_retry_policy
from delayed_middleware.target import check_target_name
from delayed_pubsub.settings_spec import load_spec, unknown_key_warnings

log = logging.getLogger(__name__)

DEFAULT_PORT = 6379
# delayShards: default on Redis Cluster (spreads over 3..16 masters), and the most allowed.
DEFAULT_CLUSTER_SHARDS = 16
MAX_DELAY_SHARDS = 1024

# Every key we read, as metadata.yaml declares them (settings_spec). Anything
# else daprd hands us is ignored, with a warning at Init (unknown_keys).
SPEC: Final = load_spec()
KNOWN_KEYS: Final = SPEC.names

# Upper bounds, checked at Init so a value that parses but that Redis (or the
# data path) would refuse later fails now, naming its key. See RELIABILITY.md.
# Go's time.Duration is int64 nanoseconds: daprd and go-redis cannot express
# more, and Redis takes every millisecond count up to it (XPENDING IDLE, XCLAIM min-idle).
MAX_DURATION_MS = (2**63 - 1) // 1_000_000
# The trim MINID is now - streamTTL: it must stay a valid (positive) stream id.
MAX_STREAM_TTL_MS = 10 * 365 * 86_400_000
# XADD MAXLEN and most Redis counts are signed 64-bit.
MAX_REDIS_COUNT = 2**63 - 1
# Redis's SELECT index is a C int.
MAX_REDIS_DB = 2**31 - 1
# Each unit of concurrency/queueDepth may hold one message in our memory.
MAX_IN_FLIGHT = 100_000
# Redis's default maxclients.
MAX_POOL_SIZE = 10_000
MAX_RETRIES = 1_000
# One hand-off call (handoffTimeout): a day is past any broker's accept time.
MAX_HANDOFF_TIMEOUT_MS = 86_400_000
# Calls held by the process (queued in gRPC or running) before publishes are refused
# with RESOURCE_EXHAUSTED (admission.py): about 0.25 s of delayed publishes for one
# process on a small machine, so a caller past it hears at once instead of queueing.
DEFAULT_MAX_INFLIGHT_PUBLISHES = 256

_TRUE = frozenset({"true", "t", "yes", "y", "on", "1"})
_FALSE = frozenset({"false", "f", "no", "n", "off", "0", ""})


@dataclass(frozen=True)
class Settings:
    """One component instance's configuration; every duration in milliseconds."""

    hosts: tuple[tuple[str, int], ...]
    username: str | None = None
    password: str | None = None
    db: int = 0
    redis_type: Literal["node", "cluster"] = "node"
    failover: bool = False
    sentinel_master_name: str = ""
    enable_tls: bool = False
    insecure_skip_tls_verify: bool = False
    client_cert: str | None = None
    client_key: str | None = None
    # The same as files (a Secret mounted read-only), read at each dial.
    client_cert_file: str | None = None
    client_key_file: str | None = None
    consumer_id: str = ""
    processing_timeout_ms: int = 60_000
    redeliver_interval_ms: int = 15_000
    queue_depth: int = 100
    concurrency: int = 10
    max_len_approx: int | None = None
    stream_ttl_ms: int | None = None
    max_retries: int = 3
    dial_timeout_ms: int | None = 5_000
    read_timeout_ms: int | None = 3_000
    write_timeout_ms: int | None = 3_000
    pool_size: int | None = None
    # The bound of admission control (admission.py): past it Publish/BulkPublish are refused.
    max_inflight_publishes: int = DEFAULT_MAX_INFLIGHT_PUBLISHES
    enable_delayed_messaging: bool = False
    max_delay_ms: int | None = None
    # The delay engine's lifecycle history: entries kept (0 = no history) and age.
    history_max_len: int = 1_000_000
    history_max_age_ms: int = 86_400_000
    # Markers on a topic when a cancel or an expiry removes its message: their TTL; 0 = no markers.
    delete_marker_ttl_ms: int = 0
    # Delayed messages without targetPubsub go to this pub/sub when due ('' = our own topics).
    default_target_pubsub: str = ""
    # The sidecar's gRPC API for hand-offs ('' = $DAPR_GRPC_PORT, else 127.0.0.1:50001).
    dapr_grpc_address: str = ""
    # One hand-off call to the sidecar; past it the call is a failed attempt.
    handoff_timeout_ms: int = 10_000
    # Where a hand-off that failed its last attempt goes ('' = keep retrying).
    dead_letter_topic: str = ""
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    # Shard streams of the delayed topic (None: 16 on Redis Cluster, 1 on a single node).
    delay_shards: int | None = None

    @property
    def shards(self) -> int:
        """How many shard streams the delayed topic has (delayShards, else the deployment's default)."""
        if self.delay_shards:
            return self.delay_shards
        return DEFAULT_CLUSTER_SHARDS if self.redis_type == "cluster" else 1

    @property
    def address(self) -> str:
        """`host:port[,host:port…]`, as an operator would write it in redisHost."""
        return ",".join(_format_host(h, p) for h, p in self.hosts)


def parse_settings(props: Mapping[str, str]) -> Settings:
    """Parse Init metadata (the YAML's spec.metadata, secrets resolved) into Settings.

    Raises InvalidArgumentError for the first malformed value, naming its key.
    Keys it does not read are ignored here; `unknown_keys` says which.
    """
    port = _int(props, "redisPort", DEFAULT_PORT, minimum=1, maximum=65535)
    hosts = _hosts(props.get("redisHost", "").strip(), port)

    redis_type = props.get("redisType", "node").strip().lower() or "node"
    if redis_type not in ("node", "cluster"):
        raise InvalidArgumentError("redisType", props["redisType"], "must be node or cluster")
    db = _int(props, "redisDB", 0, minimum=0, maximum=MAX_REDIS_DB)
    if redis_type == "cluster" and db != 0:
        raise InvalidArgumentError("redisDB", props["redisDB"], "Redis Cluster has only database 0")

    failover = _bool(props, "failover", False)
    master = props.get("sentinelMasterName", "").strip()
    if failover and not master:
        raise InvalidArgumentError("sentinelMasterName", master, "required when failover is true")
    if failover and redis_type == "cluster":
        raise InvalidArgumentError("failover", props["failover"], "sentinel failover needs redisType node")

    client_cert_file = props.get("clientCertFile", "").strip() or None
    client_key_file = props.get("clientKeyFile", "").strip() or None
    if client_cert_file and not client_key_file:
        raise InvalidArgumentError("clientKeyFile", "", "required when clientCertFile is set")
    if client_key_file and not client_cert_file:
        raise InvalidArgumentError("clientCertFile", "", "required when clientKeyFile is set")
    if client_cert_file and props.get("clientCert"):
        raise InvalidArgumentError(
            "clientCertFile", client_cert_file, "give clientCert or clientCertFile, not both"
        )
    for key, path in (("clientCertFile", client_cert_file), ("clientKeyFile", client_key_file)):
        # Whether the file is there is checked at Init (connection.py), where a pod's
        # volume is mounted; here only that it is a path.
        if path is not None and ("-----BEGIN" in path or not path.startswith("/")):
            shown = path if "-----BEGIN" not in path else f"<{len(path)} characters, redacted>"
            raise InvalidArgumentError(
                key, shown, "must be an absolute file path (PEM contents go in " + key[:-4] + ")"
            )

    client_cert = props.get("clientCert") or None
    client_key = props.get("clientKey") or None
    if client_cert and not client_key:
        raise InvalidArgumentError("clientKey", "", "required when clientCert is set")
    if client_key and not client_cert:
        raise InvalidArgumentError("clientCert", "", "required when clientKey is set")
    for key, pem in (("clientCert", client_cert), ("clientKey", client_key)):
        # Only the shape is checked here; a wrong key fails at connect, naming the host.
        if pem is not None and "-----BEGIN" not in pem:
            # A private key must not be echoed, not even its first characters.
            shown = _redact(pem) if key == "clientCert" else f"<{len(pem)} characters, redacted>"
            raise InvalidArgumentError(key, shown, "must be PEM contents, not a path")

    consumer_id = props.get("consumerID", "").strip()
    # Every key of the app derives from it: an id that could name another app's keys is refused
    # even without delayed messaging (the retry records and dead-letter sets derive from it too).
    check_consumer_id(consumer_id)

    read_timeout = _timeout(props, "readTimeout", 3_000)
    max_retries = _int(props, "redisMaxRetries", 3, minimum=-1, maximum=MAX_RETRIES)
    default_target, dapr_address, dead_letter = _forwarding(props)

    return Settings(
        hosts=hosts,
        username=props.get("redisUsername") or None,
        password=props.get("redisPassword") or None,
        db=db,
        redis_type="cluster" if redis_type == "cluster" else "node",
        failover=failover,
        sentinel_master_name=master,
        enable_tls=_bool(props, "enableTLS", False),
        client_cert_file=client_cert_file,
        client_key_file=client_key_file,
        insecure_skip_tls_verify=_bool(props, "insecureSkipTLSVerify", False),
        client_cert=client_cert,
        client_key=client_key,
        consumer_id=consumer_id,
        processing_timeout_ms=_legacy_ms(props, "processingTimeout", 60_000),
        redeliver_interval_ms=_legacy_ms(props, "redeliverInterval", 15_000),
        queue_depth=_int(props, "queueDepth", 100, minimum=1, maximum=MAX_IN_FLIGHT),
        concurrency=_int(props, "concurrency", 10, minimum=1, maximum=MAX_IN_FLIGHT),
        max_len_approx=_int(props, "maxLenApprox", 0, minimum=0, maximum=MAX_REDIS_COUNT) or None,
        stream_ttl_ms=_duration(props, "streamTTL", 0, maximum=MAX_STREAM_TTL_MS) or None,
        # go-redis reads -1 as "no retries"; so do we.
        max_retries=max(0, max_retries),
        dial_timeout_ms=_timeout(props, "dialTimeout", 5_000),
        read_timeout_ms=read_timeout,
        write_timeout_ms=_timeout(props, "writeTimeout", read_timeout),
        pool_size=_int(props, "poolSize", 0, minimum=0, maximum=MAX_POOL_SIZE) or None,
        max_inflight_publishes=_int(
            props, "maxInflightPublishes", DEFAULT_MAX_INFLIGHT_PUBLISHES, minimum=1, maximum=MAX_IN_FLIGHT
        ),
        enable_delayed_messaging=_bool(props, "enableDelayedMessaging", False),
        max_delay_ms=_duration(props, "maxDelay", 0) or None,
        history_max_len=_int(props, "historyMaxLen", 1_000_000, 0, 1_000_000_000),
        history_max_age_ms=_duration(props, "historyMaxAge", 86_400_000),
        delete_marker_ttl_ms=_duration(props, "deleteMarkerTTL", 0),
        default_target_pubsub=default_target,
        dapr_grpc_address=dapr_address,
        handoff_timeout_ms=_handoff_timeout(props),
        dead_letter_topic=dead_letter,
        retry=parse_retry_policy(props),
        delay_shards=_int(props, "delayShards", 0, minimum=1, maximum=MAX_DELAY_SHARDS) or None,
    )


def unknown_keys(props: Mapping[str, str]) -> list[str]:
    """A warning for each key of `props` that parse_settings does not read (names only, never values)."""
    return unknown_key_warnings(props, SPEC)


def _forwarding(props: Mapping[str, str]) -> tuple[str, str, str]:
    """defaultTargetPubsub, daprGrpcAddress, deadLetterTopic (delays for any pub/sub)."""
    default_target = props.get("defaultTargetPubsub", "")
    if default_target:
        check_target_name("defaultTargetPubsub", default_target)
    address = props.get("daprGrpcAddress", "").strip()
    if address and any(c.isspace() for c in address):
        raise InvalidArgumentError("daprGrpcAddress", address, "not host:port (or unix:///path)")
    dead_letter = props.get("deadLetterTopic", "").strip()
    if dead_letter and (is_engine_key(dead_letter) or is_delayed_topic(dead_letter)):
        raise InvalidArgumentError(
            "deadLetterTopic", dead_letter, "reserved: names ending in -delayed belong to the delay engine"
        )
    return default_target, address, dead_letter


def _handoff_timeout(props: Mapping[str, str]) -> int:
    ms = _duration(props, "handoffTimeout", 10_000, maximum=MAX_HANDOFF_TIMEOUT_MS)
    if ms <= 0:
        raise InvalidArgumentError("handoffTimeout", props["handoffTimeout"], "must be more than 0")
    return ms


# --- field parsers ------------------------------------------------------------


def _format_host(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _hosts(raw: str, default_port: int) -> tuple[tuple[str, int], ...]:
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


def _int(props: Mapping[str, str], key: str, default: int, minimum: int, maximum: int | None = None) -> int:
    raw = props.get(key, "").strip()
    if not raw:
        return default
    # int() alone would also take "5_000", "+5" and non-ASCII digits.
    if not _is_decimal(raw.removeprefix("-")):
        raise InvalidArgumentError(key, raw, "not an integer")
    value = _decimal(raw)
    if value < minimum or (maximum is not None and value > maximum):
        bound = f"between {minimum} and {maximum}" if maximum is not None else f"at least {minimum}"
        raise InvalidArgumentError(key, raw, f"must be {bound}")
    return value


def _bool(props: Mapping[str, str], key: str, default: bool) -> bool:
    if key not in props:
        return default
    raw = props[key].strip().lower()
    if raw in _TRUE:
        return True
    if raw in _FALSE:
        return False
    raise InvalidArgumentError(key, props[key], "not a boolean (true/false)")


def _duration(props: Mapping[str, str], key: str, default_ms: int, maximum: int = MAX_DURATION_MS) -> int:
    raw = props.get(key, "").strip()
    if not raw:
        return default_ms
    try:
        ms = parse_go_duration(raw)
    except ValueError:
        raise InvalidArgumentError(key, raw, "not a Go duration (e.g. 500ms, 30s, 1h)") from None
    if ms < 0:
        raise InvalidArgumentError(key, raw, "must not be negative")
    _at_most(key, raw, ms, maximum)
    return ms


def _legacy_ms(props: Mapping[str, str], key: str, default_ms: int) -> int:
    """A Go duration, or a bare integer meaning milliseconds (pubsub.redis's legacy form)."""
    raw = props.get(key, "").strip()
    if _is_decimal(raw):
        return _at_most(key, raw, _decimal(raw), MAX_DURATION_MS)
    return _duration(props, key, default_ms)


def _at_most(key: str, raw: str, ms: int, maximum: int) -> int:
    if ms > maximum:
        raise InvalidArgumentError(key, raw, f"must be at most {maximum}ms ({maximum // 86_400_000} days)")
    return ms


def _timeout(props: Mapping[str, str], key: str, default_ms: int | None) -> int | None:
    """Like _legacy_ms, but 0 means "no timeout"."""
    if not props.get(key, "").strip():
        return default_ms
    return _legacy_ms(props, key, 0) or None


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
