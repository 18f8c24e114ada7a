# megatron-zeppelin on NVIDIA's PyTorch container: CUDA, NCCL, torch, Transformer Engine and
# Apex come with the base image; this adds megatron-core 0.16.1 and the package (C++ router
# built by setup.py).
#
#   docker build -t megatron-zeppelin .
#   docker run --gpus all --rm megatron-zeppelin python -m pytest -q
#   ZEPPELIN_IMAGE=megatron-zeppelin sbatch --nodes=4 scripts/slurm/zeppelin.sbatch CONFIG.yaml ...
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:25.10-py3
FROM ${BASE_IMAGE}

WORKDIR /workspace/megatron-zeppelin
COPY . .

# --no-deps keeps the image's own torch and Transformer Engine; the pure-Python requirements
# of setup.py are installed explicitly.
RUN pip install --no-cache-dir --no-deps megatron-core==0.16.1 \
 && pip install --no-cache-dir "pyyaml>=6" tqdm matplotlib psutil "pybind11>=2.12" \
        "pytest>=8" "hypothesis>=6" \
 && pip install --no-cache-dir --no-deps --no-build-isolation -e . \
 && python -c "import megatron_zeppelin._router_cpp, megatron.core; print('megatron-zeppelin ready')"

ENV PYTHONUNBUFFERED=1
CMD ["zeppelin", "--help"]
