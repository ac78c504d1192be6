"""`serve --log-format json`: one JSON object per line, and never a body, a password or a client key."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from pathlib import Path

import grpc
import pytest
import redis

from delayed_pubsub.logs import JsonFormatter
from tests.components.driver import Component
from tests.components.serve import start_serve, terminate, wait_for_socket
from tests.redis_server import RedisServer

PASSWORD = "pw-9f8e7d6c5b4a"
BODY_MARK = "body-1a2b3c4d5e6f"
KEY_MARK = "KEYMATERIAL0123456789abcdef"
CLIENT_CERT = "-----BEGIN CERTIFICATE-----\nMIIBcert\n-----END CERTIFICATE-----\n"
CLIENT_KEY = f"-----BEGIN PRIVATE KEY-----\n{KEY_MARK}\n-----END PRIVATE KEY-----\n"


async def test_json_lines_without_secrets_or_bodies(
    folder: Path, redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    redis_client.config_set("requirepass", PASSWORD)
    path = folder / "delayed-pubsub.sock"
    proc = start_serve("--socket", str(path), "--log-format", "json")
    try:
        wait_for_socket(proc, path)
        async with grpc.aio.insecure_channel(f"unix://{path}") as channel:
            props = {
                "redisHost": f"127.0.0.1:{redis_server.port}",
                "consumerID": "app1",
                "maxDeliveryAttempts": "2",
                "retryInitialInterval": "10ms",
                "deadLetterTopic": "dlq",
            }
            bad = Component(channel, "bad")
            # A wrong password: the failure is logged and reported, the password is not.
            with pytest.raises(grpc.aio.AioRpcError):
                await bad.init({**props, "redisPassword": PASSWORD + "x"})
            c = Component(channel, "delayed")
            await c.init(
                {**props, "redisPassword": PASSWORD, "clientCert": CLIENT_CERT, "clientKey": CLIENT_KEY}
            )
            stream = await c.subscribe("orders")
            await c.publish("orders", BODY_MARK.encode(), {"note": "x"})
            for _ in range(2):
                await stream.nack((await stream.next()).id, "handler failed")
            await c.publish("orders", b"{" * 100_000)  # poison-ish payload
            await stream.ack((await stream.next()).id)
            # The dead letter is written (and logged) in the background: wait for it.
            authed = redis.Redis(port=redis_server.port, password=PASSWORD)
            deadline = time.monotonic() + 10
            # (The history record is written just before the log line.)
            while authed.xlen("{app1-delayed}:history") < 2:
                assert time.monotonic() < deadline, "no dead letter"
                await asyncio.sleep(0.02)
            authed.close()
    finally:
        terminate(proc)
        redis_client.config_set("requirepass", "")
    assert proc.stdout is not None
    lines = proc.stdout.read().decode().splitlines()
    records = [json.loads(line) for line in lines]  # every line is one JSON object
    assert records, "nothing logged"
    assert all({"time", "level", "logger", "msg"} <= r.keys() for r in records)
    messages = " ".join(r["msg"] for r in records)
    assert "gave up after 2 deliveries" in messages, "\n".join(r["msg"] for r in records)
    assert "initialized" in messages
    text = "\n".join(lines)
    for secret in (PASSWORD, KEY_MARK, BODY_MARK, "MIIBcert"):
        assert secret not in text


def test_formatter_keeps_exceptions_on_one_line() -> None:
    try:
        raise ValueError("bad\nthing")
    except ValueError:
        exc_info = sys.exc_info()
    record = logging.LogRecord("x", logging.ERROR, __file__, 1, "failed %s", ("here",), exc_info)
    line = JsonFormatter().format(record)
    assert "\n" not in line
    parsed = json.loads(line)
    assert parsed["msg"] == "failed here"
    assert "ValueError: bad" in parsed["exception"]
    assert parsed["level"] == "error"
