"""The cost of agreeing on a stop signal, per training step, measured side by side in one run.

    python benchmarks/stop_check_cost.py                      # 2 and 4 ranks
    python benchmarks/stop_check_cost.py --ranks 2 --steps 2000 --output /tmp/stop.md

Every rank runs "steps" of a fixed compute (a matmul of about --step-ms milliseconds) in blocks of 50,
in the order A B C C B A:
  A  compute + `StopSignals.agreed` (train.stop_check_interval = 1: the async MAX all-reduce of a host
     int issued after each step and read after the next, as the trainer runs it);
  B  compute alone;
  C  compute + the blocking all-reduce of three float64 the trainer runs every step for its metrics
     (`all_reduce_floats`), for scale.
A rank's figure per variant is its median milliseconds per step over the blocks; the record gives rank
0's, and the overheads A - B and C - B in microseconds per step.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from scalable_transformer.metrics.environment import record_sections
from scalable_transformer.parallel.distributed import all_reduce_floats
from scalable_transformer.train.resilience import StopSignals

BLOCK = 50


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, steps: int, step_ms: float, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=dt.timedelta(seconds=120),
    )
    stop = StopSignals(dist.group.WORLD, check_interval=1)
    x = torch.randn(256, 256)
    start = time.perf_counter()
    for _ in range(20):
        x @ x
    reps = max(1, round(step_ms / (1000 * (time.perf_counter() - start) / 20)))  # matmuls per step
    iteration = 0

    def step(extra: str) -> None:
        nonlocal iteration
        for _ in range(reps):
            x @ x
        iteration += 1
        if extra == "A":
            stop.agreed(iteration)
        elif extra == "C":
            all_reduce_floats([1.0, 2.0, 3.0])

    times: dict[str, list[float]] = {"A": [], "B": [], "C": []}
    with stop:
        for _ in range(max(1, steps // (6 * BLOCK))):
            for name in "ABCCBA":
                t0 = time.perf_counter()
                for _ in range(BLOCK):
                    step(name)
                times[name].append(1e3 * (time.perf_counter() - t0) / BLOCK)
    dist.destroy_process_group()
    if rank == 0:
        medians = [statistics.median(times[k]) for k in "ABC"]
        Path(out).write_text(" ".join(map(str, medians)), encoding="utf-8")


def measure(world: int, steps: int, step_ms: float) -> tuple[float, float, float]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result")
        args = (world, _free_port(), steps, step_ms, out)
        mp.start_processes(_rank, args=args, nprocs=world, start_method="spawn")
        a, b, c = (float(x) for x in Path(out).read_text().split())
    return a, b, c


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=1200, help="steps per variant and rank count")
    parser.add_argument("--step-ms", type=float, default=20.0, help="compute per step (ms)")
    parser.add_argument("--output", default=str(Path(__file__).parent / "results" / "stop_check_cost.md"))
    args = parser.parse_args(argv)
    rows = []
    for world in args.ranks:
        a, b, c = measure(world, args.steps, args.step_ms)
        rows.append(
            f"| {world} | {a:.3f} | {b:.3f} | {c:.3f} | {1000 * (a - b):+.0f} | {1000 * (c - b):+.0f} |"
        )
        print(rows[-1], flush=True)
    command = "python benchmarks/stop_check_cost.py " + " ".join(argv)
    text = "\n".join(
        [
            "# The cost of the stop-signal agreement",
            "",
            f"Command: `{command.strip()}`",
            "",
            f"{args.steps} steps of about {args.step_ms:g} ms of compute per variant, in blocks of {BLOCK} "
            "(A B C C B A), gloo on this host, one torch thread per rank; rank 0's median ms per step.",
            "A: compute + the stop check (interval 1, async); B: compute alone; C: compute + the blocking "
            "metrics all-reduce.",
            "",
            "| ranks | A (ms/step) | B (ms/step) | C (ms/step) | A - B (us/step) | C - B (us/step) |",
            "|---|---|---|---|---|---|",
            *rows,
            "",
            *record_sections(),
        ]
    )
    Path(args.output).write_text(text + "\n", encoding="utf-8")
    print(f"written: {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
