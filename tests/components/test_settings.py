"""parse_settings: pubsub.redis's metadata names and defaults, and a refusal naming the key for every bad value."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from delayed_middleware.errors import InvalidArgumentError
from delayed_pubsub.settings import Settings, parse_settings, unknown_keys

BASE = {"redisHost": "localhost:6379"}
PEM_CERT = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"
PEM_KEY = "-----BEGIN PRIVATE KEY-----\nMIIE\n-----END PRIVATE KEY-----\n"


def test_defaults_are_pubsub_redis_defaults() -> None:
    s = parse_settings(BASE)
    assert s == Settings(hosts=(("localhost", 6379),))
    assert (s.processing_timeout_ms, s.redeliver_interval_ms, s.queue_depth, s.concurrency) == (
        60_000,
        15_000,
        100,
        10,
    )
    assert (s.max_len_approx, s.stream_ttl_ms, s.enable_delayed_messaging, s.max_delay_ms) == (
        None,
        None,
        False,
        None,
    )
    assert s.address == "localhost:6379"


@pytest.mark.parametrize(
    ("props", "field", "expected"),
    [
        ({"redisHost": "redis"}, "hosts", (("redis", 6379),)),
        ({"redisHost": "redis", "redisPort": "6380"}, "hosts", (("redis", 6380),)),
        ({"redisHost": "redis:7000", "redisPort": "6380"}, "hosts", (("redis", 7000),)),
        ({"redisHost": "a:1, b:2,c"}, "hosts", (("a", 1), ("b", 2), ("c", 6379))),
        ({"redisHost": "[::1]:6390"}, "hosts", (("::1", 6390),)),
        ({"redisHost": "[::1]"}, "hosts", (("::1", 6379),)),
        ({"redisUsername": "u", "redisPassword": "p:@"}, "password", "p:@"),
        ({"redisUsername": "u"}, "username", "u"),
        ({"redisDB": "15"}, "db", 15),
        ({"redisType": "Cluster"}, "redis_type", "cluster"),
        ({"redisType": ""}, "redis_type", "node"),
        ({"failover": "true", "sentinelMasterName": "mymaster"}, "sentinel_master_name", "mymaster"),
        ({"enableTLS": "TRUE"}, "enable_tls", True),
        ({"enableTLS": "0"}, "enable_tls", False),
        ({"insecureSkipTLSVerify": "yes"}, "insecure_skip_tls_verify", True),
        ({"clientCert": PEM_CERT, "clientKey": PEM_KEY}, "client_key", PEM_KEY),
        ({"consumerID": " myapp "}, "consumer_id", "myapp"),
        # A prefix of another app's id, a -delayed ending, `:` and glob characters keep their own keys.
        ({"consumerID": "a-delayed"}, "consumer_id", "a-delayed"),
        ({"consumerID": "team:orders*"}, "consumer_id", "team:orders*"),
        ({"processingTimeout": "30s"}, "processing_timeout_ms", 30_000),
        ({"processingTimeout": "1m30s"}, "processing_timeout_ms", 90_000),
        # A bare integer is milliseconds, as pubsub.redis has always read it.
        ({"processingTimeout": "500"}, "processing_timeout_ms", 500),
        ({"redeliverInterval": "250"}, "redeliver_interval_ms", 250),
        ({"redeliverInterval": "0"}, "redeliver_interval_ms", 0),
        ({"redeliverInterval": "1.5s"}, "redeliver_interval_ms", 1500),
        ({"queueDepth": "1000"}, "queue_depth", 1000),
        ({"concurrency": "1"}, "concurrency", 1),
        ({"maxLenApprox": "10000"}, "max_len_approx", 10000),
        ({"maxLenApprox": "0"}, "max_len_approx", None),
        ({"streamTTL": "24h"}, "stream_ttl_ms", 86_400_000),
        ({"streamTTL": "0s"}, "stream_ttl_ms", None),
        ({"redisMaxRetries": "-1"}, "max_retries", 0),
        ({"redisMaxRetries": "7"}, "max_retries", 7),
        ({"dialTimeout": "2s"}, "dial_timeout_ms", 2000),
        ({"readTimeout": "10s"}, "write_timeout_ms", 10_000),  # writeTimeout follows readTimeout
        ({"readTimeout": "10s", "writeTimeout": "1s"}, "write_timeout_ms", 1000),
        ({"readTimeout": "0"}, "read_timeout_ms", None),
        ({"poolSize": "20"}, "pool_size", 20),
        ({"enableDelayedMessaging": "true"}, "enable_delayed_messaging", True),
        ({"maxDelay": "720h"}, "max_delay_ms", 720 * 3_600_000),
        ({}, "handoff_timeout_ms", 10_000),
        ({"handoffTimeout": "30s"}, "handoff_timeout_ms", 30_000),
    ],
)
def test_parses(props: dict[str, str], field: str, expected: Any) -> None:
    assert getattr(parse_settings({**BASE, **props}), field) == expected


@pytest.mark.parametrize(
    ("props", "key", "value"),
    [
        ({"redisHost": ""}, "redisHost", ""),
        ({"redisHost": "a b"}, "redisHost", "a b"),
        ({"redisHost": "redis:port"}, "redisHost", "redis:port"),
        ({"redisHost": "redis:70000"}, "redisHost", "redis:70000"),
        ({"redisHost": "redis://x:1"}, "redisHost", "redis://x:1"),
        ({"redisHost": "a,,b"}, "redisHost", "a,,b"),
        ({"redisHost": "[::1"}, "redisHost", "[::1"),
        ({"redisPort": "http"}, "redisPort", "http"),
        ({"redisPort": "0"}, "redisPort", "0"),
        ({"redisPort": "65536"}, "redisPort", "65536"),
        ({"redisDB": "-1"}, "redisDB", "-1"),
        ({"redisDB": "one"}, "redisDB", "one"),
        ({"redisType": "sentinel"}, "redisType", "sentinel"),
        ({"redisType": "cluster", "redisDB": "2"}, "redisDB", "2"),
        ({"failover": "true"}, "sentinelMasterName", ""),
        ({"failover": "ja", "sentinelMasterName": "m"}, "failover", "ja"),
        ({"failover": "true", "sentinelMasterName": "m", "redisType": "cluster"}, "failover", "true"),
        ({"enableTLS": "maybe"}, "enableTLS", "maybe"),
        ({"insecureSkipTLSVerify": "2"}, "insecureSkipTLSVerify", "2"),
        ({"clientCert": PEM_CERT}, "clientKey", ""),
        ({"clientKey": PEM_KEY}, "clientCert", ""),
        ({"clientCert": "/etc/cert.pem", "clientKey": PEM_KEY}, "clientCert", "/etc/cert.pem"),
        ({"clientCertFile": "/etc/c.crt"}, "clientKeyFile", ""),
        ({"clientKeyFile": "/etc/c.key"}, "clientCertFile", ""),
        ({"clientCertFile": "c.crt", "clientKeyFile": "/etc/c.key"}, "clientCertFile", "c.crt"),
        (
            {
                "clientCertFile": "/c.crt",
                "clientKeyFile": "/c.key",
                "clientCert": PEM_CERT,
                "clientKey": PEM_KEY,
            },
            "clientCertFile",
            "/c.crt",
        ),
        ({"processingTimeout": "10 minutes"}, "processingTimeout", "10 minutes"),
        ({"processingTimeout": "-1s"}, "processingTimeout", "-1s"),
        ({"processingTimeout": "5d"}, "processingTimeout", "5d"),
        ({"redeliverInterval": "1.5"}, "redeliverInterval", "1.5"),
        ({"redeliverInterval": "-200"}, "redeliverInterval", "-200"),
        ({"redeliverInterval": "²"}, "redeliverInterval", "²"),
        ({"redisHost": "redis:²"}, "redisHost", "redis:²"),
        ({"queueDepth": "0"}, "queueDepth", "0"),
        ({"queueDepth": "1e3"}, "queueDepth", "1e3"),
        ({"queueDepth": "1_000"}, "queueDepth", "1_000"),
        ({"redisDB": "٣"}, "redisDB", "٣"),
        ({"concurrency": "-3"}, "concurrency", "-3"),
        ({"maxLenApprox": "-1"}, "maxLenApprox", "-1"),
        ({"maxLenApprox": "lots"}, "maxLenApprox", "lots"),
        ({"streamTTL": "1d"}, "streamTTL", "1d"),
        ({"streamTTL": "3600"}, "streamTTL", "3600"),
        ({"redisMaxRetries": "-2"}, "redisMaxRetries", "-2"),
        ({"dialTimeout": "soon"}, "dialTimeout", "soon"),
        ({"readTimeout": "-1"}, "readTimeout", "-1"),
        ({"writeTimeout": "1x"}, "writeTimeout", "1x"),
        ({"poolSize": "-5"}, "poolSize", "-5"),
        ({"enableDelayedMessaging": "sure"}, "enableDelayedMessaging", "sure"),
        ({"maxDelay": "forever"}, "maxDelay", "forever"),
        ({"maxDelay": "-1h"}, "maxDelay", "-1h"),
        # Shard 1 of app `tenant`, and the keys' hash tag: refused with or without delayed messaging.
        ({"consumerID": "tenant~1"}, "consumerID", "tenant~1"),
        ({"consumerID": "{a}", "enableDelayedMessaging": "true"}, "consumerID", "{a}"),
        ({"consumerID": " a} "}, "consumerID", "a}"),
    ],
)
def test_refuses_naming_key_and_value(props: dict[str, str], key: str, value: str) -> None:
    with pytest.raises(InvalidArgumentError) as err:
        parse_settings({**BASE, **props})
    assert err.value.key == key
    assert err.value.value == value
    assert key in str(err.value)


def test_unknown_keys_are_ignored_and_each_has_a_warning() -> None:
    props = {**BASE, "idleTimeout": "5m", "minIdleConns": "3"}
    assert parse_settings(props) == parse_settings(BASE)
    warnings = unknown_keys(props)
    assert len(warnings) == 2
    assert "'idleTimeout'" in warnings[0]
    assert "'minIdleConns'" in warnings[1]


def test_settings_are_frozen() -> None:
    s = parse_settings(BASE)
    with pytest.raises(AttributeError):
        s.concurrency = 3  # type: ignore[misc]


@given(h=st.integers(0, 48), m=st.integers(0, 59), sec=st.integers(0, 59), ms=st.integers(0, 999))
def test_go_durations_parse_to_milliseconds(h: int, m: int, sec: int, ms: int) -> None:
    text = f"{h}h{m}m{sec}s{ms}ms"
    expected = ((h * 60 + m) * 60 + sec) * 1000 + ms
    s = parse_settings({**BASE, "processingTimeout": text, "streamTTL": text, "maxDelay": text})
    assert s.processing_timeout_ms == expected
    assert s.stream_ttl_ms == (expected or None)
    assert s.max_delay_ms == (expected or None)


@given(st.integers(0, 10**12))
def test_bare_integers_are_milliseconds_for_the_legacy_keys(n: int) -> None:
    s = parse_settings({**BASE, "processingTimeout": str(n), "redeliverInterval": str(n)})
    assert (s.processing_timeout_ms, s.redeliver_interval_ms) == (n, n)


@given(st.text(max_size=12))
def test_any_text_either_parses_or_is_refused_naming_the_key(text: str) -> None:
    for key in (
        "redisPort",
        "redisDB",
        "queueDepth",
        "enableTLS",
        "processingTimeout",
        "streamTTL",
        "redisType",
    ):
        error: InvalidArgumentError | None = None
        try:
            parse_settings({**BASE, key: text})
        except InvalidArgumentError as e:
            error = e
        assert error is None or error.key == key


@pytest.mark.parametrize(
    ("props", "shards"),
    [
        ({}, 1),
        ({"redisType": "cluster"}, 16),
        ({"redisType": "cluster", "delayShards": "3"}, 3),
        ({"delayShards": "4"}, 4),
        ({"delayShards": "1024"}, 1024),
    ],
)
def test_delay_shards_default_to_16_on_cluster_and_1_on_a_node(props: dict[str, str], shards: int) -> None:
    assert parse_settings({**BASE, **props}).shards == shards


@pytest.mark.parametrize("bad", ["0", "-3", "1025", "two", "2.0"])
def test_bad_delay_shards_are_refused_naming_the_value(bad: str) -> None:
    with pytest.raises(InvalidArgumentError) as err:
        parse_settings({**BASE, "delayShards": bad})
    assert (err.value.key, err.value.value) == ("delayShards", bad)


# --- ranges: whatever parses must also be usable by Redis and the data path ------

TWO_63 = str(2**63)
GO_MAX_MS = str((2**63 - 1) // 1_000_000)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        # 2^63 overflows Redis's signed 64-bit counts and Go's durations.
        ("maxLenApprox", TWO_63),
        ("maxLenApprox", str(2**64)),
        ("processingTimeout", TWO_63),
        ("processingTimeout", str(int(GO_MAX_MS) + 1)),
        ("redeliverInterval", TWO_63),
        ("dialTimeout", TWO_63),
        ("readTimeout", TWO_63),
        ("writeTimeout", TWO_63),
        ("processingTimeout", "2562048h"),  # beyond Go's int64 nanoseconds
        ("maxDelay", "2562048h"),
        ("streamTTL", "87601h"),  # > 10 years: the trim MINID would go below 0-0 one day
        ("streamTTL", "2562047h"),
        ("queueDepth", TWO_63),
        ("queueDepth", "100001"),
        ("concurrency", TWO_63),
        ("concurrency", "100001"),
        ("concurrency", "0"),
        ("poolSize", TWO_63),
        ("poolSize", "10001"),
        ("redisMaxRetries", TWO_63),
        ("redisMaxRetries", "1001"),
        ("redisDB", str(2**31)),
        ("redisPort", TWO_63),
        ("queueDepth", "-1"),
        ("poolSize", "-1"),
        ("maxLenApprox", "-" + TWO_63),
        ("streamTTL", "-1s"),
        ("dialTimeout", "-1s"),
        ("writeTimeout", "-5"),
        # Past 4300 digits int() itself raises ValueError: still a refusal naming the key.
        ("queueDepth", "7" * 16_384),
        ("processingTimeout", "7" * 16_384),
        ("redisDB", "-" + "7" * 5_000),
    ],
)
def test_out_of_range_numbers_are_refused_at_init_naming_key_and_value(key: str, value: str) -> None:
    with pytest.raises(InvalidArgumentError) as err:
        parse_settings({**BASE, key: value})
    assert (err.value.key, err.value.value) == (key, value)
    assert key in str(err.value)
    assert value[:200] in str(err.value)  # long values are cut


def test_the_largest_accepted_values_parse() -> None:
    s = parse_settings(
        {
            **BASE,
            "maxLenApprox": str(2**63 - 1),
            "processingTimeout": GO_MAX_MS,
            "redeliverInterval": GO_MAX_MS,
            "readTimeout": GO_MAX_MS,
            "queueDepth": "100000",
            "concurrency": "100000",
            "poolSize": "10000",
            "redisMaxRetries": "1000",
            "redisDB": str(2**31 - 1),
            "streamTTL": "87600h",
            "maxDelay": "2562047h",
        }
    )
    assert s.max_len_approx == 2**63 - 1
    assert s.processing_timeout_ms == s.redeliver_interval_ms == int(GO_MAX_MS)
    assert s.stream_ttl_ms == 87600 * 3_600_000


# --- secrets: never echoed ---------------------------------------------------------


@pytest.mark.parametrize(
    "host",
    [
        "redis://user:s3cr3t-pw@localhost:6379",
        "rediss://:s3cr3t-pw@localhost",
        "user:s3cr3t-pw@localhost:6379",
        "redis://user:s3cr3t,pw:x@localhost:6379,other:6380",
    ],
)
def test_a_url_form_redis_host_is_refused_without_echoing_its_password(host: str) -> None:
    with pytest.raises(InvalidArgumentError) as err:
        parse_settings({"redisHost": host})
    assert err.value.key == "redisHost"
    for shown in (str(err.value), err.value.value, err.value.reason):
        assert "s3cr3t" not in shown
    assert "localhost" in str(err.value)  # still says which host was meant


def test_a_client_key_that_is_not_pem_is_refused_without_echoing_any_of_it() -> None:
    key = "MIIEvQIBADANBgkqhkiG9w0BAQEFAASCBKcwggSjAgEAAoIBAQC7"  # base64 without the PEM armour
    with pytest.raises(InvalidArgumentError) as err:
        parse_settings({**BASE, "clientCert": PEM_CERT, "clientKey": key})
    assert err.value.key == "clientKey"
    assert key[:4] not in str(err.value)
    assert "redacted" in str(err.value)


def test_forwarding_keys_default_to_off() -> None:
    s = parse_settings(BASE)
    assert (s.default_target_pubsub, s.dapr_grpc_address, s.dead_letter_topic) == ("", "", "")


def test_forwarding_keys_are_read() -> None:
    s = parse_settings(
        {
            **BASE,
            "defaultTargetPubsub": "kafka",
            "daprGrpcAddress": "127.0.0.1:50002",
            "deadLetterTopic": "undeliverable",
        }
    )
    assert (s.default_target_pubsub, s.dapr_grpc_address, s.dead_letter_topic) == (
        "kafka",
        "127.0.0.1:50002",
        "undeliverable",
    )


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("defaultTargetPubsub", "kaf ka"),
        ("daprGrpcAddress", "127.0.0.1 :50001"),
        ("deadLetterTopic", "app1-delayed"),
        ("deadLetterTopic", "{app1-delayed}:ids"),
        ("handoffTimeout", "0s"),
        ("handoffTimeout", "-1s"),
        ("handoffTimeout", "soon"),
        ("handoffTimeout", "48h"),
    ],
)
def test_bad_forwarding_values_are_refused_naming_the_key(key: str, value: str) -> None:
    with pytest.raises(InvalidArgumentError) as err:
        parse_settings({**BASE, key: value})
    assert err.value.key == key
    assert err.value.value == value
