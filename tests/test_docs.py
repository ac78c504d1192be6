"""README.md and docs/*.md held to the code: every `delayed-pubsub` command line they show names a real
subcommand and only flags that subcommand's parser has; every `make` target and `scripts/` file they
name exists; every publish metadata key they document is one the component reads, and every key it
reads is documented. A doc that drifts from `--help` fails here."""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from delayed_middleware.publish_keys import ALL_KEYS
from delayed_pubsub.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Code blocks in these languages are command lines; others (yaml, python, text) are not.
SHELL_LANGS = {"", "sh", "bash", "shell", "console"}
FENCE = re.compile(r"^```([\w-]*)\s*$")
# `delayed-pubsub SUB ...`, also as .venv/bin/delayed-pubsub, after env assignments or `$(`.
COMMAND = re.compile(r"(?:^|[\s/(`$])delayed-pubsub((?:\s+\S+)+)")
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
MAKE = re.compile(r"(?:^|[\s`(])make\s+([a-z][\w-]*)")
SCRIPT = re.compile(r"(?:^|[\s`(])(scripts/[\w.-]+)")
PUBLISH_KEYS = ALL_KEYS


@dataclass(frozen=True)
class Line:
    """One command line of a doc (continuations joined, comment dropped), and where it is."""

    doc: Path
    number: int
    text: str

    def where(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.number}: {self.text.strip()}"


def _strip_comment(text: str) -> str:
    # A shell comment starts at a `#` after a blank; `#` inside a word (a URL fragment) is kept.
    return re.split(r"(?:^|\s)#", text, maxsplit=1)[0]


def command_lines(doc: Path, text: str) -> Iterator[Line]:
    """Lines of the doc's shell code blocks, and its inline code spans outside blocks (a span may
    run over a line break within its paragraph)."""
    lang: str | None = None
    pending = ""
    start = 0
    paragraph: list[tuple[int, str]] = []

    def spans() -> Iterator[Line]:
        if paragraph:
            joined = " ".join(raw for _, raw in paragraph)
            for span in re.findall(r"`([^`]+)`", joined):
                yield Line(doc, paragraph[0][0], span)
            paragraph.clear()

    for number, raw in enumerate(text.splitlines(), 1):
        fence = FENCE.match(raw.strip())
        if fence:
            yield from spans()
            lang = fence.group(1) if lang is None else None
            continue
        if lang is None:
            if raw.strip():
                paragraph.append((number, raw))
            else:
                yield from spans()
            continue
        if lang not in SHELL_LANGS or re.search("[├└│]", raw):  # a tree drawing is no command
            continue
        line = _strip_comment(raw)
        if not pending:
            start = number
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        yield Line(doc, start, pending + line)
        pending = ""
    yield from spans()


def subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _segments(text: str) -> list[str]:
    """`text` cut at pipes, `&&`, `;` and redirections outside brackets (synopses use `[a | b]`)."""
    parts, depth, current = [], 0, ""
    i = 0
    while i < len(text):
        c = text[i]
        if c in "[(":
            depth += 1
        elif c in "])":
            depth -= 1
        if depth <= 0 and (text.startswith(" | ", i) or text.startswith("&&", i) or c in ";>"):
            parts.append(current)
            current = ""
            i += 3 if text.startswith(" | ", i) else 2 if text.startswith("&&", i) else 1
            continue
        current += c
        i += 1
    parts.append(current)
    return parts


@dataclass(frozen=True)
class Invocation:
    line: Line
    sub: str
    flags: tuple[str, ...]


def invocations(lines: list[Line], subs: dict[str, argparse.ArgumentParser]) -> list[Invocation]:
    """Every `delayed-pubsub SUB --flags` in the lines; also an inline span that starts with a
    subcommand's name and shows one of its flags (`pending --prefix P`)."""
    found = []
    for line in lines:
        for segment in _segments(line.text):
            match = COMMAND.search(segment)
            if match:
                words = match.group(1).split()
                sub = words[0].rstrip(").,;:")
                rest = " ".join(words[1:])
            else:
                words = segment.split()
                if not words or words[0] not in subs or not FLAG.search(segment) or segment != line.text:
                    continue
                sub, rest = words[0], " ".join(words[1:])
            found.append(Invocation(line, sub, tuple(FLAG.findall(rest))))
    return found


def all_lines() -> list[Line]:
    return [line for doc in DOCS for line in command_lines(doc, doc.read_text())]


def check_invocations(lines: list[Line]) -> list[str]:
    """What is wrong with the command lines: unknown subcommands and flags, one message each."""
    subs = subparsers()
    top = build_parser()
    problems = []
    for inv in invocations(lines, subs):
        if inv.sub.startswith("--"):
            known = set(top._option_string_actions)
            for flag in (inv.sub, *inv.flags):
                if flag not in known:
                    problems.append(f"{inv.line.where()}\n    delayed-pubsub has no {flag}")
            continue
        if inv.sub not in subs:
            if re.fullmatch(r"[a-z][a-z-]*", inv.sub):
                problems.append(
                    f"{inv.line.where()}\n    no subcommand {inv.sub!r} (have: {', '.join(subs)})"
                )
            continue
        known = set(subs[inv.sub]._option_string_actions)
        for flag in inv.flags:
            if flag not in known:
                problems.append(f"{inv.line.where()}\n    delayed-pubsub {inv.sub} has no {flag}")
    return problems


def test_every_delayed_pubsub_command_in_the_docs_uses_real_subcommands_and_flags() -> None:
    lines = all_lines()
    seen = invocations(lines, subparsers())
    # The check reads what it should: the docs show most subcommands with flags.
    assert {inv.sub for inv in seen if inv.flags} >= {"serve", "pending", "history", "stats", "dashboard"}
    assert check_invocations(lines) == []


def test_the_check_fails_on_a_flag_that_does_not_exist() -> None:
    doc = ROOT / "docs" / "operations.md"
    text = "```sh\ndelayed-pubsub pending --redis-host h:1 --app-id a \\\n    --no-such-flag\n```\n"
    problems = check_invocations(list(command_lines(doc, text)))
    assert len(problems) == 1
    assert "delayed-pubsub pending has no --no-such-flag" in problems[0]
    inline = list(command_lines(doc, "use `serve --health-adress 0.0.0.0` here\n"))
    assert ["serve has no --health-adress" in p for p in check_invocations(inline)] == [True]
    unknown = list(command_lines(doc, "```sh\ndelayed-pubsub stat --app-id a\n```\n"))
    assert ["no subcommand 'stat'" in p for p in check_invocations(unknown)] == [True]


def test_every_make_target_and_script_the_docs_name_exists() -> None:
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z][\w-]*):", makefile, flags=re.MULTILINE))
    problems = []
    for line in all_lines():
        for target in MAKE.findall(line.text):
            if target not in targets:
                problems.append(f"{line.where()}\n    no make target {target!r}")
        for script in SCRIPT.findall(line.text):
            if not (ROOT / script.rstrip(".,:;")).is_file():
                problems.append(f"{line.where()}\n    no file {script}")
    assert problems == []


def _documented_publish_keys(text: str) -> set[str]:
    """The first column of the tables headed `| key |` (`a` / `b` names two keys)."""
    keys: set[str] = set()
    in_table = False
    for raw in text.splitlines():
        if raw.startswith("| key "):
            in_table = True
            continue
        if not raw.startswith("|"):
            in_table = False
            continue
        if in_table and not raw.startswith("|---"):
            keys.update(re.findall(r"`([A-Za-z]+)`", raw.split("|")[1]))
    return keys


def test_publish_metadata_keys_in_the_docs_are_the_code_s() -> None:
    reference = _documented_publish_keys((ROOT / "docs" / "publish-metadata.md").read_text())
    readme = _documented_publish_keys((ROOT / "README.md").read_text())
    assert reference == PUBLISH_KEYS, "docs/publish-metadata.md's key table and the code differ"
    assert readme <= PUBLISH_KEYS, (
        f"README's publishing table names keys the code does not read: {readme - PUBLISH_KEYS}"
    )
    # Keys in publish URLs and SDK calls: `metadata.KEY=` and publish_metadata={"KEY": ...}.
    used: dict[str, str] = {}
    for doc in DOCS:
        text = doc.read_text()
        for key in re.findall(r"metadata\.([a-z][A-Za-z]*)=", text):
            used.setdefault(key, str(doc.relative_to(ROOT)))
        for call in re.findall(r"publish_metadata=\{([^}]*)\}", text):
            for key in re.findall(r"\"([A-Za-z]+)\"\s*:", call):
                used.setdefault(key, str(doc.relative_to(ROOT)))
    # Dapr's own publish metadata, read by daprd rather than the component.
    dapr_keys = {"rawPayload", "cloudevent"}
    assert {k: d for k, d in used.items() if k not in PUBLISH_KEYS | dapr_keys} == {}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_between_docs_point_at_files_that_exist(doc: Path) -> None:
    missing = []
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
        if "://" in target or target.startswith("mailto:"):
            continue
        if not (doc.parent / target).exists():
            missing.append(target)
    assert missing == []
