"""targetPubsub: which publishes may name another pub/sub, and what metadata reaches it."""

from __future__ import annotations

import pytest

from delayed_middleware.errors import InvalidArgumentError
from delayed_middleware.target import forwarded_metadata, target_pubsub


def test_a_delayed_message_goes_to_the_named_target() -> None:
    assert target_pubsub({"targetPubsub": "kafka"}, delayed=True) == "kafka"


def test_the_named_target_wins_over_the_default() -> None:
    assert target_pubsub({"targetPubsub": "kafka"}, delayed=True, default="rabbit") == "kafka"


def test_the_default_applies_to_delayed_messages_only() -> None:
    assert target_pubsub({}, delayed=True, default="rabbit") == "rabbit"
    assert target_pubsub({}, delayed=False, default="rabbit") is None


def test_no_target_no_default_means_our_own_topic() -> None:
    assert target_pubsub({"customer": "x"}, delayed=True) is None


def test_target_without_a_delay_is_refused_naming_key_and_value() -> None:
    with pytest.raises(InvalidArgumentError) as err:
        target_pubsub({"targetPubsub": "kafka"}, delayed=False)
    assert err.value.key == "targetPubsub"
    assert err.value.value == "kafka"
    assert "needs delay metadata" in str(err.value)


@pytest.mark.parametrize("name", ["", "   ", " kafka", "kaf ka", "kafka\n", "a\x00b", "x" * 254], ids=repr)
def test_bad_target_names_are_refused(name: str) -> None:
    with pytest.raises(InvalidArgumentError) as err:
        target_pubsub({"targetPubsub": name}, delayed=True)
    assert err.value.key == "targetPubsub"


def test_forwarded_metadata_drops_our_keys_and_keeps_the_users() -> None:
    metadata = {
        "scheduledSendDelay": "5s",
        "scheduledSendTime": "2045-01-01T00:00:00Z",
        "scheduleId": "s1",
        "targetPubsub": "kafka",
        "ttlInSeconds": "60",
        "ttl": "1m",
        "customer": "acme",
        "scheduler": "s1",
        "scheduleNext": "purge",
        "partitionKey": "k",
    }
    assert forwarded_metadata(metadata) == {
        "customer": "acme",
        "scheduler": "s1",
        "scheduleNext": "purge",
        "partitionKey": "k",
    }


def test_pulsar_delay_keys_are_not_forwarded_so_a_pulsar_target_does_not_delay_again() -> None:
    metadata = {"deliverAfter": "5s", "deliverAt": "", "targetPubsub": "pulsar", "customer": "acme"}
    assert forwarded_metadata(metadata) == {"customer": "acme"}
