#!/usr/bin/env bash
# The README's test command: sets up .venv, then runs lint, types and the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
.venv/bin/ruff check nccl_back tests benchmarks scripts
.venv/bin/mypy
exec .venv/bin/python -m pytest "$@"
