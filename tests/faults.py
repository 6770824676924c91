"""Faults injected from the tests, never through production signatures."""

from __future__ import annotations

from typing import Any

import torch

#: A sender issues two broadcasts (plan digest, then the receiver's verdict) before data.
_FIRST_DATA_BROADCAST = 3


class CorruptingTransport:
    """Wraps a sender's transport: one byte of the ``step``-th data broadcast (1: the
    first) is flipped in a copy on its way to the wire (the sender's own tensors are
    never touched)."""

    def __init__(self, inner: Any, byte: int = 0, step: int = 1) -> None:
        self._inner = inner
        self._byte = byte
        self._at = _FIRST_DATA_BROADCAST - 1 + step
        self._calls = 0
        self._keep: list[torch.Tensor] = []  # a copy must outlive its broadcast

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def copy(self, tensor: torch.Tensor, src: int = 0) -> Any:
        self._calls += 1
        if self._calls == self._at:
            tensor = tensor.clone()
            tensor[self._byte] ^= 0xFF
            self._keep.append(tensor)
        return self._inner.copy(tensor, src)
