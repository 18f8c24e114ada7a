#!/usr/bin/env bash
# Check megatron-zeppelin on a GPU machine, in steps that each fit a 10-minute command, from the
# repository root:
#
#     bash scripts/gpu_check.sh                      # the quick set (under 8 minutes on one H100)
#     bash scripts/gpu_check.sh --list               # every step, its estimate, the quick set
#     bash scripts/gpu_check.sh --step rank-tests --step megatron-lm   # or a comma list
#     bash scripts/gpu_check.sh --step all           # every step (several calls' worth)
#
# Every invocation first records the environment (the GPU, torch, CUDA: never changed by this
# script) and installs what is missing (megatron-core 0.16.1 from a carried wheel, below, then
# this package with --no-deps --no-index), then runs the steps asked for, each under `timeout`
# 480 s (running past it is a FAIL). Results go to --out DIR, else $OUT when set (the device
# tool's folder), else build/gpu_check: one log per step (DIR/STEP.log) and DIR/summary.txt,
# which every step appends to (a header per invocation, PASS/FAIL/SKIP per step with its
# figures, a RESULT line), so that steps run by separate calls add up in one file.
# Exit status: 0 when every step that ran passed (SKIP: could not run here, e.g. nothing
# carried; listed, not failed), 1 when a step failed or missed a target, 2 on a bad argument or
# with no usable CUDA torch.
#
# Steps (estimates for one H100 from GPU-FACTS' figures; `--list` prints them):
#   kernel-tests    tests/test_gpu.py but the 4-rank tests: every backend vs float64, the CPU
#                   stand-in vs the real kernel, the hot path under sync debug mode
#   rank-tests      tests/test_gpu.py's 4 ranks on one GPU (engine vs float64, a windowed ring
#                   by halo exchange vs float64, inside a node and across 2 emulated nodes in
#                   the routed global steps, a tiny GPT vs one process; gloo with the staged
#                   transport)
#   contract-tests  the native backend's CPU contract tests (tests/test_native_backend.py,
#                   tests/test_kernels.py)
#   bench-kernels   `zeppelin bench kernels --device cuda`: block call vs raw kernel, stream and
#                   synced per call; targets ratio <= 1.05 at >= 4K tokens, <= 20 us extra
#   bench-engine    `zeppelin bench engine --device cuda --parts local,ring`: local-only engine
#                   vs raw kernels (<= 1.10x); ring path (4 positions on the GPU) vs the raw
#                   kernels of the same blocks (<= 1.5x), overhead per block in us
#   bench-ranks     `zeppelin bench engine --parts gpu-ranks`: 4 ranks on the one GPU (staged
#                   transport) vs one process (no target: a shared GPU; it must run)
#   train           one-GPU bf16 training (scripts/pretrain_gpt.py: 4 layers, hidden 1024,
#                   16/4 heads, seq 16K, 128K tokens per iteration) with the native backend
#                   (target >= 250K tokens/s) and the torch reference path (losses within 0.02)
#   megatron-lm     scripts/gpu_check_megatron_lm.sh check 1 (Megatron-LM's pretrain_gpt.py,
#                   patched, zeppelin vs static on one GPU)
#   megatron-lm-cp  its checks 2-3 (CP 2 vs TE's CP, MoE with EP 2): SKIP with fewer than 2 GPUs
#   mcore-versions  scripts/gpu_check_megatron_lm.sh check 4 (megatron-core 0.16.1 vs 0.19.2,
#                   losses within a bf16 tolerance)
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
#   .megatron-lm/ (~7 MB; megatron-lm is SKIP without it): Megatron-LM at tag core_v0.16.1,
#   its megatron/ package, top-level *.py and LICENSE, already patched (git may be missing):
#     git clone -q --depth 1 -b core_v0.16.1 https://github.com/NVIDIA/Megatron-LM /tmp/mlm
#     mkdir -p .megatron-lm && tar -C /tmp/mlm -cf - megatron LICENSE $(cd /tmp/mlm && ls *.py) |
#       tar -C .megatron-lm -xf - && scripts/apply_megatron_patch.sh .megatron-lm
#   (MLM_DIR or MEGATRON_LM_PATH may name another checkout instead; default: .megatron-lm/.)
#
# Environment: PYTHON (default python3), GPU_CHECK_TRAIN_ITERS (default 10), MLM_DIR, OUT.
# GPU_CHECK_CPU=1: a dry run of this script's plumbing on a machine without a GPU (--device
# cpu, tiny sizes, no targets, test steps only collected, Megatron-LM steps skipped); none of
# its figures means anything.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
STEP_LIMIT_S=480
INSTALL_ESTIMATE_S=30
ORDER=(kernel-tests rank-tests contract-tests bench-kernels bench-engine bench-ranks train
       megatron-lm megatron-lm-cp mcore-versions)
QUICK=(kernel-tests bench-kernels bench-engine train)
declare -A ESTIMATE=(
    # pytest and CUDA start ~15 s; blocks <= 2K tokens; the hot-path test spawns one process
    [kernel-tests]=60
    # 4 spawned processes x 3 tests, each starting CUDA and gloo (~15 s), small batches
    [rank-tests]=210
    # CPU tests on 16 cores
    [contract-tests]=60
    # 164 calls per row (stream 1 + 3 x 20, synced 1 + 20, ours and raw); at 64K tokens a
    # causal forward is 35 TFLOP (0.10 s at 344 TFLOP/s), a backward 0.27 s: ~60 s, the rest ~5 s
    [bench-kernels]=90
    # 40K + 32K tokens fwd + bwd (a few ms each) x 8 runs x 4 variants; planning, start
    [bench-engine]=40
    # 4 spawned processes starting CUDA and gloo, 8 runs of a 40K-token batch
    [bench-ranks]=90
    # two torchrun starts (~30 s each); native 10 x 128K tokens at ~330K tokens/s (4 s);
    # reference 3 x 128K at ~9.5K tokens/s (40 s)
    [train]=120
    # two Megatron-LM starts (~60 s each: imports, mock data, helpers) + 10 iterations of 32K
    [megatron-lm]=180
    # two runs of CP 2 and one MoE run, 2 GPUs each (~70 s each: starts dominate)
    [megatron-lm-cp]=240
    # two wheel installs (5 s) and starts (~30 s), 8 iterations of 16K tokens each
    [mcore-versions]=90
)
declare -A WHAT=(
    [kernel-tests]="GPU tests: backends vs float64, stand-in vs real kernel, hot path syncs"
    [rank-tests]="GPU tests: 4 ranks on one GPU (engine and halo exchange vs float64, tiny GPT vs 1 process)"
    [contract-tests]="the native backend's CPU contract tests"
    [bench-kernels]="block call vs raw kernel, stream + synced (<= 1.05x at >= 4K, <= 20 us)"
    [bench-engine]="local-only engine vs raw (<= 1.10x); ring path vs raw blocks (<= 1.5x)"
    [bench-ranks]="4 ranks on one GPU, staged transport, vs one process (must run)"
    [train]="one-GPU bf16 training: >= 250K tokens/s; losses vs torch path within 0.02"
    [megatron-lm]="Megatron-LM pretrain_gpt.py, zeppelin vs static (SKIP w/o .megatron-lm/)"
    [megatron-lm-cp]="Megatron-LM CP 2 vs TE CP, MoE EP 2 (SKIP with < 2 GPUs)"
    [mcore-versions]="megatron-core 0.16.1 vs 0.19.2 losses, bf16 tolerance (SKIP w/o wheels)"
)

usage() {
    sed -n '2,/^set -uo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'
}

list_steps() {
    local name total=$INSTALL_ESTIMATE_S
    printf '%-15s %9s %6s  %s\n' step estimate quick what
    for name in "${ORDER[@]}"; do
        local quick=no
        [[ " ${QUICK[*]} " == *" $name "* ]] && quick=yes && total=$((total + ESTIMATE[$name]))
        printf '%-15s %7s s %6s  %s\n' "$name" "${ESTIMATE[$name]}" "$quick" "${WHAT[$name]}"
    done
    echo "every invocation first installs (~${INSTALL_ESTIMATE_S} s); each step stops at" \
         "${STEP_LIMIT_S} s (a FAIL)"
    echo "quick set (the default): $(IFS=,; echo "${QUICK[*]}"): estimate ${total} s in all" \
         "on one H100 (GPU-FACTS' figures)"
}

# ---------------------------------------------------------------- arguments
DIR="" LIST=0 WANTED=()
while [ $# -gt 0 ]; do
    case "$1" in
        --list) LIST=1 ;;
        --step|--out)
            [ $# -ge 2 ] || { echo "gpu_check: $1 needs a value" >&2; exit 2; }
            if [ "$1" = --out ]; then DIR="$2"; else IFS=, read -ra more <<< "$2"
                WANTED+=("${more[@]}"); fi
            shift ;;
        --step=*) IFS=, read -ra more <<< "${1#--step=}"; WANTED+=("${more[@]}") ;;
        --out=*) DIR="${1#--out=}" ;;
        -h|--help) usage; exit 0 ;;
        *) echo "gpu_check: unknown argument '$1' (expected --step NAME[,NAME], --list," \
                "--out DIR; --help)" >&2; exit 2 ;;
    esac
    shift
done
[ "$LIST" = 1 ] && { list_steps; exit 0; }
[ "${#WANTED[@]}" -eq 0 ] && WANTED=(quick)
STEPS=()
for name in "${WANTED[@]}"; do
    case "$name" in
        quick) add=("${QUICK[@]}") ;;
        all) add=("${ORDER[@]}") ;;
        *) [ -n "${ESTIMATE[$name]+x}" ] || { echo "gpu_check: --step '$name' is not a step:" \
               "expected quick, all or one of ${ORDER[*]}" >&2; exit 2; }
           add=("$name") ;;
    esac
    for one in "${add[@]}"; do [[ " ${STEPS[*]} " == *" $one "* ]] || STEPS+=("$one"); done
done

PY="${PYTHON:-python3}"
ITERS="${GPU_CHECK_TRAIN_ITERS:-10}"
CPU_DRY_RUN="${GPU_CHECK_CPU:-0}"
DIR="${DIR:-${OUT:-$ROOT/build/gpu_check}}"
mkdir -p "$DIR" || { echo "gpu_check: cannot create the results folder $DIR" >&2; exit 2; }
DIR="$(cd "$DIR" && pwd)"
BUILD="$ROOT/build/gpu_check"  # scratch that must not travel back with the results
mkdir -p "$BUILD"
cd "$ROOT" || exit 2
SUMMARY="$DIR/summary.txt"
FAILED=0
DEVICE=cuda
[ "$CPU_DRY_RUN" = 1 ] && DEVICE=cpu
note() { echo "$*" | tee -a "$SUMMARY"; }
note ""
DRY=""
[ "$CPU_DRY_RUN" = 1 ] && DRY=" (GPU_CHECK_CPU=1: a dry run on CPU; no figure means anything)"
note "== gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ): steps $(IFS=,; echo "${STEPS[*]}") on" \
     "$DEVICE$DRY"

# shellcheck source=scripts/gpu_check_steps.sh
. "$ROOT/scripts/gpu_check_steps.sh"

prelude || exit $?
for name in "${STEPS[@]}"; do
    run_step "$name"
done
if [ "$FAILED" = 0 ]; then note "RESULT: PASS ($(IFS=,; echo "${STEPS[*]}"))"
else note "RESULT: FAIL ($(IFS=,; echo "${STEPS[*]}"); see the FAIL lines above)"; fi
echo "results in $DIR (summary: $SUMMARY)"
exit "$FAILED"
