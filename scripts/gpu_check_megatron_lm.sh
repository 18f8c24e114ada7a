#!/usr/bin/env bash
# GPU checks of the Megatron-LM drop-in (issue 11), one command on a CUDA machine.
# scripts/gpu_check.sh runs checks 1-3 as its step megatron-lm and check 4 as its step
# mcore-versions (MLM_DIR default .megatron-lm/); on its own too:
#
#   MLM_DIR=/path/to/Megatron-LM WHEELS=.whl scripts/gpu_check_megatron_lm.sh [--checks 1,2,3,4]
#
# --checks LIST: the checks to run (default all); each training run stops at 210 s, so that
# checks 1-3 (two runs on one GPU) and check 4 (two runs) each fit gpu_check.sh's 480 s step.
# MLM_DIR: a Megatron-LM checkout at a tag patches/ has (core_v0.16.1 ... core_v0.19.0; a
#   patched copy is made under $OUT).
# WHEELS: a folder with megatron_core-0.16.1 and -0.19.2 wheels for this Python (GPU-FACTS.md
#   says how to download them); check 4 is skipped without them.
# OUT (default /tmp/gpu_check_megatron_lm): logs. WORK (default OUT): scratch (the patched
# Megatron-LM copy, the megatron-core installs). PYTHON (default python3).
# Checks (each prints PASS / FAIL / SKIP and its numbers; exit status 0 iff none failed):
#   1. Megatron-LM pretrain_gpt.py on one GPU, bf16, Megatron's default position embedding
#      (learned_absolute), TE layers when Transformer Engine imports (else local): zeppelin
#      (a pool of 1) and static losses agree within 0.05 per iteration; tokens/s of both.
#   2. With >= 2 GPUs and TE: CP 2 with --reset-position-ids --reset-attention-mask, zeppelin
#      vs Megatron's own TE context parallelism: losses within 0.05, tokens/s side by side.
#   3. With >= 2 GPUs: MoE (4 experts, alltoall, EP 2), zeppelin CP 2 runs and its loss falls.
#   4. scripts/pretrain_gpt.py (--device cuda --bf16) with megatron-core 0.16.1 and 0.19.2,
#      same seed: iteration 1 identical (same initial weights, and the forward is
#      deterministic: the flash forward has no atomics, the GEMMs have fixed shapes on one
#      GPU), every later iteration within one bf16 spacing of the loss. Derivation: the flash
#      backward adds dq's partial sums with float32 atomics in a run-dependent order, so from
#      iteration 2 the weights differ by rounding and so do the losses, even between two runs
#      of one version. The model computes in bf16 (8 significant bits), whose numbers are
#      2^(e-7) apart in [2^e, 2^(e+1)): for a loss in [4, 8) 0.03125, in [2, 4) 0.0156. A loss
#      difference within that spacing is the resolution of a bf16 computation; beyond it the
#      two versions computed something different. (FlashAttention's deterministic backward is
#      not reachable through torch's aten op, hence a tolerance rather than equality.)
# Only this machine's missing tools are stood in for (the bare GPU image has no make/nvcc):
# megatron-core's prebuilt helpers_cpp is copied into the Megatron-LM tree, a no-op `make` is
# put on PATH when the real one fails, a stand-in `nvcc -V` when CUDA_HOME has none (Megatron's
# fused_kernels.load() only parses its version), and TORCHDYNAMO_DISABLE=1 (no C compiler for
# torch.compile'd fusions).
set -uo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
CHECKS=1,2,3,4
while [ $# -gt 0 ]; do
    case "$1" in
        --checks) [ $# -ge 2 ] || { echo "gpu_check_megatron_lm: --checks needs a value" >&2
                                    exit 2; }
                  CHECKS=$2; shift ;;
        --checks=*) CHECKS=${1#--checks=} ;;
        *) echo "gpu_check_megatron_lm: unknown argument '$1' (expected --checks LIST)" >&2
           exit 2 ;;
    esac
    shift
done
if ! [[ "$CHECKS" =~ ^[1-4](,[1-4])*$ ]]; then
    echo "gpu_check_megatron_lm: --checks=$CHECKS is invalid: expected a comma list of 1-4" >&2
    exit 2
fi
wants() { [[ ",$CHECKS," == *",$1,"* ]]; }
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/gpu_check_megatron_lm}
WORK=${WORK:-$OUT}
RUN_LIMIT_S=210
MLM_DIR=${MLM_DIR:-${MEGATRON_LM_PATH:-}}
mkdir -p "$OUT" "$WORK"
status=0
report() { echo "$1: $2"; [ "$1" = FAIL ] && status=1; return 0; }

gpus=$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
if [ "$gpus" -lt 1 ]; then
    echo "gpu_check_megatron_lm: no CUDA device visible" >&2
    exit 2
fi
te=$("$PY" -c 'import transformer_engine' >/dev/null 2>&1 && echo 1 || echo 0)
export CUDA_DEVICE_MAX_CONNECTIONS=1 TORCHDYNAMO_DISABLE=${TORCHDYNAMO_DISABLE:-1}

# ------------------------------------------------------------------ a patched Megatron-LM copy
tree="$WORK/Megatron-LM"
if ! wants 1 && ! wants 2 && ! wants 3; then
    tree=""
elif [ -n "$MLM_DIR" ] && [ -f "$MLM_DIR/pretrain_gpt.py" ]; then
    rm -rf "$tree" && mkdir -p "$tree"
    (cd "$MLM_DIR" && tar --exclude=.git --exclude=tests -cf - .) | tar -xf - -C "$tree"
    bash "$here/scripts/apply_megatron_patch.sh" "$tree" > "$OUT/apply.log" 2>&1 \
        || { cat "$OUT/apply.log"; tree=""; }
else
    tree=""
fi
if [ -n "$tree" ]; then
    so=$("$PY" -c 'import importlib.util as u; print(u.find_spec("megatron.core.datasets.helpers_cpp").origin)' 2>/dev/null | tail -1)
    [ -f "$so" ] && cp "$so" "$tree/megatron/core/datasets/"
    shim="$WORK/shim" && mkdir -p "$shim/cuda/bin"
    if ! make -C "$tree/megatron/core/datasets" > "$OUT/make.log" 2>&1; then
        printf '#!/bin/sh\nexit 0\n' > "$shim/make" && chmod +x "$shim/make"
        export PATH="$shim:$PATH"
    fi
    cuda_home=$("$PY" -c 'from torch.utils.cpp_extension import CUDA_HOME; print(CUDA_HOME or "")' 2>/dev/null | tail -1)
    if [ -z "$cuda_home" ] || [ ! -x "$cuda_home/bin/nvcc" ]; then
        v=$("$PY" -c 'import torch; print(torch.version.cuda)')
        printf '#!/bin/sh\necho "Cuda compilation tools, release %s, V%s.0"\n' "$v" "$v" > "$shim/cuda/bin/nvcc"
        chmod +x "$shim/cuda/bin/nvcc" && export CUDA_HOME="$shim/cuda"
    fi
fi

impl=local
[ "$te" = 1 ] && impl=transformer_engine
COMMON=(--mock-data --tokenizer-type NullTokenizer --vocab-size 32000 --split 90,10,0
        --num-workers 0 --num-layers 4 --hidden-size 1024 --ffn-hidden-size 2816
        --num-attention-heads 16 --group-query-attention --num-query-groups 4 --swiglu
        --normalization RMSNorm --disable-bias-linear --seq-length 4096
        --max-position-embeddings 4096 --micro-batch-size 1 --global-batch-size 8
        --train-iters 10 --eval-iters 1 --eval-interval 1000 --log-interval 1 --lr 3e-4
        --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 2 --bf16 --seed 1234
        --calculate-per-token-loss --attention-dropout 0.0 --hidden-dropout 0.0
        --transformer-impl "$impl")
[ "$te" = 0 ] && COMMON+=(--no-gradient-accumulation-fusion --no-masked-softmax-fusion
                          --no-bias-swiglu-fusion --no-bias-dropout-fusion --no-rope-fusion
                          --no-persist-layer-norm)

mlm() {  # name nproc flags... -> log; prints the losses
    local name=$1 n=$2
    shift 2
    (cd "$tree" && timeout "$RUN_LIMIT_S" "$PY" -m torch.distributed.run --standalone \
        --nproc-per-node "$n" pretrain_gpt.py \
        "${COMMON[@]}" "$@") > "$OUT/$name.log" 2>&1
    grep -o "lm loss: [0-9.E+-]*" "$OUT/$name.log" | awk '{print $3}' | tr '\n' ' '
}
throughput() {  # tokens/s from Megatron's "elapsed time per iteration (ms)"
    grep -o "elapsed time per iteration (ms): [0-9.]*" "$OUT/$1.log" | tail -5 |
        awk -v t="$2" '{s += $NF; n++} END {if (n) printf "%.0f", t * 1000 / (s / n); else print "?"}'
}
close() {  # "a b ..." "c d ..." tol -> 0 when every pair is within tol
    "$PY" - "$1" "$2" "$3" <<'EOF'
import sys
a, b = [list(map(float, s.split())) for s in sys.argv[1:3]]
sys.exit(0 if a and len(a) == len(b) and all(abs(x - y) <= float(sys.argv[3]) for x, y in zip(a, b)) else 1)
EOF
}
tokens=$((8 * 4096))

if ! wants 1 && ! wants 2 && ! wants 3; then
    :
elif [ -z "$tree" ]; then
    report SKIP "1-3 Megatron-LM (set MLM_DIR to a checkout at a patched tag, e.g. core_v0.19.0)"
else
    if wants 1; then
        z=$(mlm zeppelin1 1 --context-parallel-mode zeppelin --context-parallel-size 1)
        s=$(mlm static1 1 --context-parallel-mode static --context-parallel-size 1)
        if close "$z" "$s" 0.05; then r=PASS; else r=FAIL; fi
        report $r "1 one GPU ($impl): zeppelin [$z] static [$s]; tokens/s zeppelin $(throughput zeppelin1 $tokens) static $(throughput static1 $tokens)"
    fi
    if ! wants 2; then
        :
    elif [ "$gpus" -ge 2 ] && [ "$te" = 1 ]; then
        docs=(--reset-position-ids --reset-attention-mask --position-embedding-type rope)
        z=$(mlm zeppelin2 2 "${docs[@]}" --context-parallel-mode zeppelin --context-parallel-size 2)
        s=$(mlm static2 2 "${docs[@]}" --context-parallel-mode static --context-parallel-size 2)
        if close "$z" "$s" 0.05; then r=PASS; else r=FAIL; fi
        report $r "2 CP 2: zeppelin [$z] TE CP [$s]; tokens/s zeppelin $(throughput zeppelin2 $tokens) static $(throughput static2 $tokens)"
    else
        report SKIP "2 CP 2 needs 2 GPUs and Transformer Engine (static CP > 1 is TE's)"
    fi
    if ! wants 3; then
        :
    elif [ "$gpus" -ge 2 ]; then
        z=$(mlm moe2 2 --context-parallel-mode zeppelin --context-parallel-size 2 --num-experts 4 \
            --moe-router-topk 2 --moe-token-dispatcher-type alltoall --expert-model-parallel-size 2 \
            --moe-aux-loss-coeff 0.01)
        first=$(echo "$z" | awk '{print $1}') last=$(echo "$z" | awk '{print $NF}')
        if [ -n "$z" ] && "$PY" -c "import sys; sys.exit(0 if float('$last') < float('$first') else 1)"; then
            r=PASS; else r=FAIL; fi
        report $r "3 MoE EP 2 zeppelin CP 2: [$z]"
    else
        report SKIP "3 MoE needs 2 GPUs"
    fi
fi

# ------------------------------------------------------------------ megatron-core 0.16.1 vs 0.19.2
WHEELS=${WHEELS:-$here/.whl}
if ! wants 4; then
    :
elif ls "$WHEELS"/megatron_core-0.16.1*.whl "$WHEELS"/megatron_core-0.19.2*.whl > /dev/null 2>&1; then
    losses=()
    for v in 0.16.1 0.19.2; do
        site="$WORK/site-$v" && rm -rf "$site"
        "$PY" -m pip install -q --no-index --no-deps --target "$site" "$WHEELS"/megatron_core-$v*.whl
        rm -f "$OUT/ours-$v.json"
        PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" timeout "$RUN_LIMIT_S" "$PY" \
            -m torch.distributed.run --standalone --nproc-per-node 1 \
            "$here/scripts/pretrain_gpt.py" --device cuda --bf16 --mock-data --vocab-size 256 \
            --context-parallel-mode zeppelin --zeppelin-overlong split \
            --num-layers 4 --hidden-size 512 --num-attention-heads 8 --seq-length 4096 \
            --global-batch-size 4 --train-iters 8 --seed 7 --log-json "$OUT/ours-$v.json" \
            > "$OUT/ours-$v.log" 2>&1
        losses+=("$("$PY" -c "import json, sys; print(' '.join(str(json.loads(l)['loss']) for l in open(sys.argv[1])))" "$OUT/ours-$v.json" 2>/dev/null)")
    done
    verdict=$("$PY" "$here/scripts/gpu_check_losses.py" "${losses[0]}" "${losses[1]}")
    if [ $? = 0 ]; then r=PASS; else r=FAIL; fi
    report $r "4 scripts/pretrain_gpt.py megatron-core 0.16.1 [${losses[0]}] 0.19.2 [${losses[1]}]: $verdict"
else
    report SKIP "4 megatron-core 0.16.1 vs 0.19.2 (no wheels in $WHEELS)"
fi
echo "logs: $OUT"
exit $status
