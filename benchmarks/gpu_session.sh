#!/usr/bin/env bash
# The GPU checks of a session lent a GPU machine (torch and CUDA preinstalled, no network):
# the wheels shardwise needs beyond that image travel in .whl/ (pydantic and its parts, hjson,
# the deepspeed sdist). Writes its logs and JSON to $OUT.
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error PYTHONWARNINGS=ignore
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=$PWD/src:$PWD/tests:/tmp/site
( cd /tmp && DS_BUILD_OPS=0 timeout 120 python3 -m pip install -q --no-index --no-deps --no-build-isolation \
    --no-cache-dir --target /tmp/site "$OLDPWD"/.whl/deepspeed-*.tar.gz ) > "$OUT/deepspeed_install.log" 2>&1 \
    || echo "deepspeed did not install (see deepspeed_install.log): its CUDA cases skip"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
timeout "${PLAN_S:-330}" python3 benchmarks/plan_gpu.py --out "$OUT" 2>&1 | tee "$OUT/plan_gpu.log" | grep -v "^    "
timeout "${CUDA_S:-170}" python3 -m pytest -q -s -p no:cacheprovider tests/test_cuda.py 2>&1 | tee "$OUT/test_cuda.log" | tail -45
