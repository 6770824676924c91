"""The vLLM adapter's pieces that need vLLM but no running engine: registration,
settings from model_loader_extra_config, identity, the loaded-state holder."""

from __future__ import annotations

from importlib.metadata import entry_points
from typing import Any

import pytest
import torch
from torch import nn
from vllm.config.load import LoadConfig
from vllm.model_executor.model_loader import get_model_loader

from nccl_back.config import Settings
from nccl_back.engines import vllm as adapter
from nccl_back.errors import ConfigError
from nccl_back.model.identity import ModelSpec
from nccl_back.model.skeleton import named_tensors
from nccl_back.model.storage import Shard

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(120)]


def _loader(extra: Any) -> Any:
    adapter.register()
    return get_model_loader(LoadConfig(load_format="nccl_back", model_loader_extra_config=extra))


def test_entry_point_registers_the_load_format() -> None:
    """The installed package declares the vllm.general_plugins entry point that registers `nccl_back`."""
    eps = [e for e in entry_points(group="vllm.general_plugins") if e.name == "nccl_back"]
    assert [e.value for e in eps] == ["nccl_back.engines.vllm:register"]
    eps[0].load()()
    eps[0].load()()  # vLLM calls plugins in every process, maybe more than once
    assert isinstance(_loader({}), adapter.NcclBackModelLoader)


def test_extra_config_overrides_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """model_loader_extra_config values are parsed like NCCL_BACK_* and win over them."""
    monkeypatch.setenv("NCCL_BACK_MAX_CONCURRENT_SENDS", "3")
    monkeypatch.setenv("NCCL_BACK_NAMESPACE", "fromenv")
    s = _loader({"max_concurrent_sends": "2", "strict": True, "transfer_timeout": 5}).settings
    assert (s.max_concurrent_sends, s.strict, s.transfer_timeout, s.namespace) == (2, True, 5.0, "fromenv")


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"bogus": 1}, r"unknown key\(s\) \['bogus'\] for load format 'nccl_back'; valid keys: advertise_host"),
        ({"max_concurrent_sends": 0}, r"model_loader_extra_config: max_concurrent_sends=0: must be a positive integer"),
        ({"transfer_timeout": "soon"}, r"model_loader_extra_config: NCCL_BACK_TRANSFER_TIMEOUT='soon'"),
        ({"verify": "maybe"}, r"verify='maybe': choose sampled, full or none"),
        ({"strict": [1]}, r"model_loader_extra_config\['strict'\]=\[1\]: expected a string, number or boolean"),
        ({"redis_url": "http://x"}, r"redis_url='http://x': scheme must be"),
        ({"busy_wait": 5}, r"model_loader_extra_config\['busy_wait'\]: setting retired; derived: half of"),
    ],
)
def test_bad_extra_config_is_one_clear_error(extra: dict[str, Any], match: str) -> None:
    """An unknown key or a bad value raises one ConfigError when vLLM builds the loader."""
    with pytest.raises(ConfigError, match=match):
        _loader(extra)


def test_engine_layout_changes_the_version() -> None:
    """Same checkpoint and layout: same version; another dtype or TP rank: another version."""
    checkpoint = ModelSpec({"model_type": "llama"}, (Shard("/m/model.safetensors", "0badcafe", 10),))
    layout = {"engine": "vllm", "dtype": "bfloat16", "tp_size": 2, "tp_rank": 0}
    v = adapter.engine_spec(checkpoint, layout).version
    assert adapter.engine_spec(checkpoint, dict(layout)).version == v
    assert adapter.engine_spec(checkpoint, {**layout, "dtype": "float16"}).version != v
    assert adapter.engine_spec(checkpoint, {**layout, "tp_rank": 1}).version != v
    assert v != checkpoint.version


def test_loaded_state_shares_the_models_tensors() -> None:
    """The holder has the model's names and storage (tied ones stay tied), so writes land in the model."""
    model = nn.Sequential(nn.Embedding(4, 3), nn.Linear(3, 4, bias=False))
    model[1].weight = model[0].weight  # tied, as tie_word_embeddings
    model.register_buffer("scale", torch.ones(2))
    state = adapter.loaded_state(model)
    tensors, aliases = named_tensors(state)
    assert list(tensors) == ["0.weight", "scale"] and aliases == {"1.weight": "0.weight"}
    tensors["0.weight"].fill_(7.0)
    assert torch.equal(model[1].weight.data, torch.full((4, 3), 7.0))
    # What vLLM's post-processing does to the model afterwards does not change the holder.
    model[0].weight = nn.Parameter(torch.empty(0), requires_grad=False)
    assert named_tensors(state)[0]["0.weight"].shape == (4, 3)


def test_settings_defaults_without_extra_config() -> None:
    """No extra config: exactly Settings.from_env()."""
    assert adapter.settings_from(None) == Settings.from_env()
