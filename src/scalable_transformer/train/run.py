"""Named builders and `run_training`: config in, run directory and summary out.

The data flow is one way: config -> device -> tokenizer/data -> model -> parallelize ->
optimizer -> Trainer.fit -> sinks and summary.json.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import json
import os
import random
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
from rich.console import Console

from ..bench.environment import environment
from ..config.load import to_yaml
from ..config.schema import Config, need
from ..config.validate import resolve
from ..data.loader import build_datasets, build_loader, eval_batches
from ..data.tokenizers import load_tokenizer
from ..errors import ConfigError
from ..metrics.flops import ModelShape, flops_per_iteration, throughput_metrics
from ..metrics.hardware import cpu_precision_warning, resolve_peak
from ..metrics.sinks import ConsoleSink, JsonlSink, Sinks, TensorBoardSink, percent
from ..models import build_model, count_parameters
from ..parallel.apply import parallelize
from ..parallel.dims import ParallelDims
from ..parallel.distributed import (
    all_reduce_floats,
    env_world_size,
    init_distributed,
    is_main_process,
    shutdown_distributed,
)
from .optim import build_optimizer, build_scheduler
from .trainer import History, Layout, Trainer

if TYPE_CHECKING:
    from ..checkpoint.manager import Resume


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


def summarize(
    cfg: Config, history: History, flops, peak, num_params: int, wall_seconds: float, num_devices: int = 1
) -> dict:
    """Median throughput over the post-warm-up window, plus the losses and memory of the run."""
    times = history.iteration_seconds
    global_batch = need(cfg.train.global_batch_size, "train.global_batch_size")
    warmup = cfg.logging.warmup_iters if len(times) > cfg.logging.warmup_iters else 0
    window = times[warmup:]
    median = statistics.median(window)
    perf = throughput_metrics(flops, median, num_devices, peak.flops_per_second)
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


@contextlib.contextmanager
def rank_zero_first():
    """Rank 0 runs the block first (building caches: tokenizer, index mappings, CPU peak), then the
    others, which then read what rank 0 wrote instead of racing it."""
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    if distributed and dist.get_rank() != 0:
        dist.barrier()
    yield
    if distributed and dist.get_rank() == 0:
        dist.barrier()


def run_training(cfg: Config, console: Console | None = None) -> tuple[Path | None, dict]:
    """Train as the config says; return the run directory (None on ranks other than 0) and the summary.

    Under a launcher (WORLD_SIZE > 1) every rank calls this; the layout is checked before any
    process group work, and the process group is torn down on the way out, also after an error.
    """
    start = time.perf_counter()
    console = console or Console(highlight=False, soft_wrap=True)
    device = select_device(cfg)
    world = env_world_size()
    # Layout checks that need no tokenizer run first, so a bad layout fails before anything starts.
    resolve(cfg, world)
    needs_group = world > 1 or cfg.parallel.zero_stage >= 2
    created = init_distributed(device, cfg.parallel.timeout_minutes, needed=needs_group)
    try:
        return _run(cfg, console, device, world, start)
    finally:
        shutdown_distributed(created)


def _run(
    cfg: Config, console: Console, device: torch.device, world: int, start: float
) -> tuple[Path | None, dict]:
    main = is_main_process()
    d = cfg.data
    with rank_zero_first():
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
    cfg = resolve(cfg, world_size=world)
    dims = ParallelDims.from_config(cfg)
    mesh = dims.build_mesh(device.type) if dist.is_initialized() else None
    coords = dims.coordinates(dist.get_rank() if dist.is_initialized() else 0)
    resume = open_resume(cfg)  # a bad checkpoint or save directory fails here, before anything runs

    with rank_zero_first():
        train_ds, valid_ds, _ = build_datasets(cfg, tokenizer)
        peak = resolve_peak(
            device.type, cfg.train.precision, cfg.logging.device_name, cfg.logging.peak_tflops
        )
        slow_precision = cpu_precision_warning(cfg.train.precision) if main and device.type == "cpu" else None
        if slow_precision is not None:
            console.print(f"[bold yellow]warning[/]: {slow_precision}")
    train_loader = build_loader(
        train_ds,
        cfg.train.micro_batch_size,
        consumed_samples=resume.consumed_samples if resume is not None else 0,
        seed=cfg.train.seed,
        dp_rank=coords["dp"],
        dp_size=dims.dp,
        num_workers=cfg.data.num_workers,
    )

    def valid_batches():
        return eval_batches(valid_ds, cfg.train.micro_batch_size, cfg.train.eval_iters)

    set_seed(cfg.train.seed)  # right before init: nothing above may shift the weights or dropout masks
    model, layout = build_parallel_model(cfg, dims, mesh, device, coords)
    num_params = count_parameters(cfg.model)
    zero_group = (
        mesh["dp"].get_group() if mesh is not None and cfg.parallel.zero_stage == 1 and dims.dp > 1 else None
    )
    optimizer = build_optimizer(model, cfg.optim, zero_group=zero_group)
    scheduler = build_scheduler(optimizer, cfg.optim, cfg.train.train_iters)

    flops = flops_per_iteration(
        ModelShape.from_config(cfg.model, num_params),
        need(cfg.train.global_batch_size, "train.global_batch_size"),
        cfg.logging.flops_convention,
        cfg.parallel.activation_checkpointing,
    )

    run_dir = make_run_dir(cfg) if main else None
    sinks: list = []
    if run_dir is not None:
        (run_dir / "config.yaml").write_text(to_yaml(cfg), encoding="utf-8")
        write_json(run_dir / "env.json", environment())
        sinks = [ConsoleSink(console), JsonlSink(run_dir / "metrics.jsonl")]
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
        bubble = pipeline_bubble(cfg)
        console.print(
            f"layout: {world} process(es), {describe_layout(cfg)}"
            + (f"; pipeline bubble {100 * bubble:.1f}% of a step (theoretical)" if bubble is not None else "")
        )
        console.print(
            f"TFLOPs/MFU/HFU: FLOPs convention '{flops.convention}' "
            f"({flops.model_flops / 1e9:.2f} model GFLOPs, {flops.hardware_flops / 1e9:.2f} hardware "
            f"GFLOPs per iteration) over {world} device(s); peak {peak.flops_per_second / 1e12:.3f} "
            f"TFLOP/s per device from {peak.source}"
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
        num_devices=world,
        layout=layout,
    )
    saver = attach_checkpoints(cfg, trainer, resume, console if main else None)
    if trainer.iteration >= cfg.train.train_iters:
        if main:
            console.print(
                f"nothing to train: already at iteration {trainer.iteration} of {cfg.train.train_iters}"
            )
        trainer.sinks.close()
        return run_dir, {"iterations": 0, "resumed_at_iteration": trainer.iteration}
    try:
        history = trainer.fit()
        if saver is not None:
            saver.save_final(trainer)
    finally:
        trainer.sinks.close()
    per_rank_peak = gather_per_rank(history.peak_memory_bytes, world)
    summary = summarize(cfg, history, flops, peak, num_params, time.perf_counter() - start, world)
    summary["peak_memory_bytes_per_rank"] = per_rank_peak
    summary["layout"] = describe_layout(cfg)
    summary["world_size"] = world
    summary["pipeline_bubble_theoretical"] = pipeline_bubble(cfg)
    if run_dir is None:
        return None, summary
    write_json(run_dir / "summary.json", summary)
    console.print(
        f"[bold green]done[/]: {summary['iterations']} iterations in {summary['wall_seconds']:.1f} s; "
        f"median {summary['samples_per_second']:.2f} samples/s, {summary['tokens_per_second']:.0f} tokens/s, "
        f"{summary['tflops_per_device']:.3f} TFLOPs/device, MFU {percent(summary['mfu'])}, "
        f"HFU {percent(summary['hfu'])} ({flops.convention} convention, {world} device(s)) over iterations "
        f"{summary['warmup_iterations_excluded'] + 1}-{summary['iterations']}; train loss "
        f"{summary['first_logged_train_loss']:.4f} -> {summary['final_train_loss']:.4f}; peak memory per "
        f"rank {', '.join(f'{b / 2**20:.0f}' for b in per_rank_peak)} MiB ({history.peak_memory_method}); "
        f"summary: {run_dir / 'summary.json'}"
    )
    return run_dir, summary


def open_resume(cfg: Config) -> Resume | None:
    """Check checkpoint.save is writable and checkpoint.load is a complete checkpoint, before any
    training: the checkpoint to continue from (None: start fresh)."""
    from ..checkpoint.manager import LoadOptions, check_save_dir, find_checkpoint, open_checkpoint

    c = cfg.checkpoint
    if c.save:
        check_save_dir(c.save)
    path = find_checkpoint(c.load, c.save) if c.load else None
    if path is None:
        return None
    return open_checkpoint(path, LoadOptions(not c.no_load_optim, not c.no_load_rng, c.finetune))


def attach_checkpoints(cfg: Config, trainer: Trainer, resume: Resume | None, console: Console | None):
    """Load `resume` into the trainer's model, optimizer, schedule and scaler and set its counters and
    RNG; hook the periodic saves onto the loop. Returns the saver (None without checkpoint.save)."""
    from ..checkpoint.manager import LoadOptions, Saver, TrainState, load_checkpoint, set_rng_state

    c = cfg.checkpoint
    state = TrainState(
        trainer.model,
        trainer.optimizer,
        trainer.scheduler,
        trainer.scaler,
        trainer.layout.pipeline is not None,
    )
    if resume is not None:
        t0 = time.perf_counter()
        load_checkpoint(state, resume, LoadOptions(not c.no_load_optim, not c.no_load_rng, c.finetune))
        trainer.iteration, trainer.consumed_samples = resume.iteration, resume.consumed_samples
        if console is not None:
            console.print(
                f"[bold]resumed[/] from {resume.path} (saved at iteration {resume.meta['iteration']}, "
                f"layout {resume.meta['layout']}) in {time.perf_counter() - t0:.2f} s: continuing at "
                f"iteration {resume.iteration}, {resume.consumed_samples} consumed samples"
                + "".join(f"; {note}" for note in resume.notes)
            )
    saver = None
    if c.save:
        info = {
            "layout": describe_layout(cfg),
            "parallel": dataclasses.asdict(cfg.parallel),
            "model": dataclasses.asdict(cfg.model),
            "num_parameters": count_parameters(cfg.model),
            "config_yaml": to_yaml(cfg),
            "environment": environment() if is_main_process() else {},
        }
        saver = Saver(state, cfg, info, console)
        if resume is not None and not c.finetune:
            saver.last_saved = resume.iteration  # that checkpoint exists: do not write it again
        trainer.on_iteration_end = saver.maybe_save
    if resume is not None and resume.rng is not None:  # last: nothing may draw numbers before step 1
        set_rng_state(resume.rng)
    return saver


def describe_layout(cfg: Config) -> str:
    """'dp=2 tp=1 pp=1 zero3+offload, activation checkpointing full': the layout label of a run."""
    p = cfg.parallel
    parts = [f"dp={p.dp}", f"tp={p.tp}", f"pp={p.pp}", f"zero{p.zero_stage}"]
    if p.offload_optimizer or p.offload_param:
        parts[-1] += "+offload"
    if p.sequence_parallel:
        parts.append("sequence-parallel")
    if p.pp > 1:
        parts.append(
            f"schedule {p.pipeline_schedule}"
            + (f" x{p.virtual_pipeline_stages}" if p.virtual_pipeline_stages > 1 else "")
        )
    if p.activation_checkpointing != "none":
        parts.append(f"recompute {p.activation_checkpointing}")
    return " ".join(parts)


def pipeline_bubble(cfg: Config) -> float | None:
    """Idle share of a pipeline step, in theory: (pp - 1) / (v * m + pp - 1) for m micro-batches and
    v stages per rank (GPipe and 1F1B: v = 1; Narayanan et al. 2021); None without pipelining. The
    zero-bubble schedules fill most of it, so this is their upper bound."""
    p = cfg.parallel
    if p.pp == 1:
        return None
    m = need(cfg.train.gradient_accumulation_steps, "train.gradient_accumulation_steps")
    return (p.pp - 1) / (p.virtual_pipeline_stages * m + p.pp - 1)


def gather_per_rank(value: float, world: int) -> list[int]:
    """One number from every rank, in rank order (all ranks call this)."""
    if world == 1 or not dist.is_initialized():
        return [int(value)]
    slots = [0.0] * world
    slots[dist.get_rank()] = float(value)
    return [int(v) for v in all_reduce_floats(slots)]


def build_parallel_model(
    cfg: Config, dims: ParallelDims, mesh, device: torch.device, coords: dict[str, int]
) -> tuple[torch.nn.Module, Layout]:
    """The plain model, split into this rank's pipeline stages when pp > 1, each parallelized."""
    model = build_model(cfg.model)
    if cfg.checkpoint.init_from_hf:
        from ..checkpoint.hf_import import load_hf_weights

        load_hf_weights(model, cfg.model, cfg.checkpoint.init_from_hf)
    model = model.to(device)
    if mesh is None:
        return parallelize(model, cfg), Layout()
    dp_group = mesh["dp"].get_group() if dims.dp > 1 else None
    if dims.pp == 1:
        return parallelize(model, cfg, mesh, device), Layout(dp=dims.dp, tp=dims.tp, dp_group=dp_group)
    from ..parallel.pipeline import PipelineRunner, split_model, stage_ids

    p = cfg.parallel
    ids = stage_ids(dims.pp, coords["pp"], p.virtual_pipeline_stages, p.pipeline_schedule)
    stages = [parallelize(stage, cfg, mesh, device) for stage in split_model(model, cfg, coords["pp"])]
    pp_group = mesh["pp"].get_group()
    runner = PipelineRunner(
        stages, ids, cfg, pp_group, device, need(cfg.train.gradient_accumulation_steps, "accumulation")
    )
    layout = Layout(
        dp=dims.dp,
        tp=dims.tp,
        dp_group=dp_group,
        pp_group=pp_group,
        pipeline=runner,
        grad_norm_excluded=runner.grad_norm_excluded(),
    )
    return torch.nn.ModuleList(stages), layout
