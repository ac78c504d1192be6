"""A Dapr Component YAML as the command-line tools read it: the component's metadata, secrets from the environment.

Both the operator commands (`pending`, `inspect`, ...) and `stats` take
`--component PATH.yaml` and read it here, the same way:

- the Component is the first one of type `pubsub.delayed-pubsub` in the file,
  else the first `pubsub.*` one (a `pubsub.redis` component reads the same streams);
- a `secretKeyRef` value comes from an environment variable: the ref's `key`,
  upper-cased with every character other than A-Z/0-9 turned into `_`
  (`key: redis-password` -> `REDIS_PASSWORD`, as Dapr's local.env secret store
  names them); if that is unset, `<NAME>_<KEY>` likewise (`name: redis, key:
  password` -> `REDIS_PASSWORD`; `name: redis-tls, key: tls.key` -> `REDIS_TLS_TLS_KEY`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

import yaml

from delayed_middleware.errors import DelayedPubSubError

COMPONENT_TYPE: Final = "pubsub.delayed-pubsub"


class ComponentFileError(DelayedPubSubError):
    """A --component YAML that does not give usable metadata (the message says why)."""


def component_properties(path: Path, environ: Mapping[str, str]) -> dict[str, str]:
    """The metadata of the Component in a YAML file, as daprd would hand it to Init."""
    try:
        docs = list(yaml.safe_load_all(path.read_text()))
    except OSError as e:
        raise ComponentFileError(f"cannot read {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ComponentFileError(f"{path} is not valid YAML: {e}") from None
    pubsubs = [
        doc
        for doc in docs
        if isinstance(doc, dict)
        and doc.get("kind") == "Component"
        and str((doc.get("spec") or {}).get("type", "")).startswith("pubsub.")
    ]
    if not pubsubs:
        raise ComponentFileError(f"{path} holds no pub/sub Component (kind: Component, spec.type: pubsub.*)")
    ours = [doc for doc in pubsubs if doc["spec"].get("type") == COMPONENT_TYPE]
    props: dict[str, str] = {}
    for item in (ours or pubsubs)[0]["spec"].get("metadata") or []:
        if not isinstance(item, dict) or "name" not in item:
            raise ComponentFileError(f"{path}: a spec.metadata item has no name: {item!r}")
        name = str(item["name"])
        if "secretKeyRef" in item:
            props[name] = secret_from_env(item["secretKeyRef"], name, environ)
        else:
            props[name] = _yaml_string(item.get("value", ""))
    return props


def secret_env_names(ref: Mapping[str, Any]) -> list[str]:
    """The environment variables a secretKeyRef is read from, in order."""
    name, key = str(ref.get("name", "")), str(ref.get("key", "") or ref.get("name", ""))
    names = [_env_name(key)]
    if name and name != key:
        names.append(_env_name(f"{name}_{key}"))
    return names


def secret_from_env(ref: Any, field: str, environ: Mapping[str, str]) -> str:
    """The value of the secretKeyRef `ref` of metadata `field`, from `environ`."""
    if not isinstance(ref, Mapping):
        raise ComponentFileError(f"{field}: secretKeyRef must be a mapping with name and key")
    names = secret_env_names(ref)
    for env in names:
        if env in environ:
            return environ[env]
    raise ComponentFileError(
        f"{field} comes from a secretKeyRef: set the environment variable {' or '.join(names)}"
    )


def _env_name(text: str) -> str:
    return re.sub(r"[^A-Z0-9]", "_", text.upper())


def _yaml_string(value: Any) -> str:
    # YAML turns `true` and `5` into bool and int; daprd hands us their text.
    if isinstance(value, bool):
        return "true" if value else "false"
    return "" if value is None else str(value)
