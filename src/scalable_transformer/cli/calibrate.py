"""`stx calibrate CONFIG [key=value ...] [--output profile.yaml] [--quick]`: measure this machine's
rates for the planner's time model (calibrate/) and write a hardware profile."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

import torch

from ..calibrate.calibration import calibrate
from ..calibrate.timing import calibration_device, calibration_job
from ..config.load import load_config
from ..errors import UsageError
from ..parallel.cluster_env import apply_cluster_env
from ..plan.hardware_profile import profile_from_dict, save_profile
from .parsers import DEFAULT_PROFILE_OUTPUT, split_config_args


@dataclasses.dataclass(frozen=True)
class CalibrateOptions:
    config: str | None
    overrides: tuple[str, ...]
    output: Path
    quick: bool

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> CalibrateOptions:
        config, overrides = split_config_args(args.items)
        return cls(config, tuple(overrides), Path(args.output), args.quick)


def check_output(path: Path) -> None:
    """Fail before measuring when the profile could not be written (rank 0 writes it)."""
    parent = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise UsageError(
            f"--output {path} is a directory; give a file name, e.g. {path / DEFAULT_PROFILE_OUTPUT}"
        )
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"--output {path}: cannot create its directory {parent} ({e.strerror})") from None
    if not os.access(parent, os.W_OK):
        raise UsageError(f"--output {path}: its directory {parent} is not writable")


def output_ok(job, path: Path) -> None:
    """Rank 0 checks that it can write the profile before anyone measures; every rank stops at
    once when it cannot (a rank left waiting in a collective would only go when the launcher kills it)."""
    error: UsageError | None = None
    if job.rank == 0:
        try:
            check_output(path)
        except UsageError as e:
            error = e
    if not job.agree(error is None):
        raise error or UsageError(f"rank 0 cannot write --output {path}; see its error")


def run(args: argparse.Namespace) -> int:
    opts = CalibrateOptions.from_args(args)
    # Started by srun / mpiexec rather than torchrun: RANK, WORLD_SIZE... from their variables.
    apply_cluster_env()
    cfg = load_config(opts.config, list(opts.overrides))
    device = calibration_device()
    with calibration_job(device, opts.quick, cfg.parallel.timeout_minutes) as job:
        output_ok(job, opts.output)

        def say(line: str) -> None:
            if job.rank == 0:
                print(line, flush=True)

        say(
            f"calibrate: {job.world} process(es) on {len(set(job.hosts))} node(s), {device.type}, "
            f"{cfg.train.precision}, threads per process {torch.get_num_threads()}"
            + (" (--quick)" if opts.quick else "")
        )
        mapping = calibrate(cfg, job, say)
        if job.rank == 0:
            profile = profile_from_dict(mapping, str(opts.output))
            save_profile(profile, opts.output)
            print(f"wrote {opts.output} (use it: stx plan ... --hardware {opts.output})")
    sys.stdout.flush()
    return 0
