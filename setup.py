"""megatron-zeppelin: build and install (the one build path; it also builds csrc/).

    pip install torch==2.13.0 -e ".[test]"      # CPU development install
    pip install -e ".[gpu]"                     # on a CUDA machine with its own torch

The C++ twins (csrc/) are compiled with pybind11: the router (``csrc/router*.cpp``) as
``megatron_zeppelin._router_cpp`` and the planner (``csrc/planner*.cpp``) as
``megatron_zeppelin._planner_cpp``; the planner is built without floating-point contraction so
that its arithmetic matches the Python reference bit for bit.
"""
from pathlib import Path

from setuptools import find_packages, setup

try:
    from pybind11.setup_helpers import Pybind11Extension, build_ext
except ImportError as exc:  # pyproject.toml's build-system brings pybind11
    raise SystemExit("building megatron-zeppelin needs pybind11 (pip install pybind11)") from exc

HERE = Path(__file__).resolve().parent


def sources(prefix: str) -> list[str]:
    return sorted(str(p.relative_to(HERE)) for p in (HERE / "csrc").glob(f"{prefix}*.cpp"))


HEADERS = sorted(str(p.relative_to(HERE)) for p in (HERE / "csrc").glob("*.h"))

ext_modules = [
    Pybind11Extension(f"megatron_zeppelin._{name}_cpp", sources(name), include_dirs=["csrc"],
                      depends=HEADERS, cxx_std=17,
                      extra_compile_args=["-O3", "-ffp-contract=off", "-pthread"],
                      extra_link_args=["-pthread"])
    for name in ("router", "planner") if sources(name)
]

setup(
    name="megatron-zeppelin",
    version="0.1.0",
    description="Zeppelin context parallelism for Megatron-Core: hierarchical sequence "
                "partitioning, NIC-aware routing and attention/linear remapping",
    long_description=(HERE / "README.md").read_text() if (HERE / "README.md").exists() else "",
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=["megatron_zeppelin", "megatron_zeppelin.*"]),
    ext_modules=ext_modules,
    cmdclass={"build_ext": build_ext},
    install_requires=[
        "torch>=2.6",
        "megatron-core>=0.16.1,<0.20",  # range: megatron/common/compat.py; CI tests 0.16.1
        "numpy",
        "scipy>=1.9",  # FlexSP's MILP: scipy.optimize.milp (HiGHS)
        "pyyaml>=6",
        "tqdm",
        "matplotlib",
        "psutil",  # megatron-core's dist_checkpointing needs it
        "einops",  # megatron-core's Megatron-FSDP (--use-megatron-fsdp) builds its mesh with it
    ],
    extras_require={
        "test": ["pytest>=8", "hypothesis>=6"],
        "te": ["transformer-engine[pytorch]>=2.9,<2.19"],  # signatures read up to 2.18
        "flash-attn": ["flash-attn>=2.6"],
        "tensorboard": ["tensorboard"],
    },
    entry_points={"console_scripts": ["zeppelin=megatron_zeppelin.cli:main"]},
    zip_safe=False,
)
