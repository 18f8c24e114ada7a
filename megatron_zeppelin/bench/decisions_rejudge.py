"""``zeppelin bench decisions --rejudge FILE``: judge the current estimate on stored
measurements, without training. The file is a ``bench decisions --json`` result; its
micro-batches' lengths are planned again with the current cost model (the file's training
flags, or those given after ``--``), each candidate's estimate and the portfolio's pick taken
anew, and scored on the stored measured medians (and repeats, where the file has them: older
files have none, and the statistical figure is then stated as unavailable). A file whose
candidates are not the ones the current portfolio builds (names differ: a candidate added,
removed, or two plans merged differently) is refused, naming the micro-batch."""
from __future__ import annotations

import json
from pathlib import Path

from megatron_zeppelin.bench.decisions import NAME, Decision, _validate, decide
from megatron_zeppelin.bench.train import YAML
from megatron_zeppelin.config import ConfigError
from megatron_zeppelin.planner.common import check_lengths

KEYS = ("index", "lengths", "names", "measured_s")  # what a micro-batch must hold


def load(path: str) -> dict:
    """The stored result; ConfigError naming the file when it is not one."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"--rejudge {path}: no such file") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--rejudge {path}: not JSON ({exc})") from None
    except OSError as exc:
        raise ConfigError(f"--rejudge {path}: cannot be read ({exc.strerror or exc})") from None
    batches = data.get("micro_batches") if isinstance(data, dict) else None
    if not batches or not all(isinstance(b, dict) and all(k in b for k in KEYS)
                              for b in batches):
        raise ConfigError(f"--rejudge {path}: not a 'bench decisions --json' result (expected "
                          f"micro_batches, each with {', '.join(KEYS)})")
    for batch in batches:
        try:
            check_lengths(batch["lengths"])  # the planner's own check of a batch
        except ValueError:
            raise ConfigError(f"--rejudge {path}: micro-batch {batch['index']!r}'s lengths "
                              f"{str(batch['lengths'])[:60]} are invalid: expected positive "
                              "integers") from None
    return data


def planner_of(flags: list[str]):
    """The portfolio planner ``bench decisions`` runs with these training flags (no world)."""
    from megatron_zeppelin.megatron.loop import args as train_args, train

    argv = ["--yaml-cfg", str(YAML), *flags, "--context-parallel-mode", "zeppelin",
            "--zeppelin-strategy", NAME]
    layout = _validate(argv)
    args = train_args.parse_args(argv)
    cost = train.make_cost_model(args, train.model_spec(args), layout)
    return train.make_planner(args, cost, layout)


def rejudge(path: str, flags: list[str] | None = None) -> list[Decision]:
    """Every stored micro-batch re-estimated and judged on its stored measurements."""
    from megatron_zeppelin.bench.measure_candidates import estimated_candidates

    data = load(path)
    planner = planner_of(flags or data.get("flags") or [])
    out = []
    for batch in data["micro_batches"]:
        plans, estimates, pick = estimated_candidates(list(batch["lengths"]), planner)
        names = [name for name, _ in plans]
        if names != list(batch["names"]):
            raise ConfigError(f"--rejudge {path}: micro-batch {batch['index']}'s candidates "
                              f"{names} are not the stored {batch['names']}: re-measure it")
        out.append(decide(batch["index"], batch["lengths"], names, estimates,
                          batch["measured_s"], pick, batch.get("noise", 0.0),
                          batch.get("repeats", ())))
    return out
