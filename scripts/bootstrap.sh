#!/usr/bin/env bash
# Creates .venv and installs nccl-back with its dev extra. Idempotent and quiet when
# nothing changed. Without a GPU it installs a CPU build of torch first, so the
# "torch>=2.4" requirement does not pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.nccl-back-installed
if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ]; then
  exit 0
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    .venv/bin/python -m pip install -q "torch>=2.4"
  else
    # CPU-only wheel: from the local wheel cache where present, else the CPU index.
    .venv/bin/python -m pip install -q torch==2.13.0 2>/dev/null \
      || .venv/bin/python -m pip install -q torch --index-url https://download.pytorch.org/whl/cpu
  fi
fi
.venv/bin/python -m pip install -q -e ".[dev]"
touch "$stamp"
