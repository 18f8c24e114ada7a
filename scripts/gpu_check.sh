#!/usr/bin/env bash
# Check megatron-zeppelin on a GPU machine in one command (issue 9), from the repository root:
#
#     bash scripts/gpu_check.sh [RESULTS_DIR]
#
# 1. environment: the GPU, torch and CUDA versions (never changed by this script);
# 2. install: megatron-core from a carried wheel if it is missing (.whl/, see GPU-FACTS: no
#    internet there), then this package with --no-deps --no-index (the machine's own torch stays);
# 3. the `gpu` tests (tests/test_gpu.py: every backend vs float64, the CPU stand-in vs the real
#    kernel, the hot path under sync debug mode, 4 ranks on one GPU vs one process, a tiny GPT)
#    and the native backend's CPU contract tests;
# 4. `zeppelin bench kernels --device cuda`: our block call vs the raw kernel (targets <= 1.05x
#    at >= 4K tokens, <= 20 us extra per call);
# 5. `zeppelin bench engine --device cuda`: the engine on a local-only plan vs raw kernels
#    (target <= 1.10x) and a 4-rank plan on the one GPU (staged transport);
# 6. one-GPU bf16 training (scripts/pretrain_gpt.py: 4 layers, hidden 1024, 16/4 heads, seq 16K,
#    128K tokens per iteration) with the native backend (target >= 250K tokens/s) and with the
#    torch reference path (first iterations' losses must match);
# then prints a summary (also RESULTS_DIR/summary.txt). Every step's log is in RESULTS_DIR
# (default gpu-check-results/DATE). Exit status: 0 when every step passed, 1 otherwise.
# Environment: PYTHON (default python3), GPU_CHECK_TRAIN_ITERS (default 10).
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:-$ROOT/gpu-check-results/$(date +%Y%m%d-%H%M%S)}"
PY="${PYTHON:-python3}"
ITERS="${GPU_CHECK_TRAIN_ITERS:-10}"
mkdir -p "$OUT" || { echo "gpu_check: cannot create the results folder $OUT" >&2; exit 2; }
cd "$ROOT" || exit 2
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
FAILED=0

note() { echo "$*" | tee -a "$SUMMARY"; }

# step NAME TIMEOUT_S COMMAND...: run COMMAND (log in OUT/NAME.log), record PASS/FAIL.
step() {
    local name="$1" limit="$2"
    shift 2
    echo "== $name: $*" | tee "$OUT/$name.log"
    local start=$SECONDS
    timeout "$limit" "$@" >> "$OUT/$name.log" 2>&1
    local rc=$?
    local took=$((SECONDS - start))
    if [ "$rc" -eq 0 ]; then
        note "PASS  $name (${took} s)"
    else
        [ "$rc" -eq 124 ] && echo "gpu_check: $name ran past ${limit} s" >> "$OUT/$name.log"
        note "FAIL  $name (exit $rc after ${took} s; see $OUT/$name.log)"
        FAILED=1
    fi
    return "$rc"
}

# ---------------------------------------------------------------- 1. environment
if ! "$PY" - > "$OUT/environment.log" 2>&1 <<'EOF'
import sys
import torch
print("python", sys.version.split()[0], "| torch", torch.__version__, "| cuda", torch.version.cuda)
if not torch.cuda.is_available():
    sys.exit("torch.cuda.is_available() is False: this is not a GPU machine (or torch is CPU-only)")
print("gpu", torch.cuda.get_device_name(), "| capability", torch.cuda.get_device_capability())
print("flash kernel", hasattr(torch.ops.aten, "_flash_attention_forward"))
EOF
then
    cat "$OUT/environment.log" >&2
    echo "gpu_check: no usable CUDA torch; nothing checked" >&2
    exit 2
fi
cat "$OUT/environment.log" | tee -a "$SUMMARY"
command -v nvidia-smi > /dev/null && nvidia-smi > "$OUT/nvidia-smi.log" 2>&1
TORCH_BEFORE="$("$PY" -c 'import torch; print(torch.__version__)')"

# ---------------------------------------------------------------- 2. install
install() {
    if ! "$PY" -c "import megatron.core" 2> /dev/null; then
        local wheels=("$ROOT"/.whl/megatron_core-*.whl)
        if [ ! -e "${wheels[0]}" ]; then
            echo "megatron-core is not installed and no wheel was carried: on a machine with" \
                 "internet, from the repository root: python3 -m pip download --no-deps" \
                 "--only-binary=:all: --python-version 3.12 --implementation cp --platform" \
                 "manylinux_2_28_x86_64 -d .whl megatron-core==0.16.1"
            return 1
        fi
        local site="$OUT/site-packages"
        "$PY" -m pip install -q --no-index --no-deps --target "$site" "${wheels[@]}" || return 1
        export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
        echo "megatron-core from ${wheels[*]} -> $site"
    fi
    if [ "$("$PY" -c 'import megatron_zeppelin, os; print(os.path.dirname(os.path.dirname(
os.path.abspath(megatron_zeppelin.__file__))))' 2> /dev/null)" = "$ROOT" ]; then
        echo "megatron_zeppelin is already importable from $ROOT"
    # --no-deps: the machine's own torch is never replaced; --no-index: no network needed
    elif ! "$PY" -m pip install -q --no-deps --no-build-isolation --no-index -e "$ROOT"; then
        echo "pip install -e failed; building the router in place and using PYTHONPATH"
        "$PY" setup.py -q build_ext --inplace || return 1
        export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
    fi
    "$PY" -c "import megatron_zeppelin, megatron.core, torch; \
print('megatron_zeppelin', megatron_zeppelin.__file__, '| megatron-core', \
megatron.core.__version__, '| torch', torch.__version__)"
}
echo "== install" > "$OUT/install.log"
if install >> "$OUT/install.log" 2>&1; then
    note "PASS  install ($(tail -n 1 "$OUT/install.log"))"
else
    note "FAIL  install (see $OUT/install.log); nothing else can run"
    cat "$OUT/install.log" >&2
    exit 1
fi
TORCH_AFTER="$("$PY" -c 'import torch; print(torch.__version__)')"
if [ "$TORCH_BEFORE" != "$TORCH_AFTER" ]; then
    note "FAIL  install changed torch: $TORCH_BEFORE -> $TORCH_AFTER"
    FAILED=1
fi
ZEPPELIN=("$PY" -m megatron_zeppelin.cli)

# ---------------------------------------------------------------- 3. tests
step gpu-tests 3600 "$PY" -m pytest -q -rs -m gpu tests/test_gpu.py \
    --junitxml "$OUT/gpu-tests.xml"
step contract-tests 900 "$PY" -m pytest -q tests/test_native_backend.py tests/test_kernels.py

# ---------------------------------------------------------------- 4./5. benchmarks
step bench-kernels 1200 "${ZEPPELIN[@]}" bench kernels --device cuda \
    --json "$OUT/bench-kernels.json"
step bench-engine 1800 "${ZEPPELIN[@]}" bench engine --device cuda

# ---------------------------------------------------------------- 6. one-GPU bf16 training
TRAIN=(--device cuda --bf16 --num-layers 4 --hidden-size 1024 --num-attention-heads 16
       --num-query-groups 4 --seq-length 16384 --micro-batch-size 8 --global-batch-size 8
       --vocab-size 256 --mock-data --context-parallel-mode zeppelin --context-parallel-size 1
       --zeppelin-gpus-per-node 1 --zeppelin-overlong split --lr 3e-4 --log-interval 1
       --seed 1234)
train() {  # train NAME BACKEND ITERS
    step "$1" 2400 "$PY" -m torch.distributed.run --standalone --nproc-per-node 1 \
        scripts/pretrain_gpt.py "${TRAIN[@]}" --train-iters "$3" --zeppelin-attention-backend "$2"
}
train train-native native "$ITERS"
train train-reference torch 3

# losses and tokens/s from the training logs ("iteration i/N | loss X | tokens/s Y | ...")
if "$PY" scripts/gpu_check_training.py "$OUT" > "$OUT/training-summary.log" 2>&1; then
    note "PASS  training targets"
else
    note "FAIL  training targets (see $OUT/training-summary.log)"
    FAILED=1
fi

# ---------------------------------------------------------------- summary
{
    echo
    echo "---- figures"
    grep -h -E "^  (native|target)" "$OUT/bench-kernels.log" 2> /dev/null
    grep -h -E "local-only|ranks on one GPU" "$OUT/bench-engine.log" 2> /dev/null
    cat "$OUT/training-summary.log"
    grep -h -E "passed|failed|skipped" "$OUT/gpu-tests.log" 2> /dev/null | tail -n 1
} | tee -a "$SUMMARY"
echo "results in $OUT"
exit "$FAILED"
