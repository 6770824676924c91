"""Artifact sets on one machine: the manifest parser (property-based), path confinement,
the keyed digest checked before any write, installs that never overwrite and leave no
half-written unit, and no secret meaning no caches at all.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nccl_back.caches import artifact_transfer as flow
from nccl_back.config import Settings
from nccl_back.errors import ArtifactError
from nccl_back.model import trusted_tree
from nccl_back.model.artifact_sets import (
    MAX_FILES,
    MAX_PART_BYTES,
    MAX_PATH_CHARS,
    TMP_PREFIX,
    ArtifactFile,
    ArtifactManifest,
    collect,
    install,
    normalise,
    parse_manifest,
    set_digest,
)

KEY = b"k" * 32
MAX = 1 << 20


def make_cache(root: Path) -> list[str]:
    """A small vLLM-like cache: a hash directory with a kernel, and a model-info file."""
    kernels = root / "torch_compile_cache" / "abc123" / "rank_0_0" / "inductor_cache" / "eb"
    kernels.mkdir(parents=True)
    (kernels / "kernel.so").write_bytes(bytes(range(256)) * 40)
    (kernels / "kernel.cpp").write_text("int main() { return 0; }\n")
    (root / "torch_compile_cache" / "abc123" / "rank_0_0" / "model").write_bytes(b"\x00\x01graph")
    (root / "modelinfos").mkdir()
    (root / "modelinfos" / "llama.json").write_text("{}")
    return ["torch_compile_cache/abc123", "modelinfos/llama.json"]


def files_under(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# -- the manifest parser -------------------------------------------------------------------

part = st.text(st.characters(codec="utf-8", exclude_characters="/\\\x00"), min_size=1,
               max_size=12).filter(lambda p: p not in (".", ".."))
rel_path = st.lists(part, min_size=1, max_size=4).map("/".join)


@st.composite
def manifests(draw: Any) -> dict[str, Any]:
    units = draw(st.lists(part, min_size=1, max_size=4, unique=True))
    files = []
    for u in units:
        inner = draw(st.lists(rel_path, min_size=1, max_size=3, unique=True))
        files += [[f"{u}/{p}", draw(st.integers(0, 1000))] for p in inner]
    return {"units": units, "files": files, "digest": draw(st.text("0123456789abcdef",
                                                                   min_size=64, max_size=64))}


@given(manifests())
@settings(max_examples=200, deadline=None)
def test_valid_manifests_round_trip(data: dict[str, Any]) -> None:
    """A valid manifest parses, and its JSON form parses to the same manifest."""
    try:
        man = parse_manifest(data, MAX)
    except ArtifactError as e:  # a file that is also another's directory: refused, said why
        assert "file and a directory" in str(e)
        return
    assert parse_manifest(json.loads(json.dumps(man.to_json())), MAX) == man
    assert man.nbytes == sum(size for _, size in data["files"])


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20)


@given(st.one_of(json_values, manifests().flatmap(lambda m: st.fixed_dictionaries({
    "units": st.just(m["units"]) | json_values,
    "files": st.just(m["files"]) | st.lists(st.lists(json_values, max_size=3), max_size=3),
    "digest": st.just(m["digest"]) | json_values,
}))))
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_any_input_is_a_manifest_or_an_artifact_error(data: Any) -> None:
    """Arbitrary JSON is a manifest or ArtifactError, never another exception."""
    with contextlib.suppress(ArtifactError):
        parse_manifest(data, MAX)


@pytest.mark.parametrize("path,why", [
    ("../etc/passwd", "normalised"),
    ("a/../../b", "normalised"),
    ("/etc/passwd", "absolute"),
    ("a//b", "normalised"),
    ("./a", "normalised"),
    ("a/", "normalised"),
    ("a/\x00.so", "NUL"),
    ("a\\..\\b", "backslash"),
    ("a/" + "x" * MAX_PATH_CHARS, "longer than"),
    ("a/" + "x" * (MAX_PART_BYTES + 1), "a part longer"),
    ("a/" + "é" * 200, "a part longer"),
    ("", "non-empty"),
])
def test_paths_leaving_the_cache_directory_are_refused(path: str, why: str) -> None:
    """A path that is absolute, climbs out, is not normalised, holds NUL or is overlong is refused."""
    with pytest.raises(ArtifactError, match=why):
        normalise(path)
    with pytest.raises(ArtifactError):
        parse_manifest({"units": ["a"], "files": [[path, 1]], "digest": "0" * 64}, MAX)


def test_manifest_bounds_are_refused() -> None:
    """Too many bytes, too many files, negative sizes, files outside every unit are refused."""
    def man(**kw: Any) -> dict[str, Any]:
        return {"units": ["u"], "files": [["u/a", 1]], "digest": "0" * 64, **kw}

    with pytest.raises(ArtifactError, match="more than max_artifact_bytes"):
        parse_manifest(man(files=[["u/a", MAX + 1]]), MAX)
    with pytest.raises(ArtifactError, match="at most"):
        parse_manifest(man(files=[[f"u/{i}", 0] for i in range(MAX_FILES + 1)]), MAX)
    with pytest.raises(ArtifactError, match="bad size"):
        parse_manifest(man(files=[["u/a", -1]]), MAX)
    with pytest.raises(ArtifactError, match="belongs to no unit"):
        parse_manifest(man(files=[["v/a", 1]]), MAX)
    with pytest.raises(ArtifactError, match="inside another unit"):
        parse_manifest(man(units=["u", "u/x"], files=[["u/a", 1], ["u/x/b", 1]]), MAX)
    with pytest.raises(ArtifactError, match="64 hex"):
        parse_manifest(man(digest="zz"), MAX)


# -- collect and install -------------------------------------------------------------------


def test_a_set_installs_byte_for_byte(tmp_path: Path) -> None:
    """collect then install reproduces every file under vLLM's own names."""
    src, dst = tmp_path / "a", tmp_path / "b"
    units = make_cache(src)
    man, data = collect(str(src), units, KEY, MAX)
    assert parse_manifest(man.to_json(), MAX) == man
    done = install(str(dst), man, data, KEY)
    assert done.installed == units and done.kept == []
    assert files_under(dst) == files_under(src)


def test_one_changed_byte_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    """A set whose bytes differ in one byte of a kernel is refused with nothing written."""
    src, dst = tmp_path / "a", tmp_path / "b"
    man, data = collect(str(src), make_cache(src), KEY, MAX)
    so = next(i for i, f in enumerate(man.files) if f.path.endswith(".so"))
    data[man.offsets[so] + 100] ^= 1
    with pytest.raises(ArtifactError, match="keyed digest.*nothing written"):
        install(str(dst), man, data, KEY)
    assert not dst.exists()
    data[man.offsets[so] + 100] ^= 1
    with pytest.raises(ArtifactError, match="keyed digest"):  # another fleet's secret
        install(str(dst), man, data, b"x" * 32)
    with pytest.raises(ArtifactError, match="bytes received"):
        install(str(dst), man, data[:-1], KEY)
    assert not dst.exists()


def test_a_local_cache_is_never_overwritten(tmp_path: Path) -> None:
    """A unit that exists locally is kept as it is; the others are installed."""
    src, dst = tmp_path / "a", tmp_path / "b"
    man, data = collect(str(src), make_cache(src), KEY, MAX)
    mine = dst / "torch_compile_cache" / "abc123"
    mine.mkdir(parents=True)
    (mine / "local").write_text("mine")
    done = install(str(dst), man, data, KEY)
    assert done.kept == ["torch_compile_cache/abc123"]
    assert done.installed == ["modelinfos/llama.json"]
    assert files_under(mine) == {"local": b"mine"}


def test_a_symlink_out_of_the_root_is_refused(tmp_path: Path) -> None:
    """A unit whose directory leads out of the cache root through a symlink is refused; nothing lands outside."""
    src, dst, outside = tmp_path / "a", tmp_path / "b", tmp_path / "outside"
    man, data = collect(str(src), make_cache(src), KEY, MAX)
    dst.mkdir()
    outside.mkdir()
    (dst / "torch_compile_cache").symlink_to(outside)
    with pytest.raises(ArtifactError, match="torch_compile_cache: a symlink .*not installed"):
        install(str(dst), man, data, KEY)
    assert list(outside.iterdir()) == []
    deep = ArtifactManifest(("torch_compile_cache/torch_aot_compile/h",),
                            (ArtifactFile("torch_compile_cache/torch_aot_compile/h/k.so", 1),),
                            set_digest(KEY, ["torch_compile_cache/torch_aot_compile/h"],
                                       [ArtifactFile("torch_compile_cache/torch_aot_compile/h/k.so", 1)],
                                       b"x"))
    with pytest.raises(ArtifactError, match="a symlink"):  # no directory made out there
        install(str(dst), deep, b"x", KEY)
    assert list(outside.iterdir()) == []


def test_collect_leaves_out_symlinks_and_half_written_installs(tmp_path: Path) -> None:
    """Only regular files the engine wrote are collected: no symlink, no temporary install."""
    src = tmp_path / "a"
    units = make_cache(src)
    hashdir = src / "torch_compile_cache" / "abc123"
    (hashdir / "evil.so").symlink_to("/etc/passwd")
    (hashdir / (TMP_PREFIX + "x")).mkdir()
    (hashdir / (TMP_PREFIX + "x") / "half").write_bytes(b"1")
    man, _ = collect(str(src), units, KEY, MAX)
    paths = [f.path for f in man.files]
    assert not any("evil" in p or TMP_PREFIX in p for p in paths)
    with pytest.raises(ArtifactError, match="more than max_artifact_bytes"):
        collect(str(src), units, KEY, 100)


def test_a_failed_install_leaves_no_partial_unit(tmp_path: Path) -> None:
    """A unit whose write fails midway leaves neither the unit nor its temporary directory."""
    src, dst = tmp_path / "a", tmp_path / "b"
    units = ["u"]
    (src / "u").mkdir(parents=True)
    files = [ArtifactFile("u/a", 3), ArtifactFile("u/b", 3)]
    data = bytearray(b"abcdef")
    man = ArtifactManifest(("u",), tuple(files), set_digest(KEY, units, files, data))
    dst.mkdir()
    real_write = trusted_tree.write_file
    calls = []

    def failing(parent: int, name: str, blob: memoryview) -> None:
        calls.append(name)
        if len(calls) == 2:
            raise OSError("disk full")
        real_write(parent, name, blob)

    trusted_tree.write_file = failing  # type: ignore[assignment]
    try:
        with pytest.raises(OSError, match="disk full"):
            install(str(dst), man, data, KEY)
    finally:
        trusted_tree.write_file = real_write  # type: ignore[assignment]
    assert list(dst.iterdir()) == []


# -- no secret: no caches ------------------------------------------------------------------


def test_without_a_secret_caches_are_skipped_with_one_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Without a secret nothing is published or fetched, and one warning says so."""
    flow._warned.clear()
    s = Settings(redis_url="redis://127.0.0.1:9/0", secret=None)
    key = flow.CacheKey({"vllm": "1"}, "0" * 32)
    src = tmp_path / "a"
    units = make_cache(src)
    with caplog.at_level(logging.WARNING, logger="nccl_back"):
        assert flow.publish(s, key, str(src), units) == "not published: no fleet secret"
        got = flow.fetch(s, key, str(tmp_path / "b"))
        flow.fetch(s, key, str(tmp_path / "b"))
    assert not got.ok and "no fleet secret" in got.reason
    warned = [r for r in caplog.records if "compile_caches_skipped" in r.getMessage()]
    assert len(warned) == 1 and warned[0].levelno == logging.WARNING
    assert not (tmp_path / "b").exists()
    assert os.listdir(src)  # the local cache is untouched
