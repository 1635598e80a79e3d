#!/usr/bin/env bash
# The GPU checks of a session lent a GPU machine (torch and CUDA preinstalled, no network), in
# about 11 minutes of an H200: the CUDA tests, the planner check, the largest batch of GPT-2 Large
# and XL under a 24 GB cap, GPT-2 XL tokens/s with ZeRO-3 + offload against DeepSpeed, and the
# speed features at ~100M (eager vs compiled step time, synchronous vs asynchronous save stall,
# the activation-checkpointing modes' peak and step time; pinned staging and offload on CUDA).
# (gpu_capacity.py and offload_gpu.py have CPU dry runs in tests/test_benchmarks.py.) The wheels
# shardwise needs beyond that image travel in .whl/ (pydantic and its parts, hjson, the transformers
# this repository tests with, the deepspeed sdist): `pip download` them for cp312 manylinux x86_64.
# Writes its logs and JSON to $OUT. STEPS picks the parts (default all): plan cuda capacity offload
# speed tp moe long; each part's limit is its *_S variable.
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error PYTHONWARNINGS=ignore
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
STEPS=" ${STEPS:-plan cuda capacity offload speed tp moe long} "
want() { [[ "$STEPS" == *" $1 "* ]]; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH=$PWD/src:$PWD/tests:/tmp/site
( cd /tmp && DS_BUILD_OPS=0 timeout 120 python3 -m pip install -q --no-index --no-deps --no-build-isolation \
    --no-cache-dir --target /tmp/site "$OLDPWD"/.whl/deepspeed-*.tar.gz ) > "$OUT/deepspeed_install.log" 2>&1 \
    || echo "deepspeed did not install (see deepspeed_install.log): its CUDA cases skip"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
want plan && timeout "${PLAN_S:-130}" python3 benchmarks/plan_gpu.py --out "$OUT" 2>&1 | tee "$OUT/plan_gpu.log" | grep -v "^    "
want cuda && timeout "${CUDA_S:-110}" python3 -m pytest -q -s -p no:cacheprovider tests/test_cuda.py 2>&1 | tee "$OUT/test_cuda.log" | tail -45
want capacity && timeout "${CAP_S:-130}" python3 benchmarks/gpu_capacity.py --budget-gb 24 --models gpt2-large gpt2-xl \
    --timed-steps 2 --out "$OUT" 2>&1 | tee "$OUT/gpu_capacity.log" | tail -12
want offload && timeout "${OFFLOAD_S:-200}" python3 benchmarks/offload_gpu.py --model gpt2-xl --batch 8 --seq 512 --rounds 2 \
    --steps 2 --out "$OUT" 2>&1 | tee "$OUT/offload_gpu.log" | tail -6
want speed && timeout "${SPEED_S:-170}" python3 -m torch.distributed.run --standalone --nproc-per-node 1 \
    benchmarks/speed_features.py --strategies zero3 --steps 4 --batch 8 --seq 512 --out "$OUT" 2>&1 \
    | tee "$OUT/speed_features.log" | tail -10
# tensor parallelism against ZeRO alone (benchmarks/tensor_parallel.py) needs one GPU per process,
# 4 of them: on a machine with fewer (a lent H200 is one) it is skipped, saying so
GPUS=$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)
if ! want tp; then :
elif [ "$GPUS" -ge 4 ]; then
    timeout "${TP_S:-150}" python3 -m torch.distributed.run --standalone --nproc-per-node 4 \
        benchmarks/tensor_parallel.py --device cuda --hidden 1024 --layers 8 --out "$OUT" 2>&1 | tee "$OUT/tensor_parallel.log" | tail -8
else
    echo "tensor_parallel.py skipped: $GPUS GPU(s), it needs 4 (one per process)"
fi
# mixture-of-experts (benchmarks/moe.py): expert parallelism against ZeRO-3 alone, one GPU per
# process, 4 of them (a larger Mixtral shape than the CPU run's)
if ! want moe; then :
elif [ "$GPUS" -ge 4 ]; then
    timeout "${MOE_S:-120}" python3 benchmarks/moe.py --device cuda --processes 4 --eps 1 2 4 --hidden 1024 \
        --intermediate 4096 --steps 5 --out "$OUT" 2>&1 | grep -v "Warning" | tee "$OUT/moe.log" | tail -6
else
    echo "moe.py skipped: $GPUS GPU(s), it needs 4 (one per process)"
fi
# long context (benchmarks/long_context.py): the longest sequence under a 24 GiB activation budget,
# one process on one GPU, context parallelism over the GPUs there are (one per process)
CP=$([ "$GPUS" -ge 4 ] && echo "1 2 4" || { [ "$GPUS" -ge 2 ] && echo "1 2" || echo "1"; })
want long && timeout "${LONG_S:-120}" python3 benchmarks/long_context.py --device cuda --processes $CP --cap-mib 24576 \
    --lengths 16384 32768 65536 --out "$OUT" 2>&1 | grep -v "Warning" | tee "$OUT/long_context.log" | tail -8
