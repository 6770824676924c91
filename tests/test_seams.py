"""The registries behind the seams: one list of transport kinds, the classes registered
for each, the storage backends by scheme, the engine adapters by name."""

from __future__ import annotations

import pytest
import torch

from nccl_back.config import Settings
from nccl_back.errors import ConfigError
from nccl_back.kinds import TRANSPORT_KINDS
from nccl_back.transport import all_transports, resolve_kind, transport_classes


def test_transport_registry_covers_exactly_the_kinds() -> None:
    """Every name in nccl_back.kinds has its classes registered by its module, no others."""
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
