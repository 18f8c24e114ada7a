# megatron-zeppelin on NVIDIA's PyTorch container: CUDA, NCCL, torch, Transformer Engine and
# Apex come with the base image; this adds megatron-core and the package (C++ router and planner
# built by setup.py).
#
#   docker build -t megatron-zeppelin .        # megatron-core 0.16.1 (the version CI tests)
#   docker build --build-arg MCORE_VERSION=0.19.2 -t megatron-zeppelin .   # any in setup.py's
#                                                # range (>=0.16.1,<0.20); 0.17+ needs Python 3.12
#   docker run --gpus all --rm megatron-zeppelin python -m pytest -q
#   ZEPPELIN_IMAGE=megatron-zeppelin sbatch --nodes=4 scripts/slurm/zeppelin.sbatch CONFIG.yaml ...
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:25.10-py3
FROM ${BASE_IMAGE}
ARG MCORE_VERSION=0.16.1

WORKDIR /workspace/megatron-zeppelin
COPY . .

# --no-deps keeps the image's own torch and Transformer Engine; the pure-Python requirements
# of setup.py (install_requires less torch and megatron-core, the test extra) are installed
# explicitly: the image's torch is a pre-release build that pip would otherwise replace.
RUN pip install --no-cache-dir --no-deps "megatron-core==${MCORE_VERSION}" \
 && pip install --no-cache-dir numpy "scipy>=1.9" "pyyaml>=6" tqdm matplotlib psutil \
        "pybind11>=2.12" \
        "pytest>=8" "hypothesis>=6" \
 && pip install --no-cache-dir --no-deps --no-build-isolation -e . \
 && python -c "import megatron_zeppelin._router_cpp, megatron_zeppelin._planner_cpp, megatron.core; \
from megatron_zeppelin.megatron.common import compat; compat.check_megatron_core(); print('megatron-zeppelin ready')"

ENV PYTHONUNBUFFERED=1
CMD ["zeppelin", "--help"]
