"""`stx submit --scheduler slurm|pbs --nodes K --gpus-per-node G [...] train CONFIG [key=value ...]`."""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
from pathlib import Path

from ..launch.batch import DEFAULT_SIGNAL_GRACE


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "submit",
        help="submit stx train as a Slurm or PBS batch job: "
        "stx submit --scheduler slurm --nodes 2 train gpt-1b",
        description="stx submit --scheduler slurm|pbs --nodes K --gpus-per-node G [options] train CONFIG "
        "[key=value ...]: write the batch script (one rank per GPU, started by srun or mpiexec) into the "
        "run directory, submit it and print the job id. --dry-run prints the script and submits nothing.",
    )
    p.add_argument("--scheduler", required=True, choices=("slurm", "pbs"), help="the batch scheduler")
    p.add_argument("--nodes", type=int, default=1, metavar="K", help="nodes (default 1)")
    p.add_argument(
        "--gpus-per-node", type=int, default=1, metavar="G", help="GPUs per node = ranks per node (default 1)"
    )
    p.add_argument("--time", metavar="TIME", help="time limit: MINUTES, HH:MM:SS or D-HH:MM:SS")
    p.add_argument("--partition", "--queue", dest="partition", help="Slurm partition / PBS queue")
    p.add_argument("--account", help="account (project) to charge")
    p.add_argument(
        "--container", metavar="PREFIX", help='command prefix of every rank, e.g. "apptainer exec --nv IMAGE"'
    )
    p.add_argument("--env-file", metavar="FILE", help="a file of VAR=value lines, sourced by the job")
    p.add_argument(
        "--export",
        action="append",
        default=[],
        metavar="NAME",
        help="pass this variable's current value to the job (repeatable), e.g. --export NCCL_SOCKET_IFNAME",
    )
    p.add_argument(
        "--no-gpu-request", action="store_true", help="leave the GPU request out (CPU-only partitions)"
    )
    p.add_argument(
        "--launcher",
        choices=("srun", "torchrun"),
        default="srun",
        help="Slurm: srun starts every rank (default), or torchrun: one stx launch per node starts them",
    )
    p.add_argument(
        "--requeue",
        action="store_true",
        help="continue the run in new jobs until train.train_iters is reached: the ranks stop on "
        "SIGUSR1 before the time limit, save (checkpoint.save must be set) and the job submits the "
        "same script again, which resumes with checkpoint.load=auto",
    )
    p.add_argument(
        "--signal-grace",
        type=int,
        metavar="SECONDS",
        help="with --requeue: how long before the time limit the ranks get SIGUSR1, enough to finish "
        f"a step and save a checkpoint (default {DEFAULT_SIGNAL_GRACE}; Slurm may send it up to a "
        "minute earlier)",
    )
    p.add_argument("--dry-run", action="store_true", help="print the batch script; write and submit nothing")
    p.add_argument(
        "subcommand",
        choices=("train", "calibrate"),
        metavar="train|calibrate",
        help="the stx command to run: train, or calibrate (a hardware profile of the job's nodes)",
    )
    p.add_argument("items", nargs=argparse.REMAINDER, metavar="CONFIG|key=value")
    p.set_defaults(fn=run)


def run(args: argparse.Namespace) -> int:
    from ..config.load import load_config
    from ..config.validate import resolve
    from ..errors import UsageError
    from ..launch.batch import (
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
    from .train import split_config_args

    if args.signal_grace is not None and not args.requeue:
        raise UsageError("--signal-grace goes with --requeue (it says when the ranks are asked to stop)")
    opts = BatchOptions(
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
    parent = Path(cfg.logging.run_dir).resolve()
    name = cfg.logging.run_name or f"{cfg.model.type}-{dt.datetime.now():%Y%m%d-%H%M%S}"
    run_dir, n = parent / name, 1
    while run_dir.exists() and not (run_dir / MARKER_NAME).is_file():
        n += 1
        run_dir = parent / f"{name}-{n}"
    if args.requeue:
        refuse_unresumable(cfg.checkpoint.save, cfg.checkpoint.load, cfg.checkpoint.finetune)
        requeue = Requeue(
            checkpoint_dir=Path(str(cfg.checkpoint.save)).resolve(),  # the ranks run in this directory
            script=run_dir / SCRIPT_NAME,
            grace_seconds=DEFAULT_SIGNAL_GRACE if args.signal_grace is None else args.signal_grace,
        )
        opts = dataclasses.replace(opts, requeue=requeue)  # checks the grace against --time
    # Where the run goes is decided here (the script lives there): the user's own values are replaced.
    ours = ("logging.run_dir=", "logging.run_name=")
    train_args = [*([config] if config else []), *(o for o in overrides if not o.startswith(ours))]
    train_args += [f"logging.run_dir={parent}", f"logging.run_name={run_dir.name}"]
    if opts.requeue:
        train_args.append("checkpoint.load=auto")  # the first job starts fresh, the next ones resume
    job = JobSpec("train", tuple(train_args), nproc=opts.gpus_per_node, nnodes=opts.nodes)
    log_path = run_dir / LOG_NAME
    if args.dry_run:
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
    from ..errors import UsageError

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
    from ..config.load import load_config
    from ..launch.batch import LOG_NAME, pbs_script, slurm_script, submit_script, write_script
    from ..launch.launcher import JobSpec
    from .calibrate import DEFAULT_OUTPUT
    from .train import split_config_args

    parser = argparse.ArgumentParser(prog="stx submit ... calibrate")
    parser.add_argument("items", nargs="*")
    parser.add_argument("--output", default=DEFAULT_OUTPUT)
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
