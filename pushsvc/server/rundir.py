"""The directories the worker socket lives in, made or checked before the socket is bound.

The default runtime dir, ``/tmp/pushsvc-<uid>``, is a name any local user can take first.
Whoever owns the directory can empty and refill it: put their own socket where workers
connect and read the KV layout and memory they send, or leave a symlink that sends the
daemon's chmod and bind somewhere else. So a directory that already exists must be a real
directory (not a symlink) owned by the daemon's uid; a missing one is created with its final
mode. Both are checked and changed through one descriptor opened without following links,
so the directory checked is the directory changed.

Refusals are ``ConfigError``s naming the field: the CLI exits with status 2, and a restart
would not fix them.
"""

from __future__ import annotations

import errno
import os
import pwd
import stat

from pushsvc.errors import ConfigError


def prepare_runtime_dir(path: str, gid: int | None) -> None:
    """Create ``runtime_dir`` or check that the daemon's uid owns it; then set its mode.

    Owner only (0700); with a socket group 0710 and owned by that group, so members may
    traverse to the socket but not list the directory.
    """
    _create(path, "runtime_dir")
    _make_private(path, gid, "runtime_dir")


def prepare_socket_dir(socket_path: str, runtime_dir: str, gid: int | None) -> None:
    """The directory ``socket_path`` is bound in, when it is not the runtime dir.

    Missing: created like the runtime dir (0700, or 0710 and owned by ``gid``). Present:
    it must be a real directory owned by the daemon's uid or by root (``/run``, ``/tmp``);
    its mode is left alone, since it may hold other programs' files too.
    """
    directory = os.path.dirname(socket_path) or "."
    if _same_path(directory, runtime_dir):
        return
    if _create(directory, "socket_path"):
        _make_private(directory, gid, "socket_path")
    else:
        os.close(_open_owned_dir(directory, "socket_path", root_ok=True))


def _create(path: str, field: str) -> bool:
    """Make the directory ``path`` (and missing parents); False if something is there already."""
    try:
        try:
            os.mkdir(path, 0o700)  # the umask may narrow it; _make_private sets the final mode
        except FileNotFoundError:
            os.makedirs(os.path.dirname(os.path.normpath(path)), exist_ok=True)
            os.mkdir(path, 0o700)
    except FileExistsError:
        return False
    except OSError as exc:
        why = "a component of its path is not a directory" if exc.errno == errno.ENOTDIR else exc.strerror or exc
        raise ConfigError(field, f"cannot create the directory {path}: {why}") from None
    return True


def _make_private(path: str, gid: int | None, field: str) -> None:
    mode = 0o710 if gid is not None else 0o700
    fd = _open_owned_dir(path, field, root_ok=False)
    try:
        if gid is not None:
            try:
                os.fchown(fd, -1, gid)
            except OSError as exc:
                raise ConfigError("socket_group", f"cannot give {path} to gid {gid} (the daemon's user must "
                                                  f"be a member of it): {exc.strerror or exc}") from None
        try:
            os.fchmod(fd, mode)
        except OSError as exc:
            raise ConfigError(field, f"cannot set the mode of {path}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)


def _open_owned_dir(path: str, field: str, *, root_ok: bool) -> int:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise ConfigError(field, _why_not(path, exc, field, root_ok)) from None
    try:
        owner = os.fstat(fd).st_uid
    except OSError as exc:
        os.close(fd)
        raise ConfigError(field, f"cannot inspect {path}: {exc.strerror or exc}") from None
    if not _owner_ok(owner, root_ok):
        os.close(fd)
        raise ConfigError(field, _not_owned(path, owner, field))
    return fd


def _owner_ok(owner: int, root_ok: bool) -> bool:
    return owner == os.geteuid() or (root_ok and owner == 0)


def _not_owned(path: str, owner: int, field: str) -> str:
    return (f"{path} is owned by {_user(owner)}, not by the daemon's user {_user(os.geteuid())}; another "
            f"user may have created it first: remove it, or set {field} to another path")


def _why_not(path: str, exc: OSError, field: str, root_ok: bool) -> str:
    """Why ``path`` could not be opened as a directory without following a link."""
    try:
        st = os.lstat(path)
    except OSError:
        if exc.errno == errno.ENOTDIR:
            return f"cannot open the directory {path}: a component of its path is not a directory"
        return f"cannot open the directory {path}: {exc.strerror or exc}"
    if stat.S_ISLNK(st.st_mode):
        return f"{path} is a symbolic link; the daemon uses only a real directory its user owns"
    if not stat.S_ISDIR(st.st_mode):
        return f"{path} is not a directory"
    if not _owner_ok(st.st_uid, root_ok):  # e.g. another user's 0700 directory
        return _not_owned(path, st.st_uid, field)
    return f"cannot open the directory {path}: {exc.strerror or exc}"


def _same_path(a: str, b: str) -> bool:
    return os.path.normpath(os.path.abspath(a)) == os.path.normpath(os.path.abspath(b))


def _user(uid: int) -> str:
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"
