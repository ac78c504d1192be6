"""The quickstart's subscriber: prints each delivery with the headers the component adds.

A plain HTTP app (standard library only) behind ``dapr run --app-port``. The subscription is
declarative, dapr/subscriptions/orders.yaml: topic ``orders`` of the component ``delayed`` is
POSTed to ``/orders``. daprd passes the message's metadata as HTTP headers; the component adds

- ``scheduler``: the schedule id that produced the message (its ``scheduleId``);
- ``scheduleNext``: the RFC 3339 instant of the next fire of a schedule, ``purge`` for a one-shot;
- ``deliveryAttempt``: 1 on the first delivery, 2 after one failure, ...

One line per delivery, ``key=value`` pairs::

    orders label=order-1 deliveryAttempt=1 scheduler=order-1 scheduleNext=purge lateness_ms=12 status=200

A message whose data has ``"fail_first": true`` is answered 500 the first time (daprd then
reports the failure to the component, which delivers it again later, with ``deliveryAttempt: 2``).

Usage::

    python examples/quickstart/subscriber.py [--port 6002]
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

# The headers to show, as the component names them (HTTP header names are case-insensitive).
HEADERS = ("deliveryAttempt", "scheduler", "scheduleNext")


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    failed_once: set[str] = set()
    lock = threading.Lock()

    def log_message(self, format: str, *args: Any) -> None:
        pass  # the deliveries are the log

    def _reply(self, status: int, payload: Any) -> None:
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        # No programmatic subscriptions: dapr/subscriptions/orders.yaml declares the one we have.
        if self.path == "/dapr/subscribe":
            self._reply(200, [])
        else:
            self._reply(404, {"error": f"no route {self.path}"})

    def do_POST(self) -> None:
        received_ms = time.time_ns() // 1_000_000
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.path != "/orders":
            self._reply(404, {"error": f"no route {self.path}"})
            return
        event = json.loads(body)  # a CloudEvent; our JSON payload is its "data"
        data = event.get("data") if isinstance(event.get("data"), dict) else {}
        status = 200
        if data.get("fail_first"):
            with self.lock:
                if event["id"] not in self.failed_once:
                    self.failed_once.add(event["id"])
                    status = 500
        fields = {"label": data.get("label", event.get("id"))}
        fields.update({name: self.headers.get(name, "-") for name in HEADERS})
        due_ms = data.get("due_ms")
        if due_ms is None and fields["scheduleNext"] not in ("-", "purge"):
            # A schedule's message is due one interval before its next fire; the quickstart's
            # schedule fires every 3 s.
            due_ms = int(datetime.fromisoformat(fields["scheduleNext"]).timestamp() * 1000) - 3000
        if isinstance(due_ms, int):
            fields["lateness_ms"] = str(received_ms - due_ms)
        fields["status"] = str(status)
        print("orders " + " ".join(f"{k}={v}" for k, v in fields.items()), flush=True)
        # 200 acks the message; anything else asks for a redelivery.
        self._reply(status, {"status": "SUCCESS" if status == 200 else "RETRY"})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, default=6002, help="port to listen on, 127.0.0.1 (default 6002)")
    args = parser.parse_args(argv)
    server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    server.daemon_threads = True
    print(f"subscriber listening on 127.0.0.1:{args.port}", file=sys.stderr, flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
