#!/usr/bin/env bash
# The README's test command: sets up .venv, then runs lint, types, the documentation
# build (mkdocs --strict: a broken link or a missing page fails) and the test suite.
# Without arguments it then runs the vLLM integration tests (tests/vllm, real vLLM
# engines) in their own environment, .venv-vllm (scripts/bootstrap_vllm.sh); set
# NCCL_BACK_SKIP_VLLM=1 to leave them out locally.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
.venv/bin/ruff check nccl_back tests benchmarks scripts
.venv/bin/mypy
# Offline and quick (a few seconds); into a temporary directory, so the tree stays clean.
site=$(mktemp -d)
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --site-dir "$site" || { rm -rf "$site"; exit 1; }
rm -rf "$site"
if [ "$#" -gt 0 ] || [ "${NCCL_BACK_SKIP_VLLM:-0}" = 1 ]; then
  exec .venv/bin/python -m pytest "$@"
fi
.venv/bin/python -m pytest
bash scripts/bootstrap_vllm.sh
# pyproject's addopts ignore tests/vllm for the main run; this run is only that folder.
exec .venv-vllm/bin/python -m pytest tests/vllm -m vllm -o addopts=-ra
