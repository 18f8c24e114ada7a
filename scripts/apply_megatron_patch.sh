#!/usr/bin/env bash
# Patch a Megatron-LM checkout so that its own pretrain_gpt.py accepts
# --context-parallel-mode zeppelin (patches/megatron-lm-core_v<version>.patch, chosen by the
# version in the checkout's megatron/core/package_info.py: tags core_v0.16.1, core_v0.17.1,
# core_v0.18.2 and core_v0.19.0, which reports 0.19.1).
#
#   scripts/apply_megatron_patch.sh /path/to/Megatron-LM
#
# Idempotent: a checkout that already has the patch is left as it is. The checkout may be its
# own git repository, a plain folder, or a folder inside another repository (git is kept from
# looking above it, so the patch is applied to the checkout itself).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
arg=${1:?usage: scripts/apply_megatron_patch.sh PATH_TO_MEGATRON_LM}
files=(pretrain_gpt.py gpt_builders.py megatron/training/arguments.py
       megatron/training/yaml_arguments.py megatron/training/training.py
       megatron/core/package_info.py)
patched_files=("${files[@]:0:5}")  # the files the patch changes (not the version file)
for f in "${files[@]}"; do
    if [ ! -f "$arg/$f" ]; then
        echo "apply_megatron_patch: $arg is not a Megatron-LM checkout (no $f)" >&2
        exit 2
    fi
done
target=$(cd "$arg" && pwd -P)
version=$(cd "$target/megatron/core" && python3 -c \
    'import runpy; i = runpy.run_path("package_info.py"); print(i["MAJOR"], i["MINOR"], i["PATCH"], sep=".")')
patch="$here/patches/megatron-lm-core_v$version.patch"
if [ ! -f "$patch" ]; then
    known=$(cd "$here/patches" && ls megatron-lm-core_v*.patch | sed 's/megatron-lm-core_v//; s/.patch//' | tr '\n' ' ')
    echo "apply_megatron_patch: $target is Megatron-LM with megatron-core $version; patches exist" \
         "for: $known(git -C $target checkout core_v<version>)" >&2
    exit 1
fi
cd "$target"
# A checkout inside another repository must not be patched relative to that repository's root
# (git apply would skip every path outside the current folder and report success).
export GIT_CEILING_DIRECTORIES
GIT_CEILING_DIRECTORIES=$(dirname "$target")
patched=$( (grep -l "megatron-zeppelin" "${patched_files[@]}" || true) | wc -l)
if ! command -v git > /dev/null 2>&1; then  # e.g. a GPU image without git: the marker decides
    if [ "$patched" -eq ${#patched_files[@]} ]; then
        echo "apply_megatron_patch: already applied in $target (git not found: judged by the" \
             "megatron-zeppelin marker in ${patched_files[*]})"
        exit 0
    fi
    echo "apply_megatron_patch: git not found: it applies $patch to $target (install git, or" \
         "patch a copy where git is and bring the patched tree)" >&2
    exit 1
fi
if [ "$patched" -eq ${#patched_files[@]} ] && git apply --reverse --check "$patch" 2>/dev/null; then
    echo "apply_megatron_patch: already applied in $target"
    exit 0
fi
if [ "$patched" -ne 0 ]; then
    echo "apply_megatron_patch: $target is partly patched ($patched of ${#patched_files[@]} files" \
         "name megatron-zeppelin); restore ${patched_files[*]} first" >&2
    exit 1
fi
if ! git apply --check "$patch" 2>/dev/null; then
    echo "apply_megatron_patch: $patch does not apply to $target (local changes?)" >&2
    exit 1
fi
git apply "$patch"
if [ "$( (grep -l "megatron-zeppelin" "${patched_files[@]}" || true) | wc -l)" -ne ${#patched_files[@]} ]; then
    echo "apply_megatron_patch: git apply reported success but the files are unchanged" >&2
    exit 1
fi
echo "apply_megatron_patch: patched $target for megatron-core $version (${patched_files[*]})"
echo "  run: torchrun ... pretrain_gpt.py --context-parallel-mode zeppelin" \
     "--context-parallel-size N --calculate-per-token-loss --attention-dropout 0.0 ..."
