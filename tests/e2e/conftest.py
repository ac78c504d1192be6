"""Fixtures of the end-to-end suite: one real stack per session, torn down whatever happens.

Order matters: Redis, then `delayed-pubsub serve` (its socket must exist before daprd starts,
daprd scans the socket folder once), then the subscriber app (daprd asks it for its
subscriptions at start), then daprd.
"""

from __future__ import annotations

import json
import os
import statistics
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest

from tests.e2e import harness
from tests.e2e.harness import Stack
from tests.redis_server import RedisServer

APP_ID = "e2e-app"
PUBSUB = "delayed"
# A second instance of the same component type on the same socket, on its own Redis database.
PUBSUB_B = "delayed-b"
# A third, on database 2, whose component metadata holds a retry policy with a dead-letter topic
# that the app subscribes to as well (test_retry_e2e).
PUBSUB_DL = "delayed-dl"
DL_TOPIC = "dl-dead"
DL_METADATA = {"maxDeliveryAttempts": "2", "retryInitialInterval": "200ms", "deadLetterTopic": DL_TOPIC}

SUBSCRIPTIONS = (
    f"{PUBSUB}=orders",
    f"{PUBSUB}=raw:raw",
    f"{PUBSUB}=bulk",
    f"{PUBSUB}=flaky",
    f"{PUBSUB}=iso",
    f"{PUBSUB}=later",
    f"{PUBSUB}=sdk",
    f"{PUBSUB_B}=iso",
    # A retry policy of this subscription alone (test_retry_e2e), through daprd's metadata.
    f"{PUBSUB}=retry;maxDeliveryAttempts=5;retryInitialInterval=300ms;retryMultiplier=2"
    ";deadLetterTopic=retry-dead",
    f"{PUBSUB}=retry-dead",
    f"{PUBSUB_DL}=dl-orders",
    f"{PUBSUB_DL}={DL_TOPIC}",
)


@pytest.fixture(scope="session")
def daprd_path() -> str:
    try:
        return harness.find_daprd()
    except harness.HarnessError as exc:
        pytest.fail(str(exc), pytrace=False)


@pytest.fixture(scope="session")
def e2e_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(Path(tmp_path_factory.mktemp("e2e-redis")))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def stack(
    daprd_path: str, e2e_redis: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    workdir = Path(tmp_path_factory.mktemp("e2e-stack"))
    resources = workdir / "resources"
    resources.mkdir()
    (resources / f"{PUBSUB}.yaml").write_text(
        harness.component_yaml(PUBSUB, harness.component_metadata(e2e_redis.port))
    )
    (resources / f"{PUBSUB_B}.yaml").write_text(
        harness.component_yaml(PUBSUB_B, harness.component_metadata(e2e_redis.port, redisDB="1"))
    )
    (resources / f"{PUBSUB_DL}.yaml").write_text(
        harness.component_yaml(
            PUBSUB_DL, harness.component_metadata(e2e_redis.port, redisDB="2", **DL_METADATA)
        )
    )

    with harness.started_stack(
        daprd_path,
        workdir,
        resources,
        redis_port=e2e_redis.port,
        pubsubs=(PUBSUB, PUBSUB_B, PUBSUB_DL),
        subscriptions=SUBSCRIPTIONS,
        app_id=APP_ID,
        component=not harness.BUILTIN,
    ) as s:
        wait_for_subscriptions(s)
        yield s


def wait_for_subscriptions(s: Stack) -> None:
    """daprd lists the app's subscriptions in its metadata once it has loaded them."""

    def loaded() -> bool:
        meta = s.client.get(f"{s.dapr_url}/v1.0/metadata").json()
        names = {c["name"] for c in meta.get("components", [])}
        subs = {(x["pubsubname"], x["topic"]) for x in meta.get("subscriptions", [])}
        want = {tuple(sub.split(";")[0].split(":")[0].split("=", 1)) for sub in SUBSCRIPTIONS}
        return {PUBSUB, PUBSUB_B, PUBSUB_DL} <= names and want <= subs

    harness.wait_until_blocking(
        loaded, "daprd to load the components and every subscription", 30, process=s.daprd
    )


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A failing e2e test's report carries the tails of the component, daprd and app logs."""
    report: pytest.TestReport = yield
    s = getattr(item, "funcargs", {}).get("stack")
    if report.failed and isinstance(s, Stack):
        report.sections.append(("e2e process logs", s.logs()))
    return report


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    figures = harness.LATENESS
    if not figures:
        return
    values = sorted(ms for _, ms in figures)
    terminalreporter.write_sep("-", "e2e lateness of delayed messages under daprd (ms)")
    terminalreporter.write_line(
        f"n={len(values)} min={values[0]} median={statistics.median(values):g} max={values[-1]}"
    )
    for name, ms in figures:
        terminalreporter.write_line(f"  {ms:6d}  {name}")
    # For bench/RESULTS.md: E2E_LATENESS_FILE=path appends this run's figures as JSON lines.
    out = os.environ.get("E2E_LATENESS_FILE")
    if out:
        with open(out, "a", encoding="utf-8") as f:
            for name, ms in figures:
                f.write(json.dumps({"test": name, "lateness_ms": ms}) + "\n")
