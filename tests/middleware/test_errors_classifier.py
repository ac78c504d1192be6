"""The one Redis error classifier (delayed_middleware.redis_errors), against the replies a real
redis-server sends: through the sync and the asyncio client, through pipelines and from inside
Lua scripts, and wrapped in our own errors."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Callable, Iterator

import pytest
import redis
import redis.asyncio as aioredis
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError
from redis.retry import Retry

from delayed_middleware.errors import BackendUnavailableError, DelayedPubSubError
from delayed_middleware.redis_errors import (
    DUP,
    TRANSIENT_ERRORS,
    describe,
    is_auth_refusal,
    is_busy_group,
    is_dial_failure,
    is_moved,
    is_no_group,
    is_no_script,
    is_wrong_type,
    reply_code,
    script_status,
)
from tests.redis_server import free_port

PREDICATES: dict[str, Callable[[BaseException | None], bool]] = {
    "WRONGTYPE": is_wrong_type,
    "BUSYGROUP": is_busy_group,
    "NOGROUP": is_no_group,
    "NOSCRIPT": is_no_script,
    "MOVED": is_moved,
}


def _only(code: str, error: BaseException) -> None:
    """`error` is classified as `code` by reply_code and by its predicate, and by no other predicate."""
    assert reply_code(error) == code, str(error)
    answers = {name: p(error) for name, p in PREDICATES.items()}
    assert answers == {name: name == code for name in PREDICATES}, str(error)


def _client(port: int, **kwargs: object) -> redis.Redis:
    """A client that tries once: redis-py's default retries would only make a refusal slow."""
    return redis.Redis(port=port, socket_connect_timeout=1, retry=Retry(NoBackoff(), 0), **kwargs)  # type: ignore[arg-type]


def _raised(call: Callable[[], object]) -> BaseException:
    with pytest.raises(redis.RedisError) as info:
        call()
    return info.value


def test_wrong_type_from_a_command_a_pipeline_and_a_script(redis_client: redis.Redis) -> None:
    redis_client.hset("taken", "f", "v")
    _only("WRONGTYPE", _raised(lambda: redis_client.xadd("taken", {"data": "x"})))
    pipe = redis_client.pipeline(transaction=False)
    pipe.xadd("free", {"data": "x"})
    pipe.xadd("taken", {"data": "x"})
    _only("WRONGTYPE", _raised(pipe.execute))
    # A script's redis.call error comes back with the inner reply's code.
    script = "return redis.call('XADD', KEYS[1], '*', 'data', 'x')"
    _only("WRONGTYPE", _raised(lambda: redis_client.eval(script, 1, "taken")))
    # Pipelines that do not raise hand the error back as a value.
    pipe = redis_client.pipeline(transaction=False)
    pipe.xadd("taken", {"data": "x"})
    (value,) = pipe.execute(raise_on_error=False)
    assert isinstance(value, ResponseError)
    _only("WRONGTYPE", value)


def test_busy_group_and_no_group(redis_client: redis.Redis) -> None:
    redis_client.xgroup_create("topic", "g", id="0", mkstream=True)
    _only("BUSYGROUP", _raised(lambda: redis_client.xgroup_create("topic", "g", id="0", mkstream=True)))
    _only("NOGROUP", _raised(lambda: redis_client.xreadgroup("other", "c", {"topic": ">"})))
    _only("NOGROUP", _raised(lambda: redis_client.xreadgroup("g", "c", {"missing": ">"})))
    script = "return redis.call('XGROUP', 'CREATE', KEYS[1], 'g', '0')"
    _only("BUSYGROUP", _raised(lambda: redis_client.eval(script, 1, "topic")))


def test_no_script(redis_client: redis.Redis) -> None:
    error = _raised(lambda: redis_client.evalsha("0" * 40, 0))
    # redis-py gives NOSCRIPT a class of its own and cuts the code from the text.
    assert isinstance(error, NoScriptError)
    assert not str(error).startswith("NOSCRIPT")
    _only("NOSCRIPT", error)


async def test_the_asyncio_client_and_its_pipeline(aclient: aioredis.Redis) -> None:
    await aclient.set("plain", "v")
    with pytest.raises(ResponseError) as info:
        await aclient.xadd("plain", {"data": "x"})
    _only("WRONGTYPE", info.value)
    await aclient.xgroup_create("t", "g", id="0", mkstream=True)
    pipe = aclient.pipeline(transaction=False)
    pipe.xreadgroup("g", "c", {"t": ">"})
    pipe.xreadgroup("nope", "c", {"t": ">"})
    with pytest.raises(ResponseError) as info:
        await pipe.execute()
    # The asyncio pipeline puts its note, then the repr of the reply's args, before the reply.
    assert str(info.value).startswith("Command # 2 ")
    _only("NOGROUP", info.value)


def test_a_word_elsewhere_in_the_text_is_no_code(redis_client: redis.Redis) -> None:
    """Only the reply's code counts: a key, topic or message that merely contains a code's word
    (as text matching took it) is not that error."""
    error = _raised(lambda: redis_client.eval("return redis.error_reply('ERR group NOGROUP WRONGTYPE')", 0))
    assert reply_code(error) not in PREDICATES
    error = _raised(lambda: redis_client.eval("return redis.error_reply('WRONGTYPEX NOGROUP')", 0))
    assert reply_code(error) == "WRONGTYPEX"
    assert not any(p(error) for p in PREDICATES.values())
    # A real NOGROUP reply quotes the names it was given: a consumer group named BUSYGROUP.
    redis_client.xadd("topic", {"data": "x"})
    named = _raised(lambda: redis_client.xreadgroup("BUSYGROUP", "c", {"topic": ">"}))
    assert "BUSYGROUP" in str(named)
    _only("NOGROUP", named)
    # Our own error naming a topic called WRONGTYPE, with no Redis reply behind it.
    assert not is_wrong_type(DelayedPubSubError("publish to 'WRONGTYPE': redis refused XADD: boom"))


def test_our_error_raised_from_a_reply_is_classified_by_its_cause(redis_client: redis.Redis) -> None:
    redis_client.hset("taken", "f", "v")
    reply = _raised(lambda: redis_client.xadd("taken", {"data": "x"}))
    inner = DelayedPubSubError("publish to 'taken': redis refused XADD")
    inner.__cause__ = reply  # as `raise ... from reply` sets it
    outer = BackendUnavailableError("again")
    outer.__cause__ = inner
    assert is_wrong_type(outer)
    assert not is_no_group(outer)


def test_forms_no_server_here_sends() -> None:
    """Redis 6.2 wraps a script's error ("ERR Error running script ..."; redis-py cuts the ERR),
    and redis-py's sync pipeline note carries the text as it is."""
    wrapped = ResponseError(
        "Error running script (call to f_0123abcd): @user_script:1: WRONGTYPE Operation against a key"
    )
    _only("WRONGTYPE", wrapped)
    noted = ResponseError(
        "Command # 3 (XREADGROUP GROUP g c STREAMS t >) of pipeline caused error: NOGROUP No"
    )
    _only("NOGROUP", noted)
    assert reply_code(None) is None
    assert reply_code(ResponseError()) is None


def test_auth_refusals(redis_client: redis.Redis) -> None:
    # "ERR AUTH <password> called without any password configured ..."
    error = _raised(lambda: redis_client.auth("not-the-password"))
    assert is_auth_refusal(error)
    redis_client.acl_setuser(
        "reader", enabled=True, passwords=["+pw"], keys=["*"], commands=["+get", "+ping"]
    )
    port = int(redis_client.connection_pool.connection_kwargs["port"])
    reader = _client(port, username="reader", password="pw")
    try:
        denied = _raised(lambda: reader.set("k", "v"))
        assert is_auth_refusal(denied)
        assert reply_code(denied) == "NOPERM"
        wrong = _client(port, username="reader", password="bad")
        refused = _raised(wrong.ping)
        wrong.close()
        assert is_auth_refusal(refused)
    finally:
        reader.close()
        redis_client.acl_deluser("reader")
    redis_client.hset("taken", "f", "v")
    assert not is_auth_refusal(_raised(lambda: redis_client.xadd("taken", {"data": "x"})))


@pytest.fixture
def hang_up_port() -> Iterator[int]:
    """A port that accepts connections and closes them at once, without a word."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.settimeout(0.1)
    done = threading.Event()

    def serve() -> None:
        while not done.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield int(listener.getsockname()[1])
    finally:
        done.set()
        thread.join()
        listener.close()


def test_no_reply_behind_connection_errors(hang_up_port: int) -> None:
    """Refused (nothing listens) and hung up on (accepted, then closed) are both ConnectionErrors
    without a reply code; only the first is a failure to dial."""
    refused = _raised(_client(free_port()).ping)
    assert isinstance(refused, RedisConnectionError)
    assert isinstance(refused, TRANSIENT_ERRORS)
    assert reply_code(refused) is None
    assert is_dial_failure(refused)
    hung_up = _raised(_client(hang_up_port).ping)
    assert isinstance(hung_up, RedisConnectionError)
    assert reply_code(hung_up) is None
    assert not is_dial_failure(hung_up)


async def test_describe(redis_client: redis.Redis) -> None:
    # A call bounded by asyncio.timeout fails with a TimeoutError without text.
    with pytest.raises(TimeoutError) as info:
        async with asyncio.timeout(0.01):
            await asyncio.Event().wait()
    assert describe(info.value) == "redis: timed out"
    assert describe(None) == "redis: timed out"
    redis_client.hset("taken", "f", "v")
    reply = _raised(lambda: redis_client.xadd("taken", {"data": "x"}))
    assert describe(reply) == f"redis: {reply}"
    assert describe(reply).startswith("redis: WRONGTYPE ")


@pytest.mark.parametrize("decode", [False, True])
def test_script_status_is_one_str_whatever_the_client_decodes(redis_server_port: int, decode: bool) -> None:
    client = redis.Redis(port=redis_server_port, decode_responses=decode)
    try:
        raw = client.eval("return {'dup', 'moved', 7}", 0)
    finally:
        client.close()
    assert isinstance(raw[0], str if decode else bytes)
    assert [script_status(v) for v in raw] == [DUP, "moved", "7"]
    assert script_status(b"\xff") == "\ufffd"


@pytest.fixture
def redis_server_port(redis_client: redis.Redis) -> int:
    return int(redis_client.connection_pool.connection_kwargs["port"])
