#!/usr/bin/env bash
# Apply patches/megatron-lm-core_v0.16.1.patch to a Megatron-LM checkout (tag core_v0.16.1),
# so that its own pretrain_gpt.py accepts --context-parallel-mode zeppelin.
#
#   scripts/apply_megatron_patch.sh /path/to/Megatron-LM
#
# Idempotent: a checkout that already has the patch is left as it is.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
patch="$here/patches/megatron-lm-core_v0.16.1.patch"
target=${1:?usage: scripts/apply_megatron_patch.sh PATH_TO_MEGATRON_LM}
if [ ! -f "$target/pretrain_gpt.py" ] || [ ! -f "$target/megatron/training/arguments.py" ]; then
    echo "apply_megatron_patch: $target is not a Megatron-LM checkout (no pretrain_gpt.py or" \
         "megatron/training/arguments.py)" >&2
    exit 2
fi
cd "$target"
if git apply --reverse --check "$patch" 2>/dev/null; then
    echo "apply_megatron_patch: already applied in $target"
    exit 0
fi
if ! git apply --check "$patch" 2>/dev/null; then
    echo "apply_megatron_patch: the patch does not apply to $target; it is made for Megatron-LM" \
         "tag core_v0.16.1 (git -C $target checkout core_v0.16.1)" >&2
    exit 1
fi
git apply "$patch"
echo "apply_megatron_patch: patched $target (pretrain_gpt.py, megatron/training/arguments.py)"
echo "  run: torchrun ... pretrain_gpt.py --context-parallel-mode zeppelin" \
     "--context-parallel-size N --calculate-per-token-loss ..."
