"""Data source options: the component's metadata keys plus numPartitions/batchSize/startingOffsets."""

from __future__ import annotations

import pickle

import pytest

from delayed_pubsub.spark.options import InvalidOptionError, parse_reader_options

BASE = {"redisHost": "localhost:6379", "consumerID": "shop"}


def test_component_keys_parse_like_the_component_and_any_letter_case() -> None:
    # Spark hands options over lower-cased.
    opts = parse_reader_options(
        {
            "redishost": "r1:7000",
            "consumerid": "shop",
            "redispassword": "s3cret",
            "enabletls": "true",
            "redisdb": "2",
        }
    )
    assert opts.settings.hosts == (("r1", 7000),)
    assert opts.settings.password == "s3cret"
    assert opts.settings.enable_tls is True
    assert opts.settings.db == 2
    assert opts.consumer_id == "shop"
    assert opts.delayed_topics == ("shop-delayed",)
    assert opts.num_partitions is None
    assert opts.starting_offsets == "earliest"


def test_spark_options() -> None:
    opts = parse_reader_options(
        {**BASE, "numpartitions": "4", "batchsize": "500", "startingoffsets": "LATEST"}
    )
    assert (opts.num_partitions, opts.batch_size, opts.starting_offsets) == (4, 500, "latest")


@pytest.mark.parametrize(
    ("extra", "key", "value", "words"),
    [
        ({"redisHots": "x"}, "redisHots", "x", "did you mean redisHost"),
        ({"numPartitions": "0"}, "numPartitions", "0", "between 1 and"),
        ({"numPartitions": "two"}, "numPartitions", "two", "between 1 and"),
        ({"batchSize": "-5"}, "batchSize", "-5", "between 1 and"),
        ({"startingOffsets": "newest"}, "startingOffsets", "newest", "earliest or latest"),
        ({"redisPort": "99999"}, "redisPort", "99999", "between 1 and 65535"),
        ({"enableTLS": "maybe"}, "enableTLS", "maybe", "boolean"),
        ({"redisType": "ring"}, "redisType", "ring", "node or cluster"),
        ({"path": "/tmp/x"}, "path", "/tmp/x", "take no path"),
        ({"consumerID": ""}, "consumerID", "", "required"),
        ({"consumerID": "{appID}"}, "consumerID", "{appID}", "not a template"),
        # Shard 1 of app `tenant`: reading it as an app would show another app's messages.
        ({"consumerID": "tenant~1"}, "consumerID", "tenant~1", "another app"),
    ],
)
def test_bad_option_names_key_and_value(extra: dict[str, str], key: str, value: str, words: str) -> None:
    with pytest.raises(InvalidOptionError) as err:
        parse_reader_options({**BASE, **extra})
    message = str(err.value)
    assert message.startswith(f"invalid option {key}={value!r}")
    assert words in message
    assert err.value.key == key


def test_missing_redis_host_and_consumer_id() -> None:
    with pytest.raises(InvalidOptionError, match="redisHost"):
        parse_reader_options({"consumerID": "shop"})
    with pytest.raises(InvalidOptionError, match="consumerID"):
        parse_reader_options({"redisHost": "h"})


def test_error_survives_pickling() -> None:
    # Spark pickles errors raised in its Python workers.
    with pytest.raises(InvalidOptionError) as err:
        parse_reader_options({**BASE, "numPartitions": "0"})
    again = pickle.loads(pickle.dumps(err.value))
    assert str(again) == str(err.value)
