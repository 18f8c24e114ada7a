#!/usr/bin/env bash
# Check megatron-zeppelin on a GPU machine in one command (issue 9), from the repository root:
#
#     bash scripts/gpu_check.sh [RESULTS_DIR]
#
# 1. environment: the GPU, torch and CUDA versions (never changed by this script);
# 2. install: megatron-core 0.16.1 from a carried wheel if it is missing (.whl/, below), then
#    this package with --no-deps --no-index (the machine's own torch stays);
# 3. the `gpu` tests (tests/test_gpu.py: every backend vs float64, the CPU stand-in vs the real
#    kernel, the hot path under sync debug mode, 4 ranks on one GPU vs one process, a tiny GPT)
#    and the native backend's CPU contract tests;
# 4. `zeppelin bench kernels --device cuda`: our block call vs the raw kernel (targets <= 1.05x
#    at >= 4K tokens, <= 20 us extra per call);
# 5. `zeppelin bench engine --device cuda`: the engine on a local-only plan vs raw kernels
#    (target <= 1.10x) and a 4-rank plan on the one GPU (staged transport);
# 6. one-GPU bf16 training (scripts/pretrain_gpt.py: 4 layers, hidden 1024, 16/4 heads, seq 16K,
#    128K tokens per iteration, the built-in corpus) with the native backend (target >= 250K
#    tokens/s) and with the torch reference path (first iterations' losses must match);
# 7. optional: scripts/gpu_check_megatron_lm.sh (Megatron-LM's own pretrain_gpt.py, patched,
#    zeppelin vs static on one GPU; ours with megatron-core 0.16.1 vs 0.19.2). What it cannot
#    run (no checkout carried, no wheels, fewer than 2 GPUs) is listed as SKIP, not failed.
# then prints a summary (also RESULTS_DIR/summary.txt). Every step's log is in RESULTS_DIR
# (default gpu-check-results/DATE). Exit status: 0 when every step that ran passed, 1 otherwise
# (2: no usable CUDA torch).
#
# What to carry (the GPU machine has no internet; at most 64 MiB travels with the working tree,
# whose tracked files are ~2.5 MB). On a machine with internet, from the repository root; both
# folders are git-ignored, so name them in the device tool's `carry` ([".whl", ".megatron-lm"])
# or copy them along:
#   .whl/ (~7.5 MB): megatron-core (absent there) and pydantic (Megatron-LM imports it), for
#   CPython 3.12 on x86_64 (the GPU machine's Python; see GPU-FACTS):
#     W="python3 -m pip download --only-binary=:all: --python-version 3.12 --implementation cp
#        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl"
#     $W --no-deps megatron-core==0.16.1; $W --no-deps megatron-core==0.19.2; $W "pydantic>=2"
#   (one call per megatron-core version; pydantic_core's wheel is manylinux_2_17, hence both
#   platforms; without ">=2" pip may settle on pydantic 1, which Megatron-LM cannot use).
#   .megatron-lm/ (~7 MB; step 7's checks 1-3 are skipped without it): Megatron-LM at tag
#   core_v0.16.1, its megatron/ package, top-level *.py and LICENSE, already patched (git may
#   be missing there):
#     git clone -q --depth 1 -b core_v0.16.1 https://github.com/NVIDIA/Megatron-LM /tmp/mlm
#     mkdir -p .megatron-lm && tar -C /tmp/mlm -cf - megatron LICENSE $(cd /tmp/mlm && ls *.py) |
#       tar -C .megatron-lm -xf - && scripts/apply_megatron_patch.sh .megatron-lm
#   (MLM_DIR or MEGATRON_LM_PATH may name another checkout instead; default: .megatron-lm/.)
#
# Environment: PYTHON (default python3), GPU_CHECK_TRAIN_ITERS (default 10), MLM_DIR.
# GPU_CHECK_CPU=1: a dry run of this script's plumbing on a machine without a GPU (--device
# cpu, a tiny model, no throughput target, step 7 skipped); none of its figures means anything.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:-$ROOT/gpu-check-results/$(date +%Y%m%d-%H%M%S)}"
PY="${PYTHON:-python3}"
ITERS="${GPU_CHECK_TRAIN_ITERS:-10}"
CPU_DRY_RUN="${GPU_CHECK_CPU:-0}"
mkdir -p "$OUT" || { echo "gpu_check: cannot create the results folder $OUT" >&2; exit 2; }
OUT="$(cd "$OUT" && pwd)"
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

if [ "$CPU_DRY_RUN" = 1 ]; then
    DEVICE=cpu
    note "GPU_CHECK_CPU=1: a dry run on CPU (plumbing only: no figure below means anything)"
else
    DEVICE=cuda
fi

# ---------------------------------------------------------------- 1. environment
if ! GPU_CHECK_CPU="$CPU_DRY_RUN" "$PY" - > "$OUT/environment.log" 2>&1 <<'EOF'
import os
import sys
import torch
print("python", sys.version.split()[0], "| torch", torch.__version__, "| cuda", torch.version.cuda)
if torch.cuda.is_available():
    print("gpu", torch.cuda.get_device_name(), "| capability", torch.cuda.get_device_capability())
    print("flash kernel", hasattr(torch.ops.aten, "_flash_attention_forward"))
elif os.environ["GPU_CHECK_CPU"] != "1":
    sys.exit("torch.cuda.is_available() is False: this is not a GPU machine (or torch is CPU-only)")
EOF
then
    cat "$OUT/environment.log" >&2
    echo "gpu_check: no usable CUDA torch; nothing checked" >&2
    exit 2
fi
tee -a "$SUMMARY" < "$OUT/environment.log"
command -v nvidia-smi > /dev/null && nvidia-smi > "$OUT/nvidia-smi.log" 2>&1
TORCH_BEFORE="$("$PY" -c 'import torch; print(torch.__version__)')"

# ---------------------------------------------------------------- 2. install
install() {
    local site="$OUT/site-packages"
    if ! "$PY" -c "import megatron.core" 2> /dev/null; then
        local wheels=("$ROOT"/.whl/megatron_core-0.16.1-*.whl)
        if [ ! -e "${wheels[0]}" ]; then
            echo "megatron-core is not installed and no wheel was carried: see the header of" \
                 "scripts/gpu_check.sh (.whl/megatron_core-0.16.1-*.whl)"
            return 1
        fi
        "$PY" -m pip install -q --no-index --no-deps --target "$site" "${wheels[0]}" || return 1
        echo "megatron-core from ${wheels[0]} -> $site"
    fi
    if ! "$PY" -c "import pydantic" 2> /dev/null; then  # Megatron-LM's (step 7) only
        local extra=()
        for w in "$ROOT"/.whl/*.whl; do
            [ -e "$w" ] && [[ "$(basename "$w")" != megatron_core-* ]] && extra+=("$w")
        done
        if [ "${#extra[@]}" -gt 0 ]; then
            "$PY" -m pip install -q --no-index --no-deps --target "$site" "${extra[@]}" \
                || return 1
            echo "carried wheels -> $site: ${extra[*]##*/}"
        fi
    fi
    [ -d "$site" ] && export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    # asked from / : from the repository root the current folder would always import it
    if [ "$(cd / && "$PY" -c 'import megatron_zeppelin, os; print(os.path.dirname(
os.path.dirname(os.path.abspath(megatron_zeppelin.__file__))))' 2> /dev/null)" = "$ROOT" ]; then
        echo "megatron_zeppelin is already importable from $ROOT"
    # --no-deps: the machine's own torch is never replaced; --no-index: no network needed
    elif ! "$PY" -m pip install -q --no-deps --no-build-isolation --no-index -e "$ROOT"; then
        echo "pip install -e failed; building the C++ twins in place and using PYTHONPATH"
        "$PY" setup.py -q build_ext --inplace || return 1
        export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
    fi
    (cd / && "$PY" -c "import megatron_zeppelin") || return 1
    "$PY" -c "import importlib.util as u; print('optional here: scipy (FlexSP only)',
bool(u.find_spec('scipy')), '| pydantic (Megatron-LM only)', bool(u.find_spec('pydantic')))"
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
step bench-kernels 1200 "${ZEPPELIN[@]}" bench kernels --device "$DEVICE" \
    --json "$OUT/bench-kernels.json"
step bench-engine 1800 "${ZEPPELIN[@]}" bench engine --device "$DEVICE"

# ---------------------------------------------------------------- 6. one-GPU training
# the issue's run: bf16, 128K tokens per iteration (a micro-batch of 8 x 16K per pool of 1);
# the built-in corpus has documents longer than 16K: split into pieces (--zeppelin-overlong)
MODEL=(--device cuda --bf16 --num-layers 4 --hidden-size 1024 --num-attention-heads 16
       --num-query-groups 4 --seq-length 16384 --micro-batch-size 8 --global-batch-size 8)
FAST=native TARGET=250000
if [ "$CPU_DRY_RUN" = 1 ]; then
    MODEL=(--device cpu --num-layers 2 --hidden-size 64 --num-attention-heads 4
           --num-query-groups 2 --seq-length 4096 --micro-batch-size 2 --global-batch-size 2)
    FAST=auto TARGET=0
fi
TRAIN=("${MODEL[@]}" --vocab-size 256 --mock-data --context-parallel-mode zeppelin
       --context-parallel-size 1 --zeppelin-gpus-per-node 1 --zeppelin-overlong split
       --lr 3e-4 --min-lr 3e-5 --lr-warmup-iters 2 --lr-decay-style cosine --log-interval 1
       --seed 1234)
train() {  # train NAME BACKEND ITERS: log in OUT/NAME.log, one JSON line per iteration
    rm -f "$OUT/$1.jsonl"
    step "$1" 2400 "$PY" -m torch.distributed.run --standalone --nproc-per-node 1 \
        scripts/pretrain_gpt.py "${TRAIN[@]}" --train-iters "$3" \
        --zeppelin-attention-backend "$2" --log-json "$OUT/$1.jsonl"
}
train train-native "$FAST" "$ITERS"
train train-reference torch 3

# losses and tokens/s from the runs' JSON logs
if "$PY" scripts/gpu_check_training.py "$OUT" --min-tokens-per-s "$TARGET" \
        > "$OUT/training-summary.log" 2>&1; then
    note "PASS  training targets"
else
    note "FAIL  training targets (see $OUT/training-summary.log)"
    FAILED=1
fi

# ---------------------------------------------------------------- 7. Megatron-LM (optional)
if [ "$CPU_DRY_RUN" = 1 ]; then
    note "SKIP  megatron-lm (GPU only; the dry run does not start it)"
else
    echo "== megatron-lm: scripts/gpu_check_megatron_lm.sh" | tee "$OUT/megatron-lm.log"
    start=$SECONDS
    MLM_DIR="${MLM_DIR:-${MEGATRON_LM_PATH:-$ROOT/.megatron-lm}}" \
    OUT="$OUT/megatron-lm" PYTHON="$PY" WHEELS="$ROOT/.whl" timeout 5400 \
        bash scripts/gpu_check_megatron_lm.sh >> "$OUT/megatron-lm.log" 2>&1
    rc=$?
    if [ "$rc" -eq 0 ] && ! grep -q "^PASS:" "$OUT/megatron-lm.log"; then
        note "SKIP  megatron-lm: none of its checks could run here ($((SECONDS - start)) s):"
    elif [ "$rc" -eq 0 ]; then
        note "PASS  megatron-lm ($((SECONDS - start)) s):"
    else
        note "FAIL  megatron-lm (exit $rc after $((SECONDS - start)) s; see" \
             "$OUT/megatron-lm.log):"
        FAILED=1
    fi
    grep -E "^(PASS|FAIL|SKIP): " "$OUT/megatron-lm.log" | sed 's/^/        /' | tee -a "$SUMMARY"
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
