#!/usr/bin/env bash
# The README's demo command: sets up .venv, then runs the demo (see nccl_back/dev/demo.py).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
exec .venv/bin/python -m nccl_back.dev.demo "$@"
