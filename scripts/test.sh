#!/usr/bin/env bash
# The README's test command: sets up .venv, then runs lint, types and the test suite.
# Without arguments it then runs the vLLM integration tests (tests/vllm, real vLLM
# engines) in their own environment, .venv-vllm (scripts/bootstrap_vllm.sh); set
# NCCL_BACK_SKIP_VLLM=1 to leave them out locally.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
.venv/bin/ruff check nccl_back tests benchmarks scripts
.venv/bin/mypy
if [ "$#" -gt 0 ] || [ "${NCCL_BACK_SKIP_VLLM:-0}" = 1 ]; then
  exec .venv/bin/python -m pytest "$@"
fi
.venv/bin/python -m pytest
bash scripts/bootstrap_vllm.sh
# pyproject's addopts ignore tests/vllm for the main run; this run is only that folder.
exec .venv-vllm/bin/python -m pytest tests/vllm -m vllm -o addopts=-ra
