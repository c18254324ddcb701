"""The data loader's share of training step time: is the batch generator off the critical path?

Trains tiny-gpt (or another config) on its real data pipeline -- the embedded corpus preprocessed
into an indexed dataset, GPT index mappings, `build_loader` -- with the trainer `train/build.py`
builds, once per `num_workers` setting, and reads the trainer's own "batch-generator" timer (the
time `Trainer` waits for the next micro-batches, host-to-device copy included) against the
iteration time. Settings alternate within each repeat (0 2, then 2 0, ...) so that load on a shared
machine hits them alike; the first `--warmup` iterations of every run (worker start-up, allocator
warm-up) are excluded.

    python benchmarks/loader_share.py                         # tiny-gpt, num_workers 0 and 2
    python benchmarks/loader_share.py --config tiny-bert --workers 0 1 2 --iters 60
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

from scalable_transformer.config.load import load_config, to_yaml
from scalable_transformer.config.schema import ResolvedConfig
from scalable_transformer.config.validate import resolve
from scalable_transformer.data.loader import build_datasets, build_loader, eval_batches
from scalable_transformer.data.tokenizers import load_tokenizer
from scalable_transformer.metrics.device_specs import resolve_peak
from scalable_transformer.metrics.environment import record_sections
from scalable_transformer.metrics.flops import step_flops
from scalable_transformer.metrics.sinks import Sinks
from scalable_transformer.models import build_model, count_parameters
from scalable_transformer.parallel.apply import parallelize
from scalable_transformer.parallel.dims import ParallelDims
from scalable_transformer.train.build import set_seed
from scalable_transformer.train.measurement import Measurement
from scalable_transformer.train.optim import build_optimizer, build_scheduler
from scalable_transformer.train.trainer import Trainer

REPO = Path(__file__).resolve().parents[1]
TARGET_SHARE = 0.02


def benchmark_config(spec: str, overrides: list[str], iters: int, log_interval: int) -> ResolvedConfig:
    forced = [
        f"train.train_iters={iters}",
        f"logging.log_interval={log_interval}",
        "train.eval_interval=0",
        "train.eval_iters=1",
        "train.device=cpu",
    ]
    return resolve(load_config(spec, [*overrides, *forced]), world_size=1)


def run_once(cfg: ResolvedConfig, tokenizer, datasets, num_workers: int, warmup: int) -> dict[str, float]:
    """One training run with `num_workers` loader workers; batch-generator and iteration time
    per iteration (ms) over the iterations after the first `warmup`."""
    train_ds, valid_ds, _ = datasets
    loader = build_loader(
        train_ds, cfg.train.micro_batch_size, consumed_samples=0, seed=cfg.train.seed, num_workers=num_workers
    )
    device = torch.device("cpu")
    peak = resolve_peak("cpu", cfg.train.precision, cfg.logging.device_name, cfg.logging.peak_tflops)
    set_seed(cfg.train.seed)
    model = parallelize(build_model(cfg.model).to(device), cfg)
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.optim, cfg.train.train_iters)
    flops = step_flops(cfg, count_parameters(cfg.model))
    trainer = Trainer(
        cfg,
        model,
        optimizer,
        scheduler,
        iter(loader),
        lambda: eval_batches(valid_ds, cfg.train.micro_batch_size, cfg.train.eval_iters),
        Measurement(cfg, device, ParallelDims(dp=1, tp=1, pp=1), flops, peak.flops_per_second, Sinks([])),
    )
    history = trainer.fit()
    interval = cfg.logging.log_interval
    # Records average their log interval; keep the intervals that start after the warm-up.
    kept = [r for r in history.records if r["iteration"] - interval >= warmup]
    iteration_ms = [1000 * s for s in history.iteration_seconds[kept[0]["iteration"] - interval :]]
    batch_ms = statistics.fmean(r.phase_ms["batch-generator"] for r in kept)
    step_ms = statistics.fmean(iteration_ms)
    del loader, trainer
    return {"batch_ms": batch_ms, "iteration_ms": step_ms}


def render(
    cfg: ResolvedConfig, args: argparse.Namespace, command: str, results: dict[int, list[dict]], setup: dict
) -> str:
    m, t = cfg.model, cfg.train
    lines = [
        f"# loader_share: {args.config}",
        "",
        "Share of each training iteration spent waiting for the next micro-batch (the trainer's "
        "`batch-generator` timer: `next()` on the loader + host-to-device copy) while training "
        f"`{args.config}` ({m.type}, {m.num_layers} layers x {m.hidden_size} hidden, seq {m.seq_length}, "
        f"micro-batch {t.micro_batch_size} x accumulation {t.gradient_accumulation_steps}) on the real "
        "pipeline: the embedded corpus preprocessed into an indexed dataset, index mappings, "
        f"`build_loader`. {args.iters} iterations per run, the first {args.warmup} excluded; "
        f"{args.repeats} repeats per setting, settings alternating. Target: share < {TARGET_SHARE:.0%}.",
        "",
        f"Command: `{command}`",
        "",
        f"Data: {setup['train_samples']} train samples ({setup['dataset']}); building the datasets took "
        f"{setup['build_seconds']:.2f} s in this run (cached preprocessing and mappings: "
        f"{setup['cached']}). A sample costs {setup['item_us']:.1f} us to read in-process.",
        "",
        f"Threads: torch intra-op {torch.get_num_threads()}, inter-op {torch.get_num_interop_threads()}; "
        "loader workers are extra processes on the same cores. Load average (1 min) at the start and "
        f"end of the runs: {setup['load'][0]:.1f} -> {setup['load'][1]:.1f} on {os.cpu_count()} CPUs "
        "(other processes inflate both the iteration and the batch-generator time).",
        "",
        "| num_workers | batch-generator ms/iter (median of repeats) | iteration ms (median) | share "
        "(median) | share per repeat | target |",
        "|---|---|---|---|---|---|",
    ]
    for workers, runs in results.items():
        shares = [r["batch_ms"] / r["iteration_ms"] for r in runs]
        share = statistics.median(shares)
        lines.append(
            f"| {workers} | {statistics.median(r['batch_ms'] for r in runs):.3f} | "
            f"{statistics.median(r['iteration_ms'] for r in runs):.1f} | {100 * share:.2f}% | "
            f"{', '.join(f'{100 * s:.2f}%' for s in shares)} | "
            f"{'PASS' if share < TARGET_SHARE else 'FAIL'} |"
        )
    lines += [
        "",
        "Iteration time includes the batch-generator time; with workers the batches are prepared "
        "ahead in other processes, so what remains is the hand-over and the copy.",
        "",
    ]
    lines += record_sections(to_yaml(cfg))
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*", help="config overrides key=value, as for `stx train`")
    p.add_argument("--config", default="tiny-gpt", help="preset name or YAML path (default tiny-gpt)")
    p.add_argument("--workers", type=int, nargs="+", default=[0, 2], help="num_workers values (default 0 2)")
    p.add_argument("--iters", type=int, default=80, help="training iterations per run (default 80)")
    p.add_argument("--warmup", type=int, default=10, help="iterations excluded at the start of a run")
    p.add_argument("--log-interval", type=int, default=10, help="timer averaging interval (iterations)")
    p.add_argument("--repeats", type=int, default=3, help="runs per setting (default 3)")
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice)")
    p.add_argument("--output", default=str(REPO / "benchmarks/results/loader_share.md"))
    args = p.parse_args(argv)
    if args.warmup % args.log_interval or args.warmup >= args.iters:
        p.error("--warmup must be a multiple of --log-interval and smaller than --iters")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    command = shlex.join(["python", "benchmarks/loader_share.py", *(sys.argv[1:] if argv is None else argv)])
    cfg = benchmark_config(args.config, args.overrides, args.iters, args.log_interval)
    tokenizer = load_tokenizer(cfg.data.tokenizer, cfg.data.tokenizer_vocab_size)
    if cfg.model.vocab_size is None:  # a resolved config is frozen: resolve a changed copy
        cfg = resolve(
            dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=tokenizer.vocab_size))
        )
    start = time.perf_counter()
    datasets = build_datasets(cfg, tokenizer)
    build_seconds = time.perf_counter() - start
    train = datasets[0]
    start = time.perf_counter()
    for i in range(200):
        train[i % len(train)]  # type: ignore[index]
    item_us = (time.perf_counter() - start) / 200 * 1e6
    setup = {
        "train_samples": len(train),  # type: ignore[arg-type]
        "dataset": getattr(getattr(train, "indexed", None), "path_prefix", type(train).__name__),
        "build_seconds": build_seconds,
        "cached": bool(getattr(train, "cache_hit", False)),
        "item_us": item_us,
    }
    load_start = os.getloadavg()[0]
    results: dict[int, list[dict]] = {w: [] for w in args.workers}
    for rep in range(args.repeats):
        order = args.workers if rep % 2 == 0 else list(reversed(args.workers))
        for workers in order:
            r = run_once(cfg, tokenizer, datasets, workers, args.warmup)
            results[workers].append(r)
            print(
                f"repeat {rep + 1}/{args.repeats}, num_workers {workers}: batch-generator "
                f"{r['batch_ms']:.3f} ms of {r['iteration_ms']:.1f} ms per iteration "
                f"({100 * r['batch_ms'] / r['iteration_ms']:.2f}%)",
                flush=True,
            )
    setup["load"] = (load_start, os.getloadavg()[0])
    path = Path(args.output)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render(cfg, args, command, results, setup), encoding="utf-8")
    print(f"report: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
