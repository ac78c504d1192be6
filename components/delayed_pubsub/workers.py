"""`serve --workers N`: the firing work in worker processes that `serve` supervises.

The gRPC process keeps the request path (Init, Features, Publish, BulkPublish,
PullMessages, Ping). Each worker runs, for every instance daprd Init'ed, what
used to share that process's one core: the fire loop of every shard (with
history trimming), the forwarder and the pending gauge.

Why this is safe: every worker fires every shard, exactly as replicas of one
app do (engine/sharded.py: shards need no owner, the fire is one atomic script
on a single node and leased two-phase on Cluster). A worker killed at any
moment is one more replica gone: the others go on firing at once, and what it
had claimed (Cluster) comes back when its lease ends.

Why subprocesses of our own command line rather than multiprocessing: each
worker is a fresh interpreter (grpc's and redis-py's state never crosses a
fork), its pid and command line read plainly in `ps`, and nothing else (no
resource tracker, no pipes) lives beside it to be left behind.

The gRPC process and its workers talk through files in a private folder beside
serve's socket (`<socket stem>.workers-*`, 0700, removed at the end):

- `instances.json` (0600: Init metadata holds secrets), written by the gRPC
  process whenever an instance is Init'ed, re-Init'ed, restored or closed; the
  workers open, re-open and close their instances to match it;
- `status-<n>.json`, each worker's heartbeat (every HEARTBEAT_S): its pid and
  the background loops it has down. A worker alive whose heartbeat is older
  than STALE_S is hung: the supervisor kills it, and restarts it like one that
  died;
- `metrics-<n>.prom`, each worker's metrics in the text format; the metrics
  endpoint merges them with its own (counters and histograms summed, gauges
  the largest of the processes, so the gauges every worker keeps alike are
  not counted twice). A restarted worker's counters go on from where the
  dead one's stopped, so a counter of the endpoint never falls.

A worker ends when told (SIGTERM). When `serve` itself is killed (-9, OOM),
the kernel kills its workers with it (PR_SET_PDEATHSIG), so a crash of serve is
a crash of the whole component, as it was with one process: no worker fires on
without the process that answers daprd. (Elsewhere than Linux a worker sees
its parent gone within POLL_S and stops.) The folder such a crash leaves is
removed by the next `serve` of the same socket, once it holds the socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import json
import logging
import math
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import prometheus_client
from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from delayed_middleware.backoff import RESTART, WORKER_RESTART, Backoff
from delayed_middleware.clock import Clock
from delayed_middleware.errors import DelayedPubSubError
from delayed_pubsub.heap import freeze_startup_heap
from delayed_pubsub.loopwatch import LoopWatch
from delayed_pubsub.metrics import Metrics
from delayed_pubsub.settings import parse_settings

if TYPE_CHECKING:
    from delayed_pubsub.instance import Instance

log = logging.getLogger(__name__)

INSTANCES_FILE = "instances.json"
# How often a worker writes its heartbeat and metrics, and looks for a changed instances file.
HEARTBEAT_S = 1.0
POLL_S = 0.2
# A live worker without a heartbeat for this long is hung: killed and restarted.
STALE_S = 15.0
# A worker slot without a healthy worker for this long is not coming back: liveness fails.
DEAD_AFTER_S = 30.0
# A worker that ran this long was healthy: its restart backoff (WORKER_RESTART) starts afresh.
STEADY_S = 30.0


CGROUP_ROOT = Path("/sys/fs/cgroup")


def cgroup_cpu_quota(root: Path = CGROUP_ROOT) -> float | None:
    """The CPU quota of this process's cgroup, in CPUs (1.5 for a 1500m limit); None if none.

    What a Kubernetes CPU limit (or `podman run --cpus`) sets, as the container sees its own
    cgroup at `root`: cgroup v2's `cpu.max` ("QUOTA PERIOD", "max PERIOD" when unlimited), else
    cgroup v1's `cpu.cfs_quota_us` (-1 when unlimited) over `cpu.cfs_period_us`, in the `cpu`
    hierarchy (mounted as `cpu` or `cpu,cpuacct`).
    """
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else _cpus(quota, period)
    except (OSError, ValueError):
        pass  # no cgroup v2 CPU controller here: look for v1
    for hierarchy in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
        try:
            quota = (root / hierarchy / "cpu.cfs_quota_us").read_text().strip()
            period = (root / hierarchy / "cpu.cfs_period_us").read_text().strip()
        except OSError:
            continue
        try:
            return None if int(quota) < 0 else _cpus(quota, period)
        except ValueError:
            return None
    return None


def _cpus(quota: str, period: str) -> float | None:
    q, p = int(quota), int(period)
    return q / p if q > 0 and p > 0 else None


def cpu_cores() -> int:
    """The cores this process may run on (its CPU affinity)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def default_workers(root: Path = CGROUP_ROOT) -> int:
    """Cores this process may use, minus one for the gRPC process; at least one.

    The cores it may run on (CPU affinity), capped by its cgroup CPU quota rounded up
    (cgroup_cpu_quota): a pod limited to 2 CPUs on a 16-core node starts one worker, not fifteen.
    """
    cores = cpu_cores()
    quota = cgroup_cpu_quota(root)
    if quota is not None:
        cores = min(cores, max(1, math.ceil(quota)))
    return max(1, cores - 1)


def explain_default_workers(root: Path = CGROUP_ROOT) -> str:
    """default_workers() with where it comes from, for `serve --help`."""
    quota = cgroup_cpu_quota(root)
    limit = "no cgroup CPU quota" if quota is None else f"cgroup CPU quota {quota:g}"
    return f"{default_workers(root)}: {cpu_cores()} cores, {limit}"


def worker_command() -> list[str]:
    """The command that starts a worker: this interpreter running our own command line."""
    return [sys.executable, "-m", "delayed_pubsub"]


def _write_atomically(path: Path, data: bytes, mode: int = 0o600) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


@dataclass
class _Slot:
    """One worker place: the process in it now and since when it lacks a healthy one."""

    index: int
    proc: asyncio.subprocess.Process | None = None
    started: float = 0.0
    # monotonic time since which the slot has no healthy worker (None: healthy).
    down_since: float | None = field(default_factory=time.monotonic)
    restarts: int = 0


class WorkerPool:
    """Starts `count` worker processes, keeps them running, tells them the instances.

    `command` is the argv prefix of a worker (default: worker_command()).
    """

    def __init__(
        self,
        count: int,
        beside: Path,
        *,
        log_level: str = "info",
        log_format: str = "text",
        command: Sequence[str] | None = None,
        dead_after_s: float = DEAD_AFTER_S,
        stale_s: float = STALE_S,
    ) -> None:
        if count < 1:
            raise ValueError("a worker pool needs at least one worker")
        # Beside `beside` (serve's socket), as the Init records are: the one folder serve may
        # write where the root file system is read-only (the container image, the pod's
        # readOnlyRootFilesystem), and one no other serve's clean-up can mistake for its own
        # (pids repeat across the containers of a pod).
        self._beside = beside
        beside.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        self.folder = Path(tempfile.mkdtemp(dir=beside.parent, prefix=_sibling_prefix(beside)))
        os.chmod(self.folder, 0o700)
        self._slots = [_Slot(i) for i in range(count)]
        self._log_level = log_level
        self._log_format = log_format
        self._command = list(command) if command is not None else worker_command()
        self._dead_after_s = dead_after_s
        self._stale_s = stale_s
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        # Called when a worker goes down or comes back (the server re-checks health then).
        self.on_change: Callable[[], None] | None = None
        self.publish({})

    @property
    def count(self) -> int:
        """How many worker processes the pool keeps."""
        return len(self._slots)

    def pids(self) -> list[int]:
        """The pids of the worker processes running now."""
        return [s.proc.pid for s in self._slots if s.proc is not None and s.proc.returncode is None]

    def publish(self, instances: Mapping[str, Mapping[str, str]]) -> None:
        """Tell the workers which instances to run, with their Init metadata (replaces the last)."""
        body = {"instances": {name: dict(props) for name, props in instances.items()}}
        _write_atomically(self.folder / INSTANCES_FILE, json.dumps(body, sort_keys=True).encode())

    def start(self) -> None:
        """Start every worker and its supervision (once serve holds its socket)."""
        _remove_sibling_folders(self._beside, keep=self.folder)
        for slot in self._slots:
            self._tasks.append(asyncio.create_task(self._supervise(slot), name=f"worker {slot.index}"))

    async def _spawn(self, slot: _Slot) -> asyncio.subprocess.Process:
        argv = [
            *self._command,
            "worker",
            "--state",
            str(self.folder),
            "--index",
            str(slot.index),
            "--parent",
            str(os.getpid()),
            "--log-level",
            self._log_level,
            "--log-format",
            self._log_format,
        ]
        with contextlib.suppress(FileNotFoundError):
            (self.folder / f"status-{slot.index}.json").unlink()
        proc = await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.DEVNULL)
        slot.proc = proc
        slot.started = time.monotonic()
        log.info("worker %d started: pid %d", slot.index, proc.pid)
        return proc

    async def _supervise(self, slot: _Slot) -> None:
        """Keep a worker in `slot`: restart it (with backoff) whenever it ends before the stop."""
        backoff = WORKER_RESTART.backoff()
        while not self._stop.is_set():
            try:
                proc = await self._spawn(slot)
            except OSError as e:
                log.error("worker %d cannot start: %s", slot.index, e)
                await self._sleep_or_stop(backoff.next())
                continue
            watchdog = asyncio.create_task(self._watch(slot, proc))
            try:
                rc = await proc.wait()
            finally:
                watchdog.cancel()
            if self._stop.is_set():
                return
            if slot.down_since is None:
                slot.down_since = time.monotonic()
            slot.restarts += 1
            self._changed()
            if time.monotonic() - slot.started > STEADY_S:
                backoff.reset()
            delay = backoff.next()
            log.error(
                "worker %d (pid %d) ended with %s; restarting it in %.2fs (the other workers and replicas "
                "go on firing meanwhile)",
                slot.index,
                proc.pid,
                f"signal {-rc}" if rc < 0 else f"exit code {rc}",
                delay,
            )
            await self._sleep_or_stop(delay)

    async def _watch(self, slot: _Slot, proc: asyncio.subprocess.Process) -> None:
        """Track the heartbeat of the worker in `slot`; kill it when it is hung."""
        path = self.folder / f"status-{slot.index}.json"
        while proc.returncode is None:
            await asyncio.sleep(POLL_S)
            beat = _mtime(path)
            now = time.time()
            if beat is not None and beat >= time.time() - self._stale_s:
                if slot.down_since is not None:
                    if slot.restarts:
                        log.info("worker %d (pid %d) runs again", slot.index, proc.pid)
                    slot.down_since = None
                    self._changed()
                continue
            since_start = time.monotonic() - slot.started
            if since_start > self._stale_s and (beat is None or now - beat > self._stale_s):
                log.error(
                    "worker %d (pid %d) has not reported for %.0fs: hung; killing it to restart it",
                    slot.index,
                    proc.pid,
                    self._stale_s,
                )
                if slot.down_since is None:
                    slot.down_since = time.monotonic()
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                return

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    async def _sleep_or_stop(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self._stop.wait()

    def statuses(self) -> list[dict[str, object]]:
        """The last heartbeat of each worker running now."""
        out = []
        for slot in self._slots:
            try:
                out.append(json.loads((self.folder / f"status-{slot.index}.json").read_bytes()))
            except (OSError, ValueError):
                continue
        return out

    def problems(self) -> list[str]:
        """What keeps the firing from being whole now (readiness): workers waiting for their
        restart, and background loops a worker reports down."""
        out = []
        for slot in self._slots:
            # A first start is not a fault (as an instance's loops starting after Init are
            # not); a worker that died and has not come back yet is.
            if slot.down_since is not None and slot.restarts:
                out.append(f"worker {slot.index} (restarting)")
        for status in self.statuses():
            loops = status.get("dead_loops")
            if isinstance(loops, list):
                out += [f"worker {status.get('index')}: {loop}" for loop in loops]
        return out

    def failed(self) -> list[str]:
        """Worker places that have had no healthy worker for `dead_after_s` (liveness: they
        are not coming back by themselves)."""
        now = time.monotonic()
        return [
            f"worker {s.index} down for {now - s.down_since:.0f}s"
            for s in self._slots
            if s.down_since is not None and now - s.down_since > self._dead_after_s
        ]

    def metric_files(self) -> list[Path]:
        """The metrics each worker wrote last."""
        return [self.folder / f"metrics-{s.index}.prom" for s in self._slots]

    async def stop(self, timeout_s: float = 5.0) -> None:
        """SIGTERM every worker, SIGKILL what has not ended after `timeout_s`; remove the folder."""
        self._stop.set()
        procs = [s.proc for s in self._slots if s.proc is not None and s.proc.returncode is None]
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                p.terminate()
        try:
            async with asyncio.timeout(timeout_s):
                await asyncio.gather(*(p.wait() for p in procs))
        except TimeoutError:
            for p in procs:
                if p.returncode is None:
                    log.error("worker pid %d did not stop within %gs; killing it", p.pid, timeout_s)
                    with contextlib.suppress(ProcessLookupError):
                        p.kill()
            await asyncio.gather(*(p.wait() for p in procs))
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        shutil.rmtree(self.folder, ignore_errors=True)


def _sibling_prefix(socket_path: Path) -> str:
    return f"{socket_path.stem}.workers-"


def _remove_sibling_folders(socket_path: Path, keep: Path) -> None:
    """Remove the worker folders a serve of this socket left behind (kill -9): called once
    this serve holds the socket, so no live serve owns them. They hold Init metadata."""
    for folder in socket_path.parent.glob(f"{_sibling_prefix(socket_path)}*"):
        try:
            if folder == keep or not folder.is_dir() or folder.stat().st_uid != os.geteuid():
                continue
        except OSError:
            continue
        shutil.rmtree(folder, ignore_errors=True)


def _die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent ends (Linux; elsewhere a no-op)."""
    name = ctypes.util.find_library("c")
    if not sys.platform.startswith("linux") or name is None:
        return
    pr_set_pdeathsig = 1
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(name, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except OSError:
        return None


# --- metrics: one endpoint for every process ------------------------------------------------

_SUMMED = ("counter", "histogram", "summary", "gaugehistogram")


_Child = tuple[str, tuple[tuple[str, str], ...]]  # a family's name and a child's labels
_Key = tuple[str, tuple[tuple[str, str], ...]]  # a sample's name and all its labels


def _key(sample: Sample) -> _Key:
    """What tells a sample apart within its family: its name and all its labels."""
    return sample.name, tuple(sorted(sample.labels.items()))


def _labels(labels: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """A child's labels, without the bucket or quantile that tell its samples apart."""
    return tuple(sorted((k, v) for k, v in labels.items() if k not in ("le", "quantile")))


class _Life:
    """One child of a worker's summed metric, over the worker's restarts."""

    def __init__(self) -> None:
        self.created: float | None = None
        self.last: dict[_Key, float] = {}
        self.before: dict[_Key, float] = {}

    def carried(self, created: float | None, values: Mapping[_Key, float]) -> dict[_Key, float]:
        """`values` plus what the child's earlier lives counted.

        A new life is a new `_created`, or, where `_created` is not written
        (PROMETHEUS_DISABLE_CREATED_SERIES), any sample that fell.
        """
        reborn = self.created is not None and created is not None and created != self.created
        if reborn or any(v < self.last.get(k, 0.0) for k, v in values.items()):
            for key, last in self.last.items():
                self.before[key] = self.before.get(key, 0.0) + last
        self.created = created
        self.last = dict(values)
        return {key: value + self.before.get(key, 0.0) for key, value in values.items()}


class MergedMetrics:
    """A prometheus_client collector: this process's registry and every worker's last metrics, merged.

    Counters, histograms and summaries are summed over the processes (each
    counts its own work); gauges are the largest value any process reports
    (the workers of one serve keep the same gauges alike, so a sum would count
    them once per worker). `_created` series are left out: they have no
    meaning over several processes.
    """

    def __init__(self, local: CollectorRegistry, files: Iterable[Path] | None = None) -> None:
        self._local = local
        self.files: list[Path] = list(files or [])
        # Per worker file, per child (family, labels): the child's `_created`,
        # its samples' last values and what earlier lives of it had counted.
        self._lives: dict[Path, dict[_Child, _Life]] = {}

    def _continued(self, path: Path, families: Iterable[Metric]) -> Iterator[Metric]:
        """`path`'s families, its counters and histograms carried on across the worker's restarts.

        A restarted worker counts from 0 again. Summed as they are, the merged
        counter would fall, and Prometheus reads any fall as a reset: rate()
        would then count the whole remaining sum once more as new work. So
        what a child counted before its process restarted (its `_created`
        changed, or a sample fell) is added to what it counts now.
        """
        lives = self._lives.setdefault(path, {})
        families = list(families)
        # The text format writes a child's `_created` as a gauge family of its own, after it.
        born: dict[_Child, float] = {
            (fam.name[: -len("_created")], _labels(s.labels)): s.value
            for fam in families
            if fam.type == "gauge" and fam.name.endswith("_created")
            for s in fam.samples
        }
        for fam in families:
            if fam.type in _SUMMED:
                counted: dict[_Child, dict[_Key, float]] = {}
                for s in fam.samples:
                    child = (fam.name, _labels(s.labels))
                    if s.name.endswith("_created") and s.name != fam.name:
                        born[child] = s.value  # OpenMetrics: inside the family
                    else:
                        counted.setdefault(child, {})[_key(s)] = s.value
                totals: dict[_Key, float] = {}
                for child, values in counted.items():
                    totals.update(lives.setdefault(child, _Life()).carried(born.get(child), values))
                fam.samples = [s._replace(value=totals.get(_key(s), s.value)) for s in fam.samples]
            yield fam

    def collect(self) -> Iterator[Metric]:
        """The merged metric families."""
        merged: dict[str, Metric] = {}
        values: dict[str, dict[_Key, float]] = {}

        def add(families: Iterable[Metric]) -> None:
            for fam in families:
                if fam.name.endswith("_created") and fam.type == "gauge" and fam.name[:-8] in merged:
                    continue
                out = merged.get(fam.name)
                if out is None:
                    out = merged[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
                    values[fam.name] = {}
                seen = values[fam.name]
                for s in fam.samples:
                    if s.name.endswith("_created") and s.name != fam.name:
                        continue
                    key = _key(s)
                    old = seen.get(key)
                    if old is None:
                        seen[key] = s.value
                    elif fam.type in _SUMMED:
                        seen[key] = old + s.value
                    else:
                        seen[key] = max(old, s.value)

        add(self._local.collect())
        for path in self.files:
            try:
                text = path.read_text()
            except OSError:
                continue  # not written yet, or a worker being restarted
            try:
                add(self._continued(path, text_string_to_metric_families(text)))
            except ValueError:
                log.warning("unreadable worker metrics in %s; skipped this scrape", path)
        for name, fam in merged.items():
            for (sample, labels), value in values[name].items():
                fam.add_sample(sample, dict(labels), value)
            yield fam


def merged_registry(local: CollectorRegistry, pool: WorkerPool) -> CollectorRegistry:
    """A registry for the metrics endpoint: `local` and the workers of `pool`, merged."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(MergedMetrics(local, pool.metric_files()))
    return registry


# --- the worker process ---------------------------------------------------------------------


async def run_worker(folder: Path, index: int, clock: Clock, parent: int | None = None) -> None:
    """A worker's life: run the background loops of the instances `folder`'s instances file
    names until SIGTERM/SIGINT, or until process `parent` (default: the one that started it)
    is gone; then, as the last of serve's processes, it removes `folder`."""
    # Imported here: the instance package is heavy, and only this side needs it.
    from delayed_pubsub.instance import Instance

    # Its modules live as long as the worker: out of the GC's full collections.
    freeze_startup_heap()
    prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    # A Ctrl-C reaches the whole process group: serve stops its workers itself, in order (a
    # worker gone first would be restarted by a serve still draining its streams).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Given by serve rather than read here: serve may die before this line runs.
    parent = os.getppid() if parent is None else parent
    _die_with_parent()
    orphaned = False
    metrics = Metrics()
    watch = LoopWatch(metrics.registry, f"worker-{index}")
    watch.start()
    running: dict[str, tuple[dict[str, str], Instance]] = {}
    failing: dict[str, tuple[float, Backoff, str]] = {}
    seen: tuple[float, int] | None = None
    wanted: dict[str, dict[str, str]] = {}
    next_beat = 0.0
    log.info("worker %d: pid %d serving %s", index, os.getpid(), folder)

    async def close(name: str) -> None:
        _, inst = running.pop(name)
        await inst.close()
        log.info("worker %d: instance %r closed", index, name)

    try:
        while not stop.is_set():
            if os.getppid() != parent:
                log.error("worker %d: serve (pid %d) is gone; stopping", index, parent)
                orphaned = True
                break
            path = folder / INSTANCES_FILE
            try:
                st = path.stat()
                if seen != (st.st_mtime, st.st_ino):
                    seen = (st.st_mtime, st.st_ino)
                    wanted = json.loads(path.read_bytes())["instances"]
                    failing.clear()
            except (OSError, ValueError, KeyError) as e:
                if not path.parent.exists():
                    log.error("worker %d: %s is gone; stopping", index, folder)
                    break
                log.warning("worker %d: cannot read %s: %s", index, path, e)
            for name in [n for n, (props, _) in running.items() if wanted.get(n) != props]:
                await close(name)
            now = time.monotonic()
            for name, props in wanted.items():
                if name in running or (name in failing and failing[name][0] > now):
                    continue
                try:
                    settings = parse_settings(props)
                    # One worker scans the retry schedules: the notice is one per due topic,
                    # not one per worker (a dead worker 0 only delays retries to the cap).
                    inst = await Instance.open(
                        name, settings, clock, metrics.for_instance(name), retry_scan=index == 0
                    )
                except (DelayedPubSubError, OSError) as e:
                    backoff = failing[name][1] if name in failing else RESTART.backoff()
                    failing[name] = (now + backoff.next(), backoff, str(e))
                    log.error("worker %d: instance %r does not start: %s; retrying", index, name, e)
                    continue
                failing.pop(name, None)
                running[name] = (dict(props), inst)
                log.info("worker %d: instance %r runs its background loops", index, name)
            if time.monotonic() >= next_beat:
                next_beat = time.monotonic() + HEARTBEAT_S
                _report(folder, index, metrics, running, failing)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(POLL_S):
                    await stop.wait()
    finally:
        for name in list(running):
            try:
                await close(name)
            except Exception:
                log.exception("worker %d: closing instance %r failed", index, name)
        with contextlib.suppress(OSError):
            _report(folder, index, metrics, running, failing)
        if orphaned:
            # Nobody else will: the instances file holds Init metadata, secrets among it.
            shutil.rmtree(folder, ignore_errors=True)
        await watch.stop()
        log.info("worker %d: stopped", index)


def _report(
    folder: Path,
    index: int,
    metrics: Metrics,
    running: Mapping[str, tuple[dict[str, str], Instance]],
    failing: Mapping[str, tuple[float, Backoff, str]],
) -> None:
    """Write this worker's metrics, then its heartbeat (the heartbeat last: its mtime says both are fresh)."""
    dead: list[str] = []
    for name, (_, inst) in running.items():
        dead += [f"instance {name!r}: {loop}" for loop in inst.dead_loops()]
        # What check_health sets in a single process: the fire loops run here.
        if inst.engine is not None:
            for n, fire_loop in enumerate(inst.engine.loops):
                metrics.fire_loop_up.labels(name, str(n)).set(1 if fire_loop.healthy else 0)
    dead += [f"instance {name!r} does not start: {why}" for name, (_, _, why) in failing.items()]
    _write_atomically(folder / f"metrics-{index}.prom", prometheus_client.generate_latest(metrics.registry))
    status = {"index": index, "pid": os.getpid(), "instances": sorted(running), "dead_loops": dead}
    _write_atomically(folder / f"status-{index}.json", json.dumps(status).encode())
