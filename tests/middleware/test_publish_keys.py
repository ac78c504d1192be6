"""The one table of publish metadata keys (publish_keys.py): what it declares is what planning does
(each key's partner and the keys it refuses beside it), the docs' key tables are what it renders, and
the unknown-key warning names near misses of its keys only."""

from __future__ import annotations

import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from delayed_middleware import publish_keys, publish_values
from delayed_middleware.errors import InvalidArgumentError
from delayed_middleware.instants import parse_instant
from delayed_middleware.plan import PlanContext, plan_publish
from delayed_middleware.publish_keys import (
    ALL_KEYS,
    TABLE,
    generated_files,
    main,
    render_readme,
    render_reference,
    unknown_key_warnings,
)

ROOT = Path(__file__).resolve().parents[2]
NOW = parse_instant("2026-11-26T05:00:00Z")
CTX = PlanContext(now_ms=NOW, pubsub_name="delayed", enabled=True)

# A value each key accepts on its own (with its partner): the refusals below are then the table's rules.
VALID = {
    "scheduledSendTime": "2026-11-26T06:00:00Z",
    "scheduledSendDelay": "90s",
    "deliverAt": "2026-11-26T06:00:00Z",
    "deliverAfter": "90s",
    "schedule": "@every 1m",
    "scheduleId": "job-1",
    "scheduleCancel": "true",
    "schedulePause": "true",
    "scheduleIdPrefix": "tenant-7:",
    "scheduleTrigger": "true",
    "scheduleReschedule": "2h",
    "scheduleSource": "sensor",
    "scheduleTTL": "30s",
    "scheduleTimeZone": "UTC",
    "scheduleStart": "2026-11-26T06:00:00Z",
    "scheduleEnd": "2026-11-27T06:00:00Z",
    "scheduleLimit": "3",
    "scheduleJitter": "5s",
    "scheduleCatchup": "all",
    "scheduleCatchupWindow": "1h",
    "ttlInSeconds": "60",
    "ttl": "10m",
    "targetPubsub": "kafka",
}


def _refusal(metadata: dict[str, str]) -> InvalidArgumentError:
    with pytest.raises(InvalidArgumentError) as info:
        plan_publish("orders", b"x", metadata, "", CTX)
    return info.value


def test_every_key_the_table_lists_has_a_valid_example_here() -> None:
    # Keeps the two tests below complete: a new row needs an example value above.
    assert set(VALID) == ALL_KEYS


@pytest.mark.parametrize(
    ("key", "excluded"), [(k.name, e) for k in TABLE for e in k.excludes], ids=lambda v: str(v)
)
def test_a_key_the_table_says_another_excludes_is_refused_beside_it(key: str, excluded: str) -> None:
    row = publish_keys.BY_NAME[key]
    metadata = {key: VALID[key], excluded: VALID[excluded]}
    if row.needs:
        metadata[row.needs] = VALID[row.needs]
    err = _refusal(metadata)
    assert (err.key, err.value) == (excluded, VALID[excluded])


@pytest.mark.parametrize("key", [k.name for k in TABLE if k.needs], ids=str)
def test_a_key_without_the_key_the_table_says_it_needs_is_refused_naming_it(key: str) -> None:
    needs = publish_keys.BY_NAME[key].needs
    err = _refusal({key: VALID[key]})
    assert (err.key, err.value) == (key, VALID[key])
    assert re.search(rf"\b{needs}\b", err.reason), err.reason


def test_the_docs_key_tables_are_what_the_table_renders() -> None:
    for relative, text in generated_files(ROOT).items():
        committed = (ROOT / relative).read_text(encoding="utf-8")
        assert committed == text, (
            f"{relative} is out of date: python -m delayed_middleware.publish_keys --write"
        )


def test_the_rendered_tables_name_every_key_in_the_reference_and_join_rows_in_the_readme() -> None:
    reference = render_reference()
    for key in ALL_KEYS:
        assert f"`{key}`" in reference
    readme = render_readme()
    assert "| `deliverAfter` / `deliverAt` |" in readme
    assert "| `scheduleStart` / `scheduleEnd` |" in readme
    assert "| `ttlInSeconds` / `ttl` |" in readme


def test_check_fails_on_a_stale_table_and_write_brings_it_back(tmp_path: Path) -> None:
    for relative in (publish_keys.README_PATH, publish_keys.REFERENCE_PATH):
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / relative, tmp_path / relative)
    reference = tmp_path / publish_keys.REFERENCE_PATH
    good = reference.read_text(encoding="utf-8")
    reference.write_text(good.replace("| `scheduleLimit` |", "| `scheduleLimits` |"), encoding="utf-8")
    assert main(["--check", "--root", str(tmp_path)]) == 1
    assert main(["--write", "--root", str(tmp_path)]) == 0
    assert reference.read_text(encoding="utf-8") == good
    assert main(["--check", "--root", str(tmp_path)]) == 0


def test_a_doc_without_the_generated_table_markers_is_refused_not_rewritten() -> None:
    with pytest.raises(ValueError, match="no generated key table"):
        publish_keys.with_table("# Publish metadata\n\n| key | value | meaning |\n", render_reference())


def test_unknown_key_warning_names_near_misses_of_publish_keys_only() -> None:
    warnings = unknown_key_warnings(
        {
            "scheduledSendDelays": "90s",  # a letter too many
            "ScheduleId": "job-1",  # another case
            "scheduleDelay": "90s",  # close to scheduledSendDelay
            "traceid": "t",  # the app's own key
            "customer": "acme",
            "scheduler": "job-0",  # what a delivered message carries, republished
            "scheduleNext": "purge",
            "scheduledSendDelay": "90s",  # a known key
        }
    )
    assert warnings == [
        "publish metadata key 'ScheduleId' is not read: keys are case-sensitive, did you mean scheduleId?",
        "publish metadata key 'scheduleDelay' is not read: did you mean scheduledSendDelay?",
        "publish metadata key 'scheduledSendDelays' is not read: did you mean scheduledSendDelay?",
    ]


@pytest.fixture
def fresh_process() -> Iterator[None]:
    """The near-miss memory of a new process, and again after the test (it is process-wide)."""
    publish_keys.forget_near_misses()
    yield
    publish_keys.forget_near_misses()


@pytest.mark.usefixtures("fresh_process")
def test_near_misses_are_warned_about_once_each_and_a_stream_of_new_keys_stays_bounded() -> None:
    first = publish_keys.new_near_misses(["schedulesourse", "traceparent", "tenant", "ScheduleSource"])
    assert first == [
        "publish metadata key 'schedulesourse' is not read: did you mean scheduleSource?",
        "publish metadata key 'ScheduleSource' is not read: keys are case-sensitive, did you mean scheduleSource?",
    ]
    assert publish_keys.new_near_misses(["schedulesourse", "ScheduleSource"]) == []
    # Publishers may send any number of distinct keys: what is remembered of them stays bounded,
    # and so do the warnings.
    warned = [w for i in range(3000) for w in publish_keys.new_near_misses([f"scheduleid{i}", f"k{i}"])]
    assert len(warned) == publish_keys.MAX_WARNED - len(first)
    assert publish_keys.remembered_keys() <= publish_keys.MAX_SEEN + publish_keys.MAX_WARNED


@pytest.mark.usefixtures("fresh_process")
def test_past_its_bound_the_near_miss_memory_still_catches_another_case_of_a_publish_key() -> None:
    assert [
        w for i in range(2 * publish_keys.MAX_SEEN) for w in publish_keys.new_near_misses([f"k{i}"])
    ] == []
    assert publish_keys.new_near_misses(["SCHEDULEDSENDTIME"]) == [
        "publish metadata key 'SCHEDULEDSENDTIME' is not read: keys are case-sensitive, "
        "did you mean scheduledSendTime?"
    ]
    assert publish_keys.new_near_misses(["SCHEDULEDSENDTIME"]) == []
    assert publish_keys.remembered_keys() <= publish_keys.MAX_SEEN + publish_keys.MAX_WARNED


def test_our_keys_and_the_keys_daprd_and_apps_commonly_send_are_judged_by_one_lookup() -> None:
    common = {"traceparent", "tracestate", "rawPayload", "ttlInSeconds", "contentType", "cloudevent.id"}
    assert publish_keys.ALL_KEYS | common <= publish_keys.SEEN_KEYS


# A value each row's parser refuses (rows whose parser is publish_values.text have none: a rule reads them).
BAD = {
    "scheduledSendTime": "tomorrow",
    "scheduledSendDelay": "1d",
    "deliverAt": "2045-11-05T08:15:30",
    "deliverAfter": "90",
    "scheduleId": "job\x001",
    "scheduleCancel": "maybe",
    "schedulePause": "maybe",
    "scheduleIdPrefix": "tenant\x07",
    "scheduleTrigger": "yes",
    "scheduleReschedule": "next week",
    "scheduleTTL": "0s",
    "scheduleStart": "soon",
    "scheduleEnd": "later",
    "scheduleCatchup": "every",
    "scheduleCatchupWindow": "0s",
    "ttlInSeconds": "-5",
    "ttl": "0",
    "targetPubsub": "my kafka",
}


def test_every_row_that_parses_its_value_has_a_bad_value_here() -> None:
    parsing = {name for k in TABLE if k.parser is not publish_values.text for name in k.names}
    assert set(BAD) == parsing


@pytest.mark.parametrize("key", sorted(BAD))
def test_a_publish_with_a_bad_value_gets_exactly_the_refusal_of_its_rows_parser(key: str) -> None:
    row = publish_keys.BY_NAME[key]
    with pytest.raises(InvalidArgumentError) as parsed:
        row.parser(key, BAD[key])
    metadata = {key: BAD[key]}
    if row.needs:
        metadata[row.needs] = VALID[row.needs]
    if key == "targetPubsub":
        metadata["scheduledSendDelay"] = "90s"
    assert str(_refusal(metadata)) == str(parsed.value)
