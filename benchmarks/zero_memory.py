"""Memory per rank against data-parallel size for ZeRO-0/1/2/3, beside the ZeRO paper's formulas.

For every ZeRO stage and dp in (1, 2, 4): one `stx launch -n dp train CONFIG ... parallel.zero_stage=S`
(fp32, AdamW, no dropout, micro-batch 1, one micro-batch per rank, a few steps). From its `summary.json`:

  model states   `model_state_bytes_per_rank`: the bytes behind each rank's parameters, gradients and
                 optimizer state after the first step, counted storage by storage
  run peak       `run_peak_memory_bytes_per_rank`: the process RSS high-water mark over the whole run
                 (initialization included), and the same less the import baseline (the RSS of a fresh
                 process that has imported what a rank imports: libraries, not training state)

beside the model-state formulas of Rajbhandari et al. 2019 (ZeRO, section 5 / Figure 1) written with
our engine's bytes per parameter: P (parameters) and G (gradients) 4 each, since the engine keeps fp32
parameters as its master weights and autocasts, and K the optimizer's state (AdamW: two fp32 moments, 8;
the paper's K = 12 counts the fp32 master copy there, P = G = 2 its fp16 weights and gradients):

  ZeRO-0  (P + G + K) Psi           ZeRO-2  P Psi + (G + K) Psi / Nd
  ZeRO-1  (P + G) Psi + K Psi / Nd  ZeRO-3  (P + G + K) Psi / Nd

    python benchmarks/zero_memory.py                               # gpt-125m, seq 128, ~10 min
    python benchmarks/zero_memory.py --config tiny-gpt --dps 1 2 --stages 0 3 --output /tmp/zm.md
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from scalable_transformer.metrics.environment import record_sections
from zero_vs_deepspeed import import_baseline

REPO = Path(__file__).resolve().parents[1]
MIB = 2**20
PARTS = ("parameters", "gradients", "optimizer")
BYTES = {"P": 4, "G": 4}
OPTIMIZER_BYTES = {"adamw": 8, "adam": 8}  # exp_avg + exp_avg_sq, fp32


def formula(stage: int, psi: int, nd: int, k: int) -> int:
    """Model-state bytes per rank (ZeRO paper, section 5) with our engine's bytes per parameter."""
    p, g = BYTES["P"], BYTES["G"]
    return {
        0: (p + g + k) * psi,
        1: (p + g) * psi + k * psi // nd,
        2: p * psi + (g + k) * psi // nd,
        3: (p + g + k) * psi // nd,
    }[stage]


FORMULA_TEXT = {0: "(P+G+K)Ψ", 1: "(P+G)Ψ + KΨ/Nd", 2: "PΨ + (G+K)Ψ/Nd", 3: "(P+G+K)Ψ/Nd"}


def forced(args: argparse.Namespace, stage: int, dp: int) -> list[str]:
    return [
        "model.hidden_dropout=0",
        "model.attention_dropout=0",
        f"model.seq_length={args.seq_length}",
        "train.precision=fp32",
        "train.device=cpu",
        "parallel.tp=1",
        "parallel.pp=1",
        f"parallel.zero_stage={stage}",
        "parallel.activation_checkpointing=none",
        "optim.optimizer=adamw",
        "train.micro_batch_size=1",
        "train.gradient_accumulation_steps=1",
        f"train.global_batch_size={dp}",
        f"train.train_iters={args.iters}",
        "train.eval_interval=0",
        "train.eval_iters=1",
        "logging.warmup_iters=0",
        f"logging.log_interval={args.iters}",
        "logging.tensorboard=false",
    ]


def run(args: argparse.Namespace, stage: int, dp: int, work: Path) -> dict:
    tag = f"zero{stage}-dp{dp}"
    cmd = [
        args.stx, "launch", "-n", str(dp), "train", args.config, *args.overrides, *forced(args, stage, dp),
        f"logging.run_dir={work / 'runs'}", f"logging.run_name={tag}",
    ]  # fmt: skip
    log = work / f"{tag}.log"
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    with log.open("w") as f:
        f.write(shlex.join(cmd) + "\n\n")
        f.flush()
        done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=args.timeout)
    if done.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-25:])
        raise RuntimeError(f"exit {done.returncode}: {shlex.join(cmd)}\n--- {log} (tail) ---\n{tail}")
    run_dir = work / "runs" / tag
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"summary": summary, "config": (run_dir / "config.yaml").read_text(), "command": shlex.join(cmd)}


def span(values: list[float], digits: int = 0) -> str:
    lo, hi = min(values), max(values)
    return (
        f"{lo:,.{digits}f}"
        if round(lo, digits) == round(hi, digits)
        else f"{lo:,.{digits}f}-{hi:,.{digits}f}"
    )


def render(
    args: argparse.Namespace, results: dict, baseline: int | None, command: str, seconds: float
) -> str:
    first = next(iter(results.values()))
    psi = int(first["summary"]["num_parameters"])
    k = OPTIMIZER_BYTES["adamw"]
    lines = [
        "# zero_memory: memory per rank against dp for ZeRO-0/1/2/3, beside the ZeRO paper's formulas",
        "",
        f"Command: `{command}` ({seconds:.0f} s). Model: `{args.config}` {' '.join(args.overrides)}, "
        f"Ψ = {psi:,} parameters, seq {args.seq_length}, micro-batch 1 per rank, fp32, AdamW, "
        f"{args.iters} steps, {args.threads} torch thread(s) per rank.",
        "",
        f"Formulas per rank with our engine's bytes: P = {BYTES['P']} (fp32 parameters = master weights), "
        f"G = {BYTES['G']} (fp32 gradients), K = {k} (AdamW's two fp32 moments). "
        "The paper's mixed-precision accounting is P = G = 2, K = 12 (fp32 master copy + moments): the same "
        "16 bytes per parameter at ZeRO-0 and ZeRO-3, split differently between what ZeRO-1/2 shard.",
        "",
        "*measured model states*: `model_state_bytes_per_rank` after the first step (each storage once); "
        "min-max over ranks. *run peak*: whole-run RSS high-water mark per rank "
        "(`run_peak_memory_bytes_per_rank`), "
        "includes the Python runtime, activations, communication buffers and what a rank holds transiently; "
        + (
            f"*peak - baseline* subtracts the import baseline, {baseline / MIB:,.0f} MiB "
            "(RSS of a fresh process that has imported what a rank imports)."
            if baseline
            else "the import baseline could not be measured."
        ),
        "",
        "| ZeRO | dp | formula | formula (MiB) | measured model states (MiB) | measured / formula "
        "| params / grads / optimizer (MiB) | run peak (MiB) | peak - baseline (MiB) "
        "| (peak - baseline) / formula |",
        "|---:|---:|---|---:|---:|---:|---|---:|---:|---:|",
    ]
    for (stage, dp), r in sorted(results.items()):
        s = r["summary"]
        parts = s["model_state_bytes_per_rank"]
        states = [sum(v) for v in zip(*(parts[p] for p in PARTS), strict=True)]
        f = formula(stage, psi, dp, k)
        peaks = s["run_peak_memory_bytes_per_rank"]
        breakdown = " / ".join(span([b / MIB for b in parts[p]]) for p in PARTS)
        net = [p - baseline for p in peaks] if baseline else None
        net_cells = (
            f"{span([n / MIB for n in net])} | {span([n / f for n in net], 2)}" if net else "n/a | n/a"
        )
        lines.append(
            f"| {stage} | {dp} | {FORMULA_TEXT[stage]} | {f / MIB:,.0f} | {span([b / MIB for b in states])} "
            f"| {span([b / f for b in states], 3)} | {breakdown} | {span([p / MIB for p in peaks])} "
            f"| {net_cells} |"
        )
    lines += ["", "## Commands", ""]
    lines += [f"- `{r['command']}`" for _, r in sorted(results.items())]
    lines += [""]
    lines += record_sections(first["config"])
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="gpt-125m", help="preset name or YAML path (default gpt-125m)")
    ap.add_argument("overrides", nargs="*", help="config overrides key=value")
    ap.add_argument("--dps", type=int, nargs="+", default=[1, 2, 4], help="data-parallel sizes")
    ap.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3], choices=[0, 1, 2, 3])
    ap.add_argument("--seq-length", type=int, default=128)
    ap.add_argument("--iters", type=int, default=2, help="optimizer steps per run")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    ap.add_argument("--stx", default=str(Path(sys.executable).with_name("stx")))
    ap.add_argument("--output", type=Path, default=REPO / "benchmarks" / "results" / "zero_memory.md")
    ap.add_argument("--work-dir", type=Path, help="keep the runs here (default: a temporary directory)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = shlex.join(
        ["python", "benchmarks/zero_memory.py", *(argv if argv is not None else sys.argv[1:])]
    )
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="zero-memory-"))
    work.mkdir(parents=True, exist_ok=True)
    baseline_args = argparse.Namespace(threads=args.threads)
    baseline = import_baseline(sys.executable, "ours", baseline_args)
    start = time.perf_counter()
    results: dict[tuple[int, int], dict] = {}
    try:
        for stage in args.stages:
            for dp in args.dps:
                print(f"ZeRO-{stage} dp={dp} ...", flush=True)
                results[(stage, dp)] = run(args, stage, dp, work)
    finally:
        if args.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    text = render(args, results, baseline, command, time.perf_counter() - start)
    tmp = args.output.with_suffix(".tmp")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    tmp.write_text(text)
    tmp.replace(args.output)  # a failed run leaves no half-made record
    print(text.split("## Commands")[0])
    print(f"written: {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
