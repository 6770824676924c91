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
# .venv-vllm is set up (mostly downloads and unpacking) while the main suite runs.
vllm_log=$(mktemp)
bash scripts/bootstrap_vllm.sh >"$vllm_log" 2>&1 &
vllm_setup=$!
status=0
.venv/bin/python -m pytest || status=$?
vllm_status=0
wait "$vllm_setup" || vllm_status=$?
cat "$vllm_log" >&2
rm -f "$vllm_log"
[ "$vllm_status" = 0 ] || exit "$vllm_status"
[ "$status" = 0 ] || exit "$status"
# pyproject's addopts ignore tests/vllm for the main run; this run is only that folder.
exec .venv-vllm/bin/python -m pytest tests/vllm -m vllm -o addopts=-ra
