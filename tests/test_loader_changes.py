"""A local shard that changes while it is loaded: the bytes copied are the bytes checked.

Every change (truncation, growth, a byte rewritten in place, the file replaced) made
between the loader's header read and its copy is an error naming the shard; a change
racing the copy itself never kills the process (an mmap would: SIGBUS) and never
yields bytes other than the fingerprinted ones without an error.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from nccl_back.config import Settings
from nccl_back.errors import CheckpointFormatError, ChecksumMismatchError
from nccl_back.model.checkpoint import flat_skeleton
from nccl_back.model.identity import ModelSpec
from nccl_back.model.loader import load_from_storage
from nccl_back.model.skeleton import named_tensors
from nccl_back.model.storage import Storage

pytestmark = pytest.mark.timeout(120)

SHARD = "model.safetensors"


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "a": torch.randn(64, 64, generator=g),
        "b": torch.arange(1000, dtype=torch.int64) * seed,
        "c": torch.zeros(0),
        "d": torch.randn(3, generator=g).to(torch.bfloat16),
        "e": torch.randn(2, 2, generator=g),
    }


def _raw(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _checkpoint(directory: Path, seed: int = 1) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    save_file(_tensors(seed), str(directory / SHARD))
    (directory / "config.json").write_text(json.dumps({"seed": seed}))
    return directory


class _ChangingStorage(Storage):
    """Real storage that changes the shard on disk right after the loader read its
    header: the window between the header (and identity) checks and the copy."""

    def __init__(self, change: Callable[[Path], None], shard: Path, base: Settings) -> None:
        super().__init__(base)
        self.change, self.shard, self.changed = change, shard, False

    def read_range(self, uri: str, start: int, end: int) -> bytes:
        data = super().read_range(uri, start, end)
        if not self.changed:
            self.changed = True
            self.change(self.shard)
        return data


def _truncate(length: int) -> Callable[[Path], None]:
    return lambda p: os.truncate(p, length)


def _flip(offset: int) -> Callable[[Path], None]:
    def change(p: Path) -> None:
        with open(p, "r+b") as f:  # in place, same inode: what `cp` / `rsync --inplace` do
            f.seek(offset)
            byte = f.read(1)
            f.seek(offset)
            f.write(bytes([byte[0] ^ 0xFF]))
    return change


def _append(p: Path) -> None:
    with open(p, "ab") as f:
        f.write(b"\0")


def _replace_with_other_weights(p: Path) -> None:
    # Same names, shapes, dtypes and size; other values; a new inode (an atomic `mv`).
    other = p.with_suffix(".new")
    save_file(_tensors(2), str(other))
    assert other.stat().st_size == p.stat().st_size
    os.replace(other, p)


@settings(max_examples=40, deadline=None)
@given(kind=st.sampled_from(["truncate", "flip", "append", "replace"]), where=st.floats(0, 1))
def test_a_shard_changed_after_its_header_was_read_is_an_error_naming_it(
    kind: str, where: float
) -> None:
    """Truncated to any length, grown, any byte flipped in place, or replaced by other
    weights of the same size after the header read: a typed error naming the shard, and
    no tensor of it is reported filled."""
    with tempfile.TemporaryDirectory() as tmp:
        base = Settings(cache_dir=os.path.join(tmp, "cache"), storage_workers=1)
        ckpt = _checkpoint(Path(tmp) / "ckpt")
        shard = ckpt / SHARD
        size = shard.stat().st_size
        spec = ModelSpec.from_dir(str(ckpt), settings=base)
        skeleton = flat_skeleton(spec, settings=base)
        position = min(size - 1, int(where * size))
        change = {"truncate": _truncate(position), "flip": _flip(position), "append": _append,
                  "replace": _replace_with_other_weights}[kind]
        filled: list[str] = []
        with pytest.raises((CheckpointFormatError, ChecksumMismatchError), match=str(shard)):
            load_from_storage(skeleton, spec, storage=_ChangingStorage(change, shard, base),
                              on_filled=filled.append)
        assert filled == []


def test_the_same_bytes_in_a_new_file_load() -> None:
    """The shard replaced by an identical copy after the header read loads exactly: what
    is checked is content, not the file's identity."""
    with tempfile.TemporaryDirectory() as tmp:
        base = Settings(cache_dir=os.path.join(tmp, "cache"))
        ckpt = _checkpoint(Path(tmp) / "ckpt")
        shard = ckpt / SHARD
        spec = ModelSpec.from_dir(str(ckpt), settings=base)
        skeleton = flat_skeleton(spec, settings=base)

        def copy(p: Path) -> None:
            other = p.with_suffix(".copy")
            other.write_bytes(p.read_bytes())
            os.replace(other, p)

        load_from_storage(skeleton, spec, storage=_ChangingStorage(copy, shard, base))
        got, _ = named_tensors(skeleton)
        assert {n: _raw(t) for n, t in got.items()} == {n: _raw(t) for n, t in _tensors(1).items()}


# The race runs in a child process: a SIGBUS (a copy out of an mmap of a file truncated
# meanwhile) shows as its exit status, not as a dead test runner.
_RACE = r"""
import os, sys, threading, time
import torch
from safetensors.torch import save_file
from nccl_back.model.checkpoint import flat_skeleton
from nccl_back.config import Settings
from nccl_back.errors import CheckpointFormatError, ChecksumMismatchError
from nccl_back.model.identity import ModelSpec
from nccl_back.model.loader import load_from_storage
from nccl_back.model.skeleton import named_tensors

root, mode = sys.argv[1], sys.argv[2]
g = torch.Generator().manual_seed(0)
tensors = {f"t{i}": torch.randn(1 << 20, generator=g) for i in range(8)}   # 32 MiB
path = os.path.join(root, "model.safetensors")
save_file(tensors, path)
open(os.path.join(root, "config.json"), "w").write("{}")
past = time.time() - 60
os.utime(path, (past, past))   # cacheable: the warm path (identity from the cache)
good = open(path, "rb").read()
header = 8 + int.from_bytes(good[:8], "little")
other = good[:header] + bytes(b ^ 0x5A for b in good[header:])
settings = Settings(cache_dir=os.path.join(root, "cache"))
spec = ModelSpec.from_dir(root, settings=settings)
ModelSpec.from_dir(root, settings=settings)
skeleton = flat_skeleton(spec, settings=settings)
want = {n: t.view(torch.uint8).numpy().tobytes() for n, t in tensors.items()}
stop = threading.Event()

def churn():
    fd = os.open(path, os.O_RDWR)
    i = 0
    while not stop.is_set():
        i += 1
        if mode == "truncate":
            os.ftruncate(fd, header + (i * 7919) % (len(good) - header))
        else:
            os.pwrite(fd, other[header:], header)
        time.sleep(0.002)
        os.pwrite(fd, good, 0)   # restored in place, same inode
        os.utime(path, (past, past))   # and the stat key the cache knows, as far as it can
        time.sleep(0.002)
    os.close(fd)

t = threading.Thread(target=churn, daemon=True)
t.start()
ok = refused = 0
deadline = time.monotonic() + 8
while time.monotonic() < deadline or ok + refused < 10:
    try:
        load_from_storage(skeleton, spec, settings=settings)
    except (CheckpointFormatError, ChecksumMismatchError) as e:
        assert path in str(e), str(e)
        refused += 1
        continue
    got, _ = named_tensors(skeleton)
    if {n: x.view(torch.uint8).numpy().tobytes() for n, x in got.items()} != want:
        print("MIXED", flush=True)
        sys.exit(3)
    ok += 1
stop.set()
t.join()
print(f"ok={ok} refused={refused}", flush=True)
"""


@pytest.mark.parametrize("mode", ["truncate", "rewrite"])
def test_a_shard_changing_during_the_copy_never_kills_or_mixes(tmp_path: Path, mode: str) -> None:
    """A shard truncated and restored, or rewritten in place, over and over while loads
    run: each load gives the fingerprinted bytes or a typed error naming the shard; the
    process never dies of SIGBUS and never gets other bytes without an error."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", _RACE, str(tmp_path), mode], env=env,
                          capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, (done.returncode, done.stdout, done.stderr[-2000:])
    assert done.stdout.startswith("ok="), done.stdout
