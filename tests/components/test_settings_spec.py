"""metadata.yaml is the one declaration of the component's settings: the parser, the docs and the shipped
component YAML are held to it, and keys it does not declare are warned about, naming the nearest one."""

from __future__ import annotations

import ast
import logging
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import fields, replace
from pathlib import Path

import pytest
import yaml

from delayed_middleware.errors import InvalidArgumentError
from delayed_middleware.retry import KEYS as RETRY_KEYS
from delayed_pubsub import settings, settings_spec
from delayed_pubsub.settings import RULES, Settings, parse_settings, unknown_keys
from delayed_pubsub.settings_spec import (
    REDIS_ONLY_KEYS,
    TYPES,
    SpecError,
    generated_files,
    load_spec,
    metadata_text,
    spec,
)
from tests.components.driver import Component

ROOT = Path(__file__).resolve().parents[2]
SPEC = spec()
# No port in the host, so redisPort is read.
BASE = {"redisHost": "localhost"}
PEM_CERT = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"
PEM_KEY = "-----BEGIN PRIVATE KEY-----\nMIIE\n-----END PRIVATE KEY-----\n"
# Keys valid only beside another one.
COMPANIONS: Mapping[str, Mapping[str, str]] = {
    "failover": {"sentinelMasterName": "mymaster"},
    "clientCert": {"clientKey": PEM_KEY},
    "clientKey": {"clientCert": PEM_CERT},
    "clientCertFile": {"clientKeyFile": "/etc/redis-client-tls/tls.key"},
    "clientKeyFile": {"clientCertFile": "/etc/redis-client-tls/tls.crt"},
}
# components-contrib's component-metadata schema: the fields it allows (additionalProperties: false).
TOP_LEVEL_FIELDS = {
    "schemaVersion",
    "type",
    "name",
    "version",
    "status",
    "title",
    "description",
    "urls",
    "binding",
    "capabilities",
    "authenticationProfiles",
    "builtinAuthenticationProfiles",
    "metadata",
}
SETTING_FIELDS = {
    "name",
    "description",
    "required",
    "sensitive",
    "type",
    "default",
    "example",
    "allowedValues",
    "binding",
    "url",
    "deprecated",
}


def with_companions(key: str, value: str) -> dict[str, str]:
    pem = {"clientCert": PEM_CERT, "clientKey": PEM_KEY}
    return {**BASE, **COMPANIONS.get(key, {}), key: pem.get(key, value)}


def retry_base(key: str) -> dict[str, str]:
    # A retry key's default applies once the policy is on (any other retry key turns it on).
    return {"maxDeliveryAttempts": "5"} if key in RETRY_KEYS and key != "maxDeliveryAttempts" else {}


class Recording(Mapping[str, str]):
    """Props that remember every key the parser asks about."""

    def __init__(self, props: Mapping[str, str], asked: set[str]) -> None:
        self._props = dict(props)
        self._asked = asked

    def __getitem__(self, key: str) -> str:
        self._asked.add(key)
        return self._props[key]

    def __contains__(self, key: object) -> bool:
        if isinstance(key, str):
            self._asked.add(key)
        return key in self._props

    def __iter__(self) -> Iterator[str]:
        return iter(self._props)

    def __len__(self) -> int:
        return len(self._props)


# --- the file itself ---------------------------------------------------------------------


def test_metadata_yaml_follows_the_components_contrib_schema() -> None:
    doc = yaml.safe_load(metadata_text())
    assert set(doc) <= TOP_LEVEL_FIELDS
    assert (doc["schemaVersion"], doc["type"], doc["name"], doc["version"]) == (
        "v1",
        "pubsub",
        "delayed-pubsub",
        "v1",
    )
    assert doc["status"] in ("stable", "beta", "alpha", "development-only")
    assert doc["title"]
    assert doc["urls"]
    assert all(set(u) == {"title", "url"} and u["url"].startswith("https://") for u in doc["urls"])
    for item in doc["metadata"]:
        assert set(item) <= SETTING_FIELDS, item["name"]
        assert {"name", "description", "example"} <= set(item), item["name"]
        assert item.get("type", "string") in TYPES, item["name"]
        for field in ("default", "example"):
            # The schema's values are strings: an unquoted 5 or true would be a YAML int or bool.
            assert field not in item or isinstance(item[field], str), (item["name"], field)


def test_the_top_level_metadata_yaml_is_the_one_the_package_ships() -> None:
    assert (ROOT / "metadata.yaml").read_text() == metadata_text()


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("metadata:\n  - name: a\n    description: d\n", "example must be a non-empty string"),
        ("metadata:\n  - name: a\n    description: d\n    example: '1'\n    type: int\n", "type 'int'"),
        ("metadata:\n  - name: a\n    description: d\n    example: '1'\n    default: 1\n", "quoted string"),
        ("metadata:\n  - name: a\n    description: d\n    example: '1'\n    default: '1'\n", "must differ"),
        (
            "metadata:\n  - {name: a, description: d, example: '1'}\n  - {name: a, description: d, example: '2'}\n",
            "more than once",
        ),
    ],
)
def test_a_malformed_metadata_yaml_is_refused_saying_why(text: str, said: str) -> None:
    with pytest.raises(SpecError, match=said):
        load_spec(text)


# --- the parser and the declaration agree ----------------------------------------------------


def test_every_key_the_parser_reads_is_declared() -> None:
    asked: set[str] = set()
    parse_settings(Recording({**BASE, "maxDeliveryAttempts": "5"}, asked))
    undeclared = asked - SPEC.names
    assert not undeclared, f"parse_settings reads {sorted(undeclared)}: declare them in metadata.yaml"


@pytest.mark.parametrize("key", sorted(SPEC.names))
def test_every_declared_key_is_read_its_example_changes_the_settings(key: str) -> None:
    setting = SPEC.get(key)
    if setting.required:
        assert parse_settings({**BASE, key: setting.example}) != parse_settings({**BASE, key: "other-host"})
        return
    given = with_companions(key, setting.example)
    without = {k: v for k, v in given.items() if k != key}
    if key in ("clientCert", "clientKey", "clientCertFile", "clientKeyFile"):
        without = BASE  # each needs the other: compare the pair with neither
    assert parse_settings(given) != parse_settings(without), (
        f"{key}: giving its example changes nothing: the parser does not read it"
    )


@pytest.mark.parametrize("key", sorted(s.name for s in SPEC.settings if s.default is not None))
def test_giving_a_declared_default_changes_nothing(key: str) -> None:
    default = SPEC.get(key).default
    assert default is not None
    base = {**BASE, **retry_base(key)}
    assert parse_settings({**base, key: default}) == parse_settings(base), (
        f"{key}: metadata.yaml says the default is {default!r}, the parser disagrees"
    )


@pytest.mark.parametrize(
    ("key", "bad"),
    [
        (s.name, {"number": "twelve", "bool": "maybe", "duration": "5 parsecs"}[s.type])
        for s in SPEC.settings
        if s.type in ("number", "bool", "duration")
    ],
)
def test_a_value_not_of_the_declared_type_is_refused_naming_the_key(key: str, bad: str) -> None:
    with pytest.raises(InvalidArgumentError) as caught:
        parse_settings({**BASE, **retry_base(key), **COMPANIONS.get(key, {}), key: bad})
    assert (caught.value.key, caught.value.value) == (key, bad)


def test_allowed_values_are_exactly_what_the_parser_takes() -> None:
    redis_type = SPEC.get("redisType")
    for value in redis_type.allowed_values:
        parse_settings({**BASE, "redisType": value})
    with pytest.raises(InvalidArgumentError):
        parse_settings({**BASE, "redisType": "sentinel"})


def test_the_required_key_is_required() -> None:
    assert [s.name for s in SPEC.settings if s.required] == ["redisHost"]
    with pytest.raises(InvalidArgumentError) as caught:
        parse_settings({})
    assert caught.value.key == "redisHost"


def test_secrets_are_marked_sensitive() -> None:
    assert {s.name for s in SPEC.settings if s.sensitive} == {"redisPassword", "clientKey"}


def test_subscription_retry_keys_are_declared_as_component_keys_too() -> None:
    assert set(RETRY_KEYS) <= SPEC.names


# --- a default is written once: in metadata.yaml ---------------------------------------------


def test_settings_py_writes_no_default_every_field_takes_metadata_yaml_s() -> None:
    tree = ast.parse(Path(settings.__file__).read_text())
    [cls] = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Settings"]
    for stmt in cls.body:
        if not isinstance(stmt, ast.AnnAssign):
            continue
        assert isinstance(stmt.target, ast.Name)
        name = stmt.target.id
        if name == "hosts":
            assert stmt.value is None  # redisHost is required
            continue
        # `= _declared("<field>")`: metadata.yaml's default through the field's rule, no literal.
        assert isinstance(stmt.value, ast.Call), f"Settings.{name} has a default written in settings.py"
        assert ast.unparse(stmt.value) == f"_declared({name!r})", name
    # The table holds readers and bounds; its `unset` is only "not given" (none, or empty text).
    assert {r.unset for r in RULES} <= {None, ""}


def test_the_table_reads_exactly_the_declared_keys() -> None:
    read = [r.key for r in RULES] + list(RETRY_KEYS) + ["redisHost"]
    assert sorted(set(read)) == sorted(SPEC.names)


@pytest.fixture
def shipped_metadata_yaml() -> Iterator[Callable[[str], None]]:
    """Make one key's example its default in metadata.yaml, as a maintainer editing it would."""
    caches = (settings_spec.spec, settings.declared, settings.defaults, settings.known_keys)
    original = settings_spec.metadata_text

    def edit(key: str) -> None:
        doc = yaml.safe_load(original())
        [item] = [i for i in doc["metadata"] if i["name"] == key]
        # The schema wants a non-empty example other than the default.
        item["default"], item["example"] = item["example"], item["default"] or "another"
        text = yaml.safe_dump(doc, sort_keys=False)
        settings_spec.metadata_text = lambda: text
        for cache in caches:
            cache.cache_clear()

    yield edit
    settings_spec.metadata_text = original
    for cache in caches:
        cache.cache_clear()


@pytest.mark.parametrize("key", sorted(s.name for s in SPEC.settings if s.default is not None))
def test_a_default_edited_in_metadata_yaml_is_the_parsers_and_the_dataclasss(
    key: str, shipped_metadata_yaml: Callable[[str], None]
) -> None:
    example = SPEC.get(key).example
    base = {k: v for k, v in with_companions(key, example).items() if k != key} | retry_base(key)
    hosts = (("localhost", 6379),)
    wanted = parse_settings({**base, key: example})
    before = Settings(hosts=hosts)
    shipped_metadata_yaml(key)  # now `example` is the declared default
    assert parse_settings(base) == wanted
    after = Settings(hosts=hosts)
    changed = {f.name for f in fields(Settings) if getattr(after, f.name) != getattr(before, f.name)}
    owned = {r.field for r in RULES if r.key == key and r.field} | ({"retry"} if key in RETRY_KEYS else set())
    owned |= {"write_timeout_ms"} if key == "readTimeout" else set()  # writeTimeout's default is readTimeout
    assert changed == owned
    for name in changed - {"retry"}:
        assert getattr(after, name) == getattr(wanted, name)
    if key in RETRY_KEYS:
        # The declared defaults sit in the inactive policy until a retry key turns it on.
        assert replace(after.retry, active=True, max_attempts=5) == wanted.retry


def test_importing_the_component_does_not_read_metadata_yaml() -> None:
    # It is read at the first parse (Init), once: `delayed-pubsub --help` or an operator command
    # that needs no settings pays nothing for it.
    code = (
        "import delayed_pubsub.settings_spec as s\n"
        "def read(): raise SystemExit('metadata.yaml read at import')\n"
        "s.metadata_text = read\n"
        "import delayed_pubsub.cli, delayed_pubsub.server, delayed_pubsub.instance, delayed_pubsub.settings\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert (done.returncode, done.stderr) == (0, "")


# --- what is generated from it -----------------------------------------------------------


@pytest.mark.parametrize(("path", "text"), sorted(generated_files(SPEC).items()))
def test_committed_file_is_what_metadata_yaml_generates(path: Path, text: str) -> None:
    committed = (ROOT / path).read_text()
    assert committed == text, f"{path} is out of date: python -m delayed_pubsub.settings_spec --write"


def test_the_shipped_component_yaml_lists_every_key_and_sets_only_valid_values() -> None:
    text = (ROOT / "dapr" / "components" / "delayed-pubsub.yaml").read_text()
    listed = {line.split("name:")[1].strip() for line in text.splitlines() if "- name:" in line}
    assert listed == SPEC.names
    [doc] = yaml.safe_load_all(text)
    props = {m["name"]: m["value"] for m in doc["spec"]["metadata"]}
    assert set(props) <= SPEC.names
    assert parse_settings(props).enable_delayed_messaging


def test_the_docs_table_has_one_row_per_key_with_its_default() -> None:
    docs = (ROOT / "docs" / "component-metadata.md").read_text()
    for s in SPEC.settings:
        [row] = [line for line in docs.splitlines() if line.startswith(f"| `{s.name}` |")]
        if s.default:
            assert f"| `{s.default}` |" in row


# --- keys it does not declare ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "said"),
    [
        (
            "enableDelayMessaging",
            "unknown metadata key 'enableDelayMessaging' is ignored: did you mean enableDelayedMessaging?",
        ),
        ("redisHots", "did you mean redisHost?"),
        ("processingTimout", "did you mean processingTimeout?"),
        ("maxDeliveryAttempt", "did you mean maxDeliveryAttempts?"),
        ("redishost", "did you mean redisHost (keys are case-sensitive)?"),
        (
            "ackOnError",
            "'ackOnError' is a pubsub.redis setting that this component does not implement: accepted there, ignored here",
        ),
        ("idleTimeout", "accepted there, ignored here"),
        ("zebra", "unknown metadata key 'zebra' is ignored (the keys: docs/component-metadata.md)"),
    ],
)
def test_an_unknown_key_is_warned_about_naming_the_nearest_known_one(key: str, said: str) -> None:
    [warning] = unknown_keys({**BASE, key: "v"})
    assert said in warning
    # Still ignored: the settings are those without it.
    assert parse_settings({**BASE, key: "v"}) == parse_settings(BASE)


def test_known_keys_and_redis_only_keys_do_not_overlap_and_known_keys_raise_no_warning() -> None:
    assert not (REDIS_ONLY_KEYS & SPEC.names)
    assert unknown_keys({s.name: s.example for s in SPEC.settings}) == []


def test_a_warning_never_shows_the_value() -> None:
    [warning] = unknown_keys({**BASE, "redisPasword": "s3cret-value"})
    assert "redisPassword" in warning
    assert "s3cret-value" not in warning


async def test_init_warns_about_a_misspelt_key_and_still_starts(
    component: Callable[[str], Component], props: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    c = component("typo")
    with caplog.at_level(logging.WARNING, logger="delayed_pubsub.instance"):
        await c.init({**props, "enableDelayMessaging": "true", "ackOnError": "true"})
    await c.publish("orders", b"{}")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert (
        "instance 'typo': unknown metadata key 'enableDelayMessaging' is ignored: "
        "did you mean enableDelayedMessaging?" in warnings
    )
    assert any("'ackOnError'" in w and "accepted there, ignored here" in w for w in warnings)
