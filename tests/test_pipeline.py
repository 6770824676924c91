"""Diffusers pipeline folders as one model: identity, skeletons, storage and peer loads.

Real diffusers (a tiny LDMPipeline with random weights), real Redis, real worker
processes and real gloo groups.
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import shutil
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from groups import CTX  # forked from a server with torch and diffusers imported (tests/groups.py)
from torch import nn

from nccl_back import log
from nccl_back.cli import main
from nccl_back.config import Settings
from nccl_back.dev.gcs_emulator import LocalGCS
from nccl_back.dev.servers import free_port
from nccl_back.errors import (
    CheckpointFormatError,
    ConfigError,
    ShardNotFoundError,
    SkeletonError,
    WeightLoadError,
)
from nccl_back.model.identity import ModelSpec
from nccl_back.model.loader import load_from_storage
from nccl_back.model.pipeline import assemble, component_skeleton, pipeline_skeletons
from nccl_back.model.skeleton import named_tensors

import pipelines
from test_server import Serve

pytest.importorskip("diffusers")


@pytest.fixture(scope="module")
def pipe_src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny pipeline, written once per module (tests copy it before changing it)."""
    return pipelines.write_ldm(tmp_path_factory.mktemp("ldm") / "pipe")


@pytest.fixture
def pipe_dir(pipe_src: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(pipe_src, tmp_path / "pipe"))


@pytest.fixture
def settings(cache_dir: str) -> Settings:
    return Settings(cache_dir=cache_dir)


def _reference_image(pipe_dir: Path) -> np.ndarray:
    from diffusers import LDMPipeline

    return pipelines.generate(LDMPipeline.from_pretrained(str(pipe_dir)))


# -- identity ---------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_pipeline_spec_covers_every_component(pipe_dir: Path, settings: Settings) -> None:
    """One spec: model_index.json, every component's config (weightless ones too) and weight files."""
    spec = ModelSpec.from_dir(str(pipe_dir), settings=settings)
    assert spec.components == ("scheduler", "unet", "vqvae")
    assert spec.weighted_components == ("unet", "vqvae")
    assert [s.name for s in spec.shards] == [
        "unet/diffusion_pytorch_model.safetensors", "vqvae/diffusion_pytorch_model.safetensors"]
    assert spec.component_class("unet") == ("diffusers", "UNet2DModel")
    assert spec.component_config("scheduler", "scheduler_config.json")["_class_name"] == "DDIMScheduler"
    assert ModelSpec.from_json(json.dumps(spec.to_json())).version == spec.version


@pytest.mark.timeout(60)
def test_pipeline_version_is_content_identity(pipe_dir: Path, tmp_path: Path, settings: Settings) -> None:
    """A copy elsewhere keeps the version; one changed weight byte or scheduler setting changes it."""
    original = ModelSpec.from_dir(str(pipe_dir), settings=settings).version
    copy = Path(shutil.copytree(pipe_dir, tmp_path / "other" / "place"))
    assert ModelSpec.from_dir(str(copy), settings=settings).version == original
    weights = copy / "vqvae" / "diffusion_pytorch_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x01
    weights.write_bytes(bytes(data))
    changed = ModelSpec.from_dir(str(copy), settings=settings).version
    assert changed != original
    sched = pipe_dir / "scheduler" / "scheduler_config.json"
    sched.write_text(json.dumps({**json.loads(sched.read_text()), "num_train_timesteps": 999}))
    assert ModelSpec.from_dir(str(pipe_dir), settings=settings).version not in (original, changed)


@pytest.mark.timeout(60)
def test_missing_component_folder_is_named(pipe_dir: Path, settings: Settings) -> None:
    """A component listed in model_index.json without its folder raises ShardNotFoundError naming it."""
    shutil.rmtree(pipe_dir / "vqvae")
    with pytest.raises(ShardNotFoundError, match=r"pipeline component 'vqvae' \(listed in model_index.json\) has no folder"):
        ModelSpec.from_dir(str(pipe_dir), settings=settings)


@pytest.mark.timeout(60)
def test_component_with_only_bin_weights_is_refused(pipe_dir: Path, settings: Settings) -> None:
    """A component whose weights are not safetensors is an error, never a silently weightless component."""
    weights = pipe_dir / "unet" / "diffusion_pytorch_model.safetensors"
    weights.rename(pipe_dir / "unet" / "diffusion_pytorch_model.bin")
    with pytest.raises(CheckpointFormatError, match=r"component 'unet': only non-safetensors weights"):
        ModelSpec.from_dir(str(pipe_dir), settings=settings)


@pytest.mark.timeout(60)
def test_gs_pipeline_matches_local_copy(gcs: LocalGCS, pipe_dir: Path, settings: Settings) -> None:
    """A pipeline at a gs:// prefix has the version of its local copy, and loads the same weights."""
    import uuid

    bucket = gcs.client().create_bucket("p" + uuid.uuid4().hex[:12])
    for path in sorted(pipe_dir.rglob("*")):
        if path.is_file():
            bucket.blob(f"models/ldm/{path.relative_to(pipe_dir)}").upload_from_filename(str(path))
    remote = ModelSpec.from_dir(f"gs://{bucket.name}/models/ldm", settings=settings)
    local = ModelSpec.from_dir(str(pipe_dir), settings=settings)
    assert remote.version == local.version and remote.components == local.components
    model = pipeline_skeletons(remote, ["vqvae"])
    load_from_storage(model, remote, settings=settings)
    assert pipelines.files_match(model, str(pipe_dir))


@pytest.fixture
def reset_logging() -> Iterator[None]:
    """main() configures logging onto the captured stderr; undo it for later tests."""
    yield
    log.reset()


@pytest.mark.timeout(60)
@pytest.mark.usefixtures("reset_logging")
def test_fingerprint_shows_components(pipe_dir: Path, cache_dir: str, capsys: pytest.CaptureFixture[str]) -> None:
    """nccl-back fingerprint lists a pipeline's components, their classes and weight files."""
    assert main(["fingerprint", str(pipe_dir), "--cache-dir", cache_dir]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split() == ["component", "scheduler", "diffusers.DDIMScheduler", "config", "only"]
    assert lines[2].startswith("component unet  diffusers.UNet2DModel  1 weight file(s), ")
    assert main(["fingerprint", str(pipe_dir), "--json", "--cache-dir", cache_dir]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [(c["name"], c["files"]) for c in out["components"]] == [("scheduler", 0), ("unet", 1), ("vqvae", 1)]


# -- skeletons and storage loads --------------------------------------------------------


@pytest.mark.timeout(60)
def test_component_skeleton_reads_no_weights_one_allocation(pipe_dir: Path, settings: Settings) -> None:
    """A component skeleton is built from config.json alone (weights deleted) in one allocation."""
    spec = ModelSpec.from_dir(str(pipe_dir), settings=settings)
    (pipe_dir / "unet" / "diffusion_pytorch_model.safetensors").unlink()
    unet = component_skeleton(spec, "unet")
    tensors, _ = named_tensors(unet)
    assert len({t.untyped_storage().data_ptr() for t in tensors.values()}) == 1
    assert not any(t.device.type == "meta" for t in unet.state_dict().values())
    with pytest.raises(SkeletonError, match="'scheduler' has no weights to load"):
        component_skeleton(spec, "scheduler")


@pytest.mark.timeout(60)
def test_only_diffusers_and_transformers_classes_are_built(pipe_dir: Path, settings: Settings) -> None:
    """A model_index.json naming a class outside diffusers/transformers is refused, nothing imported."""
    index = json.loads((pipe_dir / "model_index.json").read_text())
    (pipe_dir / "model_index.json").write_text(json.dumps({**index, "unet": ["os", "system"]}))
    spec = ModelSpec.from_dir(str(pipe_dir), settings=settings)
    with pytest.raises(ConfigError, match=r"component 'unet': class os.system is not from diffusers or transformers"):
        component_skeleton(spec, "unet")


@pytest.mark.timeout(60)
def test_eager_loading_constructor_is_harmless(pipe_dir: Path, settings: Settings) -> None:
    """A constructor that loads weights eagerly allocates nothing for them; storage fills the skeleton."""
    from diffusers import VQModel

    spec = ModelSpec.from_dir(str(pipe_dir), settings=settings)
    config = spec.component_config("vqvae")

    def eager() -> nn.Module:
        model = VQModel.from_config(config)
        model.load_state_dict({k: torch.zeros_like(v, device="cpu") for k, v in model.state_dict().items()})
        return model

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the no-op copies into meta parameters stay quiet
        vq = component_skeleton(spec, "vqvae", factory=eager)
    load_from_storage({"vqvae": vq}, spec, settings=settings)
    assert pipelines.files_match({"vqvae": vq}, str(pipe_dir))


@pytest.mark.timeout(60)
def test_storage_load_generates_the_reference_image(
    pipe_dir: Path, settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    """Skeletons filled from the component files (tracked per component) generate exactly what from_pretrained does."""
    spec = ModelSpec.from_dir(str(pipe_dir), settings=settings)
    model = pipeline_skeletons(spec)
    with caplog.at_level(logging.INFO, logger="nccl_back"):
        result = load_from_storage(model, spec, settings=settings)
    assert result.bytes == sum(t.nbytes for t in named_tensors(model)[0].values())
    events = [r.nccl_back for r in caplog.records if hasattr(r, "nccl_back")]
    per_component = {e["component"]: e["bytes"] for e in events if e["event"] == "component_loaded"}
    assert per_component == {
        name: sum(t.nbytes for t in named_tensors(module)[0].values()) for name, module in model.items()
    }
    assert np.array_equal(pipelines.generate(assemble(spec, model)), _reference_image(pipe_dir))


@pytest.mark.timeout(60)
def test_transformers_component_from_its_config(tmp_path: Path, settings: Settings) -> None:
    """A transformers component (model.safetensors, config.json) gets a skeleton from its config and loads exactly."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.CLIPTextConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, max_position_embeddings=16,
                                      bos_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    reference = transformers.CLIPTextModel(cfg).eval()
    reference.save_pretrained(tmp_path / "pipe" / "text_encoder")
    (tmp_path / "pipe" / "model_index.json").write_text(json.dumps(
        {"_class_name": "Custom", "text_encoder": ["transformers", "CLIPTextModel"], "safety_checker": [None, None]}))
    spec = ModelSpec.from_dir(str(tmp_path / "pipe"), settings=settings)
    assert spec.components == ("text_encoder",)
    model = pipeline_skeletons(spec)
    load_from_storage(model, spec, settings=settings)
    ids = torch.tensor([[1, 2, 3]])
    assert torch.equal(model["text_encoder"](ids).last_hidden_state, reference(ids).last_hidden_state)


@pytest.mark.timeout(60)
def test_load_errors_name_component_and_tensor(pipe_dir: Path, settings: Settings) -> None:
    """An unknown component and a mismatched tensor are errors naming the component (and tensor)."""
    spec = ModelSpec.from_dir(str(pipe_dir), settings=settings)
    with pytest.raises(WeightLoadError, match=r"component\(s\) \['scheduler'\] have no weights"):
        load_from_storage({"scheduler": nn.Linear(1, 1)}, spec, settings=settings)
    vq = component_skeleton(spec, "vqvae", dtype=torch.float16)
    with pytest.raises(WeightLoadError, match=r"pipeline components \['vqvae'\].*vqvae.decoder.conv_in.bias: skeleton expects \[8\] float16"):
        load_from_storage({"vqvae": vq}, spec, settings=settings)


# -- peers: separate worker processes ---------------------------------------------------


class Workers:
    """Pipeline worker processes and their reports; leftovers are killed at the end."""

    def __init__(self, pipe_dir: Path, redis_url: str, namespace: str, cache_dir: str) -> None:
        self.pipe_dir = str(pipe_dir)
        self.settings = {"redis_url": redis_url, "namespace": namespace, "cache_dir": cache_dir,
                         "bucket_bytes": 65536}
        self.readers: list[Any] = []
        self.procs: list[Any] = []
        self.stop = CTX.Event()

    def _spawn(self, target: Any, *args: Any) -> None:
        reader, writer = CTX.Pipe(duplex=False)
        self.readers.append(reader)
        p = CTX.Process(target=target, args=(*args, writer, self.stop), daemon=True)
        p.start()
        self.procs.append(p)

    def worker(self, role: str) -> None:
        self._spawn(pipelines.pipeline_worker, role, self.pipe_dir, self.settings)

    def group(self) -> None:
        port = free_port()
        for rank in range(2):
            self._spawn(pipelines.pipeline_rank_worker, rank, port, self.pipe_dir, self.settings)

    def report(self, timeout: float = 90) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no worker reported in time")
            for conn in mp.connection.wait(self.readers, timeout=left):
                try:
                    r: dict[str, Any] = conn.recv()  # type: ignore[union-attr]
                except EOFError:
                    self.readers.remove(conn)
                    continue
                assert "error" not in r, r.get("traceback")
                return r

    def close(self) -> None:
        self.stop.set()
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.kill()


@pytest.fixture
def workers(pipe_dir: Path, redis_url: str, namespace: str, cache_dir: str) -> Iterator[Workers]:
    w = Workers(pipe_dir, redis_url, namespace, cache_dir)
    yield w
    w.close()


@pytest.mark.timeout(180)
def test_second_worker_receives_every_component_and_generates_the_same_image(
    workers: Workers, pipe_dir: Path
) -> None:
    """Worker B receives all components from A in one transfer and generates A's image, bit for bit."""
    workers.worker("a")
    a = workers.report()
    assert (a["source"], a["identical"]) == ("storage", True), a
    workers.worker("b")
    b = workers.report()
    assert (b["source"], b["identical"], b["verified"]) == ("peer", True, True), b
    assert np.array_equal(a["image"], b["image"])
    assert np.array_equal(b["image"], _reference_image(pipe_dir))


@pytest.mark.timeout(180)
def test_pipeline_ranks_from_storage_then_from_peers(workers: Workers) -> None:
    """Rank 0 holds the VAE, rank 1 the UNet: with no peer both load from storage; the next group, from peers."""
    workers.group()
    first = sorted((workers.report() for _ in range(2)), key=lambda r: r["rank"])
    assert [(r["components"], r["source"], r["identical"]) for r in first] == [
        (["vqvae"], "storage", True), (["unet"], "storage", True)], first
    workers.group()
    second = sorted((workers.report() for _ in range(2)), key=lambda r: r["rank"])
    assert [(r["components"], r["source"], r["identical"], r["verified"]) for r in second] == [
        (["vqvae"], "peer", True, True), (["unet"], "peer", True, True)], second


# -- the sidecar --------------------------------------------------------------------------


@pytest.fixture
def sidecar_env(redis_url: str, namespace: str, cache_dir: str) -> dict[str, str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("NCCL_BACK_")}
    return {**clean, "NCCL_BACK_REDIS_URL": redis_url, "NCCL_BACK_NAMESPACE": namespace,
            "NCCL_BACK_ADVERTISE_HOST": "127.0.0.1",
            "NCCL_BACK_CACHE_DIR": cache_dir, "NCCL_BACK_PEER_TTL": "3",
            "NCCL_BACK_TRANSFER_TIMEOUT": "20"}


@pytest.fixture
def serves() -> Iterator[list[Serve]]:
    started: list[Serve] = []
    yield started
    for s in started:
        s.kill()


@pytest.mark.timeout(180)
def test_sidecar_serves_a_pipeline_folder(
    pipe_dir: Path, sidecar_env: dict[str, str], serves: list[Serve]
) -> None:
    """serve detects a pipeline folder (flat skeleton from headers); a --diffusers sidecar receives it from a peer."""
    env = sidecar_env
    version = ModelSpec.from_dir(str(pipe_dir), cache_dir=env["NCCL_BACK_CACHE_DIR"]).version
    first = Serve(["--model", str(pipe_dir)], env, free_port())
    serves.append(first)
    ready = first.wait_ready()
    assert (ready["version"], ready["source"]) == (version, "storage")
    second = Serve(["--model", str(pipe_dir), "--diffusers"], env, free_port())
    serves.append(second)
    assert second.wait_ready()["source"] == "peer"
    assert first.stop() == 0
    assert second.stop() == 0
