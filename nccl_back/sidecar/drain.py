"""The ends of ``POST /drain`` outside the health server: the drain token file (a pod's
containers share its loopback, so loopback alone says nothing of who may drain) and the
request ``nccl-back drain`` (a preStop hook) sends. No torch here: the hook starts fast.
"""

from __future__ import annotations

import os
import secrets
import stat
import urllib.error
import urllib.request

from nccl_back.errors import AttachError, ConfigError, NcclBackError
from nccl_back.files import write_atomic
from nccl_back.sidecar.http import TOKEN_HEADER

_MAX_TOKEN_FILE = 1024


def write_token_file(path: str, token: str | None = None) -> str:
    """Write a drain token (a fresh random one by default) to ``path``, mode 0600,
    atomically; returns it. The directory must be private (see
    :func:`~nccl_back.sidecar.handoff.perms.private_dir`) or :class:`ConfigError` says why."""
    # Imported here: the hand-off package imports torch, which the preStop hook never needs.
    from nccl_back.sidecar.handoff.perms import private_dir

    token = token or secrets.token_urlsafe(32)
    directory = os.path.dirname(os.path.abspath(path))
    try:
        private_dir(directory, create=True)
    except AttachError as e:
        raise ConfigError(f"drain token file {path}: {e}") from e
    write_atomic(path, token)
    return token


def read_token_file(path: str) -> str:
    """The drain token in ``path``; :class:`ConfigError` if it is missing, too large,
    or readable by anyone but its owner."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        raise ConfigError(f"drain token file {path}: {e.strerror}") from e
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_mode & 0o077:
            raise ConfigError(
                f"drain token file {path}: must be a regular file of mode 0600"
                f" (is {st.st_mode & 0o7777:o})"
            )
        data = f.read(_MAX_TOKEN_FILE + 1)
    if not data or len(data) > _MAX_TOKEN_FILE:
        raise ConfigError(f"drain token file {path}: empty or over {_MAX_TOKEN_FILE} bytes")
    return data.decode("utf-8", "replace").strip()


def request_drain(port: int, timeout: float, token: str | None = None) -> None:
    """Ask the sidecar on loopback ``port`` to drain (with its drain ``token`` when it has
    one); returns once it has (or raises)."""
    host = "127.0.0.1"
    headers = {TOKEN_HEADER: token} if token is not None else {}
    req = urllib.request.Request(f"http://{host}:{port}/drain", method="POST", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            resp.read()
    except (urllib.error.URLError, OSError) as e:
        raise NcclBackError(f"drain request to {host}:{port} failed: {e}") from e
