"""`delayed-pubsub stats`: pending, fired, lateness and throughput of one app, computed by Spark.

    delayed-pubsub stats --redis-host H --app-id A [--out DIR] [--master URL] [--follow]
        (a password: --redis-password, or $DELAYED_PUBSUB_REDIS_PASSWORD, as the operator commands)
    delayed-pubsub stats --redis-host H --redis-type cluster --delay-shards N --app-id A [...]
    delayed-pubsub stats --component YAML --app-id A [...]   (secretKeyRef from the environment,
                                                              as the operator commands read it)
    delayed-pubsub stats ... --master spark://HOST:7077 [--conf KEY=VALUE ...]   (a standalone cluster)
    delayed-pubsub stats ... --remote sc://HOST:15002                           (a Spark Connect server)
    delayed-pubsub stats ... --stream-out DIR     (per-minute aggregates as Parquet, until Ctrl-C)

This module imports nothing of Spark until the command runs, so registering
the subcommand costs the rest of the CLI nothing and a missing `[spark]` extra
is one clear error message.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TextIO

from delayed_middleware.errors import DelayedPubSubError
from delayed_pubsub.component_file import ComponentFileError, component_properties
from delayed_pubsub.redis_flags import PASSWORD_ENV, add_redis_flags
from delayed_pubsub.settings import known_keys

FOLLOW_INTERVAL_S = 2


def register(subparsers: Any) -> None:
    """Add the `stats` subcommand to the `delayed-pubsub` parser's subparsers."""
    p = subparsers.add_parser(
        "stats",
        help="pending/fired/lateness/throughput of an app's delayed messages, computed with Spark",
        description="Reads the app's delayed topic and lifecycle history with Spark and prints pending by "
        "topic and due window, fires and lateness per topic, fires per minute and event counts.",
    )
    add_redis_flags(p, app_id_required=True)
    p.add_argument(
        "--out", metavar="DIR", type=Path, help="also write the tables as Parquet and PNG charts here"
    )
    where = p.add_mutually_exclusive_group()
    where.add_argument(
        "--master",
        metavar="URL",
        default="local[*]",
        help="Spark master: local[*] (the default), spark://HOST:PORT, yarn, k8s://...; "
        "this package is shipped to the cluster's Python workers",
    )
    where.add_argument(
        "--remote",
        metavar="URL",
        help="a Spark Connect server (sc://HOST:PORT) instead of a master; this package is "
        "added to the session as a pyfile artifact",
    )
    p.add_argument(
        "--conf",
        metavar="KEY=VALUE",
        action="append",
        default=[],
        type=_conf_pair,
        help="a Spark setting, as spark-submit --conf takes it (repeatable), e.g. "
        "spark.archives=env.tar.gz#env",
    )
    mode = p.add_mutually_exclusive_group()
    mode.add_argument(
        "--follow", action="store_true", help="keep a streaming query running; refresh until Ctrl-C"
    )
    mode.add_argument(
        "--stream-out",
        metavar="DIR",
        type=Path,
        help="run a streaming query that writes per-minute aggregates of the history (events by "
        "minute, topic and event; lateness sums) as Parquet under DIR/minutes until Ctrl-C; it "
        "resumes from DIR/_checkpoint when restarted",
    )
    p.add_argument(
        "--component",
        metavar="YAML",
        type=Path,
        help="read the Redis metadata (redisHost, redisPassword, enableTLS, ...) from this component YAML; "
        "a secretKeyRef comes from the environment (key: redis-password -> $REDIS_PASSWORD)",
    )
    p.set_defaults(handler=run)


def _conf_pair(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"--conf wants KEY=VALUE, got {text!r}")
    return key.strip(), value


def component_metadata(path: Path, environ: Mapping[str, str]) -> dict[str, str]:
    """The component's metadata from a Dapr YAML file, as the operator commands read it
    (delayed_pubsub.component_file: secretKeyRef values from the environment).

    Keys the component does not read are left out: the reader has no use for them.
    """
    props = component_properties(path, environ)
    return {name: value for name, value in props.items() if name in known_keys()}


def reader_options(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Data source options from the command line (and --component, secrets from `environ`)."""
    opts: dict[str, str] = {}
    if args.component is not None:
        opts.update(component_metadata(args.component, os.environ if environ is None else environ))
    if args.redis_host:
        opts["redisHost"] = args.redis_host
    env = os.environ if environ is None else environ
    # As the operator commands: the flag, else the variable, else the YAML's.
    password = getattr(args, "redis_password", None) or env.get(PASSWORD_ENV)
    if password:
        opts["redisPassword"] = password
    # Every shard stream of the delayed topic is read (keys.shard_topics): as many as the component has.
    if getattr(args, "redis_type", None):
        opts["redisType"] = args.redis_type
    if getattr(args, "delay_shards", None):
        opts["delayShards"] = args.delay_shards
    if not opts.get("redisHost"):
        raise ComponentFileError("give --redis-host (or --component with a redisHost)")
    # daprd sets consumerID to the app id when the YAML omits it, and resolves {appID}.
    opts["consumerID"] = opts.get("consumerID", "").replace("{appID}", args.app_id) or args.app_id
    return opts


def run(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    """Run the stats command; returns the exit code."""
    from delayed_pubsub.spark import require_extra

    try:
        require_extra()
        options = reader_options(args)
    except (ImportError, DelayedPubSubError) as e:
        print(f"delayed-pubsub stats: error: {e}", file=sys.stderr)
        return 2
    from delayed_pubsub.spark.options import parse_reader_options

    try:
        parse_reader_options(options)  # fail before Spark's ~12 s start-up
    except DelayedPubSubError as e:
        print(f"delayed-pubsub stats: error: {e}", file=sys.stderr)
        return 2

    from delayed_pubsub.spark.session import Progress, build_session

    remote = getattr(args, "remote", None)
    conf = dict(getattr(args, "conf", None) or [])
    print(f"delayed-pubsub stats: starting Spark ({remote or args.master})…", file=sys.stderr, flush=True)
    try:
        spark = build_session(args.master, remote=remote, conf=conf)
    except KeyboardInterrupt:
        print("delayed-pubsub stats: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # no Java, a master that does not answer, ...
        need = (
            f"is the Spark Connect server at {remote} up?"
            if remote
            else "it needs Java 17 (java on PATH or JAVA_HOME)"
        )
        print(
            f"delayed-pubsub stats: error: Spark did not start ({_spark_error(e)}); {need}", file=sys.stderr
        )
        return 1
    try:
        if getattr(args, "stream_out", None) is not None:
            return _stream_out(spark, args, options)
        if args.follow:
            return _follow(spark, args, options, out)
        with Progress(spark) as progress:
            text = _once(spark, args, options, progress)
        out.write(text)
        out.flush()
        return 0
    except KeyboardInterrupt:
        # pyspark's handler has cancelled the running jobs already.
        print("delayed-pubsub stats: interrupted", file=sys.stderr)
        return 130
    except DelayedPubSubError as e:
        print(f"delayed-pubsub stats: error: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # Spark wraps our errors (bad Redis, ...) in its own
        print(f"delayed-pubsub stats: error: {_spark_error(e)}", file=sys.stderr)
        return 1


def _spark_error(e: Exception) -> str:
    """The useful line of an error raised in a Spark worker (ours, not Spark's traceback)."""
    text = str(e)
    for marker in ("BackendUnavailableError: ", "InvalidOptionError: ", "Error: "):
        if marker in text:
            return text.split(marker, 1)[1].splitlines()[0]
    return text.splitlines()[0] if text else type(e).__name__


def _load(spark: Any, source: str, options: Mapping[str, str]) -> Any:
    from delayed_pubsub.spark.ship import is_connect

    if is_connect(spark):
        # No SparkContext on a Connect client: the source's own default (the server's cores) applies.
        return spark.read.format(source).options(**options).load()
    # One partition per core Spark has (local[N]: N; a cluster: its executors' cores).
    parts = str(max(1, int(spark.sparkContext.defaultParallelism)))
    return spark.read.format(source).options(**{"numPartitions": parts, **options}).load()


def _once(spark: Any, args: argparse.Namespace, options: Mapping[str, str], progress: Any) -> str:
    from delayed_pubsub.spark.datasource import HISTORY_SOURCE, PENDING_SOURCE
    from delayed_pubsub.spark.stats import compute_stats, render

    progress.phase("reading the delayed topic and the history")
    now_ms = time.time_ns() // 1_000_000
    stats = compute_stats(
        _load(spark, HISTORY_SOURCE, options), _load(spark, PENDING_SOURCE, options), now_ms
    )
    if args.out is not None:
        progress.phase(f"writing {args.out}")
        _write_out(stats, args.out, args.app_id)
    return render(stats, args.app_id)


def _write_out(stats: Any, out_dir: Path, app_id: str) -> None:
    from delayed_pubsub.spark.charts import write_charts
    from delayed_pubsub.spark.stats import write_parquet

    write_parquet(stats, out_dir)
    write_charts(stats, out_dir, app_id)


def _until_stopped(query: Any) -> int:
    """Wait for Ctrl-C or SIGTERM (or the query's failure), then stop the query."""
    # A flag, not a KeyboardInterrupt inside a Py4J call (see _follow).
    stop = threading.Event()
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}

    def on_signal(signum: int, frame: Any) -> None:
        stop.set()
        # A second Ctrl-C gets the previous handler back, for a stuck stop.
        sig = signal.Signals(signum)
        signal.signal(sig, previous[sig])

    for sig in previous:
        signal.signal(sig, on_signal)
    try:
        while query.isActive and not stop.is_set():
            stop.wait(0.5)
        if query.exception() is not None:
            print(f"delayed-pubsub stats: error: {_spark_error(query.exception())}", file=sys.stderr)
            return 1
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        query.stop()
    return 0


def _stream_out(spark: Any, args: argparse.Namespace, options: Mapping[str, str]) -> int:
    """Per-minute aggregates of the history as Parquet under --stream-out (minutes.py)."""
    from delayed_pubsub.spark.minutes import MINUTES_DIR, start_minutes_query

    query = start_minutes_query(spark, dict(options), args.stream_out, FOLLOW_INTERVAL_S)
    print(
        f"delayed-pubsub stats: streaming per-minute aggregates to {args.stream_out / MINUTES_DIR} "
        f"every {FOLLOW_INTERVAL_S} s; Ctrl-C to stop",
        file=sys.stderr,
        flush=True,
    )
    return _until_stopped(query)


def _follow(spark: Any, args: argparse.Namespace, options: Mapping[str, str], out: TextIO) -> int:
    """A streaming query on the history; the table refreshes every few seconds until Ctrl-C.

    The query appends the history's events as Parquet to a private folder (the
    history is a log; this command reads it from the start each time it runs);
    the pending set is live, so each refresh reads it afresh. Refreshes run on
    this thread, the query on Spark's: Spark hides a batch's files until they
    are complete, so a refresh sees whole batches.
    """
    from delayed_pubsub.spark.datasource import HISTORY_SOURCE, PENDING_SOURCE
    from delayed_pubsub.spark.rows import HISTORY_COLUMNS, ddl
    from delayed_pubsub.spark.stats import compute_stats, render

    work = Path(tempfile.mkdtemp(prefix="delayed-pubsub-follow-"))
    events_dir = work / "history"
    tty = out.isatty()
    query = (
        spark.readStream.format(HISTORY_SOURCE)
        .options(**options)
        .load()
        .writeStream.format("parquet")
        .option("path", str(events_dir))
        .option("checkpointLocation", str(work / "checkpoint"))
        .trigger(processingTime=f"{FOLLOW_INTERVAL_S} seconds")
        .start()
    )
    # Ctrl-C only sets a flag: a KeyboardInterrupt raised inside a Py4J call (what
    # pyspark's own handler does) would break the gateway before query.stop().
    # A second Ctrl-C gets the previous handler back, for a stuck refresh.
    stop = threading.Event()
    previous = signal.getsignal(signal.SIGINT)

    def on_sigint(signum: int, frame: Any) -> None:
        stop.set()
        signal.signal(signal.SIGINT, previous)

    signal.signal(signal.SIGINT, on_sigint)
    try:
        refreshes = 0
        while query.isActive and not stop.is_set():
            now_ms = time.time_ns() // 1_000_000
            if any(events_dir.glob("*.parquet")):
                history = spark.read.parquet(str(events_dir))
            else:
                history = spark.createDataFrame([], ddl(HISTORY_COLUMNS))
            stats = compute_stats(history, _load(spark, PENDING_SOURCE, options), now_ms)
            if args.out is not None:
                _write_out(stats, args.out, args.app_id)
            refreshes += 1
            footer = f"(following: refresh {refreshes}, every {FOLLOW_INTERVAL_S} s; Ctrl-C to stop)\n"
            out.write(("\033[H\033[2J" if tty else "") + render(stats, args.app_id) + footer)
            out.flush()
            stop.wait(FOLLOW_INTERVAL_S)
        if query.exception() is not None:
            print(f"delayed-pubsub stats: error: {_spark_error(query.exception())}", file=sys.stderr)
            return 1
    finally:
        signal.signal(signal.SIGINT, previous)
        query.stop()
        shutil.rmtree(work, ignore_errors=True)
    return 0
