"""A tiny Dapr subscriber app: the other end of the demo and the end-to-end tests.

Stdlib only (``http.server``), so it runs anywhere the component runs. daprd asks it
``GET /dapr/subscribe`` for its programmatic subscriptions and POSTs every message to
``/events/<pubsub>/<topic>`` as a CloudEvent. Each arrival is recorded with its receive
time in milliseconds (wall clock, the same clock a ``scheduledSendTime`` is written in):

- appended as one JSON line to ``--arrivals FILE`` (when given),
- served back on ``GET /arrivals`` (``?since=N`` skips the first N),
- printed with its lateness when ``--print`` is on (the demo): lateness is the receive time
  minus the due time the publisher put in the CloudEvent's data (``due_ms``), when present.

Failure injection, to prove redelivery: ``POST /fail`` with ``{"match": "<text>", "times": N}``
makes the next N deliveries whose body contains ``<text>`` answer 500 (daprd then acks the
message with an error, and the component redelivers it). ``GET /fail`` lists what is armed.

Usage::

    python examples/subscriber.py --port 6001 --sub delayed=orders --sub delayed=raw:raw --print
"""

from __future__ import annotations

import argparse
import base64
import json
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse


@dataclass(frozen=True)
class Subscription:
    """One programmatic subscription: ``pubsub=topic`` or ``pubsub=topic:raw`` (rawPayload),
    optionally followed by subscription metadata ``;key=value;key=value`` (daprd hands it to
    the component, e.g. a per-subscription retry policy).

    ``pubsub=topic:declared``: only the route; the subscription itself comes from a
    declarative Subscription YAML (so it is not listed on /dapr/subscribe).
    """

    pubsub: str
    topic: str
    raw: bool = False
    metadata: tuple[tuple[str, str], ...] = ()
    declared: bool = False

    @property
    def route(self) -> str:
        return f"/events/{self.pubsub}/{self.topic}"

    def to_dapr(self) -> dict[str, Any]:
        sub: dict[str, Any] = {"pubsubname": self.pubsub, "topic": self.topic, "route": self.route}
        metadata = dict(self.metadata)
        if self.raw:
            metadata["rawPayload"] = "true"
        if metadata:
            sub["metadata"] = metadata
        return sub

    @classmethod
    def parse(cls, text: str) -> Subscription:
        text, *pairs = text.split(";")
        metadata: list[tuple[str, str]] = []
        for pair in pairs:
            key, eq, value = pair.partition("=")
            if not eq or not key:
                raise argparse.ArgumentTypeError(f"--sub metadata wants ;KEY=VALUE, got {pair!r}")
            metadata.append((key, value))
        pubsub, sep, rest = text.partition("=")
        if not sep or not pubsub or not rest:
            raise argparse.ArgumentTypeError(f"--sub wants PUBSUB=TOPIC[:raw], got {text!r}")
        topic, _, flag = rest.partition(":")
        if flag not in ("", "raw", "declared"):
            raise argparse.ArgumentTypeError(f"--sub flag must be 'raw' or 'declared', got {flag!r}")
        return cls(pubsub, topic, raw=flag == "raw", declared=flag == "declared", metadata=tuple(metadata))


@dataclass
class State:
    """Everything the handlers share; guarded by one lock (the server is threaded)."""

    subscriptions: list[Subscription]
    arrivals_file: Path | None
    echo: bool
    arrivals: list[dict[str, Any]] = field(default_factory=list)
    failures: dict[str, int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def should_fail(self, body: bytes) -> bool:
        with self.lock:
            for match, times in self.failures.items():
                if times > 0 and match.encode() in body:
                    self.failures[match] = times - 1
                    return True
        return False

    def record(self, arrival: dict[str, Any]) -> None:
        line = json.dumps(arrival, sort_keys=True)
        with self.lock:
            self.arrivals.append(arrival)
            if self.arrivals_file is not None:
                with self.arrivals_file.open("a", encoding="utf-8") as f:
                    f.write(line + "\n")
        if self.echo:
            print(describe(arrival), flush=True)


def describe(arrival: dict[str, Any]) -> str:
    """One human line per arrival: what, where, and how late against its due time."""
    data = arrival.get("data")
    due = data.get("due_ms") if isinstance(data, dict) else None
    label = data.get("label", arrival.get("id")) if isinstance(data, dict) else arrival.get("id")
    clock = time.strftime("%H:%M:%S", time.localtime(arrival["received_ms"] / 1000))
    millis = arrival["received_ms"] % 1000
    where = f"{arrival['pubsub']}/{arrival['topic']}"
    status = "" if arrival["status"] == 200 else f"  (answered {arrival['status']}: redelivery expected)"
    if isinstance(due, int | float):
        lateness = arrival["received_ms"] - due
        return f"{clock}.{millis:03d}  {where:<22} {label!s:<28} lateness {lateness:+6d} ms{status}"
    return f"{clock}.{millis:03d}  {where:<22} {label!s:<28}{status}"


def make_handler(state: State) -> type[BaseHTTPRequestHandler]:
    routes = {sub.route: sub for sub in state.subscriptions}

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        # Headers and body leave in two writes; with Nagle on, the body waits for the ACK of
        # the headers, which a keep-alive client (daprd) delays by ~40 ms: 20-odd messages a
        # second instead of thousands.
        disable_nagle_algorithm = True

        def log_message(self, format: str, *args: Any) -> None:
            # daprd polls and posts a lot; the arrivals are the interesting log.
            pass

        def _reply(self, status: int, payload: Any) -> None:
            body = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _body(self) -> bytes:
            length = int(self.headers.get("Content-Length") or 0)
            return self.rfile.read(length) if length else b""

        def do_GET(self) -> None:
            url = urlparse(self.path)
            if url.path == "/dapr/subscribe":
                self._reply(200, [sub.to_dapr() for sub in state.subscriptions if not sub.declared])
            elif url.path == "/dapr/config":
                self._reply(200, {})
            elif url.path == "/arrivals":
                since = int(parse_qs(url.query).get("since", ["0"])[0])
                with state.lock:
                    self._reply(200, state.arrivals[since:])
            elif url.path == "/fail":
                with state.lock:
                    self._reply(200, dict(state.failures))
            elif url.path == "/healthz":
                self._reply(200, {"ok": True})
            else:
                self._reply(404, {"error": f"no route {url.path}"})

        def do_POST(self) -> None:
            received_ms = time.time_ns() // 1_000_000
            url = urlparse(self.path)
            body = self._body()
            if url.path == "/fail":
                spec = json.loads(body)
                with state.lock:
                    state.failures[str(spec["match"])] = int(spec.get("times", 1))
                self._reply(200, {"armed": spec})
                return
            sub = routes.get(url.path)
            if sub is None:
                self._reply(404, {"error": f"no subscription on {url.path}"})
                return
            status = 500 if state.should_fail(body) else 200
            state.record(arrival(sub, body, received_ms, status, dict(self.headers.items())))
            if status == 200:
                self._reply(200, {"status": "SUCCESS"})
            else:
                self._reply(500, {"error": "failure injected by the test"})

    return Handler


def arrival(
    sub: Subscription, body: bytes, received_ms: int, status: int, headers: dict[str, str]
) -> dict[str, Any]:
    """The record of one delivery: the CloudEvent's fields that matter plus the raw body."""
    try:
        event = json.loads(body)
    except ValueError:
        event = None
    if not isinstance(event, dict):
        event = {}
    record: dict[str, Any] = {
        "route": sub.route,
        "pubsub": event.get("pubsubname", sub.pubsub),
        "topic": event.get("topic", sub.topic),
        "id": event.get("id"),
        "data": event.get("data"),
        "datacontenttype": event.get("datacontenttype"),
        "received_ms": received_ms,
        "status": status,
        "body": body.decode("utf-8", errors="replace"),
        # daprd forwards the message's metadata as HTTP headers.
        "headers": headers,
    }
    if "data_base64" in event:
        record["data_base64"] = event["data_base64"]
        record["raw_hex"] = base64.b64decode(event["data_base64"]).hex()
    return record


def serve(port: int, state: State, host: str = "127.0.0.1") -> ThreadingHTTPServer:
    server = ThreadingHTTPServer((host, port), make_handler(state))
    server.daemon_threads = True
    return server


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--port", type=int, required=True, help="port to listen on (127.0.0.1)")
    parser.add_argument(
        "--sub",
        type=Subscription.parse,
        action="append",
        default=[],
        help="subscription PUBSUB=TOPIC, PUBSUB=TOPIC:raw (rawPayload) or PUBSUB=TOPIC:declared "
        "(route only: a Subscription YAML subscribes); repeatable",
    )
    parser.add_argument("--arrivals", type=Path, help="append each arrival as a JSON line to this file")
    parser.add_argument(
        "--print", dest="echo", action="store_true", help="print each arrival with its lateness"
    )
    args = parser.parse_args(argv)
    state = State(subscriptions=args.sub, arrivals_file=args.arrivals, echo=args.echo)
    server = serve(args.port, state)
    print(f"subscriber listening on 127.0.0.1:{args.port}", file=sys.stderr, flush=True)
    # SIGTERM (a pod's stop; as PID 1 of a container it would otherwise be ignored until the
    # SIGKILL that follows the grace period) stops it as Ctrl-C does.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
