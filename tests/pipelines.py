"""A tiny diffusers pipeline (LDMPipeline: UNet2DModel + VQModel + DDIMScheduler) with
random weights, written by the tests, and the worker processes that load it."""

from __future__ import annotations

import os
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file

from nccl_back.load.service import WeightService
from nccl_back.model.identity import ModelSpec
from nccl_back.model.pipeline import assemble, pipeline_skeletons
from nccl_back.model.skeleton import named_tensors

from workers import settings_for  # type: ignore[import-not-found]

#: Which components each rank of a 2-rank pipeline group holds.
RANK_COMPONENTS = {0: ("vqvae",), 1: ("unet",)}


def write_ldm(directory: str | Path, seed: int = 0) -> Path:
    """Save a tiny LDMPipeline (8x8 samples) with seeded random weights."""
    from diffusers import DDIMScheduler, LDMPipeline, UNet2DModel, VQModel

    torch.manual_seed(seed)
    unet = UNet2DModel(
        sample_size=8, in_channels=3, out_channels=3, block_out_channels=(8, 16),
        layers_per_block=1, norm_num_groups=4,
        down_block_types=("DownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "UpBlock2D"),
    )
    vqvae = VQModel(
        in_channels=3, out_channels=3, latent_channels=3, block_out_channels=(8,),
        layers_per_block=1, norm_num_groups=4, num_vq_embeddings=16,
        down_block_types=("DownEncoderBlock2D",), up_block_types=("UpDecoderBlock2D",),
    )
    LDMPipeline(vqvae=vqvae, unet=unet, scheduler=DDIMScheduler()).save_pretrained(str(directory))
    return Path(directory)


def generate(pipe: Any) -> np.ndarray:
    """Two denoising steps with a fixed generator: deterministic on one machine."""
    out = pipe(batch_size=1, num_inference_steps=2, generator=torch.Generator().manual_seed(0),
               output_type="np")
    return np.asarray(out.images)


def files_match(model: Any, pipe_dir: str) -> bool:
    """Every tensor of a skeleton map bit-identical to its component's weight file."""
    tensors, _ = named_tensors(model)
    expected: dict[str, torch.Tensor] = {}
    for component in model:
        for f in sorted(os.listdir(os.path.join(pipe_dir, component))):
            if f.endswith(".safetensors"):
                loaded = load_file(os.path.join(pipe_dir, component, f))
                expected.update({f"{component}.{k}": v for k, v in loaded.items()})
    return tensors.keys() == expected.keys() and all(torch.equal(expected[n], t) for n, t in tensors.items())


def pipeline_worker(
    role: str, pipe_dir: str, settings_kwargs: dict[str, Any], out: Any, stop: Any,
    serve_for: float = 60.0,
) -> None:
    """One worker: skeleton map of every component, load (peer first), generate, serve."""
    try:
        settings = settings_for(**settings_kwargs)
        spec = ModelSpec.from_dir(pipe_dir, settings=settings)
        model = pipeline_skeletons(spec)
        with WeightService(settings, worker_id=f"{role}-{os.getpid()}") as svc:
            result = svc.load(model, spec)
            image = generate(assemble(spec, model))
            out.send({"role": role, "source": result.source, "verified": result.verified,
                      "fallback_reason": result.fallback_reason, "image": image,
                      "identical": files_match(model, pipe_dir), "version": spec.version})
            deadline = time.monotonic() + serve_for
            while time.monotonic() < deadline and not stop.is_set():
                time.sleep(0.05)
    except BaseException as e:  # report, don't hang the parent
        out.send({"role": role, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})


def pipeline_rank_worker(
    rank: int, port: int, pipe_dir: str, settings_kwargs: dict[str, Any], out: Any, stop: Any,
) -> None:
    """One rank of a 2-rank pipeline worker (own gloo group): loads only its components."""
    from datetime import timedelta

    import torch.distributed as dist

    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=2, timeout=timedelta(seconds=60))
        settings = settings_for(**settings_kwargs)
        spec = ModelSpec.from_dir(pipe_dir, settings=settings)
        model = pipeline_skeletons(spec, RANK_COMPONENTS[rank])
        with WeightService(settings, worker_id=f"p{port}-{rank}") as svc:
            result = svc.load(model, spec, group=dist.group.WORLD)
            out.send({"rank": rank, "source": result.source, "verified": result.verified,
                      "identical": files_match(model, pipe_dir), "components": sorted(model),
                      "fallback_reason": result.fallback_reason})
            while not stop.is_set():
                time.sleep(0.05)
        dist.destroy_process_group()
    except BaseException as e:
        out.send({"rank": rank, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})
