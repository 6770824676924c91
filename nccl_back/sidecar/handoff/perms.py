"""Local doors: who may reach the hand-off socket and which segment a consumer maps.

The socket's directory is writable by its owner (or root) only (:func:`private_dir`: a
squatter could replace the socket); both ends check the other's uid (:func:`peer_uid`).
/dev/shm is writable by everyone, so a consumer maps only a segment
:func:`check_segment` accepts; anything else is an :class:`AttachError` naming why.
"""

from __future__ import annotations

import os
import socket
import stat
import struct
import threading

from nccl_back.errors import AttachError

#: ``struct ucred`` (pid, uid, gid) as ``SO_PEERCRED`` returns it on Linux.
_UCRED = struct.Struct("3i")
#: os.umask is process-wide: one caller at a time changes it, restored right after.
UMASK_LOCK = threading.Lock()


def private_dir(directory: str, *, create: bool, owner: int | None = None) -> None:
    """Make sure ``directory`` is one only ``owner`` (default: this process) or root can
    write: created 0700 when missing and ``create``; :class:`AttachError` when it is a
    link or not a directory, belongs to someone else, or its group or others may write.
    """
    uid = os.geteuid() if owner is None else owner
    if create and not os.path.lexists(directory):
        with UMASK_LOCK:
            old = os.umask(0o077)
            try:
                os.makedirs(directory, mode=0o700, exist_ok=True)
            finally:
                os.umask(old)
    try:
        st = os.lstat(directory)
    except OSError as e:
        raise AttachError(f"socket directory {directory}: {e.strerror}") from e
    if not stat.S_ISDIR(st.st_mode):
        raise AttachError(f"socket directory {directory} is not a directory (a symlink?)")
    if st.st_uid not in (uid, 0):
        raise AttachError(
            f"socket directory {directory} belongs to uid {st.st_uid}, not {uid} (or root);"
            " refusing it"
        )
    if st.st_mode & 0o022:
        raise AttachError(
            f"socket directory {directory} is writable by others (mode {st.st_mode & 0o7777:o});"
            " put the socket in a directory of its own (the server creates it 0700)"
        )


def peer_uid(conn: socket.socket) -> int:
    """The uid of the process at the other end of a Unix socket (``SO_PEERCRED``)."""
    raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    return int(_UCRED.unpack(raw)[1])


def check_segment(name: str, st: os.stat_result, size: int, owner: int) -> None:
    """:class:`AttachError` for a segment a consumer must not map: not a regular file,
    owned by neither ``owner`` (the sidecar), this process's user nor root, writable by
    others (they could rewrite checked weights), or under ``size`` bytes (SIGBUS)."""
    if not stat.S_ISREG(st.st_mode):
        raise AttachError(f"segment {name} is not a regular file; refusing to map it")
    if st.st_uid not in (owner, os.geteuid(), 0):
        raise AttachError(
            f"segment {name} belongs to uid {st.st_uid}, expected uid {owner} (or root);"
            " refusing to map it"
        )
    if st.st_mode & 0o022:
        raise AttachError(
            f"segment {name} is writable by group or others (mode {st.st_mode & 0o7777:o});"
            " refusing to map it"
        )
    if size < 1 or st.st_size < size:
        raise AttachError(f"segment {name} has {st.st_size} bytes, expected {size}")
