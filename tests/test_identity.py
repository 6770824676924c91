"""Model identity: versions that follow the bytes, cheap restarts, index de-duplication."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import IO, Any

import google_crc32c
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nccl_back.errors import ConfigError, ShardNotFoundError
from nccl_back.model.checkpoint import INDEX_NAME
from nccl_back.model.crc import crc32c_combine
from nccl_back.model.crc_cache import CACHE_NAME, file_crc32c
from nccl_back.model.identity import ModelSpec, Shard
from nccl_back.model.storage import LocalFiles, Storage

from models import TinyTransformer, fill_random, write_checkpoint

pytestmark = pytest.mark.timeout(30)


class CountingOpener:
    """Opens files like the default opener and records which ones were opened."""

    def __init__(self) -> None:
        self.opened: list[str] = []

    def __call__(self, path: str) -> IO[bytes]:
        self.opened.append(path)
        return open(path, "rb", buffering=0)


def _backdate(directory: Path, seconds: float = 60.0) -> None:
    """Make files look written a while ago, as a checkpoint on disk usually is."""
    past = time.time() - seconds
    for f in directory.iterdir():
        os.utime(f, (past, past))


def _header_bytes(path: Path) -> bytes:
    data = path.read_bytes()
    return data[: 8 + int.from_bytes(data[:8], "little")]


def test_one_changed_tensor_changes_version(tmp_path: Path, cache_dir: str) -> None:
    """Same headers, one tensor's values changed, same paths: the version differs."""
    model = fill_random(TinyTransformer(), 0)
    ckpt = write_checkpoint(model, tmp_path / "ckpt", n_shards=2)
    shard = sorted(ckpt.glob("*.safetensors"))[0]
    header_before = _header_bytes(shard)
    before = ModelSpec.from_dir(str(ckpt), cache_dir=cache_dir)

    with torch.no_grad():
        model.model.layers[0].attn_norm.weight.zero_()
    write_checkpoint(model, ckpt, n_shards=2)
    after = ModelSpec.from_dir(str(ckpt), cache_dir=cache_dir)

    assert _header_bytes(shard) == header_before
    assert [s.uri for s in after.shards] == [s.uri for s in before.shards]
    assert after.version != before.version


def test_config_key_order_does_not_matter(tmp_path: Path, cache_dir: str) -> None:
    """Reordering or reformatting config.json keeps the version."""
    ckpt = write_checkpoint(fill_random(TinyTransformer(), 0), tmp_path / "ckpt")
    first = ModelSpec.from_dir(str(ckpt), cache_dir=cache_dir)
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps(dict(reversed(list(config.items())))))
    assert ModelSpec.from_dir(str(ckpt), cache_dir=cache_dir).version == first.version
    shards = (Shard("/a", "00000001", 1), Shard("/b", "00000002", 2))
    assert (
        ModelSpec({"x": 1, "y": [1, 2]}, shards).version
        == ModelSpec({"y": [1, 2], "x": 1}, shards[::-1]).version
    )


def test_version_is_md5_of_canonical_json() -> None:
    """The version is the MD5 of sorted-key, compact JSON of config and (name, size, CRC32C)."""
    spec = ModelSpec({"b": 1, "a": "x"}, (Shard("gs://b/m/1.safetensors", "0a0b0c0d", 9),))
    canonical = '{"config":{"a":"x","b":1},"shards":[["1.safetensors",9,"0a0b0c0d"]]}'
    assert spec.version == hashlib.md5(canonical.encode()).hexdigest()


def test_version_ignores_location(tmp_path: Path, cache_dir: str) -> None:
    """The same bytes in another directory share the version; one changed byte changes it."""
    ckpt = write_checkpoint(fill_random(TinyTransformer(), 0), tmp_path / "a" / "ckpt", n_shards=2)
    copy = tmp_path / "elsewhere" / "other-name"
    shutil.copytree(ckpt, copy)
    first = ModelSpec.from_dir(str(ckpt), cache_dir=cache_dir)
    moved = ModelSpec.from_dir(f"file://{copy}", cache_dir=cache_dir)
    assert [s.uri for s in moved.shards] != [s.uri for s in first.shards]
    assert moved.version == first.version
    shard = copy / "model-00002-of-00002.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x01
    shard.write_bytes(bytes(data))
    assert ModelSpec.from_dir(str(copy), cache_dir=cache_dir).version != first.version


def test_version_covers_names_and_sizes() -> None:
    """A renamed shard (same bytes) or another size (same CRC) gives another version."""
    base = ModelSpec({}, (Shard("/m/a.safetensors", "00000001", 5),))
    renamed = ModelSpec({}, (Shard("/m/b.safetensors", "00000001", 5),))
    resized = ModelSpec({}, (Shard("/m/a.safetensors", "00000001", 6),))
    relocated = ModelSpec({}, (Shard("gs://bkt/x/y/a.safetensors", "00000001", 5),))
    assert len({base.version, renamed.version, resized.version}) == 3
    assert relocated.version == base.version


def _counted(opener: CountingOpener) -> Storage:
    """Storage whose local files are opened for checksumming through ``opener``."""
    return Storage(backends={"file": LocalFiles(opener=opener)})


def test_warm_cache_reads_no_shard_bytes(tmp_path: Path, cache_dir: str) -> None:
    """After one fingerprint, a restart with the same cache opens no shard file."""
    ckpt = write_checkpoint(fill_random(TinyTransformer(), 0), tmp_path / "ckpt", n_shards=3)
    _backdate(ckpt)
    cold, warm = CountingOpener(), CountingOpener()
    first = ModelSpec.from_dir(str(ckpt), cache_dir=cache_dir, storage=_counted(cold))
    second = ModelSpec.from_dir(str(ckpt), cache_dir=cache_dir, storage=_counted(warm))
    assert len(cold.opened) == 3
    assert warm.opened == []
    assert second == first
    assert not [p for p in Path(cache_dir).iterdir() if p.name != CACHE_NAME]  # no tmp left


def test_changed_file_is_checksummed_again(tmp_path: Path, cache_dir: str) -> None:
    """A shard rewritten after it was cached is read again and changes the version."""
    model = fill_random(TinyTransformer(), 0)
    ckpt = write_checkpoint(model, tmp_path / "ckpt", n_shards=2)
    _backdate(ckpt)
    first = ModelSpec.from_dir(str(ckpt), cache_dir=cache_dir)
    write_checkpoint(fill_random(model, 1), ckpt, n_shards=2)
    _backdate(ckpt, seconds=30)
    opener = CountingOpener()
    second = ModelSpec.from_dir(str(ckpt), cache_dir=cache_dir, storage=_counted(opener))
    assert len(opener.opened) == 2
    assert second.version != first.version


def test_recently_modified_file_is_not_cached(tmp_path: Path, cache_dir: str) -> None:
    """A file modified within the timestamp-granularity window is checksummed every time."""
    path = tmp_path / "fresh.safetensors"
    path.write_bytes(b"x" * 100)
    opener = CountingOpener()
    assert file_crc32c(str(path), cache_dir=cache_dir, opener=opener) == file_crc32c(
        str(path), cache_dir=cache_dir, opener=opener
    )
    assert len(opener.opened) == 2


def test_damaged_cache_is_ignored(tmp_path: Path, cache_dir: str) -> None:
    """A corrupt cache file costs a recomputation, never an error or a wrong CRC."""
    path = tmp_path / "w.safetensors"
    path.write_bytes(b"weights")
    _backdate(tmp_path)
    Path(cache_dir).mkdir(parents=True)
    (Path(cache_dir) / CACHE_NAME).write_text("{not json")
    assert file_crc32c(str(path), cache_dir=cache_dir) == f"{google_crc32c.value(b'weights'):08x}"


def test_cache_entry_that_is_no_crc_is_recomputed(tmp_path: Path, cache_dir: str) -> None:
    """A cache entry whose key matches but whose value is no CRC32C is recomputed, never returned."""
    path = tmp_path / "w.safetensors"
    path.write_bytes(b"weights")
    _backdate(tmp_path)
    right = f"{google_crc32c.value(b'weights'):08x}"
    assert file_crc32c(str(path), cache_dir=cache_dir) == right
    cache = Path(cache_dir) / CACHE_NAME
    for bad in ("not-a-crc", "", 12345, "0A0B0C0D", "0a0b0c0d0"):
        entries = json.loads(cache.read_text())
        entries[str(path)]["crc32c"] = bad
        cache.write_text(json.dumps(entries))
        assert file_crc32c(str(path), cache_dir=cache_dir) == right


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=3000), st.binary(max_size=3000))
def test_crc32c_combine_is_the_crc_of_the_concatenation(a: bytes, b: bytes) -> None:
    """The CRC32C of two pieces combined equals the CRC32C of the pieces joined."""
    assert crc32c_combine(google_crc32c.value(a), google_crc32c.value(b), len(b)) == \
        google_crc32c.value(a + b)
    big = len(b) << 30  # a length far beyond memory costs only its bits
    assert 0 <= crc32c_combine(google_crc32c.value(a), 0, big) < 1 << 32


def test_index_deduplicates_shards(tmp_path: Path, cache_dir: str) -> None:
    """With an index, a safetensors file it does not list is ignored; without one, all count."""
    ckpt = write_checkpoint(fill_random(TinyTransformer(), 0), tmp_path / "ckpt", n_shards=2)
    (ckpt / "consolidated.safetensors").write_bytes((ckpt / "model-00001-of-00002.safetensors").read_bytes())
    names = [Path(s.uri).name for s in ModelSpec.from_dir(str(ckpt), cache_dir=cache_dir).shards]
    assert names == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    (ckpt / INDEX_NAME).unlink()
    assert len(ModelSpec.from_dir(str(ckpt), cache_dir=cache_dir).shards) == 3


def test_index_naming_a_missing_shard(tmp_path: Path, cache_dir: str) -> None:
    """An index that lists a shard file that does not exist raises ShardNotFoundError naming it."""
    ckpt = write_checkpoint(fill_random(TinyTransformer(), 0), tmp_path / "ckpt", n_shards=2)
    (ckpt / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ShardNotFoundError, match="model-00002-of-00002.safetensors"):
        ModelSpec.from_dir(str(ckpt), cache_dir=cache_dir)


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        ("no_dir", "ckpt' not found; give the directory"),
        ("no_config", "config.json' does not exist"),
        ("no_shards", "no \\*.safetensors shards"),
    ],
)
def test_incomplete_directories(tmp_path: Path, cache_dir: str, setup: str, message: str) -> None:
    """A missing directory, config.json or shard set raises ShardNotFoundError saying which."""
    ckpt = tmp_path / "ckpt"
    if setup != "no_dir":
        ckpt.mkdir()
        if setup == "no_shards":
            (ckpt / "config.json").write_text("{}")
        else:
            (ckpt / "model.safetensors").write_bytes(b"")
    with pytest.raises(ShardNotFoundError, match=message):
        ModelSpec.from_dir(str(ckpt), cache_dir=cache_dir)


def test_json_round_trip() -> None:
    """to_json/from_json (also through JSON text) give back an equal spec and version."""
    spec = ModelSpec({"d": 32}, (Shard("gs://b/m/2.safetensors", "00ff00ff", 7),
                                 Shard("/x", "12345678", 1, "sub/x.safetensors")))
    assert ModelSpec.from_json(spec.to_json()) == spec
    again = ModelSpec.from_json(json.dumps(spec.to_json()))
    assert again.version == spec.version and again.shards == spec.shards
    old_form = {"config": {"d": 32}, "shards": [["gs://b/m/2.safetensors", "00ff00ff", 7]]}
    assert ModelSpec.from_json(old_form).shards[0].name == "2.safetensors"


@pytest.mark.parametrize("bad", ['{"config": {}}', "[1, 2]", '{"config": {}, "shards": [["u", "c"]]}'])
def test_malformed_json_is_rejected(bad: Any) -> None:
    """Malformed spec JSON raises ConfigError."""
    with pytest.raises(ConfigError, match="malformed ModelSpec JSON"):
        ModelSpec.from_json(bad)


_FULL_DISK = r"""
import os, resource, signal, sys
from nccl_back.model.crc_cache import CrcCache
# Past the limit a write fails with EFBIG (SIGXFSZ ignored), as on a full disk: the
# temporary file exists by then.
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (64, 64))
cache = CrcCache(sys.argv[1])
for i in range(100):
    cache.put_key(f"/model/shard-{i}.safetensors", [i], "0badf00d")
cache.save()
cache.save()  # a second failed save must not leak a second file
print("dirty" if cache.dirty else "clean")
"""


def test_a_failed_cache_write_leaves_no_temporary_file(tmp_path: Path) -> None:
    """A CRC-cache save whose write fails after its temporary file was created (a file
    size limit: EFBIG, as a full disk gives ENOSPC) removes the file; the load goes on."""
    import subprocess
    import sys

    cache_dir = tmp_path / "cache"
    cache_dir.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", _FULL_DISK, str(cache_dir)], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "dirty"  # not saved, so it will be tried again
    assert sorted(p.name for p in cache_dir.iterdir()) == []


@pytest.mark.parametrize(("uri", "name", "expected"), [
    ("/models/llama-8b/model-00001-of-00002.safetensors", "", "llama-8b"),
    ("gs://bucket/models/llama-8b/model.safetensors", "", "llama-8b"),
    ("/pipes/ldm/unet/diffusion_pytorch_model.safetensors", "unet/diffusion_pytorch_model.safetensors",
     "ldm"),
    ("/elsewhere/weights.bin", "other.safetensors", "elsewhere"),
])
def test_name_is_the_models_folder_and_not_part_of_the_version(uri: str, name: str, expected: str) -> None:
    """A spec's name is its folder's last component (a pipeline's, not a component's);
    the same bytes under another folder keep their version."""
    spec = ModelSpec({}, (Shard(uri, "00000001", 1, name),))
    assert spec.name == expected
    moved = ModelSpec({}, (Shard(uri.replace(expected, "renamed", 1), "00000001", 1, name),))
    assert moved.name == "renamed" and moved.version == spec.version
