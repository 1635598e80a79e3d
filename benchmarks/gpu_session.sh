#!/usr/bin/env bash
# The GPU checks of a session lent a GPU machine (torch and CUDA preinstalled, maybe no network),
# within 12 minutes by default, ending with one line per part (PASS, FAIL or SKIP and why) and
# exiting non-zero when any part failed (a check that failed, a command that exited non-zero, a
# part past its limit). Run from the repository root: `bash benchmarks/gpu_session.sh`.
#
# Parts (STEPS picks them, default all, in this order; each part's limit is its *_S variable):
#   plan      PLAN_S    the planner's predicted largest batch against the real one (plan_gpu.py)
#   cuda      CUDA_S    tests/test_cuda.py: every strategy on the GPU against one plain process
#   multi     MULTI_S   tests/test_cuda_multi.py: several processes sharing one GPU (gloo for CUDA
#                       tensors): the async checkpoint's contents and GPU memory during its write,
#                       offloaded state saved and resumed, hybrid (4 processes), cp 2, ep 2
#   capacity  CAP_S     the largest batch of GPT-2 Large under a 24 GB cap (gpu_capacity.py)
#   offload   OFFLOAD_S GPT-2 Large tokens/s, ZeRO-3 + offload against DeepSpeed (offload_gpu.py)
#   speed     SPEED_S   eager vs compiled, sync vs async save, activation checkpointing (speed_features.py)
#   tp        TP_S      tensor parallelism against ZeRO alone: 4 GPUs, one per process (else SKIP)
#   moe       MOE_S     expert parallelism against ZeRO-3: 4 GPUs, one per process (else SKIP)
#   long      LONG_S    the longest sequence under a 24 GiB activation budget (long_context.py)
# The limits (INSTALL_S for the install) add to at most SESSION_S (720 s); a part is also cut to
# what is left of SESSION_S, and a part that cannot start within it fails.
#
# Install: a `.whl/` folder, where there is one, is installed offline as before (wheels `pip
# download`ed for the machine: pydantic and its parts, hjson, transformers, the deepspeed sdist).
# Without it, what is missing is installed from the package registry (versions of
# constraints.txt, torch left as the machine has it; deepspeed optional); a machine without network
# says so in one line and goes on with what is installed.
#
# GPU_SESSION_DRY_RUN=1: each part's CPU form (tiny sizes, CPU processes), to check the script on
# a machine without a GPU (tests/test_benchmarks.py does, with a fake nvidia-smi): plan has none
# (SKIP), cuda skips, multi runs its async case on CPU processes (MULTI_K picks cases, pytest -k).
# Logs and JSON go to $OUT (default /tmp/out); PYTHON picks the interpreter (default python3).
set -uo pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error PYTHONWARNINGS=ignore
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PY=${PYTHON:-python3}
DRY=${GPU_SESSION_DRY_RUN:-0}
STEPS=" ${STEPS:-plan cuda multi capacity offload speed tp moe long} "
SESSION_S=${SESSION_S:-720}
INSTALL_S=${INSTALL_S:-60}
PLAN_S=${PLAN_S:-70}; CUDA_S=${CUDA_S:-70}; MULTI_S=${MULTI_S:-120}; CAP_S=${CAP_S:-70}
OFFLOAD_S=${OFFLOAD_S:-70}; SPEED_S=${SPEED_S:-75}; TP_S=${TP_S:-60}; MOE_S=${MOE_S:-45}; LONG_S=${LONG_S:-60}
START=$SECONDS
SUMMARY=()
FAILED=0
want() { [[ "$STEPS" == *" $1 "* ]]; }
echo "limits (s): install $INSTALL_S plan $PLAN_S cuda $CUDA_S multi $MULTI_S capacity $CAP_S offload $OFFLOAD_S" \
    "speed $SPEED_S tp $TP_S moe $MOE_S long $LONG_S; total" \
    "$((INSTALL_S + PLAN_S + CUDA_S + MULTI_S + CAP_S + OFFLOAD_S + SPEED_S + TP_S + MOE_S + LONG_S))" \
    "(session cap $SESSION_S)"

record() {  # part, PASS/FAIL/SKIP, seconds, why
    SUMMARY+=("$(printf '%-4s %-9s %4ss  %s' "$2" "$1" "$3" "$4")")
    [ "$2" = FAIL ] && FAILED=1
    return 0
}

pytest_detail() {  # a pytest log's outcome: its last summary line, the failed tests, the skip reasons
    local last failed skipped
    last=$(grep -E "^=*.*[0-9]+ (passed|failed|skipped|error|errors|deselected)" "$1" | tail -1 | tr -d '=' | sed -E 's/^ +| +$//g')
    failed=$(grep -oE "^(FAILED|ERROR) [^ ]+" "$1" | sed 's/.*:://' | sort -u | tr '\n' ' ' | sed 's/ $//')
    skipped=$(grep -E "^SKIPPED" "$1" | head -1 | sed -E 's/^SKIPPED \[[0-9]+\] [^ ]+ ?//' | cut -c1-160)
    echo "${last:-no pytest summary}${failed:+; failed: $failed}${skipped:+; skipped: $skipped}"
}

part() {  # name, limit, command...: run it under its limit (cut to the session's), log to $OUT/<name>.log
    local name=$1 limit=$2 left rc t0 log="$OUT/$1.log" detail status
    shift 2
    left=$((SESSION_S - (SECONDS - START) - 5))
    if [ "$left" -lt 5 ]; then
        record "$name" FAIL 0 "not run: under 10 s left of the session's $SESSION_S s"
        return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo "== $name (limit $limit s): $*"
    t0=$SECONDS
    timeout --kill-after=5 "$limit" "$@" > "$log" 2>&1
    rc=$?
    grep -v -e "Warning" -e "^    " "$log" | tail -n 12
    status=PASS
    if [[ "$*" == *pytest* ]]; then detail=$(pytest_detail "$log"); else detail="see $name.log"; fi
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        status=FAIL; detail="timed out after $limit s; $detail"
    elif [ "$rc" -ne 0 ]; then
        status=FAIL; detail="exit $rc; $detail"
    elif [[ "$detail" == *skipped* && "$detail" != *passed* ]]; then
        status=SKIP
    fi
    record "$name" "$status" $((SECONDS - t0)) "$detail"
}

# -- install (INSTALL_S in all) -------------------------------------------------------------------
export PYTHONPATH="$PWD/src:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}"
t0=$SECONDS
install_left() { echo $((INSTALL_S - (SECONDS - t0) > 1 ? INSTALL_S - (SECONDS - t0) : 1)); }
if [ -d .whl ]; then
    if timeout "$(install_left)" "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
            --target /tmp/site .whl/*.whl > "$OUT/install.log" 2>&1; then
        export PYTHONPATH="$PYTHONPATH:/tmp/site"
    else
        record install FAIL $((SECONDS - t0)) "the wheels of .whl/ did not install (see install.log)"
    fi
    ( cd /tmp && DS_BUILD_OPS=0 timeout "$(install_left)" "$PY" -m pip install -q --no-index --no-deps \
        --no-build-isolation --no-cache-dir --target /tmp/site "$OLDPWD"/.whl/deepspeed-*.tar.gz ) \
        >> "$OUT/install.log" 2>&1 || echo "deepspeed did not install (see install.log): its cases skip"
else
    # the modules the parts import, by the distribution that brings each (deepspeed: optional)
    MISSING=$("$PY" - <<'EOF'
import importlib.util
need = {"numpy": "numpy", "safetensors": "safetensors", "yaml": "pyyaml", "pydantic": "pydantic",
        "xxhash": "xxhash", "tqdm": "tqdm", "transformers": "transformers", "pytest": "pytest",
        "deepspeed": "deepspeed"}
print(" ".join(dist for mod, dist in need.items() if importlib.util.find_spec(mod) is None))
EOF
)
    REQUIRED=$(echo " $MISSING " | sed 's/ deepspeed / /' | sed -E 's/^ +| +$//g')
    export PIP_BREAK_SYSTEM_PACKAGES=1  # (a lent machine's own Python, given back after the session)
    PIP=("$PY" -m pip install -q --disable-pip-version-check --retries 0 --timeout 10 -c "$OUT/constraints.txt")
    grep -v '^torch==' constraints.txt > "$OUT/constraints.txt"  # (torch: the machine's own)
    if [ -z "$MISSING" ]; then
        echo "install: nothing missing"
    elif [ -n "$REQUIRED" ] && ! timeout "$(install_left)" "${PIP[@]}" $REQUIRED > "$OUT/install.log" 2>&1; then
        echo "install: pip install $MISSING failed (no network? see install.log): going on with what is installed"
    else
        [ -n "$REQUIRED" ] && echo "install: $REQUIRED from the registry"
        if [[ " $MISSING " == *" deepspeed "* ]]; then
            if DS_BUILD_OPS=0 timeout "$(install_left)" "${PIP[@]}" deepspeed >> "$OUT/install.log" 2>&1; then
                echo "install: deepspeed from the registry"
            else echo "install: deepspeed did not install (see install.log): its cases skip"; fi
        fi
    fi
fi
"$PY" -c "import torch, shardwise; print('torch', torch.__version__, 'cuda', torch.version.cuda)" \
    || record install FAIL $((SECONDS - t0)) "torch or shardwise does not import"

# -- the machine ---------------------------------------------------------------------------------
if command -v nvidia-smi > /dev/null; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    GPUS=$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)
else
    echo "no nvidia-smi: no GPU seen"; GPUS=0
fi
[ "$DRY" = 1 ] && echo "dry run: each part's CPU form"

# -- the parts -----------------------------------------------------------------------------------
PYTEST=("$PY" -m pytest -q -rfEs -p no:cacheprovider)
if want plan; then
    if [ "$DRY" = 1 ]; then record plan SKIP 0 "no CPU form (it measures the GPU's memory)"
    else part plan "$PLAN_S" "$PY" benchmarks/plan_gpu.py --models gpt2-large --out "$OUT"; fi
fi
want cuda && part cuda "$CUDA_S" "${PYTEST[@]}" -s tests/test_cuda.py
if want multi; then
    if [ "$DRY" = 1 ]; then
        part multi "$MULTI_S" env SHARDWISE_CUDA_MULTI_ON_CPU=1 "${PYTEST[@]}" tests/test_cuda_multi.py -k "${MULTI_K:-async}"
    else part multi "$MULTI_S" "${PYTEST[@]}" -s tests/test_cuda_multi.py ${MULTI_K:+-k "$MULTI_K"}; fi
fi
if want capacity; then
    if [ "$DRY" = 1 ]; then
        part capacity "$CAP_S" "$PY" benchmarks/gpu_capacity.py --dry-run --models gpt2-tiny --budget-gb 2 \
            --max-batch 16 --timed-steps 1 --out "$OUT"
    else part capacity "$CAP_S" "$PY" benchmarks/gpu_capacity.py --budget-gb 24 --models gpt2-large \
            --timed-steps 2 --out "$OUT"; fi
fi
if want offload; then
    if [ "$DRY" = 1 ]; then part offload "$OFFLOAD_S" "$PY" benchmarks/offload_gpu.py --dry-run --rounds 1 --steps 1 --out "$OUT"
    else part offload "$OFFLOAD_S" "$PY" benchmarks/offload_gpu.py --model gpt2-large --batch 8 --seq 512 \
            --rounds 1 --steps 2 --out "$OUT"; fi
fi
if want speed; then
    if [ "$DRY" = 1 ]; then SIZE=(--tiny --steps 2 --saves 1); else SIZE=(--steps 3 --batch 8 --seq 512); fi
    part speed "$SPEED_S" "$PY" -m torch.distributed.run --standalone --nproc-per-node 1 \
        benchmarks/speed_features.py --strategies zero3 "${SIZE[@]}" --out "$OUT"
fi
# tensor and expert parallelism against ZeRO alone need one GPU per process, 4 of them
if want tp; then
    if [ "$GPUS" -ge 4 ]; then
        part tp "$TP_S" "$PY" -m torch.distributed.run --standalone --nproc-per-node 4 \
            benchmarks/tensor_parallel.py --device cuda --hidden 1024 --layers 8 --out "$OUT"
    else record tp SKIP 0 "$GPUS GPU(s): it needs 4, one per process"; fi
fi
if want moe; then
    if [ "$GPUS" -ge 4 ]; then
        part moe "$MOE_S" "$PY" benchmarks/moe.py --device cuda --processes 4 --eps 1 2 4 --hidden 1024 \
            --intermediate 4096 --steps 5 --out "$OUT"
    else record moe SKIP 0 "$GPUS GPU(s): it needs 4, one per process"; fi
fi
# long context: one process, and context parallelism over the GPUs there are (one per process)
if want long; then
    if [ "$DRY" = 1 ]; then
        part long "$LONG_S" "$PY" benchmarks/long_context.py --lengths 256 --processes 1 --steps 1 --cap-mib 20 --out "$OUT"
    else
        CP=$([ "$GPUS" -ge 4 ] && echo "1 2 4" || { [ "$GPUS" -ge 2 ] && echo "1 2" || echo "1"; })
        # shellcheck disable=SC2086
        part long "$LONG_S" "$PY" benchmarks/long_context.py --device cuda --processes $CP --cap-mib 24576 \
            --lengths 16384 32768 --out "$OUT"
    fi
fi

echo "== summary ($((SECONDS - START)) s in all)"
printf '%s\n' "${SUMMARY[@]}" | tee "$OUT/summary.txt"
exit "$FAILED"
