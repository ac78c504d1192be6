"""Init records: what daprd told each component instance, kept for a restarted `serve`.

daprd calls Init once per component, at its own start. A `serve` restarted
under a running daprd (an OOM kill, a container restart, an upgrade of the
component alone) would otherwise refuse every call until daprd restarts too.
So every successful Init is written down, one file per instance, and a call
for an instance this process has not seen Init'ed re-Inits it from that file.

Where: `<socket folder>/<socket stem>.records/<instance>.json`. The socket
folder is the one place both processes already share and trust, and in
Kubernetes it is the pod's emptyDir: it survives a restart of the component's
container and dies with the pod, exactly when daprd re-Inits everything
anyway. daprd's socket scan skips directories, so the folder does not disturb
discovery.

The record holds the resolved metadata, secrets included: the same trust
boundary as the socket (whoever can connect to the socket can Init and publish).
Files are 0600 in a 0700 folder, written atomically (temporary file, fsync,
rename, fsync of the folder); a record owned by another user or readable by
group or others is refused, logged, and never used.

The record also lists the topics that had open PullMessages streams. daprd
never re-opens a stream, so after a restart those subscriptions are orphaned
until daprd restarts: the registry reports them (instance/registry.py).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import stat
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote, unquote

log = logging.getLogger(__name__)

RECORD_VERSION = 1
FILE_MODE = 0o600
FOLDER_MODE = 0o700
SUFFIX = ".json"


class RecordRefusedError(Exception):
    """A record exists but must not be used (foreign owner, loose mode, not a file, unreadable)."""


@dataclass(frozen=True)
class InitRecord:
    """The last Init daprd sent for one component instance, and its subscribed topics."""

    instance: str
    properties: Mapping[str, str]
    topics: tuple[str, ...] = ()
    written_at_ms: int = 0
    # Not part of the file: where it was read from, for messages.
    path: Path | None = field(default=None, compare=False)

    def encode(self) -> bytes:
        """The file's bytes (JSON, sorted keys)."""
        return json.dumps(
            {
                "version": RECORD_VERSION,
                "instance": self.instance,
                "metadata": dict(self.properties),
                "topics": sorted(self.topics),
                "writtenAtMs": self.written_at_ms,
            },
            sort_keys=True,
            indent=1,
        ).encode()

    @classmethod
    def decode(cls, raw: bytes, path: Path | None = None) -> InitRecord:
        """Parse a record; RecordRefusedError (naming the problem) if it is malformed."""
        try:
            doc = json.loads(raw)
        except ValueError as e:
            raise RecordRefusedError(f"not JSON: {e}") from None
        if not isinstance(doc, dict) or doc.get("version") != RECORD_VERSION:
            raise RecordRefusedError(f"not a version {RECORD_VERSION} record")
        instance, props, topics = doc.get("instance"), doc.get("metadata"), doc.get("topics", [])
        written = doc.get("writtenAtMs", 0)
        if (
            not isinstance(instance, str)
            or not isinstance(props, dict)
            or not all(isinstance(k, str) and isinstance(v, str) for k, v in props.items())
            or not isinstance(topics, list)
            or not all(isinstance(t, str) for t in topics)
            or not isinstance(written, int)
        ):
            raise RecordRefusedError("malformed fields")
        return cls(instance, dict(props), tuple(topics), written, path)


def records_folder(socket_path: Path) -> Path:
    """`<socket folder>/<socket stem>.records`: beside the socket, one folder per socket."""
    return socket_path.parent / f"{socket_path.stem}.records"


class RecordStore:
    """The record files of one socket. Reads and writes are synchronous: a
    record is a few hundred bytes written on Init and when a stream opens or
    closes, and strict ordering matters more than the millisecond an fsync takes."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def path_for(self, instance: str) -> Path:
        """The file of `instance` (its name percent-encoded: any name is one safe file name)."""
        encoded = quote(instance, safe="")
        if encoded.startswith("."):
            # Never a hidden name: those are our temporary files.
            encoded = "%2E" + encoded[1:]
        return self.folder / (encoded + SUFFIX)

    def _ensure_folder(self) -> None:
        self.folder.mkdir(mode=FOLDER_MODE, parents=True, exist_ok=True)
        st = self.folder.lstat()
        if not stat.S_ISDIR(st.st_mode):
            raise RecordRefusedError(f"{self.folder} is not a directory")
        if st.st_uid != os.geteuid():
            raise RecordRefusedError(f"{self.folder} is owned by uid {st.st_uid}, not by us ({os.geteuid()})")
        if stat.S_IMODE(st.st_mode) != FOLDER_MODE:
            os.chmod(self.folder, FOLDER_MODE)

    def save(self, record: InitRecord) -> Path:
        """Write `record` atomically (a reader sees the old file or the new one, never a mix)."""
        self._ensure_folder()
        final = self.path_for(record.instance)
        # mkstemp creates the file 0600 and O_EXCL: no window where it is readable by others.
        fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=".tmp-", suffix=SUFFIX)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(record.encode())
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        # The rename is durable only once the folder's entry is on disk.
        dir_fd = os.open(self.folder, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
        return final

    def has(self, instance: str) -> bool:
        """Whether a file (usable or not) stands where the record of `instance` would."""
        return os.path.lexists(self.path_for(instance))

    def load(self, instance: str) -> InitRecord | None:
        """The record of `instance`; None if there is none; RecordRefusedError if it must not be used."""
        return self._read(self.path_for(instance), expect=instance)

    def load_all(self) -> list[InitRecord]:
        """Every usable record (refused ones are logged and skipped)."""
        try:
            names = sorted(p for p in self.folder.iterdir() if p.name.endswith(SUFFIX))
        except FileNotFoundError:
            return []
        records = []
        for path in names:
            if path.name.startswith(".tmp-"):
                continue  # a write that died before its rename
            instance = unquote(path.name[: -len(SUFFIX)])
            try:
                record = self._read(path, expect=instance)
            except RecordRefusedError as e:
                log.error("refusing Init record %s: %s", path, e)
                continue
            if record is not None:
                records.append(record)
        return records

    def delete(self, instance: str) -> None:
        """Remove the record of `instance` if there is one."""
        with contextlib.suppress(FileNotFoundError):
            self.path_for(instance).unlink()

    def _read(self, path: Path, expect: str) -> InitRecord | None:
        try:
            folder = self.folder.lstat()
        except FileNotFoundError:
            return None
        # Whoever can write the folder can swap records (a hard link to an old one
        # of ours passes every check on the file itself): it must be ours alone.
        if not stat.S_ISDIR(folder.st_mode) or folder.st_uid != os.geteuid() or folder.st_mode & 0o022:
            raise RecordRefusedError(
                f"{self.folder} must be a directory owned by uid {os.geteuid()} and writable by it alone "
                f"(owner uid {folder.st_uid}, mode {stat.S_IMODE(folder.st_mode):04o})"
            )
        try:
            # O_NOFOLLOW: a symlink planted in the folder is refused, not followed.
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise RecordRefusedError(f"cannot open {path}: {e.strerror}") from None
        with os.fdopen(fd, "rb") as f:
            # Checked on the open file, not the path: nothing can be swapped in between.
            st = os.fstat(f.fileno())
            _check_trusted(path, st.st_mode, st.st_uid)
            raw = f.read(1 << 20)
        record = InitRecord.decode(raw, path)
        if record.instance != expect:
            raise RecordRefusedError(f"records instance {record.instance!r}, expected {expect!r}")
        return record


def _check_trusted(path: Path, mode: int, uid: int) -> None:
    if not stat.S_ISREG(mode):
        raise RecordRefusedError(f"{path} is not a regular file")
    if uid != os.geteuid():
        raise RecordRefusedError(f"{path} is owned by uid {uid}, not by us (uid {os.geteuid()})")
    if mode & 0o077:
        raise RecordRefusedError(
            f"{path} has mode {stat.S_IMODE(mode):04o}: readable or writable by others, it may have been "
            "tampered with (records are written 0600)"
        )


def topics_of(records: Sequence[InitRecord]) -> dict[str, frozenset[str]]:
    """instance -> topics that had open streams when the record was last written."""
    return {r.instance: frozenset(r.topics) for r in records if r.topics}
