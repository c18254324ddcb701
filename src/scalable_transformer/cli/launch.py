"""`stx launch -n N [options] SUBCOMMAND [ARGS ...]`: N local processes through torchrun's agent."""

from __future__ import annotations

import argparse
import os
import sys


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "launch",
        help="run an stx command as N processes (torchrun): stx launch -n 2 train tiny-gpt",
        description="stx launch -n N [options] SUBCOMMAND [ARGS ...]: start N processes on this node, "
        "each running `stx SUBCOMMAND ARGS` with RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and "
        "MASTER_PORT set, through torchrun's agent. Options go before SUBCOMMAND; everything after it "
        "is passed on untouched. When a rank fails, the others are stopped and the failing rank, its "
        "exit code and its error are printed (exit status 1).",
    )
    p.add_argument(
        "-n",
        "--nproc-per-node",
        type=int,
        metavar="N",
        help="processes on this node (>= 1); required without --hostfile (there: the hosts' slots)",
    )
    p.add_argument(
        "--hostfile",
        metavar="FILE",
        help="run on the hosts of FILE ('HOST slots=N' lines, DeepSpeed's format) over ssh; "
        "rank 0 on the first host",
    )
    p.add_argument("--include", metavar="SEL", help="with --hostfile: only these hosts/slots, e.g. h1@h2:0,1")
    p.add_argument("--exclude", metavar="SEL", help="with --hostfile: leave out these hosts/slots")
    p.add_argument(
        "--export",
        action="append",
        default=[],
        metavar="NAME",
        help="with --hostfile: pass this variable to every host (repeatable; NCCL_*, PYTHON*, STX_*, "
        "TORCH_*, OMP_*, CUDA_* are passed anyway)",
    )
    p.add_argument("--env-file", metavar="FILE", help="with --hostfile: NAME=value lines set on every host")
    p.add_argument(
        "--ssh-config",
        metavar="FILE",
        default=os.environ.get("STX_SSH_CONFIG"),
        help="with --hostfile: ssh -F FILE (default: $STX_SSH_CONFIG, else ssh's own)",
    )
    p.add_argument("--nnodes", type=int, default=1, help="nodes in the job (default 1)")
    p.add_argument("--node-rank", type=int, default=0, help="this node's rank, 0..nnodes-1 (default 0)")
    p.add_argument(
        "--master-addr",
        help="address of node 0 (needed with --nnodes > 1; default 127.0.0.1 with --master-port)",
    )
    p.add_argument(
        "--master-port",
        type=int,
        help="port on node 0 (default: one node picks a free port itself; several nodes use 29500)",
    )
    p.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="restart every rank up to this many times on a failure (default 0)",
    )
    p.add_argument(
        "--monitor-interval",
        type=float,
        default=0.1,
        metavar="SECONDS",
        help="how often the ranks are polled, i.e. how fast a failure is noticed (default 0.1)",
    )
    p.add_argument(
        "--log-dir",
        help="keep the ranks' logs (stderr, the stdout not shown) and error files here (default: not kept)",
    )
    p.add_argument(
        "--ranks-output",
        choices=("0", "all"),
        default="0",
        help="whose stdout is shown: rank 0 (default) or all (prefixed [rankN]:); all stderr is shown",
    )
    # `sub.choices` is the live name -> parser map: every command, including ones added after this.
    p.add_argument("subcommand", choices=sub.choices, metavar="SUBCOMMAND", help="the stx command to run")
    p.add_argument(
        "args", nargs=argparse.REMAINDER, metavar="ARGS", help="its arguments, passed on untouched"
    )
    p.set_defaults(fn=run)


def run(args: argparse.Namespace) -> int:
    from ..launch.local import LaunchOptions, launch, stx_command

    if args.hostfile:
        return run_hostfile(args)
    try:
        if args.subcommand == "launch":
            raise ValueError("SUBCOMMAND cannot be launch itself")
        if args.nproc_per_node is None:
            raise ValueError("-n/--nproc-per-node is required (or --hostfile)")
        if args.nnodes == 1 and not args.master_addr:
            # Under `srun --ntasks-per-node=1` on several nodes: one launcher per node, placed by Slurm.
            from ..parallel.cluster_env import slurm_node_layout

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
    from ..errors import LaunchError
    from ..launch.hostfile import exported_environment, launch_hosts, parse_hostfile, select_hosts

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
