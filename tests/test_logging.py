"""Logging like a library: events go through stdlib ``logging`` under ``nccl_back``;
an embedding process that configures nothing sees nothing, one that configures
``logging`` gets our events with rank, version and peer; the CLI keeps JSON and text."""

from __future__ import annotations

import io
import json
import logging
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from nccl_back import log
from nccl_back.dev.servers import LocalRedis, free_port

from models import TinyTransformer, fill_random, write_checkpoint

pytestmark = pytest.mark.timeout(120)

APP = Path(__file__).resolve().parent / "embed_app.py"


@pytest.fixture(autouse=True)
def _reset() -> Iterator[None]:
    yield
    log.reset()


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    return write_checkpoint(fill_random(TinyTransformer(), 0), tmp_path / "ckpt", n_shards=2)


def _app(ckpt: Path, redis_url: str, namespace: str, cache_dir: str, result: Path,
         *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(APP), str(ckpt), redis_url, namespace, cache_dir, str(result), *extra],
        cwd=APP.parent, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def test_unconfigured_embedding_prints_nothing(ckpt: Path, tmp_path: Path, cache_dir: str) -> None:
    """With Redis down the load falls back with warnings, yet an unconfigured app prints nothing."""
    result = tmp_path / "result.json"
    dead = f"redis://127.0.0.1:{free_port()}/0"
    proc = _app(ckpt, dead, "tlog", cache_dir, result)
    out, err = proc.communicate(timeout=90)
    assert proc.returncode == 0, err
    assert json.loads(result.read_text())["source"] == "storage"
    assert json.loads(result.read_text())["fallback_reason"]
    assert (out, err) == ("", "")


def test_configured_embedding_gets_events_with_rank_version_peer(
    ckpt: Path, tmp_path: Path, cache_dir: str, redis_server: LocalRedis, namespace: str
) -> None:
    """An app that configures logging gets our events (peer load: rank, version, peer) via its handlers."""
    stop = tmp_path / "stop"
    sender = _app(ckpt, redis_server.url, namespace, cache_dir, tmp_path / "a.json",
                  "--serve-until", str(stop))
    try:
        deadline = time.monotonic() + 90
        while not (tmp_path / "a.json").exists():
            assert sender.poll() is None and time.monotonic() < deadline, sender.communicate()[1]
            time.sleep(0.05)
        fields = tmp_path / "fields.jsonl"
        receiver = _app(ckpt, redis_server.url, namespace, cache_dir, tmp_path / "b.json",
                        "--logging", str(fields))
        out, err = receiver.communicate(timeout=90)
    finally:
        stop.touch()
        sender_out, sender_err = sender.communicate(timeout=30)
    assert receiver.returncode == 0, err
    assert (sender_out, sender_err) == ("", ""), "the unconfigured sender printed"
    assert json.loads((tmp_path / "b.json").read_text())["source"] == "peer"
    assert out == ""
    loaded = [r for r in map(json.loads, fields.read_text().splitlines()) if r["event"] == "loaded"]
    assert len(loaded) == 1
    rec = loaded[0]
    assert rec["logger"] == "nccl_back.load.service" and rec["level"] == "INFO"
    assert rec["rank"] == 0 and rec["source"] == "peer" and rec["peer"].startswith("embed-")
    assert rec["version"] and rec["version"] in rec["message"]
    # basicConfig's handler printed the same event as one readable line on stderr.
    line = next(x for x in err.splitlines() if x.startswith("INFO nccl_back.load.service loaded "))
    assert f"peer='{rec['peer']}'" in line and "rank=0" in line


def test_events_propagate_to_the_nccl_back_logger(caplog: pytest.LogCaptureFixture) -> None:
    """A library event is one stdlib record under nccl_back.* carrying its fields as attributes."""
    with caplog.at_level(logging.INFO, logger="nccl_back"):
        log.get_logger("nccl_back.test", rank=3).warning("fallback_to_storage", version="abc", peer="p")
    (rec,) = caplog.records
    assert rec.name == "nccl_back.test" and rec.levelno == logging.WARNING
    assert rec.getMessage() == "fallback_to_storage rank=3 version='abc' peer='p'"
    assert (rec.rank, rec.version, rec.peer) == (3, "abc", "p")  # type: ignore[attr-defined]


def test_configure_json_and_console() -> None:
    """configure() prints JSON lines or readable text on its stream; the level filters."""
    out = io.StringIO()
    log.configure("INFO", json=True, stream=out)
    log.get_logger("nccl_back.test", rank=1).info("loaded", version="v", peer="p")
    log.get_logger("nccl_back.test").debug("hidden")
    (line,) = out.getvalue().splitlines()
    event = json.loads(line)
    assert (event["event"], event["rank"], event["version"], event["peer"], event["level"]) == (
        "loaded", 1, "v", "p", "info")
    out = io.StringIO()
    log.configure("WARNING", stream=out)
    log.get_logger("nccl_back.test").info("hidden")
    log.get_logger("nccl_back.test").warning("fallback_to_storage", reason="no_peer")
    text = out.getvalue()
    assert "hidden" not in text
    assert "fallback_to_storage" in text and "reason=no_peer" in text and "[warning" in text


def test_bad_level_is_a_config_error() -> None:
    """An unknown level names the choices."""
    from nccl_back.errors import ConfigError

    with pytest.raises(ConfigError, match="choose DEBUG, INFO, WARNING or ERROR"):
        log.configure("LOUD")


@pytest.mark.parametrize("method", ["debug", "info", "warning", "error", "exception"])
@pytest.mark.parametrize("bound", [False, True])
def test_a_record_names_the_line_that_logged_it(method: str, bound: bool,
                                                caplog: pytest.LogCaptureFixture) -> None:
    """Every event's record carries the file and line of the library call that logged it,
    never structlog's (an engine's log format prints them)."""
    logger = log.get_logger("nccl_back.test_callsite", rank=0)
    if bound:
        logger = logger.bind(peer="p")
    with caplog.at_level(logging.DEBUG, logger="nccl_back"):
        line = sys._getframe().f_lineno + 1
        getattr(logger, method)("callsite_event", k=1)
    [record] = [r for r in caplog.records if r.name == "nccl_back.test_callsite"]
    assert (record.pathname, record.lineno) == (__file__, line)
