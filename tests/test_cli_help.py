"""Every ``zeppelin`` command and bench target prints its --help (argparse formats help text with
``%``: a literal percent sign in a help string breaks ``--help``)."""
from __future__ import annotations

import pytest

from megatron_zeppelin import cli
from megatron_zeppelin.bench import TARGETS


@pytest.mark.parametrize("argv", [["plan"], ["simulate"], ["calibrate"], ["calibrate-sim"],
                                  *[["bench", target] for target in TARGETS]])
def test_help_prints(argv, capsys):
    with pytest.raises(SystemExit) as done:
        cli.main([*argv, "--help"])
    assert done.value.code == 0
    assert "usage: zeppelin" in capsys.readouterr().out
