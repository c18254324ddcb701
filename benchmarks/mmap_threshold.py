"""What glibc's 64 KiB mmap threshold costs a CPU training step, kept for the run or only while building.

Every CPU rank calls `parallel.init.return_large_frees_to_the_os()` before building its model: blocks
of 64 KiB or more come from mmap, so freeing them returns them to the OS (issue 12: gpt-1b ZeRO-3
peaked 5.07-5.17 -> 4.47 GiB per rank). The low threshold costs a system call and fresh zeroed pages
for every large allocation, so it is measured three ways, each in fresh processes doing the same
steps (step_vs_bare.py's bare loop: forward, backward, clip, AdamW; fp32, dropout 0):

  always  the threshold set before the model is built, kept through the steps (the engine's setting
          until 2026-11-25; it now sets a step threshold per layout: parallel.init.step_allocation)
  scoped  the threshold only while the model is built, then glibc's settled 32 MiB and a heap trim
          (tried for the engine and rejected: gpt-1b ZeRO-3's steps then peaked at 5.10 GiB per rank,
          FSDP2's unsharded gradients below 32 MiB fragmenting the heap)
  off     glibc's default dynamic threshold throughout

Within each repeat the three run in a rotating order, so load that comes and goes hits all alike;
per repeat one scoped/off and one always/off ratio of median step times, and each process's RSS
high-water mark. The ratios are of CPU time (`time.process_time`, user + system of the one-thread
process): what a step costs, including the mmap/munmap calls and page faults a low threshold adds,
without the waits for a core that other processes on a shared machine put into wall time; the
wall-clock medians are in the table beside them.

    python benchmarks/mmap_threshold.py                                  # gpt-125m, 2 layers, ~15 min
    python benchmarks/mmap_threshold.py --repeats 2 --steps 3 model.num_layers=1 --output /tmp/mm.md
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MIB = 2**20
KINDS = ("scoped", "always", "off")
M_MMAP_THRESHOLD = -3  # glibc mallopt parameter (malloc.h)
# glibc's largest dynamic mmap threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX): where its default settles
SETTLED_THRESHOLD_BYTES = 32 * 1024 * 1024


def worker(args: argparse.Namespace) -> None:
    """One process: the model built as `args.worker` says, then warm-up and timed steps; prints JSON."""
    import ctypes
    import ctypes.util

    import torch

    from scalable_transformer.metrics.peak_memory import peak_rss_bytes
    from scalable_transformer.models import build_model
    from scalable_transformer.parallel.init import return_large_frees_to_the_os
    from step_vs_bare import adamw, bare_step, benchmark_config, synthetic_batches

    torch.set_num_threads(args.threads)
    cfg = benchmark_config("gpt", args.config, args.overrides, args.micro_batch_size)
    torch.manual_seed(cfg.train.seed)
    # "applied": glibc took the setting the kind asks for (off asks for nothing)
    applied = return_large_frees_to_the_os() if args.worker != "off" else True
    model = build_model(cfg.model)
    if args.worker == "scoped" and applied:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        libc.mallopt(M_MMAP_THRESHOLD, SETTLED_THRESHOLD_BYTES)
        libc.malloc_trim(0)
    opt = adamw(model, cfg)
    micro = synthetic_batches(cfg, cfg.train.seed)
    times, cpu_times = [], []
    for i in range(args.warmup + args.steps):
        t0, c0 = time.perf_counter(), time.process_time()
        bare_step(model, opt, micro, "gpt", cfg.optim.clip_grad)
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
            cpu_times.append(time.process_time() - c0)
    print(
        json.dumps(
            {
                "applied": applied,
                "step_seconds": times,
                "step_cpu_seconds": cpu_times,
                "peak_rss_bytes": peak_rss_bytes(),
            }
        )
    )


def run_worker(kind: str, args: argparse.Namespace, passthrough: list[str]) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", kind, *passthrough]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    if done.returncode != 0:
        raise RuntimeError(f"exit {done.returncode}: {shlex.join(cmd)}\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def render(args: argparse.Namespace, repeats: list[dict], command: str, seconds: float, cfg_yaml: str) -> str:
    from scalable_transformer.metrics.environment import record_sections

    def median_step(run: dict) -> float:
        return statistics.median(run["step_cpu_seconds"])

    def median_wall(run: dict) -> float:
        return statistics.median(run["step_seconds"])

    lines = [
        "# mmap_threshold: what a 64 KiB mmap threshold costs a CPU training step",
        "",
        f"Command: `{command}` ({seconds:.0f} s); {len(repeats)} repeat(s) of three fresh processes in a "
        f"rotating order, {args.warmup} untimed + {args.steps} timed steps each, {args.threads} torch "
        f"thread(s); 1-min load average at the end {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs.",
        "",
        "| repeat | "
        + " | ".join(f"{k}: median step CPU (ms)" for k in KINDS)
        + " | scoped / off | always / off | "
        + " | ".join(f"{k}: median step wall (ms)" for k in KINDS)
        + " | "
        + " | ".join(f"{k}: peak RSS (MiB)" for k in KINDS)
        + " |",
        "|---:|" + "---:|" * (3 * len(KINDS) + 2),
    ]
    for i, r in enumerate(repeats, 1):
        cells = [f"{median_step(r[k]) * 1e3:,.0f}" for k in KINDS]
        cells += [f"{median_step(r[k]) / median_step(r['off']):.3f}" for k in ("scoped", "always")]
        cells += [f"{median_wall(r[k]) * 1e3:,.0f}" for k in KINDS]
        cells += [f"{r[k]['peak_rss_bytes'] / MIB:,.0f}" for k in KINDS]
        lines.append(f"| {i} | " + " | ".join(cells) + " |")
    lines.append("")
    for k in ("scoped", "always"):
        ratios = [median_step(r[k]) / median_step(r["off"]) for r in repeats]
        q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
        lines.append(
            f"- **{k} / off, median step CPU-time ratio: {statistics.median(ratios):.3f}** "
            f"(IQR {q[0]:.3f}-{q[2]:.3f}; > 1: slower than glibc's default)"
        )
    lines.append("")
    lines += record_sections(cfg_yaml)
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="gpt-125m", help="preset or YAML (default gpt-125m)")
    ap.add_argument("overrides", nargs="*", help="config overrides key=value (default model.num_layers=2)")
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3, help="repeats of the three kinds of process")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--output", type=Path, default=REPO / "benchmarks" / "results" / "mmap_threshold.md")
    ap.add_argument("--worker", choices=KINDS, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if not args.overrides:
        args.overrides = ["model.num_layers=2", "model.seq_length=128"]
    passthrough = [
        "--config", args.config, "--micro-batch-size", str(args.micro_batch_size), "--steps", str(args.steps),
        "--warmup", str(args.warmup), "--threads", str(args.threads), *args.overrides,
    ]  # fmt: skip
    return args, passthrough


def main(argv: list[str] | None = None) -> int:
    args, passthrough = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    from scalable_transformer.config.load import to_yaml
    from step_vs_bare import benchmark_config

    command = shlex.join(
        ["python", "benchmarks/mmap_threshold.py", *(argv if argv is not None else sys.argv[1:])]
    )
    cfg_yaml = to_yaml(benchmark_config("gpt", args.config, args.overrides, args.micro_batch_size))
    start = time.perf_counter()
    repeats = []
    for i in range(args.repeats):
        order = KINDS[i % 3 :] + KINDS[: i % 3]
        repeat = {kind: run_worker(kind, args, passthrough) for kind in order}
        if not (repeat["scoped"]["applied"] and repeat["always"]["applied"]):
            print("mallopt is unavailable here (no glibc): nothing to measure", file=sys.stderr)
            return 1
        repeats.append(repeat)
        print(
            f"repeat {i + 1}: "
            + ", ".join(f"{k} {statistics.median(repeat[k]['step_cpu_seconds']):.3f} s CPU" for k in KINDS),
            flush=True,
        )
    text = render(args, repeats, command, time.perf_counter() - start, cfg_yaml)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.output.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(args.output)
    print(text.split("## Resolved config")[0])
    print(f"written: {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
