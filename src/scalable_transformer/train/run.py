"""Named builders and `run_training`: config in, run directory and summary out.

The data flow is one way: config -> device -> tokenizer/data -> model -> parallelize ->
optimizer -> Trainer.fit -> sinks and summary.json.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import os
import random
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Console

from ..bench.environment import environment
from ..config.load import ConfigError, to_yaml
from ..config.schema import Config, need
from ..config.validate import resolve
from ..data.loader import build_datasets, build_loader, eval_batches
from ..data.tokenizers import load_tokenizer
from ..metrics.flops import ModelShape, flops_per_iteration, throughput_metrics
from ..metrics.hardware import resolve_peak
from ..metrics.sinks import ConsoleSink, JsonlSink, Sinks, TensorBoardSink
from ..models import build_model, count_parameters
from ..parallel.apply import parallelize
from .optim import build_optimizer, build_scheduler
from .trainer import History, Trainer


def select_device(cfg: Config) -> torch.device:
    if cfg.train.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device = cuda, but no CUDA device is available; use auto or cpu")
    if cfg.train.device == "cuda" or (cfg.train.device == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def set_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def make_run_dir(cfg: Config) -> Path:
    """A new directory under logging.run_dir; an existing run is never overwritten."""
    name = cfg.logging.run_name or f"{cfg.model.type}-{dt.datetime.now():%Y%m%d-%H%M%S}"
    parent = Path(cfg.logging.run_dir)
    path, n = parent / name, 1
    while path.exists():
        n += 1
        path = parent / f"{name}-{n}"
    path.mkdir(parents=True)
    return path


def write_json(path: Path, data: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def summarize(cfg: Config, history: History, flops, peak, num_params: int, wall_seconds: float) -> dict:
    """Median throughput over the post-warm-up window, plus the losses and memory of the run."""
    times = history.iteration_seconds
    global_batch = need(cfg.train.global_batch_size, "train.global_batch_size")
    warmup = cfg.logging.warmup_iters if len(times) > cfg.logging.warmup_iters else 0
    window = times[warmup:]
    median = statistics.median(window)
    perf = throughput_metrics(flops, median, 1, peak.flops_per_second)
    phases: dict[str, float] = {}
    records = [r for r in history.records if r["iteration"] > warmup] or history.records
    for key in records[0] if records else {}:
        if key.startswith("time_ms/"):
            phases[key.split("/", 1)[1]] = statistics.median(r[key] for r in records)
    return {
        "iterations": len(times),
        "global_batch_size": global_batch,
        "seq_length": cfg.model.seq_length,
        "num_parameters": num_params,
        "warmup_iterations_excluded": warmup,
        "median_iteration_seconds": median,
        "samples_per_second": global_batch / median,
        "tokens_per_second": global_batch * cfg.model.seq_length / median,
        "tflops_per_device": perf["tflops_per_device"],
        "mfu": perf["mfu"],
        "hfu": perf["hfu"],
        "flops_convention": flops.convention,
        "model_flops_per_iteration": flops.model_flops,
        "hardware_flops_per_iteration": flops.hardware_flops,
        "peak_flops_per_device": peak.flops_per_second,
        "peak_flops_source": peak.source,
        "phase_time_ms_median": phases,
        "peak_memory_bytes": history.peak_memory_bytes,
        "peak_memory_method": history.peak_memory_method,
        "first_logged_train_loss": history.first_logged_loss,
        "final_train_loss": history.last_logged_loss,
        "final_valid": history.last_valid,
        "skipped_iterations": history.skipped_iterations,
        "wall_seconds": wall_seconds,
    }


def run_training(cfg: Config, console: Console | None = None) -> tuple[Path, dict]:
    """Train as the config says; return the run directory and the summary written into it."""
    start = time.perf_counter()
    console = console or Console(highlight=False, soft_wrap=True)
    device = select_device(cfg)
    d = cfg.data
    tokenizer = load_tokenizer(
        d.tokenizer,
        d.tokenizer_vocab_size,
        vocab_file=d.vocab_file,
        merge_file=d.merge_file,
        tokenizer_type=d.tokenizer_type,
    )
    if cfg.model.vocab_size is None:
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=tokenizer.vocab_size))
    elif cfg.model.vocab_size < tokenizer.vocab_size:
        raise ConfigError(
            f"model.vocab_size ({cfg.model.vocab_size}) is smaller than the tokenizer's "
            f"vocabulary ({tokenizer.vocab_size}); remove it to use the tokenizer's size"
        )
    cfg = resolve(cfg, world_size=1)

    train_ds, valid_ds, _ = build_datasets(cfg, tokenizer)
    train_loader = build_loader(
        train_ds,
        cfg.train.micro_batch_size,
        consumed_samples=0,
        seed=cfg.train.seed,
        num_workers=cfg.data.num_workers,
    )

    def valid_batches():
        return eval_batches(valid_ds, cfg.train.micro_batch_size, cfg.train.eval_iters)

    peak = resolve_peak(device.type, cfg.train.precision, cfg.logging.device_name, cfg.logging.peak_tflops)
    set_seed(cfg.train.seed)  # right before init: nothing above may shift the weights or dropout masks
    model = build_model(cfg.model).to(device)
    num_params = count_parameters(cfg.model)
    model = parallelize(model, cfg)
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.optim, cfg.train.train_iters)

    flops = flops_per_iteration(
        ModelShape.from_config(cfg.model, num_params),
        need(cfg.train.global_batch_size, "train.global_batch_size"),
        cfg.logging.flops_convention,
        cfg.parallel.activation_checkpointing,
    )

    run_dir = make_run_dir(cfg)
    (run_dir / "config.yaml").write_text(to_yaml(cfg), encoding="utf-8")
    write_json(run_dir / "env.json", environment())
    sinks: list = [ConsoleSink(console), JsonlSink(run_dir / "metrics.jsonl")]
    if cfg.logging.tensorboard:
        sinks.append(TensorBoardSink(Path(cfg.logging.tensorboard_dir or run_dir / "tensorboard")))
    console.print(f"[bold]run directory[/]: {run_dir}")
    console.print(
        f"model: {cfg.model.type}, {num_params:,} parameters, {cfg.model.num_layers} layers x "
        f"{cfg.model.hidden_size} hidden, seq {cfg.model.seq_length}, vocab {cfg.model.vocab_size}; "
        f"device {device}, precision {cfg.train.precision}; global batch {cfg.train.global_batch_size}"
        f" = micro {cfg.train.micro_batch_size} x accumulation "
        f"{cfg.train.gradient_accumulation_steps} x dp {cfg.parallel.dp}"
    )
    console.print(
        f"TFLOPs/MFU/HFU: FLOPs convention '{flops.convention}' "
        f"({flops.model_flops / 1e9:.2f} model GFLOPs, {flops.hardware_flops / 1e9:.2f} hardware "
        f"GFLOPs per iteration); peak {peak.flops_per_second / 1e12:.3f} TFLOP/s per device from "
        f"{peak.source}"
    )

    trainer = Trainer(
        cfg,
        model,
        optimizer,
        scheduler,
        iter(train_loader),
        valid_batches,
        device,
        Sinks(sinks),
        flops,
        peak.flops_per_second,
    )
    try:
        history = trainer.fit()
    finally:
        trainer.sinks.close()
    summary = summarize(cfg, history, flops, peak, num_params, time.perf_counter() - start)
    write_json(run_dir / "summary.json", summary)
    console.print(
        f"[bold green]done[/]: {summary['iterations']} iterations in {summary['wall_seconds']:.1f} s; "
        f"median {summary['samples_per_second']:.2f} samples/s, {summary['tokens_per_second']:.0f} tokens/s, "
        f"{summary['tflops_per_device']:.3f} TFLOPs/device, MFU {100 * summary['mfu']:.2f}%, "
        f"HFU {100 * summary['hfu']:.2f}% ({flops.convention} convention) over iterations "
        f"{summary['warmup_iterations_excluded'] + 1}-{summary['iterations']}; train loss "
        f"{summary['first_logged_train_loss']:.4f} -> {summary['final_train_loss']:.4f}; summary: "
        f"{run_dir / 'summary.json'}"
    )
    return run_dir, summary
