"""prepare_runtime_dir / prepare_socket_dir on a real file system: what is created, what is
refused (symlinks, non-directories, another user's directory), and that a refused directory
is left as it was. Directories owned by other uids need root to make; a daemon under
another uid runs in a child process that drops to it."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from pushsvc.errors import ConfigError
from pushsvc.server.rundir import prepare_runtime_dir, prepare_socket_dir

NOBODY = 65534
OTHER_UID = 64000
GROUP = 64100

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="makes directories owned by other uids: needs root")


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def refused(fn, *args) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        fn(*args)
    return info.value


# ---------------------------------------------------------------- runtime dir


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o000])
def test_missing_runtime_dir_is_created_0700_with_its_parents(tmp_path: Path, umask: int) -> None:
    path = tmp_path / "a" / "b" / "rt"
    old = os.umask(umask)
    try:
        prepare_runtime_dir(str(path), None)
    finally:
        os.umask(old)
    assert path.is_dir() and mode(path) == 0o700
    assert path.stat().st_uid == os.geteuid()


def test_own_runtime_dir_is_narrowed_to_0700(tmp_path: Path) -> None:
    path = tmp_path / "rt"
    path.mkdir()
    path.chmod(0o777)
    prepare_runtime_dir(str(path), None)
    assert mode(path) == 0o700
    prepare_runtime_dir(str(path) + "/", None)  # idempotent, trailing slash and all
    assert mode(path) == 0o700


@root_only
def test_socket_group_gets_0710_and_the_group(tmp_path: Path) -> None:
    path = tmp_path / "rt"
    prepare_runtime_dir(str(path), GROUP)
    st = path.stat()
    assert (stat.S_IMODE(st.st_mode), st.st_gid) == (0o710, GROUP)


@root_only
@pytest.mark.parametrize("owner", [NOBODY, OTHER_UID])
def test_runtime_dir_of_another_user_is_refused_and_left_alone(tmp_path: Path, owner: int) -> None:
    path = tmp_path / "pushsvc-0"
    path.mkdir(mode=0o777)
    path.chmod(0o777)
    os.chown(path, owner, owner)
    err = refused(prepare_runtime_dir, str(path), None)
    assert err.field == "runtime_dir"
    who = f"uid {owner} (nobody)" if owner == NOBODY else f"uid {owner}"
    assert f"{path} is owned by {who}, not by the daemon's user uid 0 (root)" in err.message
    assert "remove it, or set runtime_dir to another path" in err.message
    assert mode(path) == 0o777 and path.stat().st_uid == owner


@pytest.mark.parametrize("target_kind", ["own_dir", "missing"])
def test_runtime_dir_that_is_a_symlink_is_refused(tmp_path: Path, target_kind: str) -> None:
    target = tmp_path / "elsewhere"
    if target_kind == "own_dir":
        target.mkdir(mode=0o755)
        target.chmod(0o755)
    link = tmp_path / "rt"
    link.symlink_to(target)
    err = refused(prepare_runtime_dir, str(link), None)
    assert err.field == "runtime_dir" and f"{link} is a symbolic link" in err.message
    if target_kind == "own_dir":
        assert mode(target) == 0o755  # the chmod did not follow the link
    else:
        assert not target.exists()  # nor did the mkdir


def test_runtime_dir_that_is_a_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "rt"
    path.write_text("")
    err = refused(prepare_runtime_dir, str(path), None)
    assert err.field == "runtime_dir" and f"{path} is not a directory" in err.message


def test_runtime_dir_that_cannot_be_created_names_the_path(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    err = refused(prepare_runtime_dir, str(tmp_path / "file" / "rt"), None)
    assert err.field == "runtime_dir"
    assert err.message == (f"cannot create the directory {tmp_path / 'file' / 'rt'}: "
                           "a component of its path is not a directory")


# ---------------------------------------------------------------- socket dir


def test_socket_in_the_runtime_dir_changes_nothing_more(tmp_path: Path) -> None:
    rt = tmp_path / "rt"
    rt.mkdir()
    rt.chmod(0o750)
    prepare_socket_dir(str(rt / "pushsvc.sock"), str(rt) + "/", None)
    assert mode(rt) == 0o750


def test_missing_socket_dir_is_created_like_the_runtime_dir(tmp_path: Path) -> None:
    sock = tmp_path / "x" / "sockets" / "pushsvc.sock"
    prepare_socket_dir(str(sock), str(tmp_path / "rt"), None)
    assert mode(sock.parent) == 0o700 and sock.parent.stat().st_uid == os.geteuid()


@root_only
def test_missing_socket_dir_with_socket_group(tmp_path: Path) -> None:
    sock = tmp_path / "sockets" / "pushsvc.sock"
    prepare_socket_dir(str(sock), str(tmp_path / "rt"), GROUP)
    st = sock.parent.stat()
    assert (stat.S_IMODE(st.st_mode), st.st_gid) == (0o710, GROUP)


def test_existing_own_socket_dir_keeps_its_mode(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o755)
    prepare_socket_dir(str(shared / "pushsvc.sock"), str(tmp_path / "rt"), None)
    assert mode(shared) == 0o755


@root_only
def test_socket_dir_of_another_user_is_refused(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chown(shared, NOBODY, NOBODY)
    err = refused(prepare_socket_dir, str(shared / "pushsvc.sock"), str(tmp_path / "rt"), None)
    assert err.field == "socket_path"
    assert f"{shared} is owned by uid {NOBODY} (nobody)" in err.message


def test_socket_dir_symlink_or_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    err = refused(prepare_socket_dir, str(tmp_path / "link" / "pushsvc.sock"), str(tmp_path / "rt"), None)
    assert err.field == "socket_path" and "is a symbolic link" in err.message
    (tmp_path / "file").write_text("")
    err = refused(prepare_socket_dir, str(tmp_path / "file" / "pushsvc.sock"), str(tmp_path / "rt"), None)
    assert err.field == "socket_path" and f"{tmp_path / 'file'} is not a directory" in err.message


def test_socket_dir_that_cannot_be_created_names_the_path(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    sock = tmp_path / "file" / "sub" / "dir" / "pushsvc.sock"
    err = refused(prepare_socket_dir, str(sock), str(tmp_path / "rt"), None)
    assert err.field == "socket_path"
    assert err.message == f"cannot create the directory {sock.parent}: a component of its path is not a directory"


# ---------------------------------------------------------------- a daemon that is not root


def as_uid(uid: int, code: str) -> str:
    """Run ``code`` (with rundir imported as ``r``) after dropping to ``uid``; its stdout."""
    program = "import os, sys\nimport pushsvc.server.rundir as r\nfrom pushsvc.errors import ConfigError\n" \
              f"os.setgroups([]); os.setgid({uid}); os.setuid({uid})\n" + textwrap.dedent(code)
    out = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


CATCH = """
try:
    {call}
    print("ok")
except ConfigError as exc:
    print(exc)
"""


@pytest.fixture
def reachable() -> Iterator[Path]:
    """A directory other uids can traverse (pytest's tmp_path is under a 0700 one)."""
    base = Path(tempfile.mkdtemp(prefix="psrd-"))
    base.chmod(0o755)
    try:
        yield base
    finally:
        shutil.rmtree(base)


@root_only
def test_a_daemon_user_accepts_a_root_owned_socket_dir_but_not_a_root_owned_runtime_dir(reachable: Path) -> None:
    system = reachable / "run"  # like /run or /tmp: root's, and others may create in it
    system.mkdir()
    system.chmod(0o1777)
    mine = system / "rt"
    mine.mkdir()
    os.chown(mine, NOBODY, NOBODY)
    call = f"r.prepare_socket_dir({str(system / 'pushsvc.sock')!r}, {str(mine)!r}, None)"
    assert as_uid(NOBODY, CATCH.format(call=call)) == "ok"
    assert mode(system) == 0o1777  # not the daemon's to narrow
    call = f"r.prepare_runtime_dir({str(system)!r}, None)"
    assert as_uid(NOBODY, CATCH.format(call=call)) == (
        f"runtime_dir: {system} is owned by uid 0 (root), not by the daemon's user uid {NOBODY} (nobody); "
        "another user may have created it first: remove it, or set runtime_dir to another path")
    call = f"r.prepare_runtime_dir({str(mine)!r}, None)"
    assert as_uid(NOBODY, CATCH.format(call=call)) == "ok"
    assert mode(mine) == 0o700
    os.chown(mine, OTHER_UID, OTHER_UID)
    call = f"r.prepare_socket_dir({str(mine / 'pushsvc.sock')!r}, {str(system / 'other')!r}, None)"
    assert f"socket_path: {mine} is owned by uid {OTHER_UID}" in as_uid(NOBODY, CATCH.format(call=call))
