"""The quickstart's publisher: delayed and scheduled messages through the Dapr Python SDK.

It talks to the sidecar started by `dapr run` (the SDK reads ``DAPR_GRPC_PORT``, default
50001) and publishes to the component named ``delayed`` (dapr/components/delayed-pubsub.yaml),
topic ``orders``:

- ``order-1``: delivered 5 seconds from now (``scheduledSendDelay``), once;
- ``order-2``: delivered at an instant 8 seconds from now (``scheduledSendTime``); the
  subscriber fails its first delivery on purpose, so it comes back with ``deliveryAttempt: 2``
  after the component's ``redeliverInterval`` (15 s in that YAML);
- ``tick``: a recurring schedule, every 3 seconds (``schedule: @every 3s``), for 10 seconds
  (``ttlInSeconds`` on a schedule ends the schedule itself).

Every message carries ``due_ms`` (when it is due, epoch milliseconds) so the subscriber can
print how late it arrived. Usage::

    python examples/quickstart/publisher.py [--pubsub delayed] [--topic orders]
"""

from __future__ import annotations

import argparse
import json
import time
from datetime import UTC, datetime

from dapr.clients import DaprClient


def rfc3339(epoch_ms: int) -> str:
    """An RFC 3339 instant in UTC with milliseconds, as `scheduledSendTime` takes it."""
    return datetime.fromtimestamp(epoch_ms / 1000, UTC).isoformat(timespec="milliseconds")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pubsub", default="delayed", help="the component's name (default delayed)")
    parser.add_argument("--topic", default="orders", help="the topic (default orders)")
    args = parser.parse_args(argv)

    now = time.time_ns() // 1_000_000
    with DaprClient() as client:

        def publish(body: dict[str, object], metadata: dict[str, str]) -> None:
            client.publish_event(
                pubsub_name=args.pubsub,
                topic_name=args.topic,
                data=json.dumps(body),
                data_content_type="application/json",
                publish_metadata=metadata,
            )
            print(f"published {body['label']}: {metadata}", flush=True)

        publish(
            {"label": "order-1", "due_ms": now + 5_000},
            {"scheduledSendDelay": "5s", "scheduleId": "order-1"},
        )
        publish(
            {"label": "order-2", "due_ms": now + 8_000, "fail_first": True},
            {"scheduledSendTime": rfc3339(now + 8_000), "scheduleId": "order-2"},
        )
        # An @every schedule fires on a grid from its acceptance: k x 3 s after `now` (give or
        # take the publish's own few milliseconds), so due_ms is left to the subscriber to
        # work out from scheduleNext.
        publish(
            {"label": "tick"},
            {"schedule": "@every 3s", "scheduleId": "tick", "ttlInSeconds": "10"},
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
