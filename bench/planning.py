"""Publish planning and settings start-up, this tree against a git ref, in one run.

Planning (delayed_middleware.plan) reads every publish's metadata before anything
is stored: how many plans per second one core makes, for a plain publish, a
one-shot delay (scheduledSendDelay, and pubsub.pulsar's deliverAfter where the
tree knows it), and a bulk of 1,000 plain cancels (the fast path). Settings:
the time to import delayed_pubsub.settings (which reads metadata.yaml) and to
parse a component's metadata.

Each figure is the median of --rounds, the two trees taking turns, each in its
own interpreter (PYTHONPATH set to that tree's packages).

    .venv/bin/python bench/planning.py [--base REF] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Runs inside the measured tree's interpreter; prints one JSON object.
PROBE = r"""
import json, sys, time
t0 = time.perf_counter()
import delayed_pubsub.settings as settings
import_ms = (time.perf_counter() - t0) * 1000
from delayed_middleware.entry import StreamEntry
from delayed_middleware.plan import PlanContext, plan_bulk, plan_publish

ctx = PlanContext(now_ms=1_800_000_000_000, pubsub_name="p", enabled=True)
data = b'{"specversion":"1.0","id":"1","data":{"n":1}}'

def rate(fn, n):
    fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return n / (time.perf_counter() - t)

out = {"import_settings_ms": import_ms}
props = {"redisHost": "localhost:6379", "consumerID": "app", "enableDelayedMessaging": "true", "maxDelay": "720h"}
out["parse_settings_per_s"] = rate(lambda: settings.parse_settings(props), 20_000)
shapes = {
    "plain": {"traceid": "t"},
    "scheduledSendDelay": {"scheduledSendDelay": "90s", "traceid": "t"},
    "deliverAfter": {"deliverAfter": "90s", "traceid": "t"},
}
for name, md in shapes.items():
    plan = plan_publish("orders", data, md, "", ctx)
    if name == "deliverAfter" and not plan.delayed:
        continue  # this tree delivers it at once: not the same work
    out[f"plan_{name}_per_s"] = rate(lambda md=md: plan_publish("orders", data, md, "", ctx), 50_000)
cancels = [(str(i), StreamEntry(b"", {"scheduleCancel": "true", "scheduleId": f"s{i}"})) for i in range(1000)]
out["plan_bulk_1000_cancels_per_s"] = rate(lambda: plan_bulk("orders", cancels, {}, ctx), 100) * 1000
print(json.dumps(out))
"""


def extract(ref: str, into: Path) -> Path:
    """The packages of `ref` (git archive), unpacked under `into`."""
    archive = into / "base.tar"
    subprocess.run(
        ["git", "-C", str(ROOT), "archive", "-o", str(archive), ref, "proto", "middleware", "components"],
        check=True,
    )
    with tarfile.open(archive) as tar:
        tar.extractall(into / "tree", filter="data")
    return into / "tree"


def probe(tree: Path) -> dict[str, float]:
    path = os.pathsep.join(str(tree / p) for p in ("proto", "middleware", "components"))
    env = {**os.environ, "PYTHONPATH": path}
    done = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True, cwd=tree
    )
    result: dict[str, float] = json.loads(done.stdout)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base", default="main", help="the git ref to compare with (default main)")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-planning-") as tmp:
        base = extract(args.base, Path(tmp))
        runs: dict[str, list[dict[str, float]]] = {"this tree": [], args.base: []}
        for i in range(args.rounds):
            # Alternate who goes first: a neighbour's load then weighs on both alike.
            order = [("this tree", ROOT), (args.base, base)]
            for name, tree in order if i % 2 == 0 else reversed(order):
                runs[name].append(probe(tree))
    print(f"machine: {platform.node()}, {os.cpu_count()} cores; python {platform.python_version()}")
    print(
        f"| figure | this tree (median of {args.rounds}) | {args.base} | ratio: median of the rounds' "
        "ratios (lowest, highest) |"
    )
    print("|---|---|---|---|")
    for key in runs["this tree"][0]:
        ours = [r[key] for r in runs["this tree"]]
        pairs = [
            (a[key], b[key]) for a, b in zip(runs["this tree"], runs[args.base], strict=True) if key in b
        ]
        if not pairs:
            print(f"| {key} | {statistics.median(ours):,.1f} | (not delayed there) | |")
            continue
        ratios = [a / b for a, b in pairs]
        other = statistics.median(b for _, b in pairs)
        print(
            f"| {key} | {statistics.median(ours):,.1f} | {other:,.1f} | "
            f"{statistics.median(ratios):.2f} ({min(ratios):.2f}, {max(ratios):.2f}) |"
        )


if __name__ == "__main__":
    main()
