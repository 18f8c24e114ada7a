"""Which module a Megatron-LM checkout needs and this environment lacks (test scaffolding).

Megatron-LM imports packages megatron-core does not need (six and regex for its tokenizers,
pydantic, triton, einops, ...). A test driving Megatron-LM's own ``pretrain_gpt.py`` is skipped,
naming the missing module, when one is absent, instead of failing deep inside a torchrun
log. A module missing from the checkout itself (``megatron.*``, ``pretrain_gpt``) or from this
project is a real failure, never a skip.
"""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

OWN = {"megatron", "megatron_zeppelin", "pretrain_gpt", "gpt_builders", "model_provider",
       "megatron_lm_spec"}  # the checkout's, and this project's, own modules

# Import what ``driver`` imports at module level (not its ``main``), as it runs: from the tree.
PROBE = """
import runpy, sys, warnings
warnings.filterwarnings("ignore")
for name in sys.argv[2:]:
    sys.modules[name] = None  # hidden (tests of this probe)
try:
    runpy.run_path(sys.argv[1], run_name="megatron_lm_imports")
except ModuleNotFoundError as exc:
    print("MISSING", exc.name)
    sys.exit(3)
"""
_MESSAGE = re.compile(r"ModuleNotFoundError: No module named '([\w.]+)'")


def foreign(name: str | None) -> str | None:
    """``name`` when it is a third-party module (not the checkout's or ours), else None."""
    if name and name.split(".")[0] not in OWN:
        return name
    return None


def missing_module(tree: Path, driver: Path, hide: tuple[str, ...] = ()) -> str | None:
    """The third-party module whose absence stops ``driver``'s imports in ``tree`` (None when
    they all import); ``hide``: modules to make absent. Raises AssertionError, with the
    output, when the imports fail another way (a real failure)."""
    proc = subprocess.run([sys.executable, "-c", PROBE, str(driver), *hide], cwd=tree,
                          capture_output=True, text=True, timeout=300)
    if proc.returncode == 0:
        return None
    found = re.search(r"^MISSING (\S+)$", proc.stdout, re.M)
    name = foreign(found.group(1)) if found else None
    assert name, f"Megatron-LM's modules do not import:\n{proc.stdout}{proc.stderr[-3000:]}"
    return name


def missing_in_log(log: str) -> str | None:
    """The third-party module a failed run's log says is missing (an import inside Megatron-LM
    that only runs during training), else None."""
    found = _MESSAGE.search(log)
    return foreign(found.group(1)) if found else None


def skip_for(name: str) -> None:
    pytest.skip(f"Megatron-LM needs the module {name!r}, which is not installed here")
