"""The nccl-back CLI: fingerprint and load, and one-line errors for bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from nccl_back import log
from nccl_back.cli import main
from nccl_back.model.identity import ModelSpec
from nccl_back.model.skeleton import manifest

from models import TinyTransformer, fill_random, write_checkpoint

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def _reset_logging() -> Iterator[None]:
    """main() configures logging for the process; undo it so other tests see the default."""
    yield
    log.reset()


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    return write_checkpoint(fill_random(TinyTransformer(), 0), tmp_path / "ckpt", n_shards=2)


def test_fingerprint_text(ckpt: Path, cache_dir: str, capsys: pytest.CaptureFixture[str]) -> None:
    """fingerprint prints the version, then each shard's CRC32C, size and URI."""
    assert main(["fingerprint", str(ckpt), "--cache-dir", cache_dir]) == 0
    spec = ModelSpec.from_dir(str(ckpt), cache_dir=cache_dir)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"version {spec.version}"
    assert [line.split() for line in lines[1:]] == [[s.crc32c, str(s.size), s.uri] for s in spec.shards]


def test_fingerprint_json(ckpt: Path, cache_dir: str, capsys: pytest.CaptureFixture[str]) -> None:
    """fingerprint --json prints the version and shards as JSON."""
    assert main(["fingerprint", str(ckpt), "--json", "--cache-dir", cache_dir]) == 0
    out = json.loads(capsys.readouterr().out)
    spec = ModelSpec.from_dir(str(ckpt), cache_dir=cache_dir)
    assert out == {
        "version": spec.version,
        "shards": [{"uri": s.uri, "crc32c": s.crc32c, "size": s.size} for s in spec.shards],
    }


def test_load_json(ckpt: Path, cache_dir: str, capsys: pytest.CaptureFixture[str]) -> None:
    """load --json loads every byte into a flat skeleton and reports it; no bar when stderr is piped."""
    assert main(["load", str(ckpt), "--json", "--cache-dir", cache_dir]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    spec = ModelSpec.from_dir(str(ckpt), cache_dir=cache_dir)
    assert out["version"] == spec.version
    assert out["bytes"] == manifest(TinyTransformer()).nbytes
    assert "load:" not in captured.err  # stderr is no terminal here: no progress bar


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["fingerprint", "/no/such/dir"], "checkpoint '/no/such/dir' not found; give the directory"),
        (["fingerprint", "gs://Bad_Bucket/x"], "bad bucket name 'Bad_Bucket'; use gs://bucket/prefix"),
        (["fingerprint", "s3://b/x"], "bad bucket name 'b' (3-63 lowercase letters"),
        (["fingerprint", "az://b/x"], "bad container name 'b' (3-63 lowercase letters"),
        (["fingerprint", "abfs://c/x"], "unsupported scheme; use a local path"),
        (["fingerprint", "--bogus", "x"], "unrecognized arguments: --bogus"),
        (["load", "/no/such/dir", "--device", "nonsense"], "--device 'nonsense': not a torch device"),
        (["--log-level", "LOUD", "fingerprint", "x"], "log level 'LOUD'"),
    ],
)
def test_bad_input_is_one_line(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Bad input exits non-zero with one stderr line naming the bad value and the fix."""
    assert _exit_status(argv) != 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and "Traceback" not in err


def _exit_status(argv: list[str]) -> int:
    """main()'s status, whether it returns it or argparse exits with it."""
    try:
        return main(argv)
    except SystemExit as e:
        return int(e.code or 0)


@pytest.mark.timeout(60)
def test_console_script_reports_without_traceback(tmp_path: Path) -> None:
    """The installed console script exits 1 with one stderr line for a missing checkpoint."""
    exe = Path(sys.executable).parent / "nccl-back"
    proc = subprocess.run(
        [str(exe), "fingerprint", str(tmp_path / "missing")],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 1
    assert proc.stderr.count("\n") == 1 and "missing' not found" in proc.stderr


def _header_of(entries: bytes, data: bytes) -> bytes:
    import struct

    return struct.pack("<Q", len(entries)) + entries + data


_E = b'"dtype":"F32","shape":[1],"data_offsets":[0,4]'


@pytest.mark.parametrize(
    ("blob", "reason"),
    [
        (_header_of(b"{" * 40, bytes(4)), "malformed safetensors header"),
        (_header_of(b'{"a":{' + _E + b'},"b":{' + _E + b"}}", bytes(4)), "overlap"),
        (_header_of(b'{"\\ud800":{' + _E + b"}}", bytes(4)), "lone surrogate"),
        (_header_of(b'{"a":{"dtype":"F32","shape":[-0],"data_offsets":[0,0]}}', b""),
         "non-negative integers"),
        (_header_of(b'{"__metadata__":[],"a":{' + _E + b"}}", bytes(4)), "__metadata__ must map"),
        ((100_000_001).to_bytes(8, "little") + b"{}", "over the safetensors limit"),
        (_header_of(b'{"a":{' + _E + b"}}", bytes(8)), "cover 4 bytes of a 8-byte data section"),
    ],
    ids=["garbage", "overlap", "surrogate", "minus-zero", "metadata-list", "too-long", "trailing"],
)
def test_fingerprint_refuses_a_malformed_header(
    tmp_path: Path, cache_dir: str, capsys: pytest.CaptureFixture[str], blob: bytes, reason: str
) -> None:
    """fingerprint reads every shard's header: a malformed one gets no version, exit 1 and
    one line naming the file and the rule it broke."""
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(blob)
    assert main(["fingerprint", str(tmp_path), "--cache-dir", cache_dir]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert len(err.splitlines()) == 1 and "model.safetensors" in err and reason in err, err
