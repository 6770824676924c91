"""Artifact sets: files of a cache directory as one verified, confined unit.

An engine's compile caches (vLLM's ``torch_compile_cache/<hash>``, the inductor
kernels in it, ``modelinfos``) travel between peers as an *artifact set*: the bytes of
its files back to back (one ``uint8`` tensor on the wire) and a bounded
:class:`ArtifactManifest` naming each file by a relative, normalised path with its
size, plus a keyed digest (HMAC-SHA256 under the fleet secret) over every path, size
and byte. Compiled kernels are shared libraries the engine loads and runs, so a
manifest read from outside is parsed into bounds (:func:`parse_manifest`), only files
no other local user can have written are published (:func:`collect`), and a set is
installed only once its digest passed, only into trusted directories, each *unit* (a
top-level directory or file of the set) whole or not at all and never over a local one
(:func:`install`).

A set that did not arrive whole never reaches :func:`install` (the receive fails
first), so a holder dying mid-transfer leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import posixpath
import secrets
import stat
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from nccl_back.errors import ArtifactError, UntrustedPathError
from nccl_back.log import get_logger
from nccl_back.model import trusted_tree

log = get_logger(__name__)

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


class _Collector:
    """Appends the trusted files of units to one listing and one byte string."""

    def __init__(self, root: str, max_bytes: int) -> None:
        self.root, self.max_bytes = root, max_bytes
        self.files: list[ArtifactFile] = []
        self.data = bytearray()

    def _too_large(self) -> Exception:
        return ArtifactError(f"artifact set under {self.root}: more than"
                         f" max_artifact_bytes={self.max_bytes}")

    def file(self, parent: int, name: str, rel: str) -> None:
        if len(self.files) >= MAX_FILES:
            raise ArtifactError(f"artifact set under {self.root}: more than {MAX_FILES} files")
        size = trusted_tree.read_into(parent, name, f"{self.root}/{rel}", self.data,
                                      self.max_bytes - len(self.data), self._too_large)
        self.files.append(ArtifactFile(normalise(rel), size))

    def tree(self, fd: int, rel: str) -> None:
        """A trusted directory's files, then its subdirectories, each sorted; symlinks,
        sockets and FIFOs are left out (no cache file of the engine's), and so are
        half-written installs."""
        subdirs = []
        for name in sorted(os.listdir(fd)):
            if name.startswith(TMP_PREFIX):
                continue
            mode = os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode
            if stat.S_ISDIR(mode):
                subdirs.append(name)
            elif stat.S_ISREG(mode):
                self.file(fd, name, normalise(f"{rel}/{name}"))
        for name in subdirs:
            path = normalise(f"{rel}/{name}")
            sub = trusted_tree.open_subdir(fd, name, f"{self.root}/{path}", create=False)
            if sub is not None:
                try:
                    self.tree(sub, path)
                finally:
                    os.close(sub)

    def unit(self, root_fd: int, unit: str) -> None:
        """The unit's files (none if it is absent); UntrustedPathError if anything on its
        way or in it is not trusted."""
        *way, name = unit.split("/")
        with _open_way(root_fd, self.root, way, create=False) as fds:
            if len(fds) < len(way):  # a directory on its way is absent
                return
            fd = fds[-1] if fds else root_fd
            try:
                mode = os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode
            except FileNotFoundError:
                return
            if stat.S_ISREG(mode):
                self.file(fd, name, unit)
            elif stat.S_ISDIR(mode):
                sub = trusted_tree.open_subdir(fd, name, f"{self.root}/{unit}", create=False)
                if sub is not None:
                    fds.append(sub)
                    self.tree(sub, unit)


def collect(root: str, units: Sequence[str], key: bytes, max_bytes: int, *,
            refused: list[str] | None = None) -> tuple[ArtifactManifest, bytearray]:
    """The set of ``units`` (paths relative to ``root``) as it is on disk now: its
    manifest and its bytes. Only trusted files travel (:mod:`.trusted_tree`): a root
    that is not trusted is an :class:`UntrustedPathError`; a unit with anything not
    trusted on its way or in it is left out whole, its reason logged and appended to
    ``refused``. ArtifactError if the set is outside the bounds."""
    got = _Collector(root, max_bytes)
    try:
        root_fd = trusted_tree.open_root(root, create=False)
    except OSError as e:
        raise ArtifactError(f"artifact set under {root}: {e}") from e
    try:
        for unit in units:
            at, count = len(got.data), len(got.files)
            try:
                got.unit(root_fd, normalise(unit))
            except UntrustedPathError as e:
                del got.data[at:], got.files[count:]
                log.warning("artifact_unit_refused", root=root, unit=unit, reason=str(e))
                if refused is not None:
                    refused.append(f"{unit}: {e}")
    except OSError as e:
        raise ArtifactError(f"artifact set under {root}: {e}") from e
    finally:
        os.close(root_fd)
    files, data = got.files, got.data
    units = [u for u in units if any(_unit_of(f.path, [u]) for f in files)]  # absent ones
    _check(units, files, max_bytes)
    return ArtifactManifest(tuple(units), tuple(files), set_digest(key, units, files, data)), data


@dataclass
class InstallResult:
    """What :func:`install` did: units moved into place, units kept as they were."""

    installed: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    """Units that already existed locally (a local cache wins) or appeared meanwhile."""


@contextlib.contextmanager
def _open_way(root_fd: int, root: str, parts: Sequence[str], *,
              create: bool) -> Iterator[list[int]]:
    """Descriptors of each directory of ``parts`` under ``root_fd``, made when missing
    (``create``), every one checked, all closed on exit (with any the caller appends);
    UntrustedPathError for a symlink or one that is not trusted. Stops (shorter list) at
    a missing one when not ``create``."""
    fds: list[int] = []
    fd = root_fd
    try:
        for i, part in enumerate(parts):
            sub = trusted_tree.open_subdir(fd, part, f"{root}/{'/'.join(parts[:i + 1])}",
                                           create=create)
            if sub is None:
                break
            fds.append(sub)
            fd = sub
        yield fds
    finally:
        for f in fds:
            os.close(f)


def _stage(tmp_fd: int, root: str, unit: str, man: ArtifactManifest, view: memoryview) -> None:
    """Write the files of ``unit`` under the temporary directory ``tmp_fd``, where the
    unit's last component is its top (``a/b`` is staged as ``b``)."""
    skip = len(posixpath.dirname(unit).split("/")) if "/" in unit else 0
    for f, at in zip(man.files, man.offsets, strict=True):
        if _unit_of(f.path, [unit]) is None:
            continue
        *way, name = f.path.split("/")[skip:]
        with _open_way(tmp_fd, root, way, create=True) as fds:
            trusted_tree.write_file(fds[-1] if fds else tmp_fd, name, view[at:at + f.size])


def check_destination(root: str) -> None:
    """UntrustedPathError if :func:`install` would refuse ``root`` (as far as it exists)."""
    with contextlib.suppress(FileNotFoundError):
        os.close(trusted_tree.open_root(root, create=False))


def install(root: str, man: ArtifactManifest, data: bytes | bytearray | memoryview,
            key: bytes) -> InstallResult:
    """Put the received set ``data`` under ``root``.

    The digest is checked first: a set with one byte changed is refused (ArtifactError)
    before anything is written. ``root`` and every directory a unit goes into must be
    trusted (:mod:`.trusted_tree`; made, 0755, when missing): a directory another user
    owns or can write, or a symlink, is an :class:`UntrustedPathError` with nothing
    written into it. Each unit is written into a temporary directory in the unit's
    parent and renamed (a file: linked) into place only if the unit does not exist
    locally.
    """
    view = memoryview(data).cast("B")
    if len(view) != man.nbytes:
        raise ArtifactError(f"artifact set: {len(view)} bytes received, the manifest says"
                            f" {man.nbytes}; nothing written")
    got = set_digest(key, man.units, man.files, view)
    if not hmac.compare_digest(got, man.digest):
        raise ArtifactError("artifact set: its bytes do not match the keyed digest (tampered"
                            " with, or signed under another secret); nothing written")
    out = InstallResult()
    root_fd = trusted_tree.open_root(root, create=True)
    try:
        for unit in man.units:
            _install_unit(root_fd, root, unit, man, view, out)
    finally:
        os.close(root_fd)
    return out


def _install_unit(root_fd: int, root: str, unit: str, man: ArtifactManifest, view: memoryview,
                  out: InstallResult) -> None:
    *way, name = unit.split("/")
    with contextlib.ExitStack() as stack:
        try:  # each directory is checked before anything is made under it
            fds = stack.enter_context(_open_way(root_fd, root, way, create=True))
        except UntrustedPathError as e:
            raise UntrustedPathError(f"artifact unit {unit[:80]!r}: {e}; not installed") from e
        parent = fds[-1] if fds else root_fd
        try:
            os.stat(name, dir_fd=parent, follow_symlinks=False)
            out.kept.append(unit)
            return
        except FileNotFoundError:
            pass
        tmp = f"{TMP_PREFIX}{secrets.token_hex(8)}"
        os.mkdir(tmp, 0o700, dir_fd=parent)
        try:
            tmp_fd = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=parent)
            try:
                _stage(tmp_fd, root, unit, man, view)
                try:
                    if stat.S_ISDIR(os.stat(name, dir_fd=tmp_fd, follow_symlinks=False).st_mode):
                        # Fails if a non-empty one appeared meanwhile.
                        os.rename(name, name, src_dir_fd=tmp_fd, dst_dir_fd=parent)
                    else:  # never replaces an existing file
                        os.link(name, name, src_dir_fd=tmp_fd, dst_dir_fd=parent,
                                follow_symlinks=False)
                    out.installed.append(unit)
                except OSError:
                    out.kept.append(unit)
            finally:
                os.close(tmp_fd)
        finally:
            trusted_tree.remove_tree(parent, tmp)
