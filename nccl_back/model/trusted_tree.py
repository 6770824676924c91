"""Local trees no other local user can have written: the trust rules of compile caches.

Compile caches hold code the engine runs (shared libraries, precompiled headers), and
they live in directories such as ``$TMPDIR/torchinductor_<user>`` that another local
user may have created first, 0777. Other local users are not trusted (root is: it can
do anything anyway). So a file is published, and a directory written into, only under
these rules:

* **the way to the root** (each directory from ``/`` down to the root's parent, with
  the symlinks of the path as given resolved once): owned by root or this process's
  effective uid, and not writable by group or others unless sticky (``/tmp``: others
  may add entries there, but not rename or remove ours);
* **the root and every directory under it**: a directory (not a symlink) owned by this
  uid that neither group nor others may write;
* **a file**: a regular file owned by this uid that neither group nor others may write,
  with one link (no second name outside these rules), unchanged while it was read
  (size, mtime, inode).

"Files this process's engine wrote", in practice: files of this uid in such a tree,
which nobody but this uid (and root) can have written. Every check is made on the
descriptor then used: each component is opened ``O_NOFOLLOW`` relative to its checked
parent, so a path swapped between a check and its use is never followed.
A refusal is an :class:`~nccl_back.errors.UntrustedPathError` naming the path and why.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Callable

from nccl_back.errors import UntrustedPathError

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: a FIFO swapped in after the lstat must not block the open.
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH
#: Mode of the directories made here (never writable by others, whatever the umask).
DIR_MODE = 0o755
_READ_CHUNK = 8 << 20


def _mode(st: os.stat_result) -> str:
    return f"{stat.S_IMODE(st.st_mode):04o}"


def way_problem(st: os.stat_result) -> str | None:
    """Why a directory on the way to a root is not trusted, or None."""
    if not stat.S_ISDIR(st.st_mode):
        return "not a directory"
    uid = os.geteuid()
    if st.st_uid not in (0, uid):
        return f"owned by uid {st.st_uid}, neither this process's ({uid}) nor root"
    if st.st_mode & _OTHERS_WRITE and not st.st_mode & stat.S_ISVTX:
        return f"writable by group or others without the sticky bit (mode {_mode(st)})"
    return None


def dir_problem(st: os.stat_result) -> str | None:
    """Why the root or a directory under it is not trusted, or None."""
    if not stat.S_ISDIR(st.st_mode):
        return "not a directory"
    return _owner_problem(st)


def file_problem(st: os.stat_result) -> str | None:
    """Why a file is not trusted, or None."""
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    hard_links = f"has {st.st_nlink} hard links" if st.st_nlink != 1 else None
    return _owner_problem(st) or hard_links


def _owner_problem(st: os.stat_result) -> str | None:
    """Why an entry this process did not write alone is not trusted: owned by another
    uid, or writable by group or others; None if it did."""
    uid = os.geteuid()
    if st.st_uid != uid:
        return f"owned by uid {st.st_uid}, not this process's ({uid})"
    if st.st_mode & _OTHERS_WRITE:
        return f"writable by group or others (mode {_mode(st)})"
    return None


def _open_dir(parent: int, name: str, shown: str, create: bool) -> int | None:
    """``name`` under ``parent`` as a directory descriptor (made when missing and
    ``create``), None when missing; UntrustedPathError for a symlink or a non-directory."""
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=parent)
    except FileNotFoundError:
        if not create:
            return None
    except OSError as e:
        if e.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        st = os.stat(name, dir_fd=parent, follow_symlinks=False)
        raise UntrustedPathError(f"{shown}: {'a symlink' if stat.S_ISLNK(st.st_mode) else 'not a directory'}"
                                 " (only real directories are trusted)") from e
    with contextlib.suppress(FileExistsError):  # made meanwhile: checked as any other
        os.mkdir(name, DIR_MODE, dir_fd=parent)
    return _open_dir(parent, name, shown, False)


def open_root(root: str, *, create: bool) -> int:
    """A descriptor of the directory ``root``, after checking the way to it and it (see
    the module docstring); missing directories are made when ``create`` (else
    FileNotFoundError). UntrustedPathError naming the first directory that fails."""
    path = os.path.realpath(root)
    parts = [p for p in path.split("/") if p]
    fd = os.open("/", _DIR_FLAGS)
    try:
        st = os.fstat(fd)
        problem = dir_problem(st) if not parts else way_problem(st)
        if problem:
            raise UntrustedPathError(f"/: {problem}; not used for compile caches")
        for i, name in enumerate(parts):
            shown = "/" + "/".join(parts[: i + 1])
            sub = _open_dir(fd, name, shown, create)
            if sub is None:
                raise FileNotFoundError(errno.ENOENT, "no such directory", shown)
            os.close(fd)
            fd = sub
            st = os.fstat(fd)
            problem = dir_problem(st) if i == len(parts) - 1 else way_problem(st)
            if problem:
                raise UntrustedPathError(f"{shown}: {problem}; not used for compile caches")
        return fd
    except BaseException:
        os.close(fd)
        raise


def open_subdir(parent: int, name: str, shown: str, *, create: bool) -> int | None:
    """A checked descriptor of the directory ``name`` under the trusted ``parent`` (made
    when missing and ``create``), None when missing; UntrustedPathError otherwise."""
    fd = _open_dir(parent, name, shown, create)
    if fd is None:
        return None
    problem = dir_problem(os.fstat(fd))
    if problem:
        os.close(fd)
        raise UntrustedPathError(f"{shown}: {problem}")
    return fd


def read_into(parent: int, name: str, shown: str, out: bytearray, limit: int,
              too_large: Callable[[], Exception]) -> int:
    """Append the trusted file ``name`` (under the trusted ``parent``) to ``out``; its
    size. ``too_large()`` is raised if it holds more than ``limit`` bytes;
    UntrustedPathError if the file is not trusted or changed while it was read."""
    seen = os.stat(name, dir_fd=parent, follow_symlinks=False)
    problem = file_problem(seen)
    if problem:  # checked before opening: opening a device or FIFO is not harmless
        raise UntrustedPathError(f"{shown}: {problem}")
    fd = os.open(name, _FILE_FLAGS, dir_fd=parent)
    try:
        before = os.fstat(fd)
        problem = file_problem(before)
        if problem or (before.st_dev, before.st_ino) != (seen.st_dev, seen.st_ino):
            raise UntrustedPathError(f"{shown}: {problem or 'replaced while it was opened'}")
        if before.st_size > limit:
            raise too_large()
        start = len(out)
        try:
            left = before.st_size + 1  # one byte more: a file that grew is seen
            while left > 0:
                chunk = os.read(fd, min(left, _READ_CHUNK))
                if not chunk:
                    break
                out += chunk
                left -= len(chunk)
            after = os.fstat(fd)
            size = len(out) - start
            if size != before.st_size or (after.st_size, after.st_mtime_ns, after.st_ino) != (
                    before.st_size, before.st_mtime_ns, before.st_ino):
                raise UntrustedPathError(f"{shown}: changed while it was read")
        except BaseException:
            del out[start:]
            raise
        return size
    finally:
        os.close(fd)


def write_file(parent: int, name: str, blob: memoryview) -> None:
    """Write a new file ``name`` under ``parent``, 0600, never through a link or over an
    existing file."""
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o600, dir_fd=parent)
    with os.fdopen(fd, "wb") as fh:
        fh.write(blob)


def remove_tree(parent: int, name: str) -> None:
    """Remove ``name`` under ``parent`` and all it holds, never through a symlink; what
    cannot be removed is left (best effort: a temporary directory of an install)."""
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(name, dir_fd=parent)
        return
    try:
        for entry in os.listdir(fd):
            if stat.S_ISDIR(os.stat(entry, dir_fd=fd, follow_symlinks=False).st_mode):
                remove_tree(fd, entry)
            else:
                with contextlib.suppress(OSError):
                    os.unlink(entry, dir_fd=fd)
    except OSError:
        pass
    finally:
        os.close(fd)
    with contextlib.suppress(OSError):
        os.rmdir(name, dir_fd=parent)
