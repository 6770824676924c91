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
log=.venv/install.log
: >"$log"
pip_install() {
  # pip's and setuptools' chatter goes to the log; shown only if the install fails.
  if ! .venv/bin/python -m pip install -q "$@" >>"$log" 2>&1; then
    tail -n 30 "$log" >&2
    echo "bootstrap: 'pip install $*' failed; full log in $log" >&2
    return 1
  fi
}
echo "setting up .venv (first run only) ..." >&2
pip_install --upgrade pip || true
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    pip_install "torch>=2.4"
  else
    # A CPU-only build (PyPI's Linux torch is a multi-GB CUDA build): from PyTorch's
    # CPU index, or from a local wheel directory configured for pip (find-links).
    .venv/bin/python -m pip install -q --retries 1 --timeout 20 torch==2.13.0 \
        --index-url https://download.pytorch.org/whl/cpu >>"$log" 2>&1 \
      || pip_install torch==2.13.0
  fi
fi
pip_install -e ".[dev]"
touch "$stamp"
