"""Worker processes for the multi-process tests (run via multiprocessing 'spawn').

Each function is a real worker: it builds a skeleton, opens a WeightService against a
real Redis, loads, and reports what happened through a queue. Nothing is mocked.
"""

from __future__ import annotations

import os
import signal
import time
import traceback
from typing import Any

import torch
from safetensors.torch import load_file

from nccl_back.config import Settings
from nccl_back.identity import ModelSpec
from nccl_back.service import WeightService
from nccl_back.skeleton import build, named_tensors

from models import TinyTransformer  # type: ignore[import-not-found]


def settings_for(redis_url: str, namespace: str, cache_dir: str, **overrides: Any) -> Settings:
    """Loopback-only settings for a test worker."""
    base: dict[str, Any] = {
        "redis_url": redis_url,
        "namespace": namespace,
        "advertise_host": "127.0.0.1",
        "bind_host": "127.0.0.1",
        "cache_dir": cache_dir,
        "peer_ttl": 3.0,
        "transfer_timeout": 20.0,
        "receiver_handshake_timeout": 5.0,
    }
    base.update(overrides)
    return Settings(**base)


def matches_checkpoint(model: Any, ckpt: str) -> bool:
    """Every tensor bit-identical to the checkpoint's files."""
    files = sorted(p for p in os.listdir(ckpt) if p.endswith(".safetensors"))
    expected: dict[str, torch.Tensor] = {}
    for f in files:
        expected.update(load_file(os.path.join(ckpt, f)))
    tensors, aliases = named_tensors(model)
    for name, t in tensors.items():
        if name not in expected or not torch.equal(expected[name], t.cpu()):
            return False
    return len(tensors) == len(expected)


def make_model(model_kwargs: dict[str, Any] | None) -> Any:
    kwargs = dict(model_kwargs or {})
    return build(lambda: TinyTransformer(**kwargs))


def worker_main(
    role: str,
    ckpt: str,
    settings_kwargs: dict[str, Any],
    out: Any,
    stop: Any,
    *,
    model_kwargs: dict[str, Any] | None = None,
    serve_for: float = 60.0,
    corrupt: bool = False,
) -> None:
    """Load (peer first), report, then keep serving until ``stop`` is set or time runs out."""
    try:
        settings = settings_for(**settings_kwargs)
        model = make_model(model_kwargs)
        spec = ModelSpec.from_dir(ckpt, cache_dir=settings.cache_dir)
        with WeightService(settings, worker_id=f"{role}-{os.getpid()}",
                           corrupt_sends_for_test=corrupt) as svc:
            result = svc.load(model, spec)
            out.put({
                "role": role, "pid": os.getpid(), "source": result.source,
                "peer_id": result.peer_id, "fallback_reason": result.fallback_reason,
                "verified": result.verified, "identical": matches_checkpoint(model, ckpt),
                "seconds": result.seconds, "bytes": result.bytes,
                "worker_id": svc.worker_id, "timings": result.timings,
            })
            deadline = time.monotonic() + serve_for
            while time.monotonic() < deadline and not stop.is_set():
                time.sleep(0.05)
    except BaseException as e:  # report, don't hang the parent
        out.put({"role": role, "pid": os.getpid(), "error": f"{type(e).__name__}: {e}",
                 "traceback": traceback.format_exc()})


def suicide_after(seconds: float) -> None:
    """SIGKILL this process after ``seconds`` (a crash at an arbitrary point)."""
    import threading

    def _kill() -> None:
        time.sleep(seconds)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=_kill, daemon=True).start()
