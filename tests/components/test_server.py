"""`delayed-pubsub serve` as a subprocess, the way an operator runs it beside daprd."""

from __future__ import annotations

import grp
import os
import socket
import stat
from pathlib import Path
from typing import Any

import grpc
import pytest
import redis

from delayed_pubsub.cli import build_parser
from delayed_pubsub.server import default_socket_path
from tests.components.driver import Component
from tests.components.serve import start_serve, terminate, wait_for_socket
from tests.redis_server import RedisServer


def test_default_socket_path_follows_the_dapr_env() -> None:
    assert default_socket_path({}) == Path("/tmp/dapr-components-sockets/delayed-pubsub.sock")
    assert default_socket_path({"DAPR_COMPONENTS_SOCKETS_FOLDER": "/run/x"}) == Path(
        "/run/x/delayed-pubsub.sock"
    )


def test_cli_help_names_the_options() -> None:
    args = build_parser().parse_args(["serve", "--socket", "/tmp/s.sock", "--log-level", "warning"])
    assert (args.socket, args.log_level, args.metrics_port) == (Path("/tmp/s.sock"), "warning", None)


def test_serve_creates_folder_and_0660_socket_and_sigterm_removes_it(folder: Path) -> None:
    sockets = folder / "sockets"  # does not exist yet: serve creates it
    path = sockets / "delayed-pubsub.sock"
    proc = start_serve(env={"DAPR_COMPONENTS_SOCKETS_FOLDER": str(sockets)})
    try:
        wait_for_socket(proc, path)
        assert stat.S_IMODE(path.stat().st_mode) == 0o660
    finally:
        code = terminate(proc)
    assert code == 0
    assert not path.exists()


def test_serve_replaces_a_stale_socket(folder: Path) -> None:
    path = folder / "delayed-pubsub.sock"
    # What a killed process leaves behind: a socket file nobody listens on.
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(path))
    stale.close()
    path.chmod(0o777)
    with socket.socket(socket.AF_UNIX) as probe, pytest.raises(ConnectionRefusedError):
        probe.connect(str(path))
    proc = start_serve("--socket", str(path))
    try:
        wait_for_socket(proc, path)  # connects: a live socket took the stale one's place
        assert stat.S_IMODE(path.stat().st_mode) == 0o660
    finally:
        assert terminate(proc) == 0


def test_second_serve_does_not_steal_a_live_socket(folder: Path) -> None:
    path = folder / "delayed-pubsub.sock"
    first = start_serve("--socket", str(path))
    try:
        wait_for_socket(first, path)
        inode = path.stat().st_ino
        second = start_serve("--socket", str(path))
        assert second.wait(timeout=15) != 0
        out = second.stdout.read().decode() if second.stdout else ""
        assert "in use" in out
        assert path.stat().st_ino == inode  # still the first server's socket
        with socket.socket(socket.AF_UNIX) as probe:
            probe.connect(str(path))
    finally:
        assert terminate(first) == 0


def test_serve_refuses_to_delete_a_regular_file(folder: Path) -> None:
    path = folder / "delayed-pubsub.sock"
    path.write_text("precious")
    proc = start_serve("--socket", str(path))
    assert proc.wait(timeout=15) != 0
    assert path.read_text() == "precious"


async def test_sigterm_with_an_open_stream_exits_0_and_leaves_the_message_pending(
    folder: Path, redis_server: RedisServer, redis_client: redis.Redis
) -> None:
    path = folder / "delayed-pubsub.sock"
    proc = start_serve("--socket", str(path), "--grace", "1")
    try:
        wait_for_socket(proc, path)
        async with grpc.aio.insecure_channel(f"unix://{path}") as channel:
            c = Component(channel, "delayed")
            await c.init({"redisHost": f"127.0.0.1:{redis_server.port}", "consumerID": "app1"})
            stream = await c.subscribe("orders")
            await c.publish("orders", b"unacked")
            msg = await stream.next()
            assert msg.data == b"unacked"
            code = terminate(proc)
            await stream.status()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert code == 0
    assert not path.exists()
    pending: Any = redis_client.xpending("orders", "app1")
    assert pending["pending"] == 1


# --- the socket folder is trusted only if nobody else can replace the socket -------


def _serve_refused(*args: str, folder: Path) -> str:
    proc = start_serve(*args, env={"DAPR_COMPONENTS_SOCKETS_FOLDER": str(folder)})
    try:
        assert proc.wait(timeout=15) == 2
    finally:
        if proc.poll() is None:
            proc.kill()
    out = proc.stdout.read().decode() if proc.stdout else ""
    assert "Traceback" not in out
    assert not (folder / "delayed-pubsub.sock").exists()
    return out


def test_serve_refuses_a_folder_writable_by_others_without_the_sticky_bit(folder: Path) -> None:
    sockets = folder / "shared"
    sockets.mkdir()
    sockets.chmod(0o777)
    out = _serve_refused(folder=sockets)
    assert f"socket folder {sockets} is unsafe" in out
    assert "writable by others without the sticky bit (mode 0777)" in out
    assert "--allow-insecure-socket-folder" in out


def test_serve_refuses_a_folder_owned_by_another_user(folder: Path) -> None:
    # Needs root to give the folder away: the CI runs as root.
    assert os.geteuid() == 0, "this test creates a folder owned by another user: run it as root"
    sockets = folder / "theirs"
    sockets.mkdir(mode=0o755)
    os.chown(sockets, 65534, 65534)
    out = _serve_refused(folder=sockets)
    assert "owned by uid 65534" in out


def test_serve_refuses_a_symlinked_folder_owned_by_another_user(folder: Path) -> None:
    assert os.geteuid() == 0, "this test creates a symlink owned by another user: run it as root"
    target = folder / "mine"
    target.mkdir(mode=0o755)
    link = folder / "link"
    link.symlink_to(target)
    os.chown(link, 65534, 65534, follow_symlinks=False)
    out = _serve_refused(folder=link)
    assert "symlink owned by uid 65534" in out


@pytest.mark.parametrize(("mode", "flags"), [(0o1777, ()), (0o777, ("--allow-insecure-socket-folder",))])
def test_serve_accepts_a_sticky_folder_or_an_insecure_one_when_told(
    folder: Path, mode: int, flags: tuple[str, ...]
) -> None:
    sockets = folder / "shared"
    sockets.mkdir()
    sockets.chmod(mode)
    path = sockets / "delayed-pubsub.sock"
    proc = start_serve(*flags, env={"DAPR_COMPONENTS_SOCKETS_FOLDER": str(sockets)})
    try:
        wait_for_socket(proc, path)
    finally:
        assert terminate(proc) == 0
    out = proc.stdout.read().decode() if proc.stdout else ""
    assert ("serving anyway" in out) == bool(flags)


def test_socket_group_gives_the_0660_socket_to_that_group(folder: Path) -> None:
    path = folder / "delayed-pubsub.sock"
    group = "daemon" if os.geteuid() == 0 else str(os.getegid())
    proc = start_serve("--socket", str(path), "--socket-group", group)
    try:
        wait_for_socket(proc, path)
        st = path.stat()
        assert stat.S_IMODE(st.st_mode) == 0o660
        expected = grp.getgrnam(group).gr_gid if not group.isdigit() else int(group)
        assert st.st_gid == expected
    finally:
        assert terminate(proc) == 0


def test_an_unknown_socket_group_is_a_clear_error(folder: Path) -> None:
    out = _serve_refused("--socket-group", "no-such-group-x1", folder=folder)
    assert "unknown group 'no-such-group-x1'" in out
