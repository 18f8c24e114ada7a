"""``zeppelin calibrate``'s command line (the measurement: ``calibrate.py``): every flag is
checked before anything is measured, a bad one refused in one line naming it."""
from __future__ import annotations

import argparse
from pathlib import Path

from megatron_zeppelin.errors import ConfigError
from megatron_zeppelin.options import int_at_least, nonempty, number_at_least
from megatron_zeppelin.output_paths import output_file, writable_folder

DEFAULT_HEADS, DEFAULT_HEAD_DIM, DEFAULT_CONCURRENCY = 4, 64, 4


def output_path(path: str | Path, force: bool, what: str) -> Path:
    """``path`` if calibration may write there: never inside the shipped ``configs/``, never
    over an existing file without ``force``, in a folder that exists or can be made
    (ValueError naming the flag ``what`` otherwise)."""
    from megatron_zeppelin.config_yaml import configs_dir

    path = Path(path)
    shipped = (Path(__file__).resolve().parents[2] / "configs").resolve()
    if path.resolve().is_relative_to(shipped) or path.resolve().is_relative_to(
            configs_dir().resolve()):
        raise ValueError(f"{what}={str(path)!r} is inside the shipped configs folder "
                         f"({shipped}): name a path of your own (the shipped profiles are "
                         "documented measurements)")
    if path.is_dir():
        raise ValueError(f"{what}={str(path)!r} is a folder: expected a file path")
    if path.exists() and not force:
        raise ValueError(f"{what}={str(path)!r} exists: pass --force to replace it")
    writable_folder(what, str(path.parent), str(path))
    return path


def _outputs(args: argparse.Namespace, name: str) -> tuple[Path, Path | None]:
    """(the profile's path, the emulated cluster's or None on CUDA), checked."""
    if args.output is None and ("/" in name or not name.strip()):
        raise ConfigError(f"--name={name!r} is invalid: expected a name without '/' (it names "
                          "the default --output file)")
    out = output_path(args.output or Path("zeppelin-calibration") / f"{name}.yaml",
                      args.force, "--output")
    if args.device != "cpu":
        return out, None
    cluster_out = output_path(args.cluster_output or out.with_name(f"{out.stem}-cluster.yaml"),
                              args.force, "--cluster-output")
    if cluster_out.resolve() == out.resolve():
        raise ConfigError(f"--cluster-output={str(cluster_out)!r} is invalid: it is --output "
                          "(the profile would be overwritten); name another file")
    return out, cluster_out


def _check_flags(args: argparse.Namespace) -> None:
    """The flags' combinations (their values are checked by their types)."""
    import torch

    if args.device not in ("cpu", "cuda"):
        raise ConfigError(f"--device={args.device!r} is invalid: expected 'cpu' or 'cuda'")
    if args.device == "cuda":
        for flag, value in (("--concurrency", args.concurrency),
                            ("--cluster-output", args.cluster_output)):
            if value is not None:
                raise ConfigError(f"{flag}={value!r} is invalid with --device cuda: CPU only "
                                  "(drop it)")
        if not torch.cuda.is_available():
            raise ConfigError("--device='cuda' is invalid here: torch.cuda.is_available() is "
                              "False")
    if args.model:
        for flag, value in (("--heads", args.heads), ("--kv-heads", args.kv_heads),
                            ("--head-dim", args.head_dim)):
            if value is not None:
                raise ConfigError(f"{flag}={value} is invalid with --model {args.model}: the "
                                  "model's shape is measured (drop one)")
    if args.backend != "auto":
        from megatron_zeppelin.runtime.kernels import backend_problem

        why = backend_problem(args.backend, args.device,
                              torch.bfloat16 if args.device == "cuda" else torch.float32)
        if why:
            raise ConfigError(f"--backend={args.backend!r} is invalid here: {why}")
    heads = args.heads or DEFAULT_HEADS
    if args.kv_heads is not None and heads % args.kv_heads:
        raise ConfigError(f"--kv-heads={args.kv_heads} is invalid: expected a divisor of "
                          f"--heads {heads}")


def cmd_calibrate(args) -> int:
    """Measure this machine and write the profile (and, on CPU, the emulated cluster)."""
    from megatron_zeppelin.bench.calibrate import (CalibrateOptions, calibrate, check_finite,
                                                   format_calibration, write_yaml)
    from megatron_zeppelin.config import load_model

    _check_flags(args)
    name = args.name or f"{args.device}-{args.backend}"
    out, cluster_out = _outputs(args, name)
    opts = CalibrateOptions(device=args.device, backend=args.backend,
                            model=load_model(args.model) if args.model else None,
                            heads=args.heads or DEFAULT_HEADS, kv_heads=args.kv_heads,
                            head_dim=args.head_dim or DEFAULT_HEAD_DIM, lengths=args.lengths,
                            tokens_per_call=args.tokens_per_call,
                            concurrency=args.concurrency or DEFAULT_CONCURRENCY
                            if args.device == "cpu" else 1,
                            threads=args.threads, min_time_s=args.min_time)
    cal = calibrate(opts, name=name, cluster_name=f"{name}-cluster",
                    measure_links=args.device == "cpu", profile_ref=str(out.resolve()))
    check_finite(cal)
    print(format_calibration(cal))
    path = write_yaml(cal.profile, out, f"Measured by `zeppelin calibrate` "
                      f"(megatron_zeppelin/bench/calibrate.py).\n{cal.profile.source}")
    print(f"wrote {path}")
    if cal.cluster is not None:
        path = write_yaml(cal.cluster, cluster_out, "Emulated CPU cluster: 2 nodes x 2 gloo "
                          "ranks, 1 'NIC' per node; links at the measured gloo P2P "
                          "bandwidth/latency (written by `zeppelin calibrate`).")
        print(f"wrote {path}")
    return 0


def calibrate_defaults(output_dir: str | Path):
    """The arguments of a plain ``zeppelin calibrate`` writing ``cpu.yaml`` and
    ``cpu-cluster.yaml`` into ``output_dir`` (an existing folder; for scripts)."""
    parser = argparse.ArgumentParser()
    _add_calibrate_args(parser)
    return parser.parse_args(["--name", "cpu", "--output", str(Path(output_dir) / "cpu.yaml"),
                              "--force"])


def _add_calibrate_args(c) -> None:
    """Flags of ``zeppelin calibrate``."""
    from megatron_zeppelin.bench.flags import int_list
    from megatron_zeppelin.runtime.kernels import choices

    c.add_argument("--device", default="cpu", help="cpu | cuda")
    c.add_argument("--backend", default="auto", choices=choices(),
                   help="attention kernel backend to measure (auto: what the engine picks)")
    c.add_argument("--model", type=nonempty, default=None, help="model YAML path or shipped "
                   "name: attention heads/head dim and GEMM shapes (else --heads/--kv-heads/"
                   "--head-dim and square GEMMs)")
    c.add_argument("--name", type=nonempty, default=None, help="profile name (default DEVICE-BACKEND)")
    c.add_argument("--output", type=output_file(), default=None, help="where to write the "
                   "profile (default zeppelin-calibration/NAME.yaml; never the shipped configs/)")
    c.add_argument("--cluster-output", type=output_file(), default=None, help="CPU: where to "
                   "write the emulated cluster (default next to --output, NAME-cluster.yaml)")
    c.add_argument("--force", action="store_true", help="replace existing output files")
    c.add_argument("--heads", type=int_at_least(1), default=None,
                   help=f"attention heads without --model (default {DEFAULT_HEADS})")
    c.add_argument("--kv-heads", type=int_at_least(1), default=None,
                   help="KV heads without --model, a divisor of --heads (default: --heads)")
    c.add_argument("--head-dim", type=int_at_least(1), default=None,
                   help=f"head dimension without --model (default {DEFAULT_HEAD_DIM})")
    c.add_argument("--lengths", type=int_list(16, "document lengths"), default=None,
                   help="comma-separated document lengths, each >= 16 (default 128..128K on "
                   "CUDA, 128..8K on CPU)")
    c.add_argument("--tokens-per-call", type=int_at_least(0), default=None, help="tokens per "
                   "measured attention call, documents of one length (default 64K on CUDA; 0: "
                   "one document per call, the CPU default)")
    c.add_argument("--concurrency", type=int_at_least(1), default=None,
                   help="CPU: processes measuring at once (the emulated ranks sharing the "
                   f"cores; default {DEFAULT_CONCURRENCY})")
    c.add_argument("--threads", type=int_at_least(1), default=1,
                   help="torch threads per process")
    c.add_argument("--min-time", type=number_at_least(0), default=0.3,
                   help="seconds per measured point")


def register(sub) -> None:
    """Add ``calibrate`` to the ``zeppelin`` command."""
    c = sub.add_parser("calibrate", help="measure this machine; write a hardware profile (and "
                       "on CPU an emulated cluster) to --output")
    _add_calibrate_args(c)
    c.set_defaults(func=cmd_calibrate)
