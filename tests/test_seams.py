"""The registries behind the seams: one list of transport kinds, the classes registered
for each, the storage backends by scheme, the engine adapters by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from nccl_back.config import Settings
from nccl_back.engines.common import engine_adapter, engine_layout, register_engine
from nccl_back.errors import ConfigError
from nccl_back.model.storage import SCHEMES, LocalFiles, Storage, backend_class, parse_uri
from nccl_back.transport import all_transports, auto_kind, resolve_kind, transport_classes
from nccl_back.transport_kinds import TRANSPORT_KINDS


def test_transport_registry_covers_exactly_the_kinds() -> None:
    """Every name in nccl_back.transport_kinds has its classes registered by its module, no others."""
    found = all_transports()
    assert sorted(found) == sorted(TRANSPORT_KINDS)
    assert all(found[k].kind == k for k in found)
    with pytest.raises(ConfigError, match=r"transport 'tcp': choose one of \('gloo', 'nccl'\)"):
        transport_classes("tcp")


def test_resolve_kind_by_device_and_setting() -> None:
    """auto: nccl for CUDA, gloo otherwise; nccl on a CPU model is refused clearly."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert resolve_kind(Settings(), cpu) == "gloo"
    assert resolve_kind(Settings(), cuda) == "nccl"
    assert resolve_kind(Settings(transport="gloo"), cuda) == "gloo"
    with pytest.raises(ConfigError, match=r"transport=nccl needs the model on a CUDA device,"
                       r" it is on cpu; use transport=gloo or auto"):
        resolve_kind(Settings(transport="nccl"), cpu)


def test_auto_is_read_from_the_registry() -> None:
    """auto: of the kinds carrying a device's tensors, the most specialised; a device type
    no kind names goes to the most general one."""
    carriers = {d for c in all_transports().values() for d in c.devices}
    assert carriers == {"cpu", "cuda"}
    assert [auto_kind(d) for d in ("cpu", "cuda", "mps")] == ["gloo", "nccl", "gloo"]


def test_storage_schemes_map_to_backends(tmp_path: Path) -> None:
    """A URI's scheme picks its backend from one map; the messages list every form."""
    store = Storage()
    local = parse_uri(str(tmp_path))
    assert isinstance(store.backend(local), LocalFiles) and store.backend(local) is store.backend(local)
    assert set(SCHEMES) == {"file", "gs", "s3", "az"}
    assert all(backend_class(s).scheme == s for s in SCHEMES)
    assert [parse_uri(u).is_local for u in ("/x", "file:///x", "gs://bucket/x", "s3://bucket/x",
                                            "az://container/x")] == [True, True, False, False, False]
    with pytest.raises(ConfigError, match="use a local path, file:///path, gs://bucket/prefix,"
                       " s3://bucket/prefix or az://container/prefix"):
        parse_uri("abfs://container/x")


def test_engine_adapters_register_by_name() -> None:
    """An adapter registered under a name is found by it; an unknown engine is a clear error."""

    @register_engine("fake_engine")
    class Fake:
        name = "fake_engine"

    assert engine_adapter("fake_engine") is Fake
    with pytest.raises(ConfigError, match="engine 'no_such_engine': no adapter"):
        engine_adapter("no_such_engine")
    layout = engine_layout("fake_engine", "1.0", {"dtype": "bfloat16"})
    assert layout == {"engine": "fake_engine", "fake_engine_version": "1.0", "stage": "loaded",
                      "dtype": "bfloat16"}
