#!/usr/bin/env bash
# The README's test command: sets up .venv, then runs lint, types, the documentation
# build (mkdocs --strict: a broken link or a missing page fails) and the test suite.
# Without arguments it also runs the vLLM integration tests (tests/vllm, real vLLM
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
if [ "$#" -gt 0 ]; then
  exec .venv/bin/python -m pytest "$@"
fi
# The whole suite over two pytest-xdist processes, one test module each at a time (their
# module fixtures stay one per module): its tests mostly wait on the bounds they test, so
# two share the CPUs and the run takes about 60 % of one process's time.
whole=(-n 2 --dist loadscope)
if [ "${NCCL_BACK_SKIP_VLLM:-0}" = 1 ]; then
  exec .venv/bin/python -m pytest "${whole[@]}"
fi
# .venv-vllm is set up (mostly downloads and unpacking) and the vLLM integration tests
# then run while the main suite runs: both suites hold their tests to pass on a loaded
# machine, and running them side by side keeps the whole command well inside CI's time.
# pyproject's addopts ignore tests/vllm for the main run; the vLLM run is only that folder.
vllm_log=$(mktemp)
( bash scripts/bootstrap_vllm.sh \
    && exec .venv-vllm/bin/python -m pytest tests/vllm -m vllm -o addopts=-ra ) \
  >"$vllm_log" 2>&1 &
vllm_run=$!
status=0
.venv/bin/python -m pytest "${whole[@]}" || status=$?
vllm_status=0
wait "$vllm_run" || vllm_status=$?
echo "---- vLLM integration tests (tests/vllm, .venv-vllm) ----"
cat "$vllm_log"
rm -f "$vllm_log"
[ "$status" = 0 ] || exit "$status"
exit "$vllm_status"
