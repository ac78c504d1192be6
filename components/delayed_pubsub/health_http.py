"""HTTP `/healthz` and `/readyz` for Kubernetes probes: a thin front on grpc.health.v1.

Kubernetes' own gRPC probes dial TCP, and daprd reaches the component over a unix socket, so
`serve --health-port` adds a small HTTP listener. It computes nothing itself: every request
asks the component's gRPC health service over the component's own socket, the very answer
daprd and `grpc_health_probe` get (server.ComponentServer.check_health keeps it current). So
the HTTP answer can never disagree with the gRPC one, and a component whose gRPC server no
longer answers fails its liveness probe.

- `GET /healthz` (liveness): 200 when the gRPC server answers a health check and, under
  `serve --workers N`, no worker process has been down for longer than its restarts take
  (`delayed-pubsub.workers` SERVING); 503 when it does not answer within the timeout or the
  firing is not coming back by itself. A restart of the container fixes only these: an
  unreachable Redis or orphaned subscriptions are not reasons to restart it.
- `GET /readyz` (readiness): 200 when the overall service `""` (every instance's Redis answers
  and its background loops run) and `delayed-pubsub.subscriptions` (no subscription orphaned by a component restart) are both
  SERVING; 503 otherwise, the JSON body naming each service's status.

The listener runs in threads of its own, apart from the component's event loop, so a stalled
loop shows as a failed check instead of a stalled probe.
"""

from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from delayed_pubsub.server import SUBSCRIPTIONS_HEALTH_SERVICE, WORKERS_HEALTH_SERVICE

log = logging.getLogger(__name__)

# Below the probes' timeoutSeconds (deploy/kubernetes uses 3 s), so a stalled component is
# reported as 503 rather than as a probe timeout.
CHECK_TIMEOUT_S = 2.0
LIVENESS_PATH = "/healthz"
READINESS_PATH = "/readyz"
# What readiness requires to be SERVING: "" is the overall status, NOT_SERVING while an
# instance's Redis does not answer or one of its background loops is down or stalled.
READINESS_SERVICES = ("", SUBSCRIPTIONS_HEALTH_SERVICE)
# What liveness asks: "" is shown as it is; only the workers' status (no worker gone for
# good, under `serve --workers N`) must be SERVING, and it is named in the body only when not.
LIVENESS_SERVICES = ("", WORKERS_HEALTH_SERVICE)


def check_services(socket_path: Path, services: tuple[str, ...], timeout: float) -> dict[str, str]:
    """Each service's grpc.health.v1 status name, asked over the component's socket.

    A fresh channel per call: a probe every few seconds costs one unix-socket connect, and
    no channel is left in reconnect backoff after the component was briefly away. Raises
    grpc.RpcError when the component does not answer.
    """
    with grpc.insecure_channel(f"unix://{socket_path}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return {
            service: health_pb2.HealthCheckResponse.ServingStatus.Name(
                stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout).status
            )
            for service in services
        }


class HealthHttpServer:
    """`/healthz` and `/readyz` on `address:port` for the component serving on `socket_path`."""

    def __init__(
        self, socket_path: Path, port: int, address: str = "127.0.0.1", timeout: float = CHECK_TIMEOUT_S
    ) -> None:
        self.socket_path = socket_path
        self.timeout = timeout
        handler = type("_Handler", (_Handler,), {"front": self})
        self._httpd = ThreadingHTTPServer((address, port), handler)
        self._httpd.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        """The bound port (the one asked for, or the one the OS chose for port 0)."""
        return int(self._httpd.server_address[1])

    def start(self) -> None:
        """Serve in a background thread."""
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="health-http", daemon=True)
        self._thread.start()
        host, port = self._httpd.server_address[:2]
        log.info("health endpoints on http://%s:%d%s and %s", host, port, LIVENESS_PATH, READINESS_PATH)

    def stop(self) -> None:
        """Stop serving and close the listener."""
        if self._thread is not None:
            self._httpd.shutdown()
            self._thread.join()
            self._thread = None
        self._httpd.server_close()

    def answer(self, path: str) -> tuple[int, dict[str, object]]:
        """The HTTP status and JSON body for a GET of `path`."""
        if path == LIVENESS_PATH:
            services: tuple[str, ...] = LIVENESS_SERVICES
        elif path == READINESS_PATH:
            services = READINESS_SERVICES
        else:
            return 404, {"error": f"no such endpoint {path!r}; try {LIVENESS_PATH} or {READINESS_PATH}"}
        try:
            statuses = check_services(self.socket_path, services, self.timeout)
        except grpc.RpcError as e:
            detail = f"{e.code().name}: {e.details()}" if isinstance(e, grpc.Call) else str(e)
            return 503, {"status": "unavailable", "error": f"the component does not answer ({detail})"}
        if path == LIVENESS_PATH:
            ok = statuses.get(WORKERS_HEALTH_SERVICE) == "SERVING"
            if ok:
                statuses.pop(WORKERS_HEALTH_SERVICE, None)
        else:
            ok = all(s == "SERVING" for s in statuses.values())
        return (200 if ok else 503), {"status": "ok" if ok else "not ready", "services": statuses}


class _Handler(BaseHTTPRequestHandler):
    front: HealthHttpServer
    # A connection that sends nothing is dropped after this long: the listener faces the
    # pod network, and an idle client must not hold a thread for good.
    timeout = 5.0

    def do_GET(self) -> None:
        code, body = self.front.answer(self.path.split("?", 1)[0])
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: object) -> None:
        # A probe every few seconds would flood the log at INFO.
        log.debug("health http: " + format, *args)
