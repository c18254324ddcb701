"""`stx launch -n N [options] SUBCOMMAND [ARGS ...]`: N local processes through torchrun's agent."""

from __future__ import annotations

import argparse
import sys

from ..errors import LaunchError
from ..launch.hostfile import exported_environment, launch_hosts, parse_hostfile, select_hosts
from ..launch.local import LaunchOptions, launch, stx_command
from ..parallel.cluster_env import slurm_node_layout


def run(args: argparse.Namespace) -> int:
    if args.hostfile:
        return run_hostfile(args)
    try:
        if args.subcommand == "launch":
            raise ValueError("SUBCOMMAND cannot be launch itself")
        if args.nproc_per_node is None:
            raise ValueError("-n/--nproc-per-node is required (or --hostfile)")
        if args.nnodes == 1 and not args.master_addr:
            # Under `srun --ntasks-per-node=1` on several nodes: one launcher per node, placed by Slurm.
            layout = slurm_node_layout()
            if layout is not None:
                args.nnodes, args.node_rank, args.master_addr, port = layout
                args.master_port = args.master_port or port
        opts = LaunchOptions(
            nproc_per_node=args.nproc_per_node,
            nnodes=args.nnodes,
            node_rank=args.node_rank,
            master_addr=args.master_addr,
            master_port=args.master_port,
            max_restarts=args.max_restarts,
            monitor_interval=args.monitor_interval,
            log_dir=args.log_dir,
            ranks_output=args.ranks_output,
        )
    except ValueError as e:  # before any process starts
        print(f"stx launch: error: {e}", file=sys.stderr)
        return 2
    return launch(opts, stx_command(args.subcommand, args.args))


def run_hostfile(args: argparse.Namespace) -> int:
    """`stx launch --hostfile FILE`: one `stx launch` per host over ssh (launch/hostfile.py)."""
    if args.nnodes != 1 or args.node_rank != 0 or args.master_addr:
        raise LaunchError("--hostfile sets --nnodes, --node-rank and --master-addr itself; leave them out")
    hosts = select_hosts(parse_hostfile(args.hostfile), args.include, args.exclude)
    if args.nproc_per_node is not None and args.nproc_per_node != len(hosts[0].slots):
        raise LaunchError(
            f"-n {args.nproc_per_node} disagrees with the hostfile's {len(hosts[0].slots)} slots per host; "
            "leave -n out with --hostfile"
        )
    launch_args = ["--max-restarts", str(args.max_restarts), "--monitor-interval", str(args.monitor_interval)]
    launch_args += ["--ranks-output", args.ranks_output]
    if args.log_dir:
        launch_args += ["--log-dir", args.log_dir]
    return launch_hosts(
        hosts,
        [args.subcommand, *args.args],
        master_port=args.master_port,
        env=exported_environment(args.export, args.env_file),
        launch_args=launch_args,
        ssh_config=args.ssh_config,
    )
