"""The quickstart's subscriber: prints each delivery with the headers the component adds.

A Dapr Python SDK app (the FastAPI extension, ``dapr-ext-fastapi``, served by uvicorn) behind
``dapr run --app-port``. It subscribes in code: ``DaprApp.subscribe`` lists topic ``orders`` of
the component ``delayed`` on ``GET /dapr/subscribe``, where daprd reads it at start-up, and daprd
POSTs each message to ``/orders``. daprd passes the message's metadata as HTTP headers (it
lower-cases their names; header names are case-insensitive); the component adds

- ``scheduler``: the schedule id that produced the message (its ``scheduleId``);
- ``scheduleNext``: the RFC 3339 instant of the next fire of a schedule, ``purge`` for a one-shot;
- ``deliveryAttempt``: 1 on the first delivery, 2 after one failure, ...

One line per delivery, ``key=value`` pairs::

    orders label=order-1 deliveryAttempt=1 scheduler=order-1 scheduleNext=purge lateness_ms=12 status=200

A message whose data has ``"fail_first": true`` is answered 500 the first time (daprd then
reports the failure to the component, which delivers it again later, with ``deliveryAttempt: 2``).

Needs the project's ``examples`` extra (``pip install -e '.[examples]'``). Usage::

    python examples/quickstart/subscriber.py [--port 6002]
"""

from __future__ import annotations

import argparse
import sys
import time
from datetime import datetime
from typing import Any

import uvicorn
from dapr.ext.fastapi import DaprApp
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

PUBSUB = "delayed"
TOPIC = "orders"
# The headers to show, as the component names them (Starlette's headers are case-insensitive,
# so these find daprd's lower-cased `deliveryattempt`, `scheduler`, `schedulenext`).
HEADERS = ("deliveryAttempt", "scheduler", "scheduleNext")
# The publisher's schedule fires every 3 s: a schedule's message is due one interval before its
# next fire.
EVERY_MS = 3000

app = FastAPI(title="quickstart subscriber")
dapr_app = DaprApp(app)
# Ids of the CloudEvents already failed once. The handler is a coroutine on uvicorn's one event
# loop, so the check-and-add below cannot interleave with another delivery.
failed_once: set[str] = set()


# The SDK's decorator carries no type annotations (mypy --strict would call the handler untyped).
@dapr_app.subscribe(pubsub=PUBSUB, topic=TOPIC, route="/orders")  # type: ignore[untyped-decorator]
async def orders(request: Request) -> JSONResponse:
    """Print one delivery; fail the first delivery of a message asking for it."""
    received_ms = time.time_ns() // 1_000_000
    event: dict[str, Any] = await request.json()  # a CloudEvent; our JSON payload is its "data"
    payload = event.get("data")
    data: dict[str, Any] = payload if isinstance(payload, dict) else {}
    status = 200
    if data.get("fail_first") and event["id"] not in failed_once:
        failed_once.add(event["id"])
        status = 500
    fields: dict[str, str] = {"label": str(data.get("label", event.get("id")))}
    fields.update({name: request.headers.get(name, "-") for name in HEADERS})
    due_ms = data.get("due_ms")
    if due_ms is None and fields["scheduleNext"] not in ("-", "purge"):
        due_ms = int(datetime.fromisoformat(fields["scheduleNext"]).timestamp() * 1000) - EVERY_MS
    if isinstance(due_ms, int):
        fields["lateness_ms"] = str(received_ms - due_ms)
    fields["status"] = str(status)
    print(f"{TOPIC} " + " ".join(f"{k}={v}" for k, v in fields.items()), flush=True)
    # daprd acks on a 2xx (with no body status, or SUCCESS); any other status but 404 (which
    # drops the message) is a retriable failure, reported to the component, which redelivers.
    return JSONResponse({"status": "SUCCESS" if status == 200 else "RETRY"}, status_code=status)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--port", type=int, default=6002, help="port to listen on, 127.0.0.1 (default 6002)")
    args = parser.parse_args(argv)
    print(f"subscriber listening on 127.0.0.1:{args.port}", file=sys.stderr, flush=True)
    # The deliveries are the log: no access log, only uvicorn's warnings and errors.
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", access_log=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
