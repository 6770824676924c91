"""A worker that loads while Redis is unreachable serves the fleet once Redis is back.

Real redis-server (killed and restarted empty on its port), real WeightServices, gloo.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from nccl_back.coord.registry import Registry
from nccl_back.dev.servers import LocalRedis
from nccl_back.load.service import WeightService
from nccl_back.model.identity import ModelSpec
from nccl_back.model.scheme import SCHEME
from nccl_back.model.skeleton import build, named_tensors

from models import TinyTransformer, fill_random, write_checkpoint
from workers import settings_for

pytestmark = pytest.mark.timeout(120)


def _bytes(model: torch.nn.Module) -> dict[str, bytes]:
    tensors, _ = named_tensors(model)
    return {n: t.contiguous().view(torch.uint8).numpy().tobytes() for n, t in tensors.items()}


@pytest.mark.parametrize("outage", ["redis_down_at_load", "redis_restarted_empty_after"])
def test_worker_loaded_without_redis_publishes_once_it_answers(
    tmp_path: Path, cache_dir: str, outage: str
) -> None:
    """Loaded from storage while Redis was down (nothing could be published), or holding
    the version when Redis restarted empty: within a few heartbeats of Redis answering
    the worker is findable with its ground truth, and a new worker loads from it."""
    ckpt = write_checkpoint(fill_random(TinyTransformer(), seed=7), tmp_path / "ckpt")
    spec = ModelSpec.from_dir(str(ckpt), cache_dir=cache_dir)
    redis = LocalRedis().start()
    try:
        settings = settings_for(redis.url, "outage", cache_dir, redis_timeout=0.5,
                                secret="outage-test-secret-0123456789")
        if outage == "redis_down_at_load":
            redis.kill()
        with WeightService(settings) as holder:
            first = holder.load(build(TinyTransformer), spec)
            assert first.source == "storage"
            if outage == "redis_down_at_load":
                assert (first.fallback_reason or "").startswith("registry_error:"), first
            redis.restart()
            registry = Registry(settings)
            try:
                deadline = time.monotonic() + 60
                while not (registry.find_peers(spec.version, 0, 1) and registry.get_ground_truth(
                        spec.version, 0, 1, holder.peers[0].manifest_digest, SCHEME)):
                    assert time.monotonic() < deadline, "the holder never came back to Redis"
                    time.sleep(0.1)
            finally:
                registry.close()
            with WeightService(settings) as receiver:
                model = build(TinyTransformer)
                second = receiver.load(model, spec)
            assert second.source == "peer", second.fallback_reason
            assert second.peer_id == holder.peers[0].peer_id
            expected = build(TinyTransformer)
            with WeightService(settings.replace(redis_url="redis://127.0.0.1:9/0")) as offline:
                offline.load(expected, spec)  # storage, as the reference bytes
            assert _bytes(model) == _bytes(expected)
    finally:
        redis.stop()
