#!/usr/bin/env bash
# The device check (one CUDA GPU, ~6 min): every gpu-marked test, by file, and a verdict
# that FAILS if any of them is skipped or none ran; then the GPU figures
# (benchmarks/gpu_transfer.py). Prints one line "gpu_check: PASS|FAIL ..." at the end.
#
# Runs on a machine without network as it is: missing pure-Python wheels placed in a
# git-ignored .whl/ are installed into /tmp first (see README, GPU). Two ranks share the
# one GPU as tests/gpu_pair.py describes.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/nccl-back-gpu-check}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/nccl-back-site .whl/*.whl || { echo "gpu_check: FAIL (wheels did not install)"; exit 3; }
  export PYTHONPATH=/tmp/nccl-back-site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
"$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version(), "gpus", torch.cuda.device_count())'
GPU_TESTS=(tests/test_transport_gpu.py tests/test_integrity.py tests/test_handoff.py
  tests/test_relay_gpu.py tests/test_reshard_gpu.py)
timeout 480 "$PY" -m pytest -p no:cacheprovider -m gpu -rA -q -o addopts= \
  --junitxml="$OUT/gpu.xml" "${GPU_TESTS[@]}" 2>&1 | tee "$OUT/pytest.log"
verdict=$("$PY" - "$OUT/gpu.xml" <<'PY'
import sys
import xml.etree.ElementTree as ET
try:
    root = ET.parse(sys.argv[1]).getroot()
except (OSError, ET.ParseError) as e:
    print(f"FAIL (no junit report: {e})"); sys.exit()
suites = [root] if root.tag == "testsuite" else list(root)
n = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
ok = n["tests"] > 0 and n["failures"] == n["errors"] == n["skipped"] == 0
print(("PASS" if ok else "FAIL") + f" ({n['tests']} gpu tests, {n['failures']} failed,"
      f" {n['errors']} errors, {n['skipped']} skipped)")
PY
)
timeout 200 "$PY" benchmarks/gpu_transfer.py --json "$OUT/gpu_bench.json" 2>&1 | tee "$OUT/bench.log"
bench=${PIPESTATUS[0]}
[ "$bench" = 0 ] || verdict="FAIL (benchmark transfer failed) / tests: $verdict"
echo "gpu_check: $verdict"
case "$verdict" in PASS*) exit 0 ;; *) exit 1 ;; esac
