"""`stx sweep SWEEP.yaml`: run a grid of layouts, catch OOM/timeout/crash, store every result."""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path
from typing import Any

from ..bench.sweep import load_sweep, run_sweep
from ..bench.sweep_batch import sweep_status
from ..bench.sweep_types import SweepOptions
from ..errors import UsageError


def sweep_options(args: argparse.Namespace) -> SweepOptions:

    return SweepOptions(
        sweep_file=Path(args.sweep),
        store=Path(args.store).resolve() if args.store else None,
        retry_failed=args.retry_failed,
        retry_suspect=args.retry_suspect,
        dry_run=args.dry_run,
    )


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def status(store: str | None) -> int:
    """`stx sweep status STORE`: member, job id, scheduler and state of every batch job."""
    if not store:
        raise UsageError("stx sweep status STORE: name the results store (e.g. results.sqlite)")
    rows = sweep_status(Path(store))
    if not rows:
        print(f"{store}: no batch jobs (sweeps with executor: slurm or pbs record theirs here)")
        return 0
    print(f"{'job id':<14} {'scheduler':<9} {'state':<24} {'submitted':<25} member")
    for r in rows:
        submitted = r["submitted_at"] or "-"
        print(f"{r['job_id']:<14} {r['scheduler']:<9} {r['state']:<24} {submitted:<25} {r['label']}")
    return 0


def run(args: argparse.Namespace) -> int:
    if args.sweep == "status" and not Path("status").is_file():
        return status(args.status_store)
    if args.status_store:
        raise UsageError(f"unexpected argument {args.status_store!r}: stx sweep SWEEP.yaml [options]")

    opts = sweep_options(args)
    spec = load_sweep(opts.sweep_file)
    # SIGTERM (a scheduler, `kill`) stops the sweep like Ctrl-C: the running member is killed, not recorded.
    signal.signal(signal.SIGTERM, _interrupt)
    # The members' processes inherit it: their output reaches the member's log as it is written.
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    return run_sweep(spec, opts).exit_code
