"""Artifact sets: files of a cache directory as one verified, confined unit.

An engine's compile caches (vLLM's ``torch_compile_cache/<hash>``, the inductor
kernels in it, ``modelinfos``) travel between peers as an *artifact set*: the bytes of
its files back to back (one ``uint8`` tensor on the wire) and a bounded
:class:`ArtifactManifest` naming each file by a relative, normalised path with its
size, plus a keyed digest (HMAC-SHA256 under the fleet secret) over every path, size
and byte. Compiled kernels are shared libraries the engine loads and runs, so:

* a manifest read from outside is parsed into bounds (:func:`parse_manifest`): at most
  :data:`MAX_FILES` files, paths relative, ``/``-separated, normalised (no ``.``,
  ``..``, empty parts, NUL or backslash), each part at most :data:`MAX_PART_BYTES`
  bytes, the whole at most :data:`MAX_PATH_CHARS` characters;
* :func:`install` checks the digest over the received bytes *before* anything is
  written, writes only regular files (``O_EXCL | O_NOFOLLOW``) into a fresh temporary
  directory next to the destination, confined to the cache root even through a
  symlink in the local tree, and moves each *unit* (a top-level directory or file of
  the set) into place with one rename or link: a unit that already exists locally is
  kept, never overwritten or merged into, and a unit is there whole or not at all.

A set that did not arrive whole never reaches :func:`install` (the receive fails
first), so a holder dying mid-transfer leaves nothing behind.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import posixpath
import shutil
import stat
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from nccl_back.errors import ArtifactError

#: Most files in one set (vLLM's cache of one model holds tens to hundreds).
MAX_FILES = 16384
#: Longest relative path, in characters.
MAX_PATH_CHARS = 1024
#: Longest path component, in bytes (the common file-system limit).
MAX_PART_BYTES = 255
#: Name prefix of the temporary directories an install writes into (skipped by
#: :func:`collect`: a half-written install is never published).
TMP_PREFIX = ".nccl_back-incoming-"
#: Digest hex length (HMAC-SHA256).
DIGEST_CHARS = 64


@dataclass(frozen=True)
class ArtifactFile:
    """One file of a set: where it goes (relative to the cache root) and its size."""

    path: str
    size: int


@dataclass(frozen=True)
class ArtifactManifest:
    """What a set holds: its units, its files in wire order, the keyed digest."""

    units: tuple[str, ...]
    """Top-level paths each installed by one rename (a directory) or link (a file)."""
    files: tuple[ArtifactFile, ...]
    digest: str
    """HMAC-SHA256 hex over the units, every file's path and size, and every byte."""
    offsets: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        at, offsets = 0, []
        for f in self.files:
            offsets.append(at)
            at += f.size
        object.__setattr__(self, "offsets", tuple(offsets))

    @property
    def nbytes(self) -> int:
        """Bytes of every file together (the tensor on the wire)."""
        return sum(f.size for f in self.files)

    def to_json(self) -> dict[str, Any]:
        return {"units": list(self.units), "files": [[f.path, f.size] for f in self.files],
                "digest": self.digest}


def normalise(path: object) -> str:
    """``path`` if it is a relative, normalised, bounded POSIX path; else ArtifactError."""
    if not isinstance(path, str) or not path:
        raise ArtifactError(f"artifact path {str(path)[:80]!r}: not a non-empty string")
    shown = repr(path[:80])
    if len(path) > MAX_PATH_CHARS:
        raise ArtifactError(f"artifact path {shown}...: longer than {MAX_PATH_CHARS} characters")
    if "\x00" in path or "\\" in path:
        raise ArtifactError(f"artifact path {shown}: NUL or backslash")
    if path.startswith("/"):
        raise ArtifactError(f"artifact path {shown}: absolute")
    parts = path.split("/")
    if any(p in ("", ".", "..") for p in parts) or posixpath.normpath(path) != path:
        raise ArtifactError(f"artifact path {shown}: not normalised (empty, '.' or '..' part)")
    try:
        too_long = any(len(p.encode()) > MAX_PART_BYTES for p in parts)
    except UnicodeEncodeError as e:
        raise ArtifactError(f"artifact path {shown}: not UTF-8 text") from e
    if too_long:
        raise ArtifactError(f"artifact path {shown}: a part longer than {MAX_PART_BYTES} bytes")
    return path


def _unit_of(path: str, units: Sequence[str]) -> str | None:
    for u in units:
        if path == u or path.startswith(u + "/"):
            return u
    return None


def _check(units: Sequence[str], files: Sequence[ArtifactFile], max_bytes: int) -> None:
    for u in units:
        normalise(u)
    if len(set(units)) != len(units):
        raise ArtifactError("artifact set: a unit listed twice")
    for u in units:
        if _unit_of(u, [v for v in units if v != u]) is not None:
            raise ArtifactError(f"artifact set: unit {u[:80]!r} lies inside another unit")
    if len(files) > MAX_FILES:
        raise ArtifactError(f"artifact set: {len(files)} files, more than {MAX_FILES}")
    seen: set[str] = set()
    total = 0
    per_unit: dict[str, list[str]] = {u: [] for u in units}
    for f in files:
        normalise(f.path)
        if f.path in seen:
            raise ArtifactError(f"artifact set: {f.path[:80]!r} listed twice")
        seen.add(f.path)
        unit = _unit_of(f.path, units)
        if unit is None:
            raise ArtifactError(f"artifact set: {f.path[:80]!r} belongs to no unit")
        per_unit[unit].append(f.path)
        if isinstance(f.size, bool) or not isinstance(f.size, int) or f.size < 0:
            raise ArtifactError(f"artifact set: {f.path[:80]!r} has a bad size {f.size!r}")
        total += f.size
    if total > max_bytes:
        raise ArtifactError(f"artifact set: {total} bytes, more than max_artifact_bytes={max_bytes}")
    for u, paths in per_unit.items():
        if not paths:
            raise ArtifactError(f"artifact set: unit {u[:80]!r} holds no file")
        if u in paths and len(paths) > 1:
            raise ArtifactError(f"artifact set: unit {u[:80]!r} is a file and a directory")
    for p in seen:  # a file cannot also be another file's directory
        parent = p.rsplit("/", 1)[0] if "/" in p else None
        while parent:
            if parent in seen:
                raise ArtifactError(f"artifact set: {parent[:80]!r} is a file and a directory")
            parent = parent.rsplit("/", 1)[0] if "/" in parent else None


def parse_manifest(data: object, max_bytes: int) -> ArtifactManifest:
    """An :class:`ArtifactManifest` from its JSON form (read from outside), within the
    bounds above and ``max_bytes``; ArtifactError naming what is wrong."""
    if not isinstance(data, Mapping):
        raise ArtifactError("artifact manifest: not an object")
    units, files, digest = data.get("units"), data.get("files"), data.get("digest")
    if not isinstance(units, list) or len(units) > MAX_FILES:
        raise ArtifactError("artifact manifest: units must be a bounded list")
    if not isinstance(files, list) or len(files) > MAX_FILES:
        raise ArtifactError(f"artifact manifest: files must be a list of at most {MAX_FILES}")
    if not isinstance(digest, str) or len(digest) != DIGEST_CHARS or \
            any(c not in "0123456789abcdef" for c in digest):
        raise ArtifactError("artifact manifest: digest must be 64 hex characters")
    parsed = []
    for item in files:
        if not isinstance(item, list) or len(item) != 2:
            raise ArtifactError("artifact manifest: a file entry must be [path, size]")
        parsed.append(ArtifactFile(normalise(item[0]), item[1]))
    _check([normalise(u) for u in units], parsed, max_bytes)
    return ArtifactManifest(tuple(units), tuple(parsed), digest)


def set_digest(key: bytes, units: Sequence[str], files: Sequence[ArtifactFile],
               data: bytes | bytearray | memoryview) -> str:
    """The keyed digest of a set: its listing, then every byte, under ``key``."""
    mac = hmac.new(key, digestmod=hashlib.sha256)
    listing = {"units": list(units), "files": [[f.path, f.size] for f in files]}
    head = json.dumps(listing, sort_keys=True, separators=(",", ":")).encode()
    mac.update(len(head).to_bytes(8, "big"))
    mac.update(head)
    mac.update(data)
    return mac.hexdigest()


def _walk(root: str, unit: str) -> list[str]:
    """The regular files of ``unit`` (relative paths, sorted); symlinks, sockets and
    half-written installs are left out: only what the engine itself wrote travels."""
    top = os.path.join(root, unit)
    if not os.path.lexists(top):
        return []
    st = os.lstat(top)
    if stat.S_ISREG(st.st_mode):
        return [unit]
    if not stat.S_ISDIR(st.st_mode):
        return []
    out = []
    for dirpath, dirnames, filenames in os.walk(top, followlinks=False):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(TMP_PREFIX)
                             and not os.path.islink(os.path.join(dirpath, d)))
        for name in sorted(filenames):
            full = os.path.join(dirpath, name)
            if stat.S_ISREG(os.lstat(full).st_mode):
                out.append(os.path.relpath(full, root).replace(os.sep, "/"))
    return out


def collect(root: str, units: Sequence[str], key: bytes,
            max_bytes: int) -> tuple[ArtifactManifest, bytearray]:
    """The set of ``units`` (paths relative to ``root``) as it is on disk now: its
    manifest and its bytes. ArtifactError if a unit is missing or outside the bounds."""
    files: list[ArtifactFile] = []
    data = bytearray()
    try:
        for unit in units:
            for rel in _walk(root, normalise(unit)):
                with open(os.path.join(root, rel), "rb") as fh:
                    blob = fh.read(max_bytes - len(data) + 1)
                if len(data) + len(blob) > max_bytes:
                    raise ArtifactError(f"artifact set under {root}: more than"
                                        f" max_artifact_bytes={max_bytes}")
                files.append(ArtifactFile(normalise(rel), len(blob)))
                data += blob
    except OSError as e:
        raise ArtifactError(f"artifact set under {root}: {e}") from e
    units = [u for u in units if any(_unit_of(f.path, [u]) for f in files)]  # absent ones
    _check(units, files, max_bytes)
    return ArtifactManifest(tuple(units), tuple(files), set_digest(key, units, files, data)), data


@dataclass
class Installed:
    """What :func:`install` did: units moved into place, units kept as they were."""

    installed: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    """Units that already existed locally (a local cache wins) or appeared meanwhile."""


def _inside(path: str, root: str) -> bool:
    return os.path.commonpath([os.path.realpath(path), os.path.realpath(root)]) == \
        os.path.realpath(root)


def _write(path: str, blob: memoryview) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(blob)


def install(root: str, man: ArtifactManifest, data: bytes | bytearray | memoryview,
            key: bytes) -> Installed:
    """Put the received set ``data`` under ``root``.

    The digest is checked first: a set with one byte changed is refused (ArtifactError)
    before anything is written. Each unit is written into a temporary directory in the
    unit's parent and renamed into place only if the unit does not exist locally.
    """
    view = memoryview(data).cast("B")
    if len(view) != man.nbytes:
        raise ArtifactError(f"artifact set: {len(view)} bytes received, the manifest says"
                            f" {man.nbytes}; nothing written")
    got = set_digest(key, man.units, man.files, view)
    if not hmac.compare_digest(got, man.digest):
        raise ArtifactError("artifact set: its bytes do not match the keyed digest (tampered"
                            " with, or signed under another secret); nothing written")
    out = Installed()
    os.makedirs(root, exist_ok=True)
    for unit in man.units:
        final = os.path.join(root, unit)
        if os.path.lexists(final):
            out.kept.append(unit)
            continue
        parent = os.path.dirname(final)
        existing = parent
        while not os.path.lexists(existing):  # check before creating anything
            existing = os.path.dirname(existing)
        if not _inside(existing, root):
            raise ArtifactError(f"artifact unit {unit[:80]!r}: its directory leaves {root}"
                                " through a symlink; not installed")
        os.makedirs(parent, exist_ok=True)
        if not _inside(parent, root):  # a symlink appeared meanwhile
            raise ArtifactError(f"artifact unit {unit[:80]!r}: its directory leaves {root}"
                                " through a symlink; not installed")
        tmp = tempfile.mkdtemp(prefix=TMP_PREFIX, dir=parent)
        try:
            staged = os.path.join(tmp, posixpath.basename(unit))
            for f, at in zip(man.files, man.offsets, strict=True):
                if _unit_of(f.path, [unit]) is None:
                    continue
                dest = os.path.join(tmp, f.path[len(posixpath.dirname(unit)):].lstrip("/"))
                os.makedirs(os.path.dirname(dest), exist_ok=True)
                if not _inside(dest, tmp):
                    raise ArtifactError(f"artifact path {f.path[:80]!r} leaves its unit")
                _write(dest, view[at:at + f.size])
            try:
                if os.path.isdir(staged):
                    os.rename(staged, final)  # fails if a non-empty one appeared meanwhile
                else:
                    os.link(staged, final)  # never replaces an existing file
                out.installed.append(unit)
            except OSError:
                out.kept.append(unit)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out
