"""The public API: every name ``nccl_back`` exports and every import line the README
shows resolve, so a move inside the package never breaks what users wrote."""

from __future__ import annotations

import importlib
import importlib.util
import re
from pathlib import Path

import pytest

import nccl_back

ROOT = Path(__file__).resolve().parents[1]
_IMPORT = re.compile(r"^\s*(from nccl_back[\w.]* import [\w, ]+|import nccl_back[\w.]*)\s*(#.*)?$")


def _readme_imports() -> list[str]:
    lines = []
    for line in (ROOT / "README.md").read_text().splitlines():
        m = _IMPORT.match(line)
        if m:
            lines.append(m.group(1).strip())
    return lines


def test_the_readme_shows_imports() -> None:
    """The README's examples import from the package (the check below has work to do)."""
    assert any(line.startswith("from nccl_back import") for line in _readme_imports())


@pytest.mark.parametrize("line", _readme_imports())
def test_every_readme_import_line_works(line: str) -> None:
    """Each import line of the README runs as written."""
    exec(line, {})


@pytest.mark.parametrize("name", nccl_back.__all__)
def test_every_exported_name_resolves(name: str) -> None:
    """Each name in ``nccl_back.__all__`` is importable from the top level."""
    assert getattr(nccl_back, name) is not None


def test_the_entry_points_name_real_modules() -> None:
    """The console script and the vLLM plugin in pyproject point at modules that exist
    (the vLLM one is only located: vLLM itself is not installed here)."""
    text = (ROOT / "pyproject.toml").read_text()
    targets = re.findall(r'=\s*"(nccl_back[\w.]*):(\w+)"', text)
    assert targets
    for module, attr in targets:
        if module.endswith(".vllm"):
            assert importlib.util.find_spec(module) is not None
            continue
        assert callable(getattr(importlib.import_module(module), attr))
