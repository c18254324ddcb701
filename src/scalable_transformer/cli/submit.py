"""`stx submit --scheduler slurm|pbs --nodes K --gpus-per-node G [...] train CONFIG [key=value ...]`."""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
from pathlib import Path

from ..config.load import load_config
from ..config.schema import Config
from ..config.validate import resolve
from ..errors import UsageError
from ..launch.batch import (
    DEFAULT_SIGNAL_GRACE,
    LOG_NAME,
    MARKER_NAME,
    SCRIPT_NAME,
    BatchOptions,
    Requeue,
    environment_exports,
    parse_time,
    pbs_script,
    slurm_script,
    submit_script,
    write_script,
)
from ..launch.launcher import JobSpec
from .parsers import DEFAULT_PROFILE_OUTPUT, split_config_args


def run(args: argparse.Namespace) -> int:
    if args.signal_grace is not None and not args.requeue:
        raise UsageError("--signal-grace goes with --requeue (it says when the ranks are asked to stop)")
    opts = batch_options(args)
    if args.subcommand == "calibrate":
        if args.requeue:
            raise UsageError(
                "--requeue continues a training run; stx calibrate takes a few minutes in one job"
            )
        return submit_calibrate(args.items, opts, args.dry_run)
    config, overrides = split_config_args(args.items)
    cfg = load_config(config, overrides)
    # The layout must fit the job's world size: fail here, not in the queue hours later.
    resolve(cfg, world_size=opts.nodes * opts.gpus_per_node)
    parent, run_dir = new_run_dir(cfg)
    if args.requeue:
        refuse_unresumable(cfg.checkpoint.save, cfg.checkpoint.load, cfg.checkpoint.finetune)
        requeue = Requeue(
            checkpoint_dir=Path(str(cfg.checkpoint.save)).resolve(),  # the ranks run in this directory
            script=run_dir / SCRIPT_NAME,
            grace_seconds=DEFAULT_SIGNAL_GRACE if args.signal_grace is None else args.signal_grace,
        )
        opts = dataclasses.replace(opts, requeue=requeue)  # checks the grace against --time
    job = train_job(config, overrides, parent, run_dir, opts)
    return submit_train(job, opts, run_dir, args.dry_run)


def batch_options(args: argparse.Namespace) -> BatchOptions:
    """The job's resources and environment, from `stx submit`'s own options."""
    return BatchOptions(
        scheduler=args.scheduler,
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        time_seconds=parse_time(args.time) if args.time else None,
        partition=args.partition,
        account=args.account,
        container=args.container,
        env_file=args.env_file,
        env=environment_exports(args.export),
        request_gpus=not args.no_gpu_request,
        launcher=args.launcher,
    )


def new_run_dir(cfg: Config) -> tuple[Path, Path]:
    """(logging.run_dir made absolute, the run's directory in it): the run's name, or the model type and
    the time, with -2, -3, ... after it while a directory of that name holds no submitted job."""
    parent = Path(cfg.logging.run_dir).resolve()
    name = cfg.logging.run_name or f"{cfg.model.type}-{dt.datetime.now():%Y%m%d-%H%M%S}"
    run_dir, n = parent / name, 1
    while run_dir.exists() and not (run_dir / MARKER_NAME).is_file():
        n += 1
        run_dir = parent / f"{name}-{n}"
    return parent, run_dir


def train_job(
    config: str | None, overrides: list[str], parent: Path, run_dir: Path, opts: BatchOptions
) -> JobSpec:
    """The `stx train` every node runs: the user's config and overrides, writing into run_dir."""
    # Where the run goes is decided here (the script lives there): the user's own values are replaced.
    ours = ("logging.run_dir=", "logging.run_name=")
    train_args = [*([config] if config else []), *(o for o in overrides if not o.startswith(ours))]
    train_args += [f"logging.run_dir={parent}", f"logging.run_name={run_dir.name}"]
    if opts.requeue:
        train_args.append("checkpoint.load=auto")  # the first job starts fresh, the next ones resume
    return JobSpec("train", tuple(train_args), nproc=opts.gpus_per_node, nnodes=opts.nodes)


def submit_train(job: JobSpec, opts: BatchOptions, run_dir: Path, dry_run: bool) -> int:
    """Print the batch script (dry_run), or write it into run_dir, submit it and say where it went."""
    log_path = run_dir / LOG_NAME
    if dry_run:
        make = slurm_script if opts.scheduler == "slurm" else pbs_script
        print(make(job, opts, f"stx-{run_dir.name}"[:64], log_path, Path.cwd()), end="")
        return 0
    script = write_script(job, dataclasses.replace(opts), run_dir, log_path)
    job_id = submit_script(opts.scheduler, script)
    (run_dir / MARKER_NAME).write_text(f'{{"scheduler": "{opts.scheduler}", "job_id": "{job_id}"}}\n')
    print(f"stx submit: {opts.scheduler} job {job_id}: {opts.nodes} node(s) x {opts.gpus_per_node} rank(s)")
    if opts.requeue:
        print(f"  requeue: continues in new jobs from the checkpoints in {opts.requeue.checkpoint_dir}")
    print(f"  script: {script}")
    print(f"  log:    {log_path}")
    print(job_id)
    return 0


def refuse_unresumable(save: str | None, load: str | None, finetune: bool) -> None:
    """UsageError when --requeue could not continue the run from one job to the next."""
    if not save:
        raise UsageError(
            "--requeue needs checkpoint.save (e.g. checkpoint.save=ckpt): a job stopped by its time "
            "limit saves there, and the next job resumes from it"
        )
    if load not in (None, "auto"):
        raise UsageError(
            f"--requeue resumes every job with checkpoint.load=auto (the latest checkpoint in "
            f"checkpoint.save); checkpoint.load={load} would be replaced: leave it out"
        )
    if finetune:
        raise UsageError(
            "--requeue with checkpoint.finetune=true would restart at iteration 0 in every job: "
            "set checkpoint.finetune=false"
        )


def submit_calibrate(items: list[str], opts, dry_run: bool) -> int:
    """`stx submit ... calibrate CONFIG [key=value ...] [--output FILE] [--quick]`: one rank per GPU
    measures, rank 0 writes the profile at --output (made absolute: the job runs elsewhere); the
    script and the job's log go to a directory beside it."""

    parser = argparse.ArgumentParser(prog="stx submit ... calibrate")
    parser.add_argument("items", nargs="*")
    parser.add_argument("--output", default=DEFAULT_PROFILE_OUTPUT)
    parser.add_argument("--quick", action="store_true")
    parsed = parser.parse_args(items)
    config, overrides = split_config_args(parsed.items)
    load_config(config, overrides)  # a bad config fails here, not in the queue
    output = Path(parsed.output).resolve()
    args = [*([config] if config else []), *overrides, "--output", str(output)]
    job = JobSpec(
        "calibrate", (*args, *(["--quick"] if parsed.quick else [])), opts.gpus_per_node, nnodes=opts.nodes
    )
    job_dir = output.parent / f"calibrate-{dt.datetime.now():%Y%m%d-%H%M%S}"
    log_path = job_dir / LOG_NAME
    if dry_run:
        make = slurm_script if opts.scheduler == "slurm" else pbs_script
        print(make(job, opts, f"stx-{job_dir.name}"[:64], log_path, Path.cwd()), end="")
        return 0
    script = write_script(job, opts, job_dir, log_path)
    job_id = submit_script(opts.scheduler, script)
    print(f"stx submit: {opts.scheduler} job {job_id}: {opts.nodes} node(s) x {opts.gpus_per_node} rank(s)")
    print(f"  profile: {output}")
    print(f"  script:  {script}")
    print(f"  log:     {log_path}")
    print(job_id)
    return 0
