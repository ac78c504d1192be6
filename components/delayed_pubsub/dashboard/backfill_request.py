"""A backfill asked for over HTTP (the dashboard's action and POST /api/v1/backfill): the texts of
`from`, `to` and `rate` read one way, then delayed_middleware.backfill run with this dashboard's
settings. Refusals name the request's field (`from`, `to`, `rate`, `id`), not the CLI's flag."""

from __future__ import annotations

from delayed_middleware import backfill as bf
from delayed_middleware.errors import InvalidArgumentError
from delayed_middleware.history import Retention
from delayed_middleware.instants import parse_instant
from delayed_pubsub.dashboard.source import Source

# The longest backfill delivered over HTTP (its occurrences / rate, seconds): it runs inside the
# request, so a longer one is refused (400 naming `rate`) and left to the CLI.
MAX_SECONDS = 30.0

# backfill.BackfillRefusedError names the CLI's flags; a form or a JSON body has these fields.
FIELD_OF_FLAG = {"--from": "from", "--to": "to", "--rate": "rate", "ID": "id"}


def field_error(e: InvalidArgumentError) -> InvalidArgumentError:
    """`e` naming the request's field instead of the CLI's flag."""
    field = FIELD_OF_FLAG.get(e.key, e.key)
    return e if field == e.key else type(e)(field, e.value, e.reason)


def parse_range(from_text: str, to_text: str, rate_text: str) -> tuple[int, int, float]:
    """(from ms, to ms, rate per second): instants in RFC 3339, the rate as backfill.parse_rate reads
    it (empty: the default rate); InvalidArgumentError naming the field otherwise (for the rate a
    BackfillRefusedError, worded as the backfill's own refusals are)."""
    times: list[int] = []
    for name, text in (("from", from_text), ("to", to_text)):
        try:
            times.append(parse_instant(text))
        except ValueError as e:
            raise InvalidArgumentError(name, text, str(e)) from None
    try:
        rate = bf.parse_rate(rate_text) if rate_text else bf.DEFAULT_RATE
    except ValueError as e:
        raise bf.BackfillRefusedError("rate", rate_text, str(e)) from None
    return times[0], times[1], rate


async def run_backfill(
    source: Source, id: str, from_text: str, to_text: str, rate_text: str, *, dry_run: bool
) -> bf.BackfillResult:
    """Parse, then backfill schedule `id` of the dashboard's app (ScheduleNotFoundError for an
    unknown id; InvalidArgumentError, a BackfillRefusedError among them, naming the field)."""
    start_ms, end_ms, rate = parse_range(from_text, to_text, rate_text)
    settings = source.settings
    try:
        return await bf.backfill(
            source.client,
            settings.consumer_id,
            id,
            start_ms,
            end_ms,
            shards=settings.shards,
            rate=rate,
            dry_run=dry_run,
            retention=Retention(settings.history_max_len, settings.history_max_age_ms),
            max_seconds=MAX_SECONDS,
        )
    except bf.BackfillRefusedError as e:
        raise field_error(e) from None
