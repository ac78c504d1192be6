"""PullMessagesResponse bytes built by hand (delayed_pubsub.wire) read back as the message
protobuf would have built: daprd parses what the stream sends with the same schema."""

from __future__ import annotations

import pytest

from delayed_middleware.entry import EntryReader, StreamEntry, encode_entry
from delayed_pubsub.window import DELIVERY_ATTEMPT, Delivery
from delayed_pubsub.wire import Responses, varint
from delayed_pubsub_pb.dapr.proto.components.v1 import pubsub_pb2


def built(d: Delivery) -> pubsub_pb2.PullMessagesResponse:
    """The message as the handler built it before (the publisher's deliveryAttempt replaced)."""
    msg = pubsub_pb2.PullMessagesResponse(
        data=d.entry.data,
        topic_name=d.topic,
        metadata=d.entry.metadata,
        content_type=d.entry.content_type,
        id=d.id,
    )
    msg.metadata[DELIVERY_ATTEMPT] = str(d.attempt)
    return msg


@pytest.mark.parametrize("n", [0, 1, 127, 128, 300, 16_383, 16_384, 2**21, 2**35])
def test_varints_read_back(n: int) -> None:
    # A bytes field of that length, read back by protobuf: the length prefix is the varint.
    data = b"x" * n if n <= 2**21 else b""
    if data:
        raw = b"\x0a" + varint(n) + data
        assert pubsub_pb2.PullMessagesResponse.FromString(raw).data == data
    value, shift = 0, 0
    for byte in varint(n):
        value |= (byte & 0x7F) << shift
        shift += 7
    assert value == n


def test_each_delivery_reads_back_as_the_message_built_field_by_field() -> None:
    read = EntryReader()
    shared = [b"metadata", b'{"cloudevent.id":"x","\xc3\xbc":"\xc3\x9f"}']
    entries = [
        read([b"data", b"\x00payload", *shared]),
        read([b"data", b"y" * 70_000, *shared, b"contentType", b"application/json"]),
        read([b"data", b"z", b"metadata", b'{"deliveryAttempt":"9","k":""}']),
        read([b"data", b"", *shared]),  # empty data
        StreamEntry(b"no metadata"),
        read([part for k, v in encode_entry(StreamEntry(b"e", {"": "empty"})).items() for part in (k.encode(), v)]),
    ]
    deliveries = [
        Delivery(f"1795932911677-{i}", topic, entry, attempt)
        for i, (entry, attempt, topic) in enumerate(
            (e, a, t) for e in entries for a in (1, 2, 7, 8, 12, 300) for t in ("orders", "ü/topic")
        )
    ]
    streams = {t: Responses(t) for t in ("orders", "ü/topic")}
    for d in deliveries:
        sent = pubsub_pb2.PullMessagesResponse.FromString(streams[d.topic](d))
        assert sent == built(d), d
        assert sent.metadata[DELIVERY_ATTEMPT] == str(d.attempt)


def test_a_string_that_is_no_utf8_fails_as_the_message_does() -> None:
    d = Delivery("1-0", "orders", StreamEntry(b"x", {"k": "\ud800"}), 1)
    with pytest.raises(UnicodeEncodeError):
        built(d)
    with pytest.raises(UnicodeEncodeError):
        Responses("orders")(d)
