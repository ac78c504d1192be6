"""Init records on disk: private, atomic, and refused when anyone else could have written them."""

from __future__ import annotations

import json
import logging
import os
import stat
from pathlib import Path

import pytest

from delayed_pubsub.records import InitRecord, RecordRefusedError, RecordStore, records_folder

PROPS = {"redisHost": "127.0.0.1:6379", "redisPassword": "s3cret", "consumerID": "app1"}
NOBODY = 65534


@pytest.fixture
def store(tmp_path: Path) -> RecordStore:
    return RecordStore(records_folder(tmp_path / "sockets" / "delayed-pubsub.sock"))


def test_records_live_in_a_folder_beside_the_socket_named_after_it(tmp_path: Path) -> None:
    assert records_folder(tmp_path / "delayed-pubsub.sock") == tmp_path / "delayed-pubsub.records"


def test_a_record_is_0600_in_a_0700_folder_and_round_trips(store: RecordStore) -> None:
    path = store.save(InitRecord("delayed", PROPS, ("orders", "bulk"), 1_700_000_000_000))
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(store.folder.stat().st_mode) == 0o700
    assert path.stat().st_uid == os.geteuid()
    loaded = store.load("delayed")
    assert loaded == InitRecord("delayed", PROPS, ("bulk", "orders"), 1_700_000_000_000)
    assert loaded is not None
    assert loaded.path == path


def test_a_loose_umask_does_not_loosen_the_record(store: RecordStore) -> None:
    old = os.umask(0)
    try:
        path = store.save(InitRecord("delayed", PROPS))
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(store.folder.stat().st_mode) == 0o700


def test_a_record_is_replaced_atomically(store: RecordStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """While the new record is being written (up to its fsync), the file still holds the old
    one; if the write dies before the rename, the old one stays and no temporary file is left."""
    store.save(InitRecord("delayed", PROPS, ("old",)))
    seen_during_write: list[tuple[str, ...]] = []
    real_fsync = os.fsync

    def fsync_then_look(fd: int) -> None:
        real_fsync(fd)
        if stat.S_ISREG(os.fstat(fd).st_mode):
            record = store.load("delayed")
            assert record is not None
            seen_during_write.append(record.topics)

    monkeypatch.setattr(os, "fsync", fsync_then_look)
    store.save(InitRecord("delayed", PROPS, ("new",)))
    assert seen_during_write == [("old",)]
    assert store.load("delayed") == InitRecord("delayed", PROPS, ("new",))

    def rename_dies(src: str, dst: str) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", rename_dies)
    with pytest.raises(OSError, match="No space"):
        store.save(InitRecord("delayed", PROPS, ("lost",)))
    assert store.load("delayed") == InitRecord("delayed", PROPS, ("new",))
    assert sorted(p.name for p in store.folder.iterdir()) == ["delayed.json"]


def test_a_record_owned_by_another_user_is_refused(
    store: RecordStore, caplog: pytest.LogCaptureFixture
) -> None:
    path = store.save(InitRecord("delayed", PROPS))
    os.chown(path, NOBODY, NOBODY)
    with pytest.raises(RecordRefusedError, match=f"owned by uid {NOBODY}"):
        store.load("delayed")
    with caplog.at_level(logging.ERROR):
        assert store.load_all() == []
    assert f"owned by uid {NOBODY}" in caplog.text


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o660, 0o602])
def test_a_record_readable_or_writable_by_others_is_refused(store: RecordStore, mode: int) -> None:
    path = store.save(InitRecord("delayed", PROPS))
    os.chmod(path, mode)
    with pytest.raises(RecordRefusedError, match=f"mode {mode:04o}"):
        store.load("delayed")


def test_a_symlink_in_place_of_a_record_is_refused_not_followed(store: RecordStore, tmp_path: Path) -> None:
    store.save(InitRecord("other", PROPS))
    target = store.path_for("other")
    store.path_for("delayed").symlink_to(target)
    with pytest.raises(RecordRefusedError, match="cannot open"):
        store.load("delayed")


def test_a_record_renamed_to_another_instance_is_refused(store: RecordStore) -> None:
    path = store.save(InitRecord("other", PROPS))
    path.rename(store.path_for("delayed"))
    with pytest.raises(RecordRefusedError, match="expected 'delayed'"):
        store.load("delayed")


@pytest.mark.parametrize(
    "content",
    [b"not json", b"[]", b'{"version": 2}', json.dumps({"version": 1, "instance": "delayed"}).encode()],
)
def test_a_malformed_record_is_refused(store: RecordStore, content: bytes) -> None:
    store.folder.mkdir(mode=0o700, parents=True)
    path = store.path_for("delayed")
    path.write_bytes(content)
    os.chmod(path, 0o600)
    with pytest.raises(RecordRefusedError):
        store.load("delayed")


def test_a_folder_owned_by_another_user_is_not_written_into(store: RecordStore) -> None:
    store.folder.mkdir(mode=0o700, parents=True)
    os.chown(store.folder, NOBODY, NOBODY)
    with pytest.raises(RecordRefusedError, match=f"owned by uid {NOBODY}"):
        store.save(InitRecord("delayed", PROPS))
    assert list(store.folder.iterdir()) == []


@pytest.mark.parametrize("name", ["../../etc/passwd", "a/b", "..", ".tmp-x", "", "déjà vu", "x" * 200])
def test_any_instance_name_is_one_file_inside_the_folder(store: RecordStore, name: str) -> None:
    path = store.save(InitRecord(name, PROPS, ("t",)))
    assert path.parent == store.folder
    assert store.load(name) == InitRecord(name, PROPS, ("t",))
    assert [r.instance for r in store.load_all()] == [name]


def test_a_missing_record_is_none_and_delete_is_idempotent(store: RecordStore) -> None:
    assert store.load("delayed") is None
    assert store.load_all() == []
    store.save(InitRecord("delayed", PROPS))
    store.delete("delayed")
    store.delete("delayed")
    assert store.load("delayed") is None


@pytest.mark.parametrize("change", ["chown", "chmod"])
def test_records_in_a_folder_others_can_write_are_refused(store: RecordStore, change: str) -> None:
    """Whoever can write the folder can swap in an old record of ours (a hard link keeps our owner)."""
    store.save(InitRecord("delayed", PROPS))
    if change == "chown":
        os.chown(store.folder, NOBODY, NOBODY)
    else:
        os.chmod(store.folder, 0o777)
    with pytest.raises(RecordRefusedError, match="writable by it alone"):
        store.load("delayed")
