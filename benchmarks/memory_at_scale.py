"""Memory at 175B scale (issue 21): what each memory option saves, by dry run and by the planner.

Four parts, each a section of the record:

  grid    the seeds' 175B BERT layouts that ran under DeepSpeed in 2022 (bert-175b, 64 A100-40GB as 8 x 8,
          tp 16 or 32, ZeRO-3 with parameter and optimizer offload, full recompute, micro-batch 1 and 32,
          accumulation 1-32): per-GPU peak before (our engine's defaults: checkpointed layer inputs whole
          on every tp rank, unsharded gradients accumulated) and after (DeepSpeed's behaviour:
          distribute_saved_activations, reduce_each_micro_batch), by `stx plan`'s model and by dry run
          (the real engine on fake CUDA tensors, one rank of the 64). ZeRO-0 at 175B: planner only.
  sp      gpt-13b / gpt-7b with tp 2-8 and sequence parallelism, bf16, seq 2048: the peak by dry run
          before (DTensor's gathered qkv/up inputs saved whole: the engine run with `SavedShards`
          switched off in the dry run's process) and after.
  layers  bytes one layer keeps per micro-batch by dry run (dryrun/dry_run.py `saved_bytes_per_layer`)
          at gpt-13b shapes (tp 8, seq 2048, bf16, micro-batch 1, 2, 4) beside Korthikanti et al.
          2022 (the paper's 16-bit formula) and the paper adapted to our attention and dtypes
          (plan/memory_model.py `layer_activation_bytes`).
  cpu     real 2-process runs on this CPU (fp32, gloo): peak live tensor bytes and median iteration
          time of each option against its baseline, alternated A B B A in one run of this script.

    python benchmarks/memory_at_scale.py                       # all four, ~30 min on 2 cores
    python benchmarks/memory_at_scale.py --parts layers cpu --output /tmp/m.md
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from scalable_transformer.config.load import load_config, to_yaml
from scalable_transformer.config.schema import Config
from scalable_transformer.config.validate import resolve
from scalable_transformer.dryrun.dry_run import saved_bytes_per_layer
from scalable_transformer.metrics.environment import record_sections
from scalable_transformer.plan.cluster import table_cluster
from scalable_transformer.plan.memory_model import (
    activation_model,
    kept_input_fraction,
    korthikanti,
    layer_activation_bytes,
)
from scalable_transformer.plan.search import predict, prepare

GIB, MIB = 2**30, 2**20
WORLD, PER_NODE, DEVICE = 64, 8, "a100-40gb"
SEEDS = ["parallel.zero_stage=3", "parallel.offload_param=true", "parallel.offload_optimizer=true"]
SEEDS += ["parallel.activation_checkpointing=full"]
GRID = [  # (tp, micro-batch, accumulation); dp = 64 / tp
    (16, 1, 1),
    (16, 1, 32),
    (16, 32, 1),
    (16, 32, 4),
    (32, 1, 8),
    (32, 32, 1),
]
AFTER = ["parallel.distribute_saved_activations=true", "parallel.reduce_each_micro_batch=true"]
SP_LAYOUTS = [("gpt-13b", 2), ("gpt-13b", 4), ("gpt-13b", 8), ("gpt-7b", 2), ("gpt-7b", 8)]
SP_BASE = [
    "train.precision=bf16",
    "model.seq_length=2048",
    "train.micro_batch_size=4",
    "parallel.zero_stage=3",
]
NO_SLICES = (
    "import scalable_transformer.parallel.tensor as T; T.SavedShards.attach = lambda self, module: None"
)
LAYER_MODES = {
    "no TP": (1, []),
    "TP 8": (8, ["parallel.tp=8"]),
    "TP 8 + SP": (8, ["parallel.tp=8", "parallel.sequence_parallel=true"]),
    "TP 8 + SP + selective": (
        8,
        ["parallel.tp=8", "parallel.sequence_parallel=true", "parallel.activation_checkpointing=selective"],
    ),
    "TP 8 + full": (8, ["parallel.tp=8", "parallel.activation_checkpointing=full"]),
    "TP 8 + full, distributed": (
        8,
        [
            "parallel.tp=8",
            "parallel.activation_checkpointing=full",
            "parallel.distribute_saved_activations=true",
        ],
    ),
}
CPU_COMMON = [
    "model.num_layers=4", "model.hidden_size=256", "model.num_attention_heads=4", "model.seq_length=256",
    "model.hidden_dropout=0", "model.attention_dropout=0", "train.train_iters=8", "logging.log_interval=4",
    "train.eval_interval=0", "train.eval_iters=0", "logging.tensorboard=false", "logging.telemetry=false",
    "logging.track_tensor_bytes=true",
]  # fmt: skip
CPU_PAIRS = {  # option: (baseline overrides, option overrides)
    "sequence parallel (tp 2)": (
        ["parallel.tp=2", "train.micro_batch_size=4", "train.global_batch_size=4"],
        ["parallel.tp=2", "train.micro_batch_size=4", "train.global_batch_size=4",
         "parallel.sequence_parallel=true"],
    ),
    "distributed checkpoints (tp 2, full)": (
        ["parallel.tp=2", "train.micro_batch_size=4", "train.global_batch_size=4",
         "parallel.activation_checkpointing=full"],
        ["parallel.tp=2", "train.micro_batch_size=4", "train.global_batch_size=4",
         "parallel.activation_checkpointing=full", "parallel.distribute_saved_activations=true"],
    ),
    "reduce every micro-batch (ZeRO-3, accumulation 4)": (
        ["parallel.zero_stage=3", "train.micro_batch_size=1", "train.global_batch_size=8"],
        ["parallel.zero_stage=3", "train.micro_batch_size=1", "train.global_batch_size=8",
         "parallel.reduce_each_micro_batch=true"],
    ),
}  # fmt: skip


def dry_run(cfg: Config, world: int, device: str, prelude: str = "") -> dict[str, Any]:
    """dryrun/dry_run.py's `dry_run_isolated`, with `prelude` run first in the child (to measure the
    engine without one of its parts)."""
    with tempfile.TemporaryDirectory(prefix="stx-memory-at-scale-") as tmp:
        config_path, result_path = Path(tmp) / "config.yaml", Path(tmp) / "result.json"
        config_path.write_text(to_yaml(cfg), encoding="utf-8")
        argv = [str(config_path), str(world), device, str(PER_NODE), str(result_path)]
        code = (
            f"{prelude}\nfrom scalable_transformer.dryrun.dry_run import _worker_main; _worker_main({argv!r})"
        )
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=1800)
        if not result_path.exists():
            return {"error": "the dry run's process ended without a result"}
        return json.loads(result_path.read_text(encoding="utf-8"))


def gib(n: float | None) -> str:
    return "-" if n is None else f"{n / GIB:.1f}"


def peak_of(result: dict[str, Any]) -> float | None:
    return None if "error" in result else float(result["peak_memory_bytes"])


def dry_cell(result: dict[str, Any]) -> str:
    """The dry run's peak GiB and the phase it is in (`build`: materializing the model)."""
    if "error" in result:
        return f"error: {result['error'][:120]}"
    phase = result["ranks"][0]["peak_at"]["phase"]
    return f"{gib(peak_of(result))} ({phase})"


def tensors(prediction: Any) -> float:
    """The planner's peak without its allocator/context reserve: what a dry run counts."""
    return float(prediction.peak_memory_bytes - prediction.peak_stage.breakdown.get("reserve", 0))


def grid_section() -> list[str]:
    cluster = table_cluster(DEVICE, WORLD // PER_NODE, PER_NODE)
    lines = [
        "## The seeds' 175B grid (bert-175b, 64 x A100-40GB, ZeRO-3 + parameter and optimizer offload, full "
        "recompute)",
        "",
        "Per-GPU peak GiB of tensors (the planner's figure without its 2 GiB context/allocator reserve, "
        "which it adds before comparing with the 37.3 GiB of an A100-40GB; the dry run's with the phase of "
        "its peak). *before*: the "
        "engine's defaults; *after*: `parallel.distribute_saved_activations=true "
        "parallel.reduce_each_micro_batch=true` "
        "(what a DeepSpeed config with `partition_activations` and a `zero_optimization` block asks for). "
        "Saved: the planner's breakdown terms that changed. The dry runs run 2 micro-batches per step where "
        "the layout accumulates more (without pipelining the second micro-batch's backward already holds "
        "what accumulates; 32 would take a dry run 30 minutes here).",
        "",
        "| tp | dp | micro-batch x accumulation | planner before | dry run before | planner after "
        "| dry run after | fits after (planner) | saved (planner) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for tp, mb, acc in GRID:
        dp = WORLD // tp
        batch = [
            f"parallel.tp={tp}",
            f"train.micro_batch_size={mb}",
            f"train.global_batch_size={mb * acc * dp}",
        ]
        row = []
        predictions = []
        for extra in ([], AFTER):
            cfg = prepare(load_config("bert-175b", [*SEEDS, *batch, *extra]), WORLD)
            pred = predict(cfg, cluster)
            predictions.append(pred)
            t0 = time.perf_counter()
            # two micro-batches stand for any accumulation: without pipelining the second one's backward
            # already holds whatever accumulates (32 would take the dry run 30 minutes)
            short = [*batch[:2], f"train.global_batch_size={mb * min(acc, 2) * dp}"]
            result = dry_run(
                resolve(prepare(load_config("bert-175b", [*SEEDS, *short, *extra]), WORLD), WORLD),
                WORLD,
                "cuda",
            )
            print(f"  grid tp {tp} mb {mb} x {acc} {'after' if extra else 'before'}: "
                  f"{time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)  # fmt: skip
            row += [gib(tensors(pred)), dry_cell(result)]
        before, after = (p.peak_stage.breakdown for p in predictions)
        saved = {k: before.get(k, 0) - after.get(k, 0) for k in set(before) | set(after)}
        what = ", ".join(
            f"{k.replace('_', ' ')} {v / GIB:.1f}" for k, v in sorted(saved.items()) if abs(v) > GIB / 20
        )
        lines.append(
            f"| {tp} | {dp} | {mb} x {acc} | {row[0]} | {row[1]} | {row[2]} | {row[3]} | "
            f"{'yes' if predictions[1].fits else 'no: ' + (predictions[1].reason or '')} | {what or '-'} |"
        )
    zero0 = predict(
        prepare(load_config("bert-175b", ["parallel.tp=16", "train.micro_batch_size=1"]), WORLD), cluster
    )
    lines += [
        "",
        "ZeRO-0 at 175B (tp 16, micro-batch 1) stays out of reach: the planner gives "
        f"{gib(zero0.peak_memory_bytes)} "
        f"GiB per GPU ({zero0.reason}).",
        "",
    ]
    return lines


def sp_section() -> list[str]:
    lines = [
        "## Sequence parallelism at 7B-13B (8 GPUs: tp x dp, ZeRO-3, bf16, seq 2048, micro-batch 4, "
        "A100-80GB)",
        "",
        "Per-GPU peak by dry run (fake CUDA) before (the gathered qkv/up inputs saved whole, `SavedShards` "
        "off) "
        "and after (with the phase of the peak), and the planner's figure for the engine as it is now "
        "(without its reserve).",
        "",
        "| model | tp | dry run before GiB | dry run after GiB | saved GiB | planner GiB |",
        "|---|---|---|---|---|---|",
    ]
    cluster = table_cluster("a100-80gb", 1, 8)
    for name, tp in SP_LAYOUTS:
        over = [
            *SP_BASE,
            f"parallel.tp={tp}",
            "parallel.sequence_parallel=true",
            f"train.global_batch_size={32 // tp}",
        ]
        cfg = resolve(prepare(load_config(name, over), 8), 8)
        before, after = (dry_run(cfg, 8, "cuda", prelude) for prelude in (NO_SLICES, ""))
        planned = tensors(predict(prepare(load_config(name, over), 8), cluster))
        b, a = peak_of(before), peak_of(after)
        saved = None if b is None or a is None else b - a
        lines.append(
            f"| {name} | {tp} | {dry_cell(before)} | {dry_cell(after)} | {gib(saved)} | {gib(planned)} |"
        )
    return [*lines, ""]


def layers_section() -> list[str]:
    lines = [
        "## Bytes one layer keeps per micro-batch (gpt-13b shapes: h 5120, 40 heads, seq 2048, bf16, "
        "fake CUDA)",
        "",
        "Measured: dry run with 2 layers minus 1 layer, rank 0, what the first micro-batch keeps at its "
        "backward (autocast's weight copies excluded). Paper: Korthikanti et al. 2022 (16-bit activations, "
        "1-byte masks, unfused attention). Adapted: the paper's terms with flash attention (no a s^2 "
        "tensors), fp32 norm inputs "
        "and residual stream (fp32 parameters under autocast), no dropout masks (dropout 0): "
        "`layer_activation_bytes`. MiB.",
        "",
        "| layout | micro-batch | measured | adapted | measured / adapted | paper |",
        "|---|---|---|---|---|---|",
    ]
    for mode, (world, over) in LAYER_MODES.items():
        for mb in (1, 2, 4):
            batch = [f"train.micro_batch_size={mb}", f"train.global_batch_size={mb}"]
            cfg = resolve(load_config("gpt-13b", [*SP_BASE[:2], *batch, *over]), world)
            m, p = cfg.model, cfg.parallel
            assert m.ffn_hidden_size is not None
            measured = saved_bytes_per_layer(cfg, world, "cuda")
            recompute = p.activation_checkpointing
            adapted = layer_activation_bytes(
                mb, m.seq_length, m.hidden_size, m.num_attention_heads, m.ffn_hidden_size, p.tp,
                p.sequence_parallel, recompute, activation_model(cfg, "cuda"),
            )  # fmt: skip
            adapted *= kept_input_fraction(cfg, "cuda")
            if recompute == "full":
                paper = (
                    2 * mb * m.seq_length * m.hidden_size / (p.tp if p.distribute_saved_activations else 1)
                )
            else:
                paper = korthikanti(
                    mb, m.seq_length, m.hidden_size, m.num_attention_heads, p.tp, p.sequence_parallel,
                    recompute == "selective",
                )  # fmt: skip
            lines.append(
                f"| {mode} | {mb} | {measured / MIB:.1f} | {adapted / MIB:.1f} | {measured / adapted:.3f} | "
                f"{paper / MIB:.1f} |"
            )
            print(f"  layers {mode} mb {mb}: {measured / MIB:.1f} MiB", file=sys.stderr, flush=True)
    return [*lines, ""]


def cpu_run(overrides: list[str], work: Path, tag: str, stx: str) -> dict[str, Any]:
    cmd = [stx, "launch", "-n", "2", "train", "tiny-gpt", *CPU_COMMON, *overrides,
           f"logging.run_dir={work}", f"logging.run_name={tag}"]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(
            f"exit {done.returncode}: {shlex.join(cmd)}\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
        )
    summary = json.loads((work / tag / "summary.json").read_text())
    return {
        "seconds": summary["median_iteration_seconds"],
        "peak": max(summary["peak_tensor_bytes_per_rank"]),
    }


def cpu_section(stx: str, repeats: int) -> list[str]:
    lines = [
        "## Real 2-process runs on this CPU (tiny-gpt shape: 4 layers, h 256, seq 256, fp32, gloo)",
        "",
        f"Each option against its baseline, run A B B A x {repeats} (median iteration seconds over "
        "iterations "
        "1-8 of each run, then the median over runs); peak live tensor bytes (`logging.track_tensor_bytes`), "
        "the larger rank.",
        "",
        "| option | baseline peak MiB | option peak MiB | peak ratio | baseline s/iter | option s/iter | "
        "time ratio (option / baseline) |",
        "|---|---|---|---|---|---|---|",
    ]
    with tempfile.TemporaryDirectory(prefix="stx-memory-cpu-") as tmp:
        work = Path(tmp)
        for name, (base, option) in CPU_PAIRS.items():
            runs: dict[str, list[dict[str, Any]]] = {"a": [], "b": []}
            for i in range(repeats):
                for which in ("a", "b", "b", "a"):
                    over = base if which == "a" else option
                    runs[which].append(
                        cpu_run(over, work, f"{which}{i}-{len(runs[which])}-{abs(hash(name))}", stx)
                    )
            a_s = statistics.median(r["seconds"] for r in runs["a"])
            b_s = statistics.median(r["seconds"] for r in runs["b"])
            a_p, b_p = runs["a"][0]["peak"], runs["b"][0]["peak"]
            lines.append(
                f"| {name} | {a_p / MIB:.1f} | {b_p / MIB:.1f} | {b_p / a_p:.3f} | {a_s:.4f} | {b_s:.4f} | "
                f"{b_s / a_s:.3f} |"
            )
            print(f"  cpu {name}: time ratio {b_s / a_s:.3f}", file=sys.stderr, flush=True)
    return [*lines, ""]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", nargs="+", default=["grid", "sp", "layers", "cpu"],
                    choices=["grid", "sp", "layers", "cpu"])  # fmt: skip
    ap.add_argument("--repeats", type=int, default=2, help="cpu: A B B A repeats")
    ap.add_argument("--stx", default=str(Path(sys.executable).with_name("stx")))
    ap.add_argument("--output", default=str(Path(__file__).parent / "results" / "memory_at_scale.md"))
    args = ap.parse_args(argv)
    start = time.perf_counter()
    lines = ["# Memory at 175B scale (issue 21)", "", f"Command: `python benchmarks/memory_at_scale.py "
             f"--parts {' '.join(args.parts)}`", ""]  # fmt: skip
    sections = {"grid": grid_section, "sp": sp_section, "layers": layers_section}
    for part in args.parts:
        print(f"{part} ...", file=sys.stderr, flush=True)
        lines += cpu_section(args.stx, args.repeats) if part == "cpu" else sections[part]()
    lines += [f"Took {time.perf_counter() - start:.0f} s.", ""]
    lines += record_sections(to_yaml(load_config("bert-175b", [*SEEDS, "parallel.tp=16", *AFTER])))
    out = Path(args.output)
    tmp = out.with_suffix(".tmp")
    tmp.write_text("\n".join(lines) + "\n", encoding="utf-8")
    tmp.replace(out)
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
