"""The journal's directory on disk: opened once and trusted, and its files read and written through it.

Privacy: the directory and every file in it are readable by the server's user only (0700 / 0600):
transcripts and images are the users' data.

No path is trusted twice: the directory is opened once, at start-up, and every access after that is
relative to the open directories (``dir_fd``, ``O_NOFOLLOW``), so a directory renamed or swapped for a
symbolic link later redirects nothing. Opening it checks every component from ``/`` down, each
opened relative to the one before without following links (what is checked is what is opened):
every ancestor must belong to root or this uid and be writable by no one else unless sticky (as
``/tmp`` and ``/dev/shm``), or its owner could swap what lies below; the directory and its
``sessions/`` and ``images/`` folders must be real directories of this uid. Anything else is a
``ConfigError`` naming the path and what to set. (The launcher's default path, when another user
made it first, is not used: it picks a fresh private one, launch/torchserve.py.)

Durability: on a disk, a write fsyncs the new file before its rename and the directory after it
(and a removal the directory), so after a power loss an entry is the old one or the new one. On a
memory filesystem (tmpfs, ramfs: the default /dev/shm) a power loss takes everything anyway, so
nothing is fsynced. The filesystem is told by the directory's device number in
/proc/self/mountinfo (symbolic links and bind mounts resolve right); where it cannot be told
(no /proc, a device not listed there), the journal fsyncs.

Who calls this: ``Journal`` (session/state/journal.py), which holds the open directories.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from session.errors import ConfigError

MEMORY_FILESYSTEMS = frozenset({"tmpfs", "ramfs"})  # a power loss empties them: an fsync there buys nothing
_DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
_WALK = getattr(os, "O_PATH", os.O_RDONLY) | os.O_DIRECTORY | os.O_NOFOLLOW  # an ancestor: a handle, not read

def open_journal_directory(path: Path) -> int:
    """An open descriptor of ``path``, made (0700) where missing, once every component from ``/`` down
    is checked: each ancestor belongs to root or this uid and no one else may write to it unless it is
    sticky; the directory itself is a real directory of this uid (``open_own_directory``). Each component is
    opened relative to the one before without following a link: what is checked is what is opened.
    Links in the ancestors, as given, are resolved once, here. Raises ConfigError naming the path."""
    path = Path(os.path.abspath(path))
    parent = Path(os.path.realpath(path.parent))
    fd = os.open("/", _WALK)
    try:
        _check_ancestor(os.fstat(fd), Path("/"), path)
        for index, name in enumerate(parent.parts[1:], start=2):
            here = Path(*parent.parts[:index])
            try:
                child = _open_or_make(fd, name, _WALK)
            except OSError as exc:
                raise ConfigError(f"the journal directory {path} is under {here}, which cannot be opened as a "
                                  f"directory ({exc.strerror}); set RESIDENT_JOURNAL_DIR elsewhere") from None
            os.close(fd)
            fd = child
            _check_ancestor(os.fstat(fd), here, path)
        return open_own_directory(fd, path.name, path)
    finally:
        os.close(fd)


def _open_or_make(parent: int, name: str, flags: int) -> int:
    """Open the directory ``name`` under ``parent``, made (0700) first where missing (mkdir is not tried on
    what exists: on a read-only mount it would fail even then)."""
    try:
        return os.open(name, flags, dir_fd=parent)
    except FileNotFoundError:
        try:
            os.mkdir(name, 0o700, dir_fd=parent)
        except FileExistsError:  # made meanwhile, or a link to nowhere: the open says which
            pass
        return os.open(name, flags, dir_fd=parent)


def _check_ancestor(info: os.stat_result, here: Path, path: Path) -> None:
    """An ancestor another user could rename entries in (their own directory, or one writable by others
    and not sticky) could have the journal swapped under it: refused."""
    writable_by_others = info.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not info.st_mode & stat.S_ISVTX
    if info.st_uid not in (0, os.getuid()) or writable_by_others:
        who = f"belongs to uid {info.st_uid}" if info.st_uid not in (0, os.getuid()) else \
            f"is writable by other users (mode {stat.filemode(info.st_mode)}) and not sticky"
        raise ConfigError(f"the journal directory {path} is under {here}, which {who}: another user could swap the "
                          "journal for their own; set RESIDENT_JOURNAL_DIR to a directory whose every parent only "
                          "root or the server's user can write (e.g. under /dev/shm)")


def open_own_directory(parent: int, name: str, shown: Path) -> int:
    """``name`` under the open directory ``parent``, made (0700) where missing, opened without following a
    link and accepted only as a real directory of this uid, then made private: a symbolic link, or a
    directory another local user made first, would hand them our users' data."""
    try:
        fd = _open_or_make(parent, name, _DIRECTORY)
    except OSError as exc:  # a file, a link (to nowhere too), or a directory not ours: told apart here
        try:
            info = os.stat(name, dir_fd=parent, follow_symlinks=False)
        except OSError:
            info = None
        if info is not None and stat.S_ISLNK(info.st_mode):
            raise ConfigError(f"the journal directory {shown} is a symbolic link; refusing it: remove it or set "
                              "RESIDENT_JOURNAL_DIR to a directory of the server's own") from None
        if info is not None and not stat.S_ISDIR(info.st_mode):
            raise ConfigError(f"the journal directory {shown} exists and is not a directory; remove it or set "
                              "RESIDENT_JOURNAL_DIR elsewhere") from None
        if info is not None:
            _check_owner(info, shown)
        raise ConfigError(f"the journal directory {shown} cannot be opened ({exc.strerror}); set "
                          "RESIDENT_JOURNAL_DIR elsewhere") from None
    try:
        _check_owner(os.fstat(fd), shown)
    except ConfigError:
        os.close(fd)
        raise
    os.fchmod(fd, 0o700)  # also when it existed (an older, world-readable journal)
    return fd


def _check_owner(info: os.stat_result, shown: Path) -> None:
    if info.st_uid != os.getuid():
        raise ConfigError(f"the journal directory {shown} belongs to uid {info.st_uid}, not to this server's uid "
                          f"{os.getuid()} (another user may have created it first); remove it or set "
                          "RESIDENT_JOURNAL_DIR elsewhere")


def filesystem_type(path: Path) -> str | None:
    """The type of the filesystem holding ``path`` ("tmpfs", "ext4", ...), or None when it cannot be told."""
    try:
        return device_type(os.stat(path).st_dev)
    except OSError:
        return None


def device_type(device: int) -> str | None:
    """The filesystem type of the device numbered ``device`` (``st_dev``), or None when it cannot be told."""
    try:
        mountinfo = Path("/proc/self/mountinfo").read_text()
    except OSError:
        return None
    return mount_type(mountinfo, os.major(device), os.minor(device))


def mount_type(mountinfo: str, major: int, minor: int) -> str | None:
    """The filesystem type of device ``major:minor`` in the text of /proc/self/mountinfo, whose lines read
    ``id parent major:minor root mount-point options [optional fields...] - type source options``."""
    for line in mountinfo.splitlines():
        fields = line.split()
        if len(fields) > 7 and fields[2] == f"{major}:{minor}" and "-" in fields[6:]:
            rest = fields[fields.index("-", 6) + 1:]
            if rest:
                return rest[0]
    return None


def atomic_write(folder: int, name: str, data: bytes, fsync: bool) -> None:
    """``name`` under the open directory ``folder`` holds ``data``, whole or not at all: a temporary
    file renamed over it, so a reader never sees a half-written file."""
    tmp = f".{name}.{os.getpid()}.tmp"
    # 0600: never readable by other users; O_NOFOLLOW: never written through a link.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600, dir_fd=folder)
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(data)
            if fsync:
                file.flush()
                os.fsync(file.fileno())
        os.replace(tmp, name, src_dir_fd=folder, dst_dir_fd=folder)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=folder)
        except FileNotFoundError:
            pass
        raise
    if fsync:  # the rename itself is durable only once the directory is
        os.fsync(folder)


def file_size(folder: int, name: str) -> int:
    """Bytes of ``name`` under ``folder`` (a link's own), 0 when there is none."""
    try:
        return os.stat(name, dir_fd=folder, follow_symlinks=False).st_size
    except FileNotFoundError:
        return 0


def file_exists(folder: int, name: str) -> bool:
    try:
        os.stat(name, dir_fd=folder, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


def read_regular_file(folder: int, name: str) -> bytes:
    """A regular file's bytes (a link, a FIFO or a device is refused: ValueError)."""
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=folder)
    with os.fdopen(fd, "rb") as file:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError("not a regular file")
        return file.read()


def close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)
