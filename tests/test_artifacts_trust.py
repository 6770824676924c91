"""Compile caches and other local users: only files no other user can have written are
published, and nothing is installed where another user could write.

Another user is simulated with ``os.chown`` to uid 65534 (these tests run as root,
which may give files away) and with mode bits (0777 directories, 0666 files); a
property test draws whole trees of modes, owners, symlinks, FIFOs and hard links and
checks that exactly the trusted files are collected.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_artifacts import files_under, make_cache

from nccl_back.caches import artifact_transfer as flow
from nccl_back.config import Settings
from nccl_back.errors import ArtifactError, UntrustedPathError
from nccl_back.model.artifact_sets import collect, install

KEY = b"k" * 32
MAX = 1 << 20
OTHER = 65534
AS_ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not AS_ROOT, reason="giving a file to another uid needs root")
KERNEL_DIR = "torch_compile_cache/abc123/rank_0_0/inductor_cache/eb"


def snapshot(root: Path) -> dict[str, tuple[int, int, bytes]]:
    """Every entry under ``root``: mode, owner and (files) bytes."""
    out = {}
    for p in sorted(root.rglob("*")):
        st = os.lstat(p)
        out[str(p.relative_to(root))] = (st.st_mode, st.st_uid, p.read_bytes() if p.is_file() else b"")
    return out


# -- collect: the root and the way to it -------------------------------------------------


@pytest.mark.parametrize("plant,why", [
    ("root-0777", r"writable by group or others \(mode 0777\)"),
    ("root-0775", r"writable by group or others \(mode 0775\)"),
    pytest.param("root-other-owner", "owned by uid 65534", marks=needs_root),
    ("parent-0777", "without the sticky bit"),
    pytest.param("parent-sticky-other-owner", "owned by uid 65534, neither", marks=needs_root),
    ("root-symlink-to-0777", r"writable by group or others \(mode 0777\)"),
])
def test_a_cache_directory_another_user_could_have_written_publishes_nothing(
        tmp_path: Path, plant: str, why: str, caplog: pytest.LogCaptureFixture) -> None:
    """A cache root that is 0777, group-writable, another user's, under a directory others
    may write, or reached through a symlink to such a one: nothing of it is published,
    and the reason is logged."""
    parent = tmp_path / "tmp"
    parent.mkdir()
    real = parent / "torchinductor_me"
    units = make_cache(real)
    root = real
    if plant == "root-0777":
        real.chmod(0o777)
    elif plant == "root-0775":
        real.chmod(0o775)
    elif plant == "root-other-owner":
        os.chown(real, OTHER, OTHER)
    elif plant == "parent-0777":
        parent.chmod(0o777)
    elif plant == "parent-sticky-other-owner":
        parent.chmod(0o1777)
        os.chown(parent, OTHER, OTHER)
    elif plant == "root-symlink-to-0777":
        real.chmod(0o777)
        root = tmp_path / "link"
        root.symlink_to(real)
    with pytest.raises(UntrustedPathError, match=why):
        collect(str(root), units, KEY, MAX)
    s = Settings(redis_url="redis://127.0.0.1:9/0", secret="s3cret-of-the-fleet-0123")
    with caplog.at_level(logging.WARNING, logger="nccl_back"):
        what = flow.publish(s, flow.CacheKey({"a": "1"}, "0" * 32), str(root), units)
    assert what.startswith("not published: ") and "not used for compile caches" in what, what
    assert any("artifact_set_refused" in r.getMessage() for r in caplog.records)


def test_a_sticky_shared_directory_of_root_on_the_way_is_trusted(tmp_path: Path) -> None:
    """A root-owned sticky directory on the way (``/tmp``'s kind) is fine: others may add
    entries there but not move ours; the set is collected byte for byte."""
    parent = tmp_path / "tmp"
    parent.mkdir()
    parent.chmod(0o1777)
    if AS_ROOT:
        os.chown(parent, 0, 0)
    units = make_cache(parent / "torchinductor_me")
    man, data = collect(str(parent / "torchinductor_me"), units, KEY, MAX)
    dst = tmp_path / "b"
    install(str(dst), man, data, KEY)
    assert files_under(dst) == files_under(parent / "torchinductor_me")


# -- collect: files and directories inside ------------------------------------------------


@pytest.mark.parametrize("plant,why", [
    pytest.param("file-other-owner", "kernel.so: owned by uid 65534", marks=needs_root),
    ("file-0666", r"kernel.so: writable by group or others \(mode 0666\)"),
    ("file-0620", r"kernel.so: writable by group or others \(mode 0620\)"),
    ("file-hard-link", "kernel.so: has 2 hard links"),
    ("dir-0777", r"inductor_cache/eb: writable by group or others \(mode 0777\)"),
    pytest.param("dir-other-owner", "inductor_cache/eb: owned by uid 65534", marks=needs_root),
    ("way-0777", r"torch_compile_cache: writable by group or others"),
    ("way-symlink", "torch_compile_cache: a symlink"),
])
def test_a_planted_file_leaves_its_whole_unit_out(tmp_path: Path, plant: str, why: str,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    """A kernel another user owns or may write, a hard link, or a directory on the way
    another user may write: its unit is left out whole (a unit travels whole or not at
    all) with the reason logged; the other units are published as they are."""
    root = tmp_path / "cache"
    units = make_cache(root)
    kernel = root / KERNEL_DIR / "kernel.so"
    if plant == "file-other-owner":
        os.chown(kernel, OTHER, OTHER)
    elif plant == "file-0666":
        kernel.chmod(0o666)
    elif plant == "file-0620":
        kernel.chmod(0o620)
    elif plant == "file-hard-link":
        os.link(kernel, tmp_path / "elsewhere")  # a second name, outside the cache
    elif plant == "dir-0777":
        kernel.parent.chmod(0o777)
    elif plant == "dir-other-owner":
        os.chown(kernel.parent, OTHER, OTHER)
    elif plant == "way-0777":
        (root / "torch_compile_cache").chmod(0o777)
    elif plant == "way-symlink":
        (root / "torch_compile_cache").rename(tmp_path / "moved")
        (root / "torch_compile_cache").symlink_to(tmp_path / "moved")
    refused: list[str] = []
    with caplog.at_level(logging.WARNING, logger="nccl_back"):
        man, data = collect(str(root), units, KEY, MAX, refused=refused)
    assert man.units == ("modelinfos/llama.json",)
    assert [f.path for f in man.files] == ["modelinfos/llama.json"] and bytes(data) == b"{}"
    assert len(refused) == 1 and refused[0].startswith("torch_compile_cache/abc123: ")
    assert re.search(why, refused[0]), refused
    assert any("artifact_unit_refused" in r.getMessage() for r in caplog.records)


def test_a_file_that_changes_while_it_is_read_leaves_its_unit_out(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel that grows while it is read (its size and mtime are checked again after
    the read) is not published half old, half new: its unit is left out."""
    root = tmp_path / "cache"
    units = make_cache(root)
    kernel = root / KERNEL_DIR / "kernel.so"
    real_read = os.read
    grown: list[int] = []

    def read(fd: int, n: int) -> bytes:
        if not grown and os.fstat(fd).st_ino == os.stat(kernel).st_ino:
            grown.append(fd)
            with open(kernel, "ab") as fh:  # another write lands mid-read
                fh.write(b"more")
        return real_read(fd, n)

    monkeypatch.setattr(os, "read", read)
    refused: list[str] = []
    man, _ = collect(str(root), units, KEY, MAX, refused=refused)
    monkeypatch.undo()
    assert grown and man.units == ("modelinfos/llama.json",)
    assert refused and "kernel.so: changed while it was read" in refused[0]


def test_only_regular_files_travel_not_fifos_or_symlinks(tmp_path: Path) -> None:
    """A FIFO (which would block a plain open) and symlinks are left out without
    refusing their unit: they are no cache file the engine wrote."""
    root = tmp_path / "cache"
    units = make_cache(root)
    os.mkfifo(root / KERNEL_DIR / "pipe")
    (root / KERNEL_DIR / "link.so").symlink_to(root / KERNEL_DIR / "kernel.so")
    man, _ = collect(str(root), units, KEY, MAX)
    paths = [f.path for f in man.files]
    assert f"{KERNEL_DIR}/kernel.so" in paths
    assert not any(p.endswith(("pipe", "link.so")) for p in paths)


# -- install --------------------------------------------------------------------------------


@pytest.mark.parametrize("plant,why", [
    ("root-0777", r"writable by group or others \(mode 0777\)"),
    pytest.param("root-other-owner", "owned by uid 65534", marks=needs_root),
    ("missing-root-under-0777", "without the sticky bit"),
    ("unit-parent-0777", r"torch_compile_cache: writable by group or others.*not installed"),
    pytest.param("unit-parent-other-owner", "torch_compile_cache: owned by uid 65534.*not installed",
                 marks=needs_root),
    ("unit-parent-symlink", "torch_compile_cache: a symlink.*not installed"),
])
def test_install_writes_nothing_where_another_user_could_write(tmp_path: Path, plant: str,
                                                               why: str) -> None:
    """A victim never installs into a tree another user planted: a root (or a directory
    a unit goes into) that is 0777, another user's or a symlink is refused, and nothing
    is written into it."""
    src = tmp_path / "src"
    man, data = collect(str(src), make_cache(src), KEY, MAX)
    dst = tmp_path / "dst"
    dst.mkdir()
    if plant == "root-0777":
        dst.chmod(0o777)
    elif plant == "root-other-owner":
        os.chown(dst, OTHER, OTHER)
    elif plant == "missing-root-under-0777":
        dst.chmod(0o777)
        dst = dst / "torchinductor_me"
    elif plant.startswith("unit-parent"):
        tcc = dst / "torch_compile_cache"
        if plant == "unit-parent-symlink":
            (tmp_path / "elsewhere").mkdir()
            tcc.symlink_to(tmp_path / "elsewhere")
        else:
            tcc.mkdir()
            if plant == "unit-parent-0777":
                tcc.chmod(0o777)
            else:
                os.chown(tcc, OTHER, OTHER)
    top, elsewhere = tmp_path / "dst", tmp_path / "elsewhere"
    before = snapshot(top)
    with pytest.raises(UntrustedPathError, match=why):
        install(str(dst), man, data, KEY)
    if plant.startswith("unit-parent"):  # units before it may have gone in; none into it
        assert not any(k.startswith("torch_compile_cache/") for k in set(snapshot(top)) - set(before))
    else:
        assert snapshot(top) == before
    assert not elsewhere.exists() or snapshot(elsewhere) == {}


def test_install_makes_its_directories_private_whatever_the_umask(tmp_path: Path) -> None:
    """Directories an install makes are 0755 at most (never writable by others, even
    under umask 0), so a set it installed can be published again."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    man, data = collect(str(src), make_cache(src), KEY, MAX)
    old = os.umask(0)
    try:
        install(str(dst / "new" / "root"), man, data, KEY)
    finally:
        os.umask(old)
    for p in [dst / "new", *(dst / "new").rglob("*")]:
        assert not os.lstat(p).st_mode & 0o022, p
    again, _ = collect(str(dst / "new" / "root"), list(man.units), KEY, MAX)
    assert again.digest == man.digest


# -- the property: exactly the trusted files ---------------------------------------------

# Trusted modes and owners half the time, so that many trees hold trusted units.
_MODES = st.sampled_from([0o600, 0o644, 0o640]) | st.sampled_from([0o664, 0o666, 0o646, 0o620])
_DIR_MODES = st.sampled_from([0o700, 0o755, 0o750]) | st.sampled_from([0o775, 0o777, 0o757, 0o1777])
_OWNERS = st.just(os.geteuid()) | (st.just(OTHER) if AS_ROOT else st.just(os.geteuid()))
_ROOT_MODES = st.just(0o755) | _DIR_MODES
_NAMES = st.sampled_from(["a", "b", "c.so", "d.gch", "e"])


@st.composite
def nodes(draw: Any, depth: int = 0) -> dict[str, Any]:
    kind = draw(st.sampled_from(["file", "file", "dir", "symlink", "fifo"] if depth < 3 else
                                ["file", "symlink", "fifo"]))
    node: dict[str, Any] = {"kind": kind, "owner": draw(_OWNERS)}
    if kind == "file":
        node.update(mode=draw(_MODES), data=draw(st.binary(max_size=16)), linked=draw(st.booleans()))
    elif kind == "dir":
        node.update(mode=draw(_DIR_MODES),
                    children=draw(st.dictionaries(_NAMES, nodes(depth + 1), max_size=3)))
    return node


def _build(path: Path, node: dict[str, Any], links: Path) -> None:
    kind = node["kind"]
    if kind == "file":
        path.write_bytes(node["data"])
        if node["linked"]:
            os.link(path, links / f"{len(os.listdir(links))}")
    elif kind == "dir":
        path.mkdir()
        for name, child in node["children"].items():
            _build(path / name, child, links)
    elif kind == "symlink":
        path.symlink_to(links)
    else:
        os.mkfifo(path)
    if kind in ("file", "dir", "fifo"):
        if AS_ROOT:
            os.chown(path, node["owner"], node["owner"])
        if kind != "fifo":
            path.chmod(node["mode"])


def _trusted(node: dict[str, Any]) -> bool:
    """The oracle: a directory of ours writable by nobody else holding only trusted
    things; a file of ours writable by nobody else, one link; symlinks and FIFOs are
    left out without harm."""
    if node["kind"] in ("symlink", "fifo"):
        return True
    if node["owner"] != os.geteuid() or node["mode"] & 0o022:
        return False
    if node["kind"] == "file":
        return not node["linked"]
    return all(_trusted(c) for c in node["children"].values())


def _files(rel: str, node: dict[str, Any]) -> dict[str, bytes]:
    if node["kind"] == "file":
        return {rel: node["data"]}
    if node["kind"] == "dir":
        return {k: v for name, c in node["children"].items() for k, v in _files(f"{rel}/{name}", c).items()}
    return {}


@contextlib.contextmanager
def _tree(root: dict[str, Any]) -> Iterator[Path]:
    with tempfile.TemporaryDirectory() as tmp:
        links = Path(tmp) / "links"
        links.mkdir()
        _build(Path(tmp) / "root", root, links)
        yield Path(tmp) / "root"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(root_mode=_ROOT_MODES, root_owner=st.just(os.geteuid()) | _OWNERS,
       children=st.dictionaries(_NAMES, nodes(), min_size=1, max_size=4))
def test_collect_takes_exactly_the_trusted_files(root_mode: int, root_owner: int,
                                                 children: dict[str, Any]) -> None:
    """Any tree of files, directories, symlinks, FIFOs and hard links, of any modes and
    owners: an untrusted root publishes nothing; otherwise exactly the regular files of
    the units holding nothing untrusted are collected, byte for byte."""
    root = {"kind": "dir", "owner": root_owner, "mode": root_mode, "children": children}
    with _tree(root) as path:
        units = sorted(children)
        if root_owner != os.geteuid() or root_mode & 0o022:
            with pytest.raises(UntrustedPathError):
                collect(str(path), units, KEY, MAX)
            return
        refused: list[str] = []
        man, data = collect(str(path), units, KEY, MAX, refused=refused)
    expected = {k: v for u in units if _trusted(children[u]) for k, v in _files(u, children[u]).items()}
    got = {f.path: bytes(data[at:at + f.size]) for f, at in zip(man.files, man.offsets, strict=True)}
    assert got == expected
    assert sorted(r.split(":")[0] for r in refused) == sorted(u for u in units if not _trusted(children[u]))


def test_a_collect_error_is_an_artifact_error(tmp_path: Path) -> None:
    """A missing root is an ArtifactError naming it (publish says 'not published')."""
    with pytest.raises(ArtifactError, match="absent.*no such directory"):
        collect(str(tmp_path / "absent"), ["a"], KEY, MAX)
