# Sourced by scripts/gpu_check.sh (see its header): the prelude (environment, install), the step
# runner and one function per step (step_NAME, NAME's dashes as underscores). A step function
# runs in its own bash under `timeout` (its whole process group is stopped at the limit) with
# its output in DIR/NAME.log; its exit status is the step's: 0 PASS, 77 SKIP (could not run
# here), anything else FAIL. FIGURES[NAME]: the log lines (an extended regex) copied into the
# summary after the step's PASS/FAIL line.
declare -A FIGURES=(
    [kernel-tests]=' in [0-9.]+s( \(.*\))?( =+)?$'
    [rank-tests]=' in [0-9.]+s( \(.*\))?( =+)?$'
    [contract-tests]=' in [0-9.]+s( \(.*\))?( =+)?$'
    [bench-kernels]='^  target |^  targets: '
    [bench-engine]='^  local-only plan|^  ring path|^    (fwd|bwd|fwd \+ bwd): '
    [bench-ranks]='^  [0-9]+ ranks on one GPU|^  engine, 2 ranks|^  single process'
    [train]='^(fast backend|losses|reference path|no iterations)'
    [megatron-lm]='^(PASS|FAIL|SKIP): '
    [megatron-lm-cp]='^(PASS|FAIL|SKIP): '
    [mcore-versions]='^(PASS|FAIL|SKIP): '
)

prelude() {  # the environment (exit 2 without a usable CUDA torch) and the install
    if ! GPU_CHECK_CPU="$CPU_DRY_RUN" "$PY" - > "$DIR/environment.log" 2>&1 <<'EOF'
import os
import sys
import torch
print("python", sys.version.split()[0], "| torch", torch.__version__, "| cuda", torch.version.cuda)
if torch.cuda.is_available():
    print("gpu", torch.cuda.get_device_name(), "| capability", torch.cuda.get_device_capability())
    print("flash kernel", hasattr(torch.ops.aten, "_flash_attention_forward"), "| cudnn",
          torch.backends.cudnn.version())
    from importlib import metadata  # the optional kernels' packages (backends te, flash_attn*)
    found = []
    for name in ("transformer_engine", "flash_attn", "flash_attn_3"):
        try:
            found.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            found.append(f"{name} absent")
    print(" | ".join(found))
elif os.environ["GPU_CHECK_CPU"] != "1":
    sys.exit("torch.cuda.is_available() is False: this is not a GPU machine (or torch is CPU-only)")
EOF
    then
        cat "$DIR/environment.log" >&2
        echo "gpu_check: no usable CUDA torch; nothing checked" >&2
        note "FAIL  environment: no usable CUDA torch (see $DIR/environment.log)"
        return 2
    fi
    sed 's/^/      /' "$DIR/environment.log" | tee -a "$SUMMARY"
    command -v nvidia-smi > /dev/null && nvidia-smi > "$DIR/nvidia-smi.log" 2>&1
    local before after
    before="$(grep -o 'torch [^ ]*' "$DIR/environment.log" | head -n 1)"
    echo "== install" > "$DIR/install.log"
    if ! install >> "$DIR/install.log" 2>&1; then
        note "FAIL  install (see $DIR/install.log); nothing else can run"
        cat "$DIR/install.log" >&2
        return 1
    fi
    note "PASS  install ($(tail -n 1 "$DIR/install.log"))"
    after="$(grep -o '| torch [^ ]*' "$DIR/install.log" | tail -n 1)"
    if [ "| $before" != "$after" ]; then
        note "FAIL  install changed torch: $before -> ${after#| }"
        FAILED=1
    fi
}

install() {  # megatron-core from a carried wheel, pydantic, this package (no network)
    local site="$BUILD/site-packages"
    [ -d "$site" ] && export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    local found
    found="$(cd / && "$PY" -c 'import importlib.util as u, os
def spec(name):  # find_spec imports a dotted name'"'"'s parents, which may be absent
    try:
        return u.find_spec(name)
    except ImportError:
        return None
for m in ("megatron.core", "pydantic"):
    print(m, spec(m) is not None)
z = spec("megatron_zeppelin")
print("zeppelin", os.path.dirname(os.path.dirname(z.origin)) if z else "")')" || return 1
    if [[ "$found" == *"megatron.core False"* ]]; then
        local wheels=("$ROOT"/.whl/megatron_core-0.16.1-*.whl)
        if [ ! -e "${wheels[0]}" ]; then
            echo "megatron-core is not installed and no wheel was carried: see the header of" \
                 "scripts/gpu_check.sh (.whl/megatron_core-0.16.1-*.whl)"
            return 1
        fi
        "$PY" -m pip install -q --no-index --no-deps --target "$site" "${wheels[0]}" || return 1
        echo "megatron-core from ${wheels[0]} -> $site"
    fi
    if [[ "$found" == *"pydantic False"* ]]; then  # Megatron-LM's (megatron-lm) only
        local extra=() w
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
    if [[ "$found" == *"zeppelin $ROOT" ]]; then
        echo "megatron_zeppelin is already importable from $ROOT"
    # --no-deps: the machine's own torch is never replaced; --no-index: no network needed
    elif ! "$PY" -m pip install -q --no-deps --no-build-isolation --no-index -e "$ROOT"; then
        echo "pip install -e failed; building the C++ twins in place and using PYTHONPATH"
        "$PY" setup.py -q build_ext --inplace || return 1
        export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
    fi
    (cd / && "$PY" -c "import megatron_zeppelin, megatron.core, torch; \
print('megatron_zeppelin', megatron_zeppelin.__file__, '| megatron-core', \
megatron.core.__version__, '| torch', torch.__version__)")
}

run_step() {  # NAME: run step_NAME under the time limit; PASS/FAIL/SKIP and figures to SUMMARY
    local name="$1" log="$DIR/$1.log" start=$SECONDS rc took
    echo "== $name ($(date -u +%H:%M:%S)): ${WHAT[$name]}" | tee "$log"
    timeout -k 10 "$STEP_LIMIT_S" bash -c "step_${name//-/_}" >> "$log" 2>&1
    rc=$?
    took=$((SECONDS - start))
    case "$rc" in
        0) note "PASS  $name (${took} s; estimate ${ESTIMATE[$name]} s)" ;;
        77) note "SKIP  $name (${took} s): could not run here (see $log)" ;;
        124|137) note "FAIL  $name: ran past the ${STEP_LIMIT_S} s limit (see $log)"
                 FAILED=1 ;;
        *) note "FAIL  $name (exit $rc after ${took} s; see $log)"
           FAILED=1 ;;
    esac
    grep -E "${FIGURES[$name]}" "$log" | sed 's/^ */        /' | tee -a "$SUMMARY"
}

pytest_step() {  # pytest ARGS (the dry run only collects: the tests need a GPU)
    if [ "$CPU_DRY_RUN" = 1 ]; then
        "$PY" -m pytest -q --collect-only "$@"
    else
        "$PY" -m pytest -q -rs "$@"
    fi
}
step_kernel_tests() {
    pytest_step -m gpu tests/test_gpu.py -k "not four_ranks" --junitxml "$DIR/kernel-tests.xml"
}
step_rank_tests() {
    pytest_step -m gpu tests/test_gpu.py -k four_ranks --junitxml "$DIR/rank-tests.xml"
}
step_contract_tests() {
    pytest_step tests/test_native_backend.py tests/test_kernels.py
}

step_bench_kernels() {  # TINY: the dry run's sizes (plumbing only)
    TINY=()
    [ "$CPU_DRY_RUN" = 1 ] && TINY=(--tokens 64,256 --iters 2 --repeats 1 --synced 2)
    "$PY" -m megatron_zeppelin.cli bench kernels --device "$DEVICE" "${TINY[@]}" \
        --json "$DIR/bench-kernels.json"
}
engine_tiny() {  # TINY for every part; TINY_RING only where the ring part runs
    TINY=() TINY_RING=()
    [ "$CPU_DRY_RUN" = 1 ] && TINY=(--lengths 512,128,33,5 --heads 4 --kv-heads 2
                                    --head-dim 32 --iters 1 --warmup 0) \
        && TINY_RING=(--ring-lengths 256,64,5)
}
step_bench_engine() {
    engine_tiny
    "$PY" -m megatron_zeppelin.cli bench engine --device "$DEVICE" --parts local,ring \
        "${TINY[@]}" "${TINY_RING[@]}"
}
step_bench_ranks() {
    engine_tiny
    local part=gpu-ranks  # bench engine's multi-rank part of this device
    [ "$DEVICE" = cpu ] && part=cpu-ranks
    "$PY" -m megatron_zeppelin.cli bench engine --device "$DEVICE" --parts "$part" \
        "${TINY[@]}"
}

step_train() {  # two one-GPU runs (JSON logs), then their targets (gpu_check_training.py)
    # bf16, 128K tokens per iteration (a micro-batch of 8 x 16K per pool of 1); the built-in
    # corpus has documents longer than 16K: split into pieces (--zeppelin-overlong)
    local model=(--device cuda --bf16 --num-layers 4 --hidden-size 1024 --num-attention-heads 16
                 --num-query-groups 4 --seq-length 16384 --micro-batch-size 8
                 --global-batch-size 8) fast=native target=250000 name
    if [ "$CPU_DRY_RUN" = 1 ]; then
        model=(--device cpu --num-layers 2 --hidden-size 64 --num-attention-heads 4
               --num-query-groups 2 --seq-length 4096 --micro-batch-size 2 --global-batch-size 2)
        fast=auto target=0
    fi
    local common=("${model[@]}" --vocab-size 256 --mock-data --context-parallel-mode zeppelin
                  --context-parallel-size 1 --zeppelin-gpus-per-node 1
                  --zeppelin-overlong split --lr 3e-4 --min-lr 3e-5 --lr-warmup-iters 2
                  --lr-decay-style cosine --log-interval 1 --seed 1234)
    for name in native reference; do
        rm -f "$DIR/train-$name.jsonl"
        local backend=$fast iters=$ITERS
        [ "$name" = reference ] && backend=torch iters=3
        echo "== train-$name"
        "$PY" -m torch.distributed.run --standalone --nproc-per-node 1 scripts/pretrain_gpt.py \
            "${common[@]}" --train-iters "$iters" --zeppelin-attention-backend "$backend" \
            --log-json "$DIR/train-$name.jsonl" || echo "train-$name exited $?"
    done
    "$PY" scripts/gpu_check_training.py "$DIR" --min-tokens-per-s "$target"
}

mlm_checks() {  # CHECKS of scripts/gpu_check_megatron_lm.sh; 77 (SKIP) when none could run
    if [ "$CPU_DRY_RUN" = 1 ]; then
        echo "SKIP: GPU only (the dry run does not start Megatron-LM)"
        return 77
    fi
    local out rc
    out="$(MLM_DIR="${MLM_DIR:-${MEGATRON_LM_PATH:-$ROOT/.megatron-lm}}" \
           OUT="$DIR/megatron-lm" WORK="$BUILD/megatron-lm" PYTHON="$PY" WHEELS="$ROOT/.whl" \
           bash scripts/gpu_check_megatron_lm.sh --checks "$1" 2>&1)"
    rc=$?
    echo "$out"
    [ "$rc" = 0 ] && ! grep -q "^PASS:" <<< "$out" && return 77
    return "$rc"
}
step_megatron_lm() { mlm_checks 1; }
step_megatron_lm_cp() { mlm_checks 2,3; }
step_mcore_versions() { mlm_checks 4; }

export ROOT DIR BUILD PY DEVICE CPU_DRY_RUN ITERS
export -f pytest_step step_kernel_tests step_rank_tests step_contract_tests step_bench_kernels \
    engine_tiny step_bench_engine step_bench_ranks step_train mlm_checks step_megatron_lm \
    step_megatron_lm_cp step_mcore_versions
