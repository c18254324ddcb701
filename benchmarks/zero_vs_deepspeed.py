"""Our ZeRO-0 (DDP) and ZeRO-3 (FSDP2) against DeepSpeed's, 2 CPU processes, interleaved runs.

  ours       `stx launch -n 2 train CONFIG ... parallel.zero_stage=S`: `summary.json` in the run directory
             (median iteration time of rank 0 over the post-warm-up iterations, peak RSS per rank)
  deepspeed  `python -m torch.distributed.run --standalone --nproc-per-node 2 deepspeed_worker.py`,
             in a separate venv that has DeepSpeed (never the project's): the same model, data,
             initial weights, batch sizes, AdamW, clip and step count through `deepspeed.initialize`
             with `zero_optimization.stage = S`; one JSON per rank

Every run is a fresh pair of processes; the engines alternate run by run (ours first, then
DeepSpeed, then DeepSpeed first for the next stage, and the stage order flips every repeat), and
each repeat yields one ours/DeepSpeed tokens/s ratio per stage: contention on the shared machine
that comes and goes over minutes hits both engines of a repeat alike.

    python benchmarks/zero_vs_deepspeed.py --ds-python /work/dsvenv/bin/python
    python benchmarks/zero_vs_deepspeed.py --ds-python /work/dsvenv/bin/python --repeats 3 --iters 12 \\
        --stages 3 model.num_layers=4
    python benchmarks/zero_vs_deepspeed.py --ds-python /work/dsvenv/bin/python --only deepspeed

Installing DeepSpeed for it: benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

from scalable_transformer.config.load import ConfigError, load_config, to_yaml
from scalable_transformer.config.schema import Config
from scalable_transformer.config.validate import resolve
from scalable_transformer.data.tokenizers import load_tokenizer
from scalable_transformer.metrics.environment import record_sections
from scalable_transformer.models import count_parameters

REPO = Path(__file__).resolve().parents[1]
WORKER = REPO / "benchmarks" / "deepspeed_worker.py"
ENGINES = ("ours", "deepspeed")
NAMES = {"ours": "ours (stx launch)", "deepspeed": "DeepSpeed"}
# Keys of a run's resolved config that may differ from the harness's: set per run.
PER_RUN_KEYS = {("parallel", "zero_stage"), ("logging", "run_dir"), ("logging", "run_name")}
LOSS_TOLERANCE = 1e-3  # relative, per log interval: same weights, data and math, different reductions
MIB = 2**20


class NotAvailable(RuntimeError):
    """One side of the comparison cannot run in this checkout or environment."""


# ----------------------------------------------------------------------------- config


def forced_settings(args: argparse.Namespace) -> list[str]:
    """Overrides applied after the user's, on both sides: the same work (fp32 on the CPU, no
    dropout, AdamW at a constant lr, as the DeepSpeed side has no scheduler; pure data parallelism),
    the step count and the warm-up window, and quiet runs (no TensorBoard, evaluation only at the end)."""
    return [
        "model.type=gpt",
        "model.hidden_dropout=0",
        "model.attention_dropout=0",
        "train.precision=fp32",
        "train.device=cpu",
        "parallel.tp=1",
        "parallel.pp=1",
        "parallel.activation_checkpointing=none",
        "parallel.compile=false",
        "optim.optimizer=adamw",
        "optim.adam_w_mode=true",
        "optim.scheduler=megatron",
        "optim.lr_decay_style=constant",
        "optim.lr_warmup_iters=0",
        "optim.lr_warmup_fraction=",
        f"train.micro_batch_size={args.micro_batch_size}",
        f"train.gradient_accumulation_steps={args.accumulation}",
        "train.global_batch_size=",  # derived: micro-batch x accumulation x dp
        f"train.train_iters={args.iters}",
        "train.eval_interval=0",
        "train.eval_iters=1",
        f"logging.warmup_iters={args.warmup}",
        f"logging.log_interval={args.log_interval}",
        "logging.tensorboard=false",
    ]


def resolved_config(args: argparse.Namespace) -> Config:
    """The config both sides run, resolved as `stx train` resolves it (vocab from the tokenizer)."""
    cfg = load_config(args.config, [*args.overrides, *forced_settings(args)])
    if cfg.model.vocab_size is None:
        d = cfg.data
        tokenizer = load_tokenizer(
            d.tokenizer, d.tokenizer_vocab_size, vocab_file=d.vocab_file, merge_file=d.merge_file,
            tokenizer_type=d.tokenizer_type,
        )  # fmt: skip
        cfg = load_config(
            args.config, [*args.overrides, *forced_settings(args), f"model.vocab_size={tokenizer.vocab_size}"]
        )
    return resolve(cfg, world_size=args.nproc)


# ----------------------------------------------------------------------------- the two sides


def check_ours(stx: str) -> None:
    """`stx launch` must exist in this checkout; say so clearly when it does not."""
    try:
        probe = subprocess.run([stx, "launch", "--help"], capture_output=True, text=True, timeout=120)
    except OSError as e:
        raise NotAvailable(f"ours: cannot run {stx!r} ({e})") from None
    if probe.returncode != 0:
        raise NotAvailable(
            "ours: `stx launch` is not available yet in this checkout (`stx launch --help` exited "
            f"{probe.returncode}: {(probe.stderr or probe.stdout).strip().splitlines()[-1:]}); "
            "run with `--only deepspeed` to measure the DeepSpeed side alone"
        )


def check_deepspeed(ds_python: str | None) -> str:
    if not ds_python:
        raise NotAvailable(
            "deepspeed: pass --ds-python (or set STX_DEEPSPEED_PYTHON) to the python of a venv with "
            "DeepSpeed and this package installed; see benchmarks/README.md"
        )
    try:
        probe = subprocess.run(
            [ds_python, "-c", "import deepspeed, scalable_transformer; print(deepspeed.__version__)"],
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "DS_ACCELERATOR": "cpu"},
        )
    except OSError as e:
        raise NotAvailable(f"deepspeed: cannot run {ds_python!r} ({e}); see benchmarks/README.md") from None
    if probe.returncode != 0:
        tail = (probe.stderr or probe.stdout).strip().splitlines()[-3:]
        raise NotAvailable(f"deepspeed: {ds_python} cannot import deepspeed and scalable_transformer: {tail}")
    return probe.stdout.strip().splitlines()[-1]


# What a rank process imports before it builds anything: ours runs `python -m scalable_transformer.cli
# train` (the CLI, torchrun's error recorder, the training entry point); DeepSpeed's worker imports
# deepspeed and the same training modules.
IMPORTS = {
    "ours": (
        "scalable_transformer.cli",
        "torch.distributed.elastic.multiprocessing.errors",
        "scalable_transformer.train.run",
    ),
    "deepspeed": ("deepspeed", "scalable_transformer.train.run"),
}
_RSS_AFTER_IMPORTS = (
    "import importlib, sys\n"
    "for name in sys.argv[1:]:\n"
    "    importlib.import_module(name)\n"
    "print(next(int(l.split()[1]) * 1024 for l in open('/proc/self/status') if l.startswith('VmRSS:')))"
)


def import_baseline(python: str, engine: str, args: argparse.Namespace) -> int | None:
    """RSS (bytes) of a fresh process of `python` once it has imported what an `engine` rank imports:
    the part of every peak below that is libraries, not training state."""
    try:
        done = subprocess.run(
            [python, "-c", _RSS_AFTER_IMPORTS, *IMPORTS[engine]],
            capture_output=True, text=True, timeout=300, env=child_env(args),
        )  # fmt: skip
        return int(done.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def child_env(args: argparse.Namespace) -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(args.threads)
    env["DS_ACCELERATOR"] = "cpu"
    return env


def run_logged(cmd: list[str], log: Path, args: argparse.Namespace, cwd: Path) -> None:
    with log.open("w") as f:
        f.write(shlex.join(cmd) + "\n\n")
        f.flush()
        try:
            done = subprocess.run(
                cmd, stdout=f, stderr=subprocess.STDOUT, cwd=cwd, env=child_env(args), timeout=args.timeout
            )
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"timed out after {args.timeout} s: {shlex.join(cmd)} (log {log})") from None
    if done.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-25:])
        raise RuntimeError(f"exit {done.returncode}: {shlex.join(cmd)}\n--- log {log} (tail) ---\n{tail}")


def user_overrides(args: argparse.Namespace, stage: int) -> list[str]:
    return [*args.overrides, *forced_settings(args), f"parallel.zero_stage={stage}"]


def profile_window(args: argparse.Namespace) -> tuple[int, int]:
    """The profiled iterations of a --profile run: the 5 after the warm-up (or what the run has)."""
    first = min(args.warmup + 1, args.iters)
    return first, min(first + 4, args.iters)


def run_ours(args: argparse.Namespace, stage: int, tag: str, work: Path, profile: bool = False) -> dict:
    runs = work / "runs"
    window = profile_window(args)
    profiling = (
        [f"logging.profile_start_step={window[0]}", f"logging.profile_end_step={window[1]}",
         "logging.profile_ranks=0"]
        if profile
        else []
    )  # fmt: skip
    cmd = [
        args.stx, "launch", "-n", str(args.nproc), "train", args.config or "tiny-gpt",
        *user_overrides(args, stage), f"logging.run_dir={runs}", f"logging.run_name={tag}", *profiling,
    ]  # fmt: skip
    run_logged(cmd, work / f"{tag}.log", args, work)
    run_dir = runs / tag
    summary = json.loads((run_dir / "summary.json").read_text())
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    per_rank = summary.get("peak_memory_bytes_per_rank") or [summary["peak_memory_bytes"]]
    return {
        "tokens_per_second": summary["tokens_per_second"],
        "median_iteration_seconds": summary["median_iteration_seconds"],
        "iterations": summary["iterations"],
        "warmup_excluded": summary["warmup_iterations_excluded"],
        "num_parameters": summary["num_parameters"],
        "peak_memory_bytes_per_rank": per_rank,
        "peak_memory_method": summary["peak_memory_method"],
        "interval_losses": {r["iteration"]: r["loss"] for r in records if r.get("kind") == "train"},
        "resolved_config": (run_dir / "config.yaml").read_text(),
        "layout": summary.get("layout"),
        "profile": _ours_profile(summary.get("profile")),
    }


def _ours_profile(profile: dict | None) -> dict | None:
    """Our profiler window's top host operators, as ms and calls per iteration (the worker's shape)."""
    if not profile or "top_operators" not in profile:
        return None
    steps = profile["steps"]
    ops = profile["top_operators"]
    return {
        "steps": steps,
        "ms_per_iteration": {o["name"]: o["self_ms"] / steps for o in ops},
        "calls_per_iteration": {o["name"]: o["calls"] / steps for o in ops},
    }


def count_or_default(value: str) -> int | None:
    """A DeepSpeed stage-3 setting on the command line: a count, or 'default' (None: DeepSpeed's own)."""
    return None if value == "default" else int(value)


def ds_setting_flag(flag: str, value: int | None) -> list[str]:
    """The worker's flag for a DeepSpeed setting; none where DeepSpeed keeps its default."""
    return [] if value is None else [flag, str(value)]


def ds_setting_text(key: str, value: int | None, at_default: str, at_zero: str) -> str:
    """The record's sentence on a DeepSpeed stage-3 setting: `at_default` where DeepSpeed keeps its
    own, else the value, explained by `at_zero` when it is 0."""
    if value is None:
        return at_default
    return f"`{key} = {value}`" + (at_zero if value == 0 else ".")


def run_deepspeed(args: argparse.Namespace, stage: int, tag: str, work: Path, profile: bool = False) -> dict:
    out = work / f"{tag}-rank{{rank}}.json"
    window = profile_window(args)
    profiling = ["--profile-steps", f"{window[0]}-{window[1]}"] if profile else []
    cmd = [
        args.ds_python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.nproc),
        str(WORKER), "--config", args.config or "tiny-gpt", "--zero-stage", str(stage),
        "--threads", str(args.threads), "--ds-adam", args.ds_adam, "--output", str(out), *profiling,
        *ds_setting_flag("--persistence-threshold", args.ds_persistence_threshold),
        *ds_setting_flag("--max-reuse-distance", args.ds_max_reuse_distance),
        *ds_setting_flag("--prefetch-bucket-size", args.ds_prefetch_bucket_size),
        *user_overrides(args, stage),
    ]  # fmt: skip
    run_logged(cmd, work / f"{tag}.log", args, work)
    ranks = [json.loads(Path(str(out).format(rank=r)).read_text()) for r in range(args.nproc)]
    r0 = ranks[0]
    losses = r0["losses"]
    interval = args.log_interval
    # our interval means (iterations (k-1)*L+1 .. k*L, and the last partial one), from per-step losses
    ends = sorted({*range(interval, len(losses) + 1, interval), len(losses)})
    interval_losses = {}
    start = 0
    for end in ends:
        interval_losses[end] = statistics.fmean(losses[start:end])
        start = end
    return {
        "tokens_per_second": r0["tokens_per_second"],
        "median_iteration_seconds": r0["median_iteration_seconds"],
        "iterations": r0["iterations"],
        "warmup_excluded": r0["warmup_iterations_excluded"],
        "num_parameters": r0["num_parameters"],
        "peak_memory_bytes_per_rank": [r["peak_memory_bytes"] for r in ranks],
        "rss_before_loop_bytes_per_rank": [r["rss_before_loop_bytes"] for r in ranks],
        "peak_memory_method": r0["peak_memory_method"],
        "interval_losses": interval_losses,
        "resolved_config": r0.get("resolved_config"),
        "profile": r0.get("profile"),
        "worker": {
            k: v
            for k, v in r0.items()
            if k not in ("iteration_seconds", "losses", "grad_norms", "resolved_config", "profile")
        },
    }


def config_differences(expected_yaml: str, run_yaml: str) -> list[str]:
    """`section.key: expected != actual` for every resolved value a run did not share with the
    harness's config, besides the per-run keys."""
    expected, actual = yaml.safe_load(expected_yaml), yaml.safe_load(run_yaml)
    return [
        f"{section}.{key}: {value!r} != {actual.get(section, {}).get(key)!r}"
        for section, fields in expected.items()
        for key, value in fields.items()
        if (section, key) not in PER_RUN_KEYS and actual.get(section, {}).get(key) != value
    ]


# ----------------------------------------------------------------------------- measurement


def quartiles(values: list[float]) -> tuple[float, float]:
    if len(values) < 2:
        return values[0], values[0]
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q3


def schedule(stages: list[int], repeats: int, engines: tuple[str, ...]) -> list[tuple[int, int, str]]:
    """(repeat, stage, engine) in run order: within a repeat each stage's two runs are adjacent, the
    engine that goes first alternates pair by pair, and the stage order flips every repeat (ABBA)."""
    order = []
    pair = 0
    for r in range(repeats):
        for stage in stages if r % 2 == 0 else stages[::-1]:
            pair_engines = engines if pair % 2 == 0 else engines[::-1]
            order += [(r, stage, e) for e in pair_engines]
            pair += 1
    return order


def loss_check(ours: dict, ds: dict) -> tuple[float, list[tuple[int, float, float]]]:
    """Max relative difference of the log-interval mean losses, and the rows compared."""
    rows = [
        (i, ours["interval_losses"][i], ds["interval_losses"][i]) for i in sorted(ours["interval_losses"])
    ]
    rows = [(i, a, b) for i, a, b in rows if b is not None]
    worst = max((abs(a - b) / max(abs(b), 1e-12) for _, a, b in rows), default=float("nan"))
    return worst, rows


# ----------------------------------------------------------------------------- report


def fmt_iqr(values: list[float], scale: float = 1.0, digits: int = 0) -> tuple[str, str]:
    q1, q3 = quartiles(values)
    med = statistics.median(values)
    return f"{med * scale:,.{digits}f}", f"{q1 * scale:,.{digits}f}-{q3 * scale:,.{digits}f}"


def render(results: dict, args: argparse.Namespace, command: str, cfg_yaml: str, meta: dict) -> str:
    t = meta["cfg"].train
    m = meta["cfg"].model
    engines = meta["engines"]
    lines = [
        "# zero_vs_deepspeed: our ZeRO vs DeepSpeed's, 2 CPU processes",
        "",
        f"{m.type.upper()} {m.num_layers} layers x {m.hidden_size} hidden, seq {m.seq_length}, "
        f"{meta['num_parameters']:,} parameters; global batch {t.global_batch_size} = micro "
        f"{t.micro_batch_size} x accumulation {t.gradient_accumulation_steps} x dp {args.nproc}; "
        f"fp32, AdamW, clip {meta['cfg'].optim.clip_grad:g}, constant lr {meta['cfg'].optim.lr:g}; "
        f"{args.iters} steps per run, the first {args.warmup} excluded from the median.",
        "",
        f"Command: `{command}`",
        "",
        "- **ours**: `stx launch -n 2 train ... parallel.zero_stage=S` (ZeRO-0 = DDP, ZeRO-3 = FSDP2 "
        "`fully_shard` per block then root); tokens/s from `summary.json`: global batch x seq / median "
        "iteration time of rank 0 over the post-warm-up iterations; peak memory per rank from "
        "`peak_memory_bytes_per_rank`.",
        "- **DeepSpeed**: `benchmarks/deepspeed_worker.py` under `torch.distributed.run`, "
        f"`deepspeed.initialize` with `zero_optimization.stage = S`, accelerator "
        f"`{meta.get('ds_accelerator', 'CPU_Accelerator')}`, backend `gloo`, optimizer "
        f"`{meta.get('ds_optimizer', '?')}` over our two parameter groups (weight decay on matrices "
        "only); the same loader (`build_loader` with dp_rank/dp_size), the same initial weights "
        "(`set_seed(train.seed)` + `build_model`), our `compute_loss`; each step timed from fetching "
        "its micro-batches to `engine.step()` at the accumulation boundary, as our trainer times an "
        "iteration; peak memory per rank = RSS high-water mark since just before the loop "
        "(`MemoryTracker`), as ours resets it at the start of `fit`. At stage 3, "
        + ds_setting_text(
            "stage3_param_persistence_threshold",
            args.ds_persistence_threshold,
            "DeepSpeed's default `stage3_param_persistence_threshold` (100,000 elements: every smaller "
            "parameter stays whole on every rank, unlike ours).",
            " (every parameter partitioned, as in ours; DeepSpeed's default 100,000 would keep every "
            "smaller parameter whole on every rank).",
        )
        + " "
        + ds_setting_text(
            "stage3_max_reuse_distance",
            args.ds_max_reuse_distance,
            "DeepSpeed's default `stage3_max_reuse_distance` (1e9 elements: below a billion parameters "
            "every parameter gathered in forward stays gathered until its backward, so the whole model "
            "is resident on every rank during the step; ours releases each block after its forward).",
            " (each parameter released after its module's forward and gathered again for its "
            "backward, as ours does for every block but the last).",
        )
        + " "
        + ds_setting_text(
            "stage3_prefetch_bucket_size",
            args.ds_prefetch_bucket_size,
            "DeepSpeed's default `stage3_prefetch_bucket_size` (5e7 elements of the next modules' "
            "parameters gathered ahead in one collective: at this model's size all of them; ours "
            "gathers one FSDP2 unit at a time).",
            " (no prefetch: each module's parameters gathered when it runs, 60 all-gathers per "
            "iteration of tiny-gpt where the default makes 4; ours gathers one FSDP2 unit per "
            "collective, 8).",
        ),
        "",
        "Forced after the config and the overrides, on both sides: `"
        + " ".join(forced_settings(args))
        + "`.",
        "",
        f"Processes: {args.nproc}, {args.threads} torch thread(s) each (`OMP_NUM_THREADS={args.threads}`); "
        f"{meta['repeats_done']} repeat(s) (of {args.repeats} requested) of one run per engine per stage, "
        f"in the order ABBA (engines alternate pair by pair, the stage order flips every repeat); "
        f"{meta['wall']:.0f} s in all. Machine load (1-min load average, sampled before every run): "
        f"{meta['load'][0]:.1f}-{meta['load'][1]:.1f} on {os.cpu_count()} CPUs, of which this "
        f"benchmark uses {args.nproc * args.threads}; the rest is other processes competing for the cores.",
        "",
        "## Throughput",
        "",
        "Per stage: median over repeats of each run's tokens/s (IQR over repeats), and the median and "
        "IQR of the per-repeat ratios ours / DeepSpeed (> 1: ours faster).",
        "",
    ]
    if "ours" in engines:
        lines += [
            "| ZeRO stage | ours tokens/s | IQR | DeepSpeed tokens/s | IQR | ours / DeepSpeed | IQR |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
    else:
        lines += [
            "**ours: not measured** (`--only deepspeed`: `stx launch` was not available or not asked for).",
            "",
            "| ZeRO stage | DeepSpeed tokens/s | IQR | median iteration (ms) |",
            "|---|---:|---:|---:|",
        ]
    for stage in args.stages:
        ds_tps = [run["tokens_per_second"] for run in results[stage]["deepspeed"]]
        if not ds_tps:
            continue
        ds_med, ds_iqr = fmt_iqr(ds_tps)
        if "ours" in engines:
            ours_tps = [run["tokens_per_second"] for run in results[stage]["ours"]]
            ratios = [a / b for a, b in zip(ours_tps, ds_tps, strict=True)]
            o_med, o_iqr = fmt_iqr(ours_tps)
            r_med, r_iqr = fmt_iqr(ratios, digits=3)
            lines.append(f"| {stage} | {o_med} | {o_iqr} | {ds_med} | {ds_iqr} | {r_med} | {r_iqr} |")
        else:
            it_med, _ = fmt_iqr(
                [run["median_iteration_seconds"] for run in results[stage]["deepspeed"]], 1000, 1
            )
            lines.append(f"| {stage} | {ds_med} | {ds_iqr} | {it_med} |")
    lines += [
        "",
        "## Peak memory per rank",
        "",
        "Median over repeats of each run's peak RSS (MiB) per rank. On CPU this is the process's "
        "resident-set high-water mark: it includes the Python runtime and every imported library, so it "
        "bounds the training state from above rather than counting tensors. `before loop` is "
        "DeepSpeed's RSS just before its first step (model, engine and data built), for scale.",
        "",
    ]
    base = meta.get("import_baseline", {})
    if base:
        lines += [
            "Import baseline, the RSS of a fresh process that has only imported what a rank imports "
            "(measured once, before the runs): "
            + "; ".join(
                f"{NAMES[e]} {base[e] / MIB:,.0f} MiB (`{'`, `'.join(IMPORTS[e])}`)"
                for e in engines
                if base.get(e)
            )
            + ". The difference between the engines' baselines is libraries, not training state.",
            "",
        ]
    if "ours" in engines:
        lines += [
            "| ZeRO stage | rank | ours (MiB) | DeepSpeed (MiB) | ours / DeepSpeed "
            "| DeepSpeed before loop (MiB) |",
            "|---|---:|---:|---:|---:|---:|",
        ]
    else:
        lines += [
            "| ZeRO stage | rank | DeepSpeed (MiB) | DeepSpeed before loop (MiB) |",
            "|---|---:|---:|---:|",
        ]
    for stage in args.stages:
        ds_runs = results[stage]["deepspeed"]
        if not ds_runs:
            continue
        for rank in range(args.nproc):
            ds_peak = statistics.median(run["peak_memory_bytes_per_rank"][rank] for run in ds_runs) / MIB
            before = statistics.median(run["rss_before_loop_bytes_per_rank"][rank] for run in ds_runs) / MIB
            if "ours" in engines:
                per_rank = [run["peak_memory_bytes_per_rank"] for run in results[stage]["ours"]]
                if all(len(p) > rank for p in per_rank):
                    ours_peak = statistics.median(p[rank] for p in per_rank) / MIB
                    lines.append(
                        f"| {stage} | {rank} | {ours_peak:,.0f} | {ds_peak:,.0f} | "
                        f"{ours_peak / ds_peak:.3f} | {before:,.0f} |"
                    )
                else:
                    lines.append(f"| {stage} | {rank} | n/a | {ds_peak:,.0f} | n/a | {before:,.0f} |")
            else:
                lines.append(f"| {stage} | {rank} | {ds_peak:,.0f} | {before:,.0f} |")
    lines += ["", "## Like-for-like check", ""]
    if "ours" in engines:
        lines += [
            f"Mean training loss per log interval ({args.log_interval} steps), first repeat: the same "
            "initial weights, data and hyper-parameters must give the same losses up to float "
            f"reduction order (tolerance {LOSS_TOLERANCE:g} relative).",
            "",
            "| ZeRO stage | iteration | ours | DeepSpeed | relative difference |",
            "|---|---:|---:|---:|---:|",
        ]
        for stage in args.stages:
            if not results[stage]["ours"]:
                continue
            worst, rows = loss_check(results[stage]["ours"][0], results[stage]["deepspeed"][0])
            for i, a, b in rows:
                lines.append(f"| {stage} | {i} | {a:.6f} | {b:.6f} | {abs(a - b) / abs(b):.2e} |")
            verdict = "PASS" if worst <= LOSS_TOLERANCE else "FAIL"
            lines.append(f"| {stage} | max | | | {worst:.2e} {verdict} |")
    else:
        lines.append("Not possible without our side; DeepSpeed's interval losses per stage, first repeat:")
        lines.append("")
        for stage in args.stages:
            if results[stage]["deepspeed"]:
                losses = results[stage]["deepspeed"][0]["interval_losses"]
                lines.append(f"- ZeRO-{stage}: " + ", ".join(f"{i}: {v:.6f}" for i, v in losses.items()))
    lines += [
        "",
        "## Every run",
        "",
        "| # | repeat | ZeRO stage | engine | median iteration (ms) | tokens/s | peak RSS per rank (MiB) |",
        "|---:|---:|---:|---|---:|---:|---|",
    ]
    for n, (r, stage, engine, run) in enumerate(meta["runs"], 1):
        peaks = ", ".join(f"{p / MIB:,.0f}" for p in run["peak_memory_bytes_per_rank"])
        lines.append(
            f"| {n} | {r} | {stage} | {NAMES[engine]} | {1000 * run['median_iteration_seconds']:.1f} | "
            f"{run['tokens_per_second']:,.0f} | {peaks} |"
        )
    worker = meta.get("ds_worker")
    lines += ["", *render_profiles(meta.get("profiles") or {}, meta["engines"])]
    lines += ["## Versions", ""]
    lines.append(f"- project venv (ours): torch {torch.__version__} (full fingerprint below)")
    if worker:
        pkgs = ", ".join(f"{k} {v}" for k, v in worker["packages"].items() if v)
        lines.append(f"- DeepSpeed venv (`{args.ds_python}`): {pkgs}")
        lines += [
            "",
            "DeepSpeed config (ZeRO-3 run; other stages differ only in `zero_optimization.stage`):",
            "",
            "```json",
            json.dumps(worker["ds_config"], indent=2),
            "```",
        ]
    lines += [
        "",
        "Every run's resolved config equals the one below (checked: ours' `config.yaml`, the DeepSpeed "
        "worker's `resolved_config`), except `parallel.zero_stage` (the stage of the run) and "
        "`logging.run_dir` / `logging.run_name` (per run).",
        "",
    ]
    lines += record_sections(cfg_yaml)
    return "\n".join(lines)


# ----------------------------------------------------------------------------- entry point


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, as for stx train")
    p.add_argument(
        "--config",
        default="tiny-gpt",
        help="preset name or YAML path: the shape (run as a GPT; default tiny-gpt)",
    )
    p.add_argument("--stages", type=int, nargs="+", default=[0, 3], choices=(0, 1, 2, 3), help="default 0 3")
    p.add_argument("--micro-batch-size", type=int, default=4, help="samples per micro-batch (default 4)")
    p.add_argument("--accumulation", type=int, default=2, help="micro-batches per optimizer step (default 2)")
    p.add_argument("--repeats", type=int, default=6, help="runs per engine per stage (default 6)")
    p.add_argument("--iters", type=int, default=30, help="optimizer steps per run (default 30)")
    p.add_argument("--warmup", type=int, default=3, help="first steps excluded from the median (default 3)")
    p.add_argument("--log-interval", type=int, default=5, help="steps per loss comparison (default 5)")
    p.add_argument("--nproc", type=int, default=2, help="processes per run (default 2)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process (default 1)")
    p.add_argument(
        "--ds-python",
        default=os.environ.get("STX_DEEPSPEED_PYTHON"),
        help="python of the venv with DeepSpeed (default $STX_DEEPSPEED_PYTHON)",
    )
    p.add_argument(
        "--ds-adam",
        choices=("torch", "fused"),
        default="torch",
        help="DeepSpeed's optimizer: torch.optim.AdamW(foreach=True) as ours (default), or its FusedAdam",
    )
    p.add_argument(
        "--ds-persistence-threshold",
        type=count_or_default,
        default=0,
        metavar="N|default",
        help="DeepSpeed's stage3_param_persistence_threshold: 0 (default here) partitions every parameter, "
        "as our ZeRO-3 does; DeepSpeed's own default ('default', 100000 elements) keeps every smaller "
        "parameter whole on every rank, at this model's size all but the embedding",
    )
    p.add_argument(
        "--ds-max-reuse-distance",
        type=count_or_default,
        default=0,
        metavar="N|default",
        help="DeepSpeed's stage3_max_reuse_distance: 0 (default here) releases each parameter after its "
        "forward, as our ZeRO-3 does per block; DeepSpeed's own default ('default', 1e9 elements) keeps "
        "every parameter of a smaller model gathered from its forward to its backward",
    )
    p.add_argument(
        "--ds-prefetch-bucket-size",
        type=count_or_default,
        default=None,
        metavar="N|default",
        help="DeepSpeed's stage3_prefetch_bucket_size: its own default (5e7 elements, gathered ahead in "
        "one collective) unless given; 0 gathers each parameter as its module runs",
    )
    p.add_argument("--stx", help="the stx command (default: the one beside this python, else on PATH)")
    p.add_argument(
        "--only", choices=("deepspeed",), help="run the DeepSpeed side alone (no ratios, no loss check)"
    )
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds per run (default 1200)")
    p.add_argument(
        "--profile",
        action="store_true",
        help="also one profiled run per engine per stage (not timed): top operators side by side",
    )
    p.add_argument("--work-dir", help="keep run directories and logs here (default: a temporary directory)")
    p.add_argument(
        "--output",
        help="markdown record (default benchmarks/results/zero_vs_deepspeed-<date>.md in the repository)",
    )
    args = p.parse_args(argv)
    positive = (args.micro_batch_size, args.accumulation, args.repeats, args.iters, args.nproc, args.threads)
    if min(*positive, args.log_interval) < 1 or args.warmup < 0:
        p.error(
            "--micro-batch-size, --accumulation, --repeats, --iters, --nproc, --threads and --log-interval "
            "must be >= 1, --warmup >= 0"
        )
    if args.warmup >= args.iters:
        p.error("--warmup must be smaller than --iters")
    args.stages = list(dict.fromkeys(args.stages))
    if args.stx is None:
        beside = Path(sys.executable).parent / "stx"
        args.stx = str(beside) if beside.exists() else (shutil.which("stx") or "stx")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = shlex.join(
        ["python", *sys.argv] if argv is None else ["python", "benchmarks/zero_vs_deepspeed.py", *argv]
    )
    engines = ENGINES if args.only is None else (args.only,)
    try:
        cfg = resolved_config(args)
        ds_version = check_deepspeed(args.ds_python)
        if "ours" in engines:
            check_ours(args.stx)
    except ConfigError as e:
        print(f"zero_vs_deepspeed: config error: {e}", file=sys.stderr)
        return 2
    except NotAvailable as e:
        print(f"zero_vs_deepspeed: {e}", file=sys.stderr)
        return 3
    print(
        f"zero_vs_deepspeed: DeepSpeed {ds_version}; stages {args.stages}, {args.repeats} repeats, "
        f"{args.iters} steps per run; engines {', '.join(engines)}",
        flush=True,
    )

    pythons = {"ours": sys.executable, "deepspeed": args.ds_python}
    baseline = {e: b for e in engines if (b := import_baseline(pythons[e], e, args)) is not None}
    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="zero_vs_ds-"))
    work.mkdir(parents=True, exist_ok=True)
    results: dict[int, dict[str, list[dict]]] = {s: {e: [] for e in ENGINES} for s in args.stages}
    runs: list[tuple[int, int, str, dict]] = []
    order = schedule(args.stages, args.repeats, engines)
    load = [os.getloadavg()[0]]
    start = time.perf_counter()
    cfg_yaml = to_yaml(cfg)
    worker_meta: dict | None = None
    try:
        for r, stage, engine in order:
            tag = f"{engine}-zero{stage}-r{r}"
            t0 = time.perf_counter()
            load.append(os.getloadavg()[0])
            run = (run_ours if engine == "ours" else run_deepspeed)(args, stage, tag, work)
            if run["num_parameters"] != (expected := sum_params(cfg)):
                raise RuntimeError(f"{tag}: {run['num_parameters']:,} parameters, expected {expected:,}")
            if run.get("resolved_config") and (diff := config_differences(cfg_yaml, run["resolved_config"])):
                raise RuntimeError(f"{tag} ran another config than the harness resolved: {'; '.join(diff)}")
            if engine == "deepspeed" and (stage == max(args.stages) or worker_meta is None):
                worker_meta = run["worker"]
            results[stage][engine].append(run)
            runs.append((r, stage, engine, run))
            print(
                f"  {tag}: {run['tokens_per_second']:,.0f} tokens/s (median iteration "
                f"{1000 * run['median_iteration_seconds']:.1f} ms), peak RSS "
                f"{', '.join(f'{p / MIB:,.0f}' for p in run['peak_memory_bytes_per_rank'])} MiB; "
                f"{time.perf_counter() - t0:.0f} s",
                flush=True,
            )
        profiles = profiled_runs(args, engines, work)
    except (RuntimeError, OSError, KeyError, json.JSONDecodeError) as e:
        print(f"zero_vs_deepspeed: a run failed: {e}\n(work directory kept: {work})", file=sys.stderr)
        return 1
    load.append(os.getloadavg()[0])
    complete = {s: min(len(results[s][e]) for e in engines) for s in args.stages}
    meta = {
        "cfg": cfg,
        "engines": engines,
        "num_parameters": sum_params(cfg),
        "repeats_done": min(complete.values()),
        "wall": time.perf_counter() - start,
        "load": (min(load), max(load)),
        "runs": runs,
        "ds_worker": worker_meta,
        "import_baseline": baseline,
        "ds_accelerator": (worker_meta or {}).get("accelerator"),
        "ds_optimizer": (worker_meta or {}).get("optimizer"),
        "profiles": profiles,
    }
    path = (
        Path(args.output)
        if args.output
        else REPO / "benchmarks" / "results" / f"zero_vs_deepspeed-{dt.date.today():%Y-%m-%d}.md"
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render(results, args, command, cfg_yaml, meta), encoding="utf-8")
    for stage in args.stages:
        ds = [run["tokens_per_second"] for run in results[stage]["deepspeed"]]
        if "ours" in engines:
            ours = [run["tokens_per_second"] for run in results[stage]["ours"]]
            ratio = statistics.median(a / b for a, b in zip(ours, ds, strict=True))
            print(
                f"ZeRO-{stage}: ours {statistics.median(ours):,.0f} tokens/s, DeepSpeed "
                f"{statistics.median(ds):,.0f} tokens/s, ours/DeepSpeed {ratio:.3f}"
            )
        else:
            print(f"ZeRO-{stage}: DeepSpeed {statistics.median(ds):,.0f} tokens/s (ours not measured)")
    if args.work_dir:
        print(f"record: {path}; runs and logs: {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
        print(f"record: {path}")
    return 0


def profiled_runs(args: argparse.Namespace, engines: tuple[str, ...], work: Path) -> dict:
    """--profile: one more run per engine per stage, not timed, with torch.profiler over 5 iterations
    after the warm-up on rank 0; each engine's top host operators (ms and calls per iteration)."""
    profiles: dict[int, dict[str, dict | None]] = {}
    if not args.profile:
        return profiles
    for stage in args.stages:
        for engine in engines:
            run = (run_ours if engine == "ours" else run_deepspeed)(
                args, stage, f"{engine}-zero{stage}-profile", work, profile=True
            )
            profiles.setdefault(stage, {})[engine] = run["profile"]
            print(f"  {engine}-zero{stage}-profile: profiled", flush=True)
    return profiles


def render_profiles(profiles: dict, engines: tuple[str, ...]) -> list[str]:
    """Side-by-side top operators of the profiled runs (rank 0, self host time per iteration)."""
    if not profiles:
        return []
    out = [
        "## Where the time goes (profiled runs)",
        "",
        "One extra run per engine per stage (`--profile`, not among the timed runs): torch.profiler over "
        "5 iterations after the warm-up on rank 0, self host time per operator in ms per iteration and "
        "calls per iteration, the union of each engine's top operators. A collective's time is where the "
        "training thread waits for it; work on the communication thread does not appear.",
        "",
    ]
    for stage, by_engine in sorted(profiles.items()):
        names: list[str] = []
        for engine in engines:
            for name in (by_engine.get(engine) or {}).get("ms_per_iteration", {}):
                if name not in names:
                    names.append(name)
        out += [f"ZeRO-{stage}:", "", "| operator | " + " | ".join(
            f"{NAMES[e]} ms/it | calls/it" for e in engines
        ) + " |", "|---|" + "---:|---:|" * len(engines)]  # fmt: skip
        for name in names:
            cells = []
            for engine in engines:
                prof = by_engine.get(engine) or {}
                ms = prof.get("ms_per_iteration", {}).get(name)
                calls = prof.get("calls_per_iteration", {}).get(name)
                cells += ["" if ms is None else f"{ms:.1f}", "" if calls is None else f"{calls:g}"]
            out.append(f"| `{name}` | " + " | ".join(cells) + " |")
        out.append("")
    return out


def sum_params(cfg: Config) -> int:
    return count_parameters(cfg.model)


if __name__ == "__main__":
    sys.exit(main())
