"""Init metadata → Settings: one component instance's configuration.

The keys and defaults are pubsub.redis's, so a YAML written for Dapr's built-in
Redis pub/sub works unchanged after switching `type:`; our own keys sit beside
them. Parsing is pure: every malformed value raises InvalidArgumentError naming
the key and the value, before any connection is attempted.

Each key's default is written once, in metadata.yaml: the table below (RULES)
says only how a key's text becomes its Settings field (reader, bounds), and the
same reader turns the declared default into the field's value, for
parse_settings and for the dataclass alike. metadata.yaml is read at the first
use, not at import (settings_spec.spec()).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from delayed_middleware.errors import InvalidArgumentError
from delayed_middleware.keys import check_consumer_id, is_delayed_topic, is_engine_key
from delayed_middleware.retry import READERS as RETRY_READERS
from delayed_middleware.retry import RetryPolicy, parse_retry_policy
from delayed_middleware.storage_format import CURRENT as CURRENT_FORMAT
from delayed_middleware.storage_format import OLDEST as OLDEST_FORMAT
from delayed_middleware.target import check_target_name
from delayed_pubsub.setting_readers import (
    Reader,
    address,
    boolean,
    duration,
    file_path,
    format_host,
    go_duration,
    integer,
    legacy_ms,
    pem,
    read_int,
    redis_hosts,
    stripped,
    text,
    text_or_none,
)
from delayed_pubsub.settings_spec import spec, unknown_key_warnings

log = logging.getLogger(__name__)

# delayShards: default on Redis Cluster (spreads over 3..16 masters), and the most allowed.
DEFAULT_CLUSTER_SHARDS = 16
MAX_DELAY_SHARDS = 1024

# Upper bounds, checked at Init so a value that parses but that Redis (or the
# data path) would refuse later fails now, naming its key. See RELIABILITY.md.
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
# The lifecycle history's length (historyMaxLen).
MAX_HISTORY_LEN = 1_000_000_000


def _declared(name: str) -> Any:
    """The default of Settings field `name`: metadata.yaml's, read by the field's rule, at first use.

    Typed Any so that the dataclass (and mypy) take it as the default of a field of any type;
    at run time it is a dataclasses.Field whose factory reads defaults().
    """
    return field(default_factory=lambda: defaults()[name])


@dataclass(frozen=True)
class Settings:
    """One component instance's configuration; every duration in milliseconds.

    Every default comes from metadata.yaml (see RULES): none is written here.
    """

    hosts: tuple[tuple[str, int], ...]
    username: str | None = _declared("username")
    password: str | None = _declared("password")
    db: int = _declared("db")
    redis_type: Literal["node", "cluster"] = _declared("redis_type")
    failover: bool = _declared("failover")
    sentinel_master_name: str = _declared("sentinel_master_name")
    enable_tls: bool = _declared("enable_tls")
    insecure_skip_tls_verify: bool = _declared("insecure_skip_tls_verify")
    client_cert: str | None = _declared("client_cert")
    client_key: str | None = _declared("client_key")
    # The same as files (a Secret mounted read-only), read at each dial.
    client_cert_file: str | None = _declared("client_cert_file")
    client_key_file: str | None = _declared("client_key_file")
    consumer_id: str = _declared("consumer_id")
    processing_timeout_ms: int = _declared("processing_timeout_ms")
    redeliver_interval_ms: int = _declared("redeliver_interval_ms")
    queue_depth: int = _declared("queue_depth")
    concurrency: int = _declared("concurrency")
    max_len_approx: int | None = _declared("max_len_approx")
    stream_ttl_ms: int | None = _declared("stream_ttl_ms")
    max_retries: int = _declared("max_retries")
    dial_timeout_ms: int | None = _declared("dial_timeout_ms")
    read_timeout_ms: int | None = _declared("read_timeout_ms")
    # Without writeTimeout: readTimeout's.
    write_timeout_ms: int | None = _declared("write_timeout_ms")
    pool_size: int | None = _declared("pool_size")
    # The bound of admission control (admission.py): past it Publish/BulkPublish are refused.
    max_inflight_publishes: int = _declared("max_inflight_publishes")
    enable_delayed_messaging: bool = _declared("enable_delayed_messaging")
    max_delay_ms: int | None = _declared("max_delay_ms")
    # The delay engine's lifecycle history: entries kept (0 = no history) and age.
    history_max_len: int = _declared("history_max_len")
    history_max_age_ms: int = _declared("history_max_age_ms")
    # Markers on a topic when a cancel or an expiry removes its message: their TTL; 0 = no markers.
    delete_marker_ttl_ms: int = _declared("delete_marker_ttl_ms")
    # Delayed messages without targetPubsub go to this pub/sub when due ('' = our own topics).
    default_target_pubsub: str = _declared("default_target_pubsub")
    # The sidecar's gRPC API for hand-offs ('' = $DAPR_GRPC_PORT, else 127.0.0.1:50001).
    dapr_grpc_address: str = _declared("dapr_grpc_address")
    # One hand-off call to the sidecar; past it the call is a failed attempt.
    handoff_timeout_ms: int = _declared("handoff_timeout_ms")
    # Where a hand-off that failed its last attempt goes ('' = keep retrying).
    dead_letter_topic: str = _declared("dead_letter_topic")
    # Inactive until a retry key is given; the retry keys' defaults apply once it is on.
    # (RUF009: _declared gives a dataclasses.Field, whose factory makes the default per instance.)
    retry: RetryPolicy = _declared("retry")  # noqa: RUF009
    # Shard streams of the delayed topic (None: 16 on Redis Cluster, 1 on a single node).
    delay_shards: int | None = _declared("delay_shards")
    # storageFormat: the storage format to write (None: the one stored; a fresh app the newest).
    storage_format: int | None = _declared("storage_format")

    @property
    def shards(self) -> int:
        """How many shard streams the delayed topic has (delayShards, else the deployment's default)."""
        if self.delay_shards:
            return self.delay_shards
        return DEFAULT_CLUSTER_SHARDS if self.redis_type == "cluster" else 1

    @property
    def address(self) -> str:
        """`host:port[,host:port…]`, as an operator would write it in redisHost."""
        return ",".join(format_host(h, p) for h, p in self.hosts)


# --- a rule: how one key is read ---------------------------------------------------------


@dataclass(frozen=True)
class Rule:
    """How one metadata key is read. Its default is metadata.yaml's, read by the same reader.

    Attributes:
        key: the metadata key (as in metadata.yaml).
        field: the Settings field it fills ('' for a key read only with others: redisPort).
        read: the reader (key, text) → value.
        unset: the value when the key is not given and metadata.yaml declares no default
            (the description says what it means: none, unlimited, another key's).
        strip: blanks around the value are not part of it (False: passwords, PEM, names kept as given).
        zero_is_unset: 0 means "none"/"no limit": the field holds None.
    """

    key: str
    field: str
    read: Reader
    unset: object = None
    strip: bool = True
    zero_is_unset: bool = False

    def given(self, props: Mapping[str, str]) -> str | None:
        """The text given for the key, or None when it is absent or blank."""
        raw = props.get(self.key)
        if raw is None or (raw.strip() if self.strip else raw) == "":
            return None
        return raw

    def value(self, props: Mapping[str, str]) -> Any:
        """The field's value: the given text's, else the declared default's, else `unset`."""
        raw = self.given(props)
        if raw is None:
            return declared()[self.key]
        return self.finish(self.read(self.key, raw))

    def finish(self, value: object) -> object:
        """The value the field holds for what the reader returned."""
        return None if self.zero_is_unset and value == 0 else value


# --- readers of one key that need more than setting_readers --------------------------------


def _choice(key: str, raw: str) -> str:
    allowed = spec().get(key).allowed_values
    value = raw.strip().lower()
    if value not in allowed:
        raise InvalidArgumentError(key, raw, "must be " + " or ".join(allowed))
    return value


def _consumer_id(key: str, consumer_id: str) -> str:
    # Every key of the app derives from it: an id that could name another app's keys is refused
    # even without delayed messaging (the retry records and dead-letter sets derive from it too).
    check_consumer_id(consumer_id, key)
    return consumer_id


def _dead_letter_topic(key: str, topic: str) -> str:
    if is_engine_key(topic) or is_delayed_topic(topic):
        raise InvalidArgumentError(
            key, topic, "reserved: names ending in -delayed belong to the delay engine"
        )
    return topic


def _max_retries(key: str, text: str) -> int:
    # go-redis reads -1 as "no retries"; so do we.
    return max(0, read_int(key, text, -1, MAX_RETRIES))


def _handoff_timeout(key: str, raw: str) -> int:
    ms = duration(key, raw.strip(), MAX_HANDOFF_TIMEOUT_MS)
    if ms <= 0:
        raise InvalidArgumentError(key, raw, "must be more than 0")
    return ms


# --- the table ---------------------------------------------------------------------------

# The Settings fields, in the order the checks run: the first bad value found is the one refused.
RULES: Final[tuple[Rule, ...]] = (
    Rule("redisPort", "", integer(1, 65535)),
    Rule("redisType", "redis_type", _choice),
    Rule("redisDB", "db", integer(0, MAX_REDIS_DB)),
    Rule("failover", "failover", boolean),
    Rule("sentinelMasterName", "sentinel_master_name", stripped(text), unset=""),
    Rule("clientCertFile", "client_cert_file", stripped(file_path)),
    Rule("clientKeyFile", "client_key_file", stripped(file_path)),
    Rule("clientCert", "client_cert", pem, strip=False),
    Rule("clientKey", "client_key", pem, strip=False),
    Rule("consumerID", "consumer_id", stripped(_consumer_id), unset=""),
    Rule("readTimeout", "read_timeout_ms", stripped(legacy_ms), zero_is_unset=True),
    Rule("redisMaxRetries", "max_retries", stripped(_max_retries)),
    Rule("defaultTargetPubsub", "default_target_pubsub", check_target_name, unset="", strip=False),
    Rule("daprGrpcAddress", "dapr_grpc_address", stripped(address), unset=""),
    Rule("deadLetterTopic", "dead_letter_topic", stripped(_dead_letter_topic), unset=""),
    Rule("redisUsername", "username", text_or_none, strip=False),
    Rule("redisPassword", "password", text_or_none, strip=False),
    Rule("enableTLS", "enable_tls", boolean),
    Rule("insecureSkipTLSVerify", "insecure_skip_tls_verify", boolean),
    Rule("processingTimeout", "processing_timeout_ms", stripped(legacy_ms)),
    Rule("redeliverInterval", "redeliver_interval_ms", stripped(legacy_ms)),
    Rule("queueDepth", "queue_depth", integer(1, MAX_IN_FLIGHT)),
    Rule("concurrency", "concurrency", integer(1, MAX_IN_FLIGHT)),
    Rule("maxLenApprox", "max_len_approx", integer(0, MAX_REDIS_COUNT), zero_is_unset=True),
    Rule("streamTTL", "stream_ttl_ms", go_duration(MAX_STREAM_TTL_MS), zero_is_unset=True),
    Rule("dialTimeout", "dial_timeout_ms", stripped(legacy_ms), zero_is_unset=True),
    # Not given: readTimeout's (parse_settings).
    Rule("writeTimeout", "write_timeout_ms", stripped(legacy_ms), zero_is_unset=True),
    Rule("poolSize", "pool_size", integer(0, MAX_POOL_SIZE), zero_is_unset=True),
    Rule("maxInflightPublishes", "max_inflight_publishes", integer(1, MAX_IN_FLIGHT)),
    Rule("enableDelayedMessaging", "enable_delayed_messaging", boolean),
    Rule("maxDelay", "max_delay_ms", go_duration(), zero_is_unset=True),
    Rule("historyMaxLen", "history_max_len", integer(0, MAX_HISTORY_LEN)),
    Rule("historyMaxAge", "history_max_age_ms", go_duration()),
    Rule("deleteMarkerTTL", "delete_marker_ttl_ms", go_duration()),
    Rule("handoffTimeout", "handoff_timeout_ms", _handoff_timeout),
    Rule("delayShards", "delay_shards", integer(1, MAX_DELAY_SHARDS)),
    Rule("storageFormat", "storage_format", integer(OLDEST_FORMAT, CURRENT_FORMAT)),
)
_RULE: Final = {r.key: r for r in RULES}
# The retry keys, read by retry.py's readers into RetryPolicy attributes (also per subscription).
RETRY_RULES: Final = tuple(Rule(key, attribute, read) for key, (attribute, read) in RETRY_READERS.items())


def _default_value(rule: Rule) -> Any:
    """metadata.yaml's default of the rule's key read by its own reader (a bad default fails
    here, naming its key), else the rule's `unset`."""
    default = spec().get(rule.key).default
    given = None if default is None else rule.given({rule.key: default})
    return rule.unset if given is None else rule.finish(rule.read(rule.key, given))


@functools.cache
def declared() -> Mapping[str, Any]:
    """Each key's value when it is not given (RULES), read from metadata.yaml at the first call."""
    return {rule.key: _default_value(rule) for rule in RULES}


@functools.cache
def defaults() -> Mapping[str, Any]:
    """Every Settings field's default (hosts aside): what metadata without the key gives."""
    # The retry keys' declared defaults, in an inactive policy: they apply once a retry key turns it on.
    retry = {r.field: _default_value(r) for r in RETRY_RULES if spec().get(r.key).default is not None}
    return {**_fields({}), "retry": RetryPolicy(**retry)}


def parse_settings(props: Mapping[str, str]) -> Settings:
    """Parse Init metadata (the YAML's spec.metadata, secrets resolved) into Settings.

    Raises InvalidArgumentError for the first malformed value, naming its key.
    Keys it does not read are ignored here; `unknown_keys` says which.
    Each key alone is read by its rule (RULES); here remain the rules that involve several keys.
    """
    port = _RULE["redisPort"].value(props)
    hosts = redis_hosts(props.get("redisHost", "").strip(), port)
    values = _fields(props)
    _check_deployment(props, values)
    _check_tls_pairs(props, values)
    retry = parse_retry_policy(props, defaults()["retry"], component=True)
    return Settings(hosts=hosts, retry=retry, **values)


def _fields(props: Mapping[str, str]) -> dict[str, Any]:
    values = {rule.field: rule.value(props) for rule in RULES if rule.field}
    if _RULE["writeTimeout"].given(props) is None:
        values["write_timeout_ms"] = values["read_timeout_ms"]
    return values


def _check_deployment(props: Mapping[str, str], values: Mapping[str, Any]) -> None:
    """redisType with redisDB and failover; failover with sentinelMasterName."""
    if values["redis_type"] == "cluster" and values["db"] != 0:
        raise InvalidArgumentError("redisDB", props["redisDB"], "Redis Cluster has only database 0")
    if values["failover"] and not values["sentinel_master_name"]:
        raise InvalidArgumentError(
            "sentinelMasterName", values["sentinel_master_name"], "required when failover is true"
        )
    if values["failover"] and values["redis_type"] == "cluster":
        raise InvalidArgumentError("failover", props["failover"], "sentinel failover needs redisType node")


def _check_tls_pairs(props: Mapping[str, str], values: Mapping[str, Any]) -> None:
    """A client certificate and its key come together, as PEM contents or as files, not both."""
    for cert, key in (("clientCertFile", "clientKeyFile"), ("clientCert", "clientKey")):
        cert_given = values[_RULE[cert].field] is not None
        key_given = values[_RULE[key].field] is not None
        if cert_given and not key_given:
            raise InvalidArgumentError(key, "", f"required when {cert} is set")
        if key_given and not cert_given:
            raise InvalidArgumentError(cert, "", f"required when {key} is set")
        if cert == "clientCertFile" and cert_given and props.get("clientCert"):
            raise InvalidArgumentError(
                cert, values["client_cert_file"], "give clientCert or clientCertFile, not both"
            )


def unknown_keys(props: Mapping[str, str]) -> list[str]:
    """A warning for each key of `props` that parse_settings does not read (names only, never values)."""
    return unknown_key_warnings(props, spec())


@functools.cache
def known_keys() -> frozenset[str]:
    """Every metadata key the component reads (metadata.yaml's)."""
    return spec().names


def __getattr__(name: str) -> frozenset[str]:
    # KNOWN_KEYS, read at first use (not at import: metadata.yaml is parsed only when needed).
    if name == "KNOWN_KEYS":
        return known_keys()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
