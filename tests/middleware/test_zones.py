"""Zone names: tzdata's zone and link names are accepted, read from the tzdata package whatever the host
has; names that read a host file or a variant of the data are refused naming the key and the value; a
schedule stored with such a name by an earlier version keeps firing, with one warning."""

from __future__ import annotations

import logging
import zoneinfo
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest

from delayed_middleware import zones
from delayed_middleware.envelope import RECURRING, Envelope
from delayed_middleware.errors import InvalidArgumentError
from delayed_middleware.instants import parse_instant
from delayed_middleware.schedules import EnvelopeRecurrence, parse_schedule, parse_stored_schedule
from delayed_middleware.zones import parse_time_zone, tzdata_names

NOW = parse_instant("2026-11-26T12:00:00Z")
REFUSED = [
    "localtime",
    "posixrules",
    "Factory",
    "posix/America/New_York",
    "right/America/New_York",
    "right/UTC",
]


@pytest.mark.parametrize("name", ["UTC", "Etc/GMT+5", "US/Eastern", "America/New_York", "Asia/Kathmandu"])
def test_tzdata_zone_and_link_names_are_accepted_in_both_keys(name: str) -> None:
    assert parse_time_zone(name).key == name
    cron = parse_schedule(f"CRON_TZ={name} 0 0 9 * * *", now_ms=NOW)
    keyed = parse_schedule("0 0 9 * * *", now_ms=NOW, time_zone=name)
    assert cron == keyed
    assert cron.tz == ("" if name == "UTC" else name)


def test_every_tzdata_name_but_factory_is_accepted_and_the_hosts_extra_names_are_not() -> None:
    for name in tzdata_names():
        assert parse_time_zone(name).key == name
    assert "Factory" not in tzdata_names()
    # What the host's zoneinfo directory adds (localtime, here) is refused.
    for name in zoneinfo.available_timezones() - tzdata_names():
        with pytest.raises(InvalidArgumentError):
            parse_time_zone(name)


@pytest.mark.parametrize("name", REFUSED)
def test_names_that_read_a_host_file_are_refused_naming_the_key_and_the_value(name: str) -> None:
    with pytest.raises(InvalidArgumentError) as keyed:
        parse_schedule("@daily", now_ms=NOW, time_zone=name)
    assert (keyed.value.key, keyed.value.value) == ("scheduleTimeZone", name)
    assert "not a time zone" in keyed.value.reason
    expr = f"CRON_TZ={name} @daily"
    with pytest.raises(InvalidArgumentError) as prefixed:
        parse_schedule(expr, now_ms=NOW)
    assert (prefixed.value.key, prefixed.value.value) == ("schedule", expr)
    assert f"CRON_TZ={name}" in prefixed.value.reason


def test_utc_is_accepted_with_every_and_at_and_changes_nothing() -> None:
    for expr in ("@every 1m", "@at 2027-01-01T00:00:00Z"):
        assert parse_schedule(expr, now_ms=NOW, time_zone="UTC") == parse_schedule(expr, now_ms=NOW)
    with pytest.raises(InvalidArgumentError):
        parse_schedule("@every 1m", now_ms=NOW, time_zone="Etc/UTC")


@pytest.fixture
def host_new_york_is_utc(tmp_path: Path) -> Iterator[None]:
    """A host whose zone files say America/New_York is UTC (a stale or tampered /usr/share/zoneinfo)."""
    fake = tmp_path / "America" / "New_York"
    fake.parent.mkdir()
    fake.write_bytes((Path(zoneinfo.TZPATH[0]) / "UTC").read_bytes())
    zones._zone.cache_clear()
    zoneinfo.reset_tzpath(to=[str(tmp_path)])
    try:
        yield
    finally:
        zoneinfo.reset_tzpath()
        zones._zone.cache_clear()


@pytest.mark.usefixtures("host_new_york_is_utc")
def test_a_zone_means_what_tzdata_says_whatever_the_host_files_say() -> None:
    tz = parse_time_zone("America/New_York")
    assert datetime(2027, 1, 15, 12, tzinfo=UTC).astimezone(tz).utcoffset().total_seconds() == -5 * 3600  # type: ignore[union-attr]
    nine = parse_schedule("0 0 9 * * *", now_ms=NOW, time_zone="America/New_York")
    assert EnvelopeRecurrence()(_envelope(nine.expr), NOW) == parse_instant("2026-11-26T14:00:00Z")


def _envelope(stored: str) -> Envelope:
    return Envelope(
        id="s", topic="t", due_ms=NOW, published_at_ms=NOW, schedule_id="s", kind=RECURRING, schedule=stored
    )


def test_a_schedule_stored_with_a_host_zone_keeps_firing_and_warns_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    stored = "CRON_TZ=right/America/New_York 0 0 9 * * *"
    zones._warned.discard("right/America/New_York")
    caplog.set_level(logging.WARNING, logger="delayed_middleware.zones")
    schedule = parse_stored_schedule(stored, now_ms=NOW)
    assert schedule.tz == "right/America/New_York"
    recurrence = EnvelopeRecurrence()
    first = recurrence(_envelope(stored), NOW)
    # As before: 09:00 as the host's file reads it (this one is off by an hour in winter).
    assert first == zones.wall_to_instant(
        datetime(2026, 11, 26, 9), zoneinfo.ZoneInfo("right/America/New_York")
    )
    assert EnvelopeRecurrence()(_envelope(stored), first or 0) == (first or 0) + 86_400_000
    warnings = [r for r in caplog.records if "right/America/New_York" in r.getMessage()]
    assert len(warnings) == 1
    assert "not a tzdata zone name" in warnings[0].getMessage()
    # A stored name no zone data has is no zone: the schedule does not parse (the engine ends it).
    with pytest.raises(InvalidArgumentError):
        parse_stored_schedule("CRON_TZ=posix/Nowhere 0 0 9 * * *", now_ms=NOW)
