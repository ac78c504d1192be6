"""The component's settings as declared in metadata.yaml, and what is generated from them.

metadata.yaml (in this package; a link to it sits at the top of the source
tree, where components-contrib keeps theirs) is the one declaration of every
component metadata key: name, type, default, example, description, whether it
is sensitive. From it come

- the key names `settings.parse_settings` knows (any other key gets a warning
  at Init, naming the nearest known one);
- every default the component uses (settings.RULES reads each with the key's
  reader, for the parser and the Settings dataclass);
- docs/component-metadata.md, the settings reference;
- the commented keys of dapr/components/delayed-pubsub.yaml.

Regenerate both files after editing metadata.yaml:

    python -m delayed_pubsub.settings_spec --write

(`--check` exits 1 when a committed file differs from what it would write.)
"""

from __future__ import annotations

import argparse
import difflib
import functools
import json
import re
import sys
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Final

import yaml

from delayed_middleware.generated import write_or_check

METADATA_FILE: Final = "metadata.yaml"
DOCS_PATH: Final = Path("docs") / "component-metadata.md"
COMPONENT_YAML_PATH: Final = Path("dapr") / "components" / "delayed-pubsub.yaml"

# contrib's schema allows these types; a missing type means string.
TYPES: Final = ("string", "number", "bool", "duration", "bytesize")

# Sections of the settings, each starting at its first key in metadata.yaml's order.
SECTIONS: Final[tuple[tuple[str, str], ...]] = (
    ("redisHost", "Connection"),
    ("consumerID", "Subscribers"),
    ("maxDeliveryAttempts", "Retries"),
    ("maxLenApprox", "Retention"),
    ("enableDelayedMessaging", "Delayed messaging"),
    ("defaultTargetPubsub", "Delays for any pub/sub"),
)

# pubsub.redis settings (components-contrib pubsub/redis/metadata.yaml) this
# component does not implement. A YAML written for pubsub.redis may carry them:
# they are accepted and ignored, with a warning that says so.
REDIS_ONLY_KEYS: Final = frozenset(
    {
        "ackOnError",
        "idleCheckFrequency",
        "idleTimeout",
        "maxConnAge",
        "minIdleConns",
        "poolTimeout",
        "redisMaxRetryInterval",
        "redisMinRetryInterval",
        "sentinelPassword",
        "sentinelUsername",
        "useEntraID",
    }
)

# What the shipped component YAML sets (the rest is shown commented out).
SHIPPED_VALUES: Final[Mapping[str, str]] = {
    "redisHost": "localhost:6379",
    "processingTimeout": "60s",
    "redeliverInterval": "15s",
    "enableDelayedMessaging": "true",
}


@dataclass(frozen=True)
class SettingSpec:
    """One metadata key of the component, as metadata.yaml declares it.

    Attributes:
        name: the key, as written in the component YAML's spec.metadata.
        type: one of TYPES.
        description: what it does, for users (several sentences at most).
        example: a valid value other than the default.
        default: the value that changes nothing when given, or None when the
            default depends on something else (the description says what).
        required: Init fails without it.
        sensitive: a secret: keep it in a secret store, never log it.
        allowed_values: the only accepted values, when the set is closed.
    """

    name: str
    type: str
    description: str
    example: str
    default: str | None = None
    required: bool = False
    sensitive: bool = False
    allowed_values: tuple[str, ...] = ()

    @property
    def summary(self) -> str:
        """The description's first sentence."""
        text = " ".join(self.description.split())
        end = text.find(". ")
        return text if end < 0 else text[: end + 1]


@dataclass(frozen=True)
class ComponentSpec:
    """metadata.yaml: the component's identity and its settings in their documented order."""

    name: str
    version: str
    status: str
    title: str
    description: str
    capabilities: tuple[str, ...]
    settings: tuple[SettingSpec, ...]

    @property
    def names(self) -> frozenset[str]:
        """Every metadata key the component reads."""
        return frozenset(s.name for s in self.settings)

    def get(self, name: str) -> SettingSpec:
        """The setting called `name` (KeyError if there is none)."""
        for s in self.settings:
            if s.name == name:
                return s
        raise KeyError(name)


class SpecError(ValueError):
    """metadata.yaml does not follow the schema (a packaging defect, found by the tests)."""


def metadata_text() -> str:
    """The text of the metadata.yaml shipped in this package."""
    return resources.files(__package__).joinpath(METADATA_FILE).read_text(encoding="utf-8")


@functools.cache
def spec() -> ComponentSpec:
    """The shipped metadata.yaml, parsed at the first call (not at import) and kept."""
    return load_spec()


def load_spec(text: str | None = None) -> ComponentSpec:
    """Parse metadata.yaml (the shipped one unless `text` is given), checking what the code relies on."""
    # libyaml's loader when PyYAML has it: the pure-Python one costs ~20 ms at every start.
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    doc = yaml.load(metadata_text() if text is None else text, Loader=loader)
    if not isinstance(doc, dict):
        raise SpecError("metadata.yaml must be a mapping")
    settings: list[SettingSpec] = []
    for item in doc.get("metadata") or []:
        settings.append(_setting(item))
    names = [s.name for s in settings]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise SpecError(f"metadata.yaml declares {duplicates} more than once")
    return ComponentSpec(
        name=str(doc.get("name", "")),
        version=str(doc.get("version", "")),
        status=str(doc.get("status", "")),
        title=str(doc.get("title", "")),
        description=" ".join(str(doc.get("description", "")).split()),
        capabilities=tuple(str(c) for c in doc.get("capabilities") or ()),
        settings=tuple(settings),
    )


def _setting(item: Any) -> SettingSpec:
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        raise SpecError(f"a metadata entry without a name: {item!r}")
    name = item["name"]
    for field in ("description", "example"):
        if not isinstance(item.get(field), str) or not item[field].strip():
            raise SpecError(f"{name}: {field} must be a non-empty string")
    kind = item.get("type", "string")
    if kind not in TYPES:
        raise SpecError(f"{name}: type {kind!r} is not one of {TYPES}")
    default = item.get("default")
    if default is not None and not isinstance(default, str):
        raise SpecError(f"{name}: default must be a quoted string, not {default!r}")
    example = item["example"]
    if default is not None and example == default:
        raise SpecError(f"{name}: the example must differ from the default (it shows a change)")
    return SettingSpec(
        name=name,
        type=kind,
        description=item["description"].strip(),
        example=example,
        default=default,
        required=bool(item.get("required", False)),
        sensitive=bool(item.get("sensitive", False)),
        allowed_values=tuple(str(v) for v in item.get("allowedValues") or ()),
    )


# --- warnings for keys the component does not read ------------------------------------


def unknown_key_warnings(props: Mapping[str, str], spec: ComponentSpec) -> list[str]:
    """One warning per metadata key in `props` that the component does not read.

    Names only, never values (a misspelt redisPassword is still a secret).
    A pubsub.redis key we do not implement is said to be accepted there and
    ignored here; any other unknown key names the nearest known one.
    """
    out: list[str] = []
    for key in sorted(set(props) - spec.names):
        if key in REDIS_ONLY_KEYS:
            out.append(
                f"metadata key {key!r} is a pubsub.redis setting that this component does not "
                "implement: accepted there, ignored here"
            )
            continue
        hint = nearest_key(key, spec)
        out.append(
            f"unknown metadata key {key!r} is ignored"
            + (f": did you mean {hint}?" if hint else " (the keys: docs/component-metadata.md)")
        )
    return out


def nearest_key(key: str, spec: ComponentSpec) -> str | None:
    """The known key `key` most likely meant to be, or None when none is close."""
    by_lower = {n.lower(): n for n in spec.names}
    if key.lower() in by_lower:
        # Keys are case-sensitive here; say so, the spelling is otherwise right.
        return f"{by_lower[key.lower()]} (keys are case-sensitive)"
    close = difflib.get_close_matches(key.lower(), list(by_lower), n=1, cutoff=0.75)
    return by_lower[close[0]] if close else None


# --- generated files ---------------------------------------------------------------------


def _sections(spec: ComponentSpec) -> list[tuple[str, list[SettingSpec]]]:
    starts = dict(SECTIONS)
    out: list[tuple[str, list[SettingSpec]]] = []
    for s in spec.settings:
        if s.name in starts:
            out.append((starts[s.name], []))
        if not out:
            raise SpecError(f"{s.name} comes before the first section's key ({SECTIONS[0][0]})")
        out[-1][1].append(s)
    return out


def _default_text(s: SettingSpec) -> str:
    if s.required:
        return "required"
    if s.default is None:
        return "see description"
    return "empty" if s.default == "" else s.default


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def render_docs(spec: ComponentSpec) -> str:
    """docs/component-metadata.md: the settings reference, as Markdown tables."""
    lines = [
        "# Component metadata",
        "",
        "<!-- Generated from metadata.yaml by `python -m delayed_pubsub.settings_spec --write`:",
        "     edit metadata.yaml, then regenerate. -->",
        "",
        f"{spec.description}",
        "",
        "Settings go in the component's `spec.metadata`, as in any Dapr component. Every value is a",
        "string. Durations are Go durations (`500ms`, `90s`, `1h30m`); where a description says so, a",
        "bare integer means milliseconds, as in `pubsub.redis`. The names and defaults of the",
        "`pubsub.redis` settings are the same as there, so an existing `pubsub.redis` component works",
        "after changing its `type:`.",
        "",
        "A malformed or out-of-range value fails Init with `INVALID_ARGUMENT`, naming the key and the",
        "value. A key the component does not read is logged at WARNING when the component starts,",
        "with the nearest known key (`enableDelayMessaging`: did you mean `enableDelayedMessaging`?).",
        "Keep sensitive values in a secret store (`secretKeyRef`).",
        "",
    ]
    for title, settings in _sections(spec):
        lines += [f"## {title}", "", "| key | type | default | description |", "|---|---|---|---|"]
        for s in settings:
            kind = s.type + (", sensitive" if s.sensitive else "")
            if s.allowed_values:
                kind += ": " + " / ".join(f"`{v}`" for v in s.allowed_values)
            default = _default_text(s)
            default = default if default in ("required", "see description", "empty") else f"`{default}`"
            lines.append(f"| `{s.name}` | {kind} | {default} | {_cell(s.description)} |")
        lines.append("")
    lines += [
        "## `pubsub.redis` settings accepted and ignored",
        "",
        "These `pubsub.redis` settings have no effect here. A component that sets them still starts,",
        "with a warning naming each one:",
        "",
        ", ".join(f"`{k}`" for k in sorted(REDIS_ONLY_KEYS)) + ".",
        "",
    ]
    return "\n".join(lines)


_YAML_HEADER: Final = """\
# The delayed pub/sub component. daprd finds it through the unix socket
# `delayed-pubsub.sock` in $DAPR_COMPONENTS_SOCKETS_FOLDER (default
# /tmp/dapr-components-sockets): start `delayed-pubsub serve` before daprd.
# The socket's file name gives the type: pubsub.delayed-pubsub.
#
# Every key the component reads is listed below, commented out unless set,
# under its type, default and meaning. Only redisHost is required.
# The names and defaults are pubsub.redis's, so an existing pubsub.redis YAML
# works after changing `type:` only. Reference: docs/component-metadata.md.
# (The keys and their comments are generated from metadata.yaml.)
apiVersion: dapr.io/v1alpha1
kind: Component
metadata:
  name: delayed          # apps publish with /v1.0/publish/delayed/<topic>
spec:
  type: pubsub.delayed-pubsub
  version: v1
  metadata:
"""


def render_component_yaml(spec: ComponentSpec) -> str:
    """dapr/components/delayed-pubsub.yaml: every key, set or commented out, under its description."""
    lines = [_YAML_HEADER.rstrip("\n")]
    for title, settings in _sections(spec):
        lines += ["", f"    # --- {title.lower()} " + "-" * max(3, 90 - len(title))]
        for s in settings:
            shipped = s.name in SHIPPED_VALUES
            mark = "" if shipped else "# "
            default = _default_text(s)
            facts = [s.type + (", sensitive" if s.sensitive else "")]
            if default != "see description":
                facts.append(default if default == "required" else f"default {default}")
            text = f"{s.name} ({', '.join(facts)}): {' '.join(s.description.split())}"
            lines += textwrap.wrap(text, width=104, initial_indent="    # ", subsequent_indent="    #   ")
            lines.append(f"    {mark}- name: {s.name}")
            if s.sensitive and not shipped:
                # The operator CLI reads this secret from $REDIS_<KEY> (operate.secret_env_names).
                key = re.sub(r"(?<!^)(?=[A-Z])", "-", s.name).lower()
                lines += [
                    f"    {mark}  secretKeyRef:",
                    f"    {mark}    name: redis",
                    f"    {mark}    key: {key}",
                ]
            else:
                lines.append(f"    {mark}  value: {json.dumps(SHIPPED_VALUES.get(s.name, s.example))}")
    return "\n".join(lines) + "\n"


def generated_files(spec: ComponentSpec) -> dict[Path, str]:
    """Every file generated from metadata.yaml, by its path from the source tree's root."""
    return {DOCS_PATH: render_docs(spec), COMPONENT_YAML_PATH: render_component_yaml(spec)}


def main(argv: Sequence[str] | None = None) -> int:
    """Write (or --check) the files generated from metadata.yaml under --root."""
    parser = argparse.ArgumentParser(prog="python -m delayed_pubsub.settings_spec", description=__doc__)
    parser.add_argument("--root", type=Path, default=Path.cwd(), help="the source tree (default: here)")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help="write the generated files")
    mode.add_argument("--check", action="store_true", help="exit 1 if a generated file is out of date")
    args = parser.parse_args(argv)
    return write_or_check(args.root, generated_files(load_spec()), write=args.write)


if __name__ == "__main__":
    sys.exit(main())
