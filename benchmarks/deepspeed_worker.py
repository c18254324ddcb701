"""One DeepSpeed training run of our model, one process per rank: the DeepSpeed side of
`zero_vs_deepspeed.py`.

Run under torchrun in the venv that has DeepSpeed (never the project's; see benchmarks/README.md):

    OMP_NUM_THREADS=1 DS_ACCELERATOR=cpu /work/dsvenv/bin/python -m torch.distributed.run --standalone \
        --nproc-per-node 2 benchmarks/deepspeed_worker.py --config tiny-gpt --zero-stage 3 \
        --output /tmp/ds-{rank}.json train.train_iters=10

It resolves the config exactly as `stx train` does (tokenizer -> vocab_size -> `resolve(cfg,
world_size)`), builds the same data (`build_datasets` + `build_loader` with dp_rank/dp_size = rank
/world size) and the same model (`set_seed(train.seed)` then `build_model(cfg.model)`: the same
initial weights as our run), hands it to `deepspeed.initialize` with the config's micro-batch,
accumulation, clip and AdamW hyper-parameters (torch's AdamW, foreach, over our two parameter groups
unless `--ds-adam fused`), and trains `train.train_iters` steps with our loss
(`scalable_transformer.models.compute_loss`). The learning rate stays at `optim.lr` (no DeepSpeed
scheduler): the harness forces a constant schedule on our side too.

Each step is timed as our trainer times an iteration (fetching the micro-batches from the loader,
forward + backward of each, the optimizer step), peak memory is the RSS high-water mark since just
before the loop (`MemoryTracker`, as our trainer resets it at the start of `fit`), and every rank
writes one JSON file (`--output`, `{rank}` replaced).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

# Before deepspeed is imported: its accelerator is chosen once, at import.
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed
import torch
import torch.distributed as dist

from scalable_transformer.config.load import load_config, to_yaml
from scalable_transformer.config.validate import resolve
from scalable_transformer.data.loader import build_datasets, build_loader
from scalable_transformer.data.tokenizers import load_tokenizer
from scalable_transformer.metrics.peak_memory import MemoryTracker
from scalable_transformer.models import build_model, compute_loss, count_parameters, model_inputs
from scalable_transformer.train.build import set_seed
from scalable_transformer.train.optim import param_groups

HUGE = 10**9  # steps_per_print: DeepSpeed never prints on its own
# Versions recorded with the result: DeepSpeed and what it brings beyond the project's own stack.
PACKAGES = (
    "deepspeed",
    "torch",
    "numpy",
    "pydantic",
    "hjson",
    "py-cpuinfo",
    "msgpack",
    "einops",
    "ninja",
    "psutil",
)
# DeepSpeed 0.19 calls torch.distributed.all_gather_into_tensor / reduce_scatter_tensor, which torch
# 2.13 deprecates with a FutureWarning printed (to stderr) inside every ZeRO-3 step: silenced, so the
# timed loop measures the engine, not the warning machinery.
warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _profile_window(text: str | None) -> tuple[int, int] | None:
    if not text:
        return None
    first, _, last = text.partition("-")
    return int(first), int(last or first)


def _top_operators(profiler, steps: int, top: int = 12) -> dict:
    """Self host time per operator over the window, ms per iteration, the largest first."""
    rows = sorted(profiler.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    return {
        "steps": steps,
        "ms_per_iteration": {e.key: e.self_cpu_time_total / 1e3 / steps for e in rows},
        "calls_per_iteration": {e.key: e.count / steps for e in rows},
    }


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def ds_config(
    cfg,
    zero_stage: int,
    adam: str,
    persistence_threshold: int | None = None,
    max_reuse_distance: int | None = None,
    prefetch_bucket_size: int | None = None,
) -> dict:
    """The DeepSpeed config equivalent to our resolved config (fp32, no scheduler). At stage 3,
    `persistence_threshold` is stage3_param_persistence_threshold: parameters with fewer elements stay
    whole on every rank (DeepSpeed's default 1e5 when None); `max_reuse_distance` is
    stage3_max_reuse_distance: a parameter used again within that many gathered elements is not
    released (DeepSpeed's default 1e9 when None: below a billion parameters, a forward's parameters
    stay gathered until their backward); `prefetch_bucket_size` is stage3_prefetch_bucket_size: how many
    elements of the next modules' parameters are gathered ahead, in one collective (DeepSpeed's
    default 5e7 when None; 0 gathers a module's parameters when it runs)."""
    o, t = cfg.optim, cfg.train
    params: dict = {
        "lr": o.lr,
        "betas": [o.adam_beta1, o.adam_beta2],
        "eps": o.adam_eps,
        "weight_decay": o.weight_decay,
    }
    if adam == "torch":
        # torch.optim.AdamW(foreach=True), as our build_optimizer; without torch_adam DeepSpeed takes
        # its FusedAdam, a C++ op JIT-compiled on first use on CPU.
        params.update(torch_adam=True, foreach=True)
    zero: dict = {"stage": zero_stage}
    if zero_stage == 3 and persistence_threshold is not None:
        zero["stage3_param_persistence_threshold"] = persistence_threshold
    if zero_stage == 3 and max_reuse_distance is not None:
        zero["stage3_max_reuse_distance"] = max_reuse_distance
    if zero_stage == 3 and prefetch_bucket_size is not None:
        zero["stage3_prefetch_bucket_size"] = prefetch_bucket_size
    return {
        "train_batch_size": t.global_batch_size,
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": t.gradient_accumulation_steps,
        "zero_optimization": zero,
        "optimizer": {"type": "AdamW", "params": params},
        "gradient_clipping": o.clip_grad,
        "fp16": {"enabled": False},
        "bf16": {"enabled": False},
        "steps_per_print": HUGE,
        "wall_clock_breakdown": False,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, as for stx train")
    p.add_argument("--config", default="tiny-gpt", help="preset name or YAML path (default tiny-gpt)")
    p.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3), required=True)
    p.add_argument("--output", required=True, help="JSON file per rank; {rank} is replaced")
    p.add_argument(
        "--ds-adam",
        choices=("torch", "fused"),
        default="torch",
        help="torch: torch.optim.AdamW(foreach=True), as ours (default); fused: DeepSpeed's FusedAdam",
    )
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per process (default 1)")
    p.add_argument(
        "--persistence-threshold",
        type=int,
        help="stage 3: stage3_param_persistence_threshold (parameters with fewer elements are not "
        "partitioned; DeepSpeed's default 100000 when not given)",
    )
    p.add_argument(
        "--max-reuse-distance",
        type=int,
        help="stage 3: stage3_max_reuse_distance (DeepSpeed's default 1e9 when not given)",
    )
    p.add_argument(
        "--prefetch-bucket-size",
        type=int,
        help="stage 3: stage3_prefetch_bucket_size (DeepSpeed's default 5e7 when not given)",
    )
    p.add_argument(
        "--profile-steps",
        metavar="A-B",
        help="torch.profiler over iterations A..B (1-based, inclusive) on rank 0; its top host operators "
        "go into the JSON (`profile`), as ours prints them with logging.profile_start_step/end_step",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    cfg = load_config(args.config, args.overrides)
    d = cfg.data
    if rank != 0:  # rank 0 builds the caches (tokenizer, corpus, index mappings) first, as run.py
        dist.barrier()
    tokenizer = load_tokenizer(
        d.tokenizer, d.tokenizer_vocab_size, vocab_file=d.vocab_file, merge_file=d.merge_file,
        tokenizer_type=d.tokenizer_type,
    )  # fmt: skip
    if cfg.model.vocab_size is None:
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=tokenizer.vocab_size))
    cfg = resolve(cfg, world_size=world)
    if cfg.parallel.tp != 1 or cfg.parallel.pp != 1:
        raise SystemExit("deepspeed_worker: only data parallelism (tp = pp = 1) is compared")
    if cfg.train.precision != "fp32":
        raise SystemExit(f"deepspeed_worker: only fp32 is compared, not {cfg.train.precision}")
    train_ds, _, _ = build_datasets(cfg, tokenizer)
    if rank == 0:
        dist.barrier()
    loader = build_loader(
        train_ds,
        cfg.train.micro_batch_size,
        consumed_samples=0,
        seed=cfg.train.seed,
        dp_rank=rank,
        dp_size=world,
        num_workers=cfg.data.num_workers,
    )
    batches = iter(loader)

    set_seed(cfg.train.seed)  # as run.py, right before init: the same initial weights as our run
    model = build_model(cfg.model)
    config = ds_config(
        cfg,
        args.zero_stage,
        args.ds_adam,
        args.persistence_threshold,
        args.max_reuse_distance,
        args.prefetch_bucket_size,
    )
    engine, optimizer, _, _ = deepspeed.initialize(
        model=model, model_parameters=param_groups(model, cfg.optim.weight_decay), config=config
    )
    inner = getattr(optimizer, "optimizer", optimizer)

    model_type = cfg.model.type
    accumulation = cfg.train.gradient_accumulation_steps
    global_batch = cfg.train.global_batch_size
    tracker = MemoryTracker("cpu")
    profile: dict | None = None
    seconds: list[float] = []
    losses: list[float] = []
    grad_norms: list[float | None] = []
    engine.train()
    dist.barrier()
    rss_before = _rss_bytes()
    tracker.reset_peak()
    window = _profile_window(args.profile_steps) if rank == 0 else None
    profiler = None
    for step in range(1, cfg.train.train_iters + 1):
        if window and step == window[0]:
            profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            profiler.__enter__()
        t0 = time.perf_counter()
        micro = [next(batches) for _ in range(accumulation)]  # what our trainer's batch-generator does
        step_loss = 0.0
        for batch in micro:
            outputs = engine(*model_inputs(model_type, batch))
            loss, _ = compute_loss(model_type, outputs, batch)
            engine.backward(loss)  # scales by 1/accumulation; averages over dp at the boundary
            engine.step()  # the optimizer steps only at the accumulation boundary
            step_loss += float(loss.detach()) / accumulation
        seconds.append(time.perf_counter() - t0)
        losses.append(step_loss)
        norm = engine.get_global_grad_norm()
        grad_norms.append(None if norm is None else float(norm))
        if profiler is not None and window and step == window[1]:
            profiler.__exit__(None, None, None)
            profile = _top_operators(profiler, window[1] - window[0] + 1)
            profiler = None
    peak = tracker.peak()

    # Mean of the ranks' losses: the global batch's loss (equal-sized, fully labelled micro-batches).
    loss_t = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(loss_t)
    warmup = cfg.logging.warmup_iters if len(seconds) > cfg.logging.warmup_iters else 0
    # the profiled iterations are left out, as ours leaves its profiler window out (all ranks: the
    # profiled rank slows the others through the collectives)
    window = _profile_window(args.profile_steps)
    timed = [
        t for i, t in enumerate(seconds[warmup:], warmup + 1) if not (window and window[0] <= i <= window[1])
    ]
    median = statistics.median(timed or seconds[warmup:])
    result = {
        "engine": "deepspeed",
        "rank": rank,
        "world_size": world,
        "zero_stage": args.zero_stage,
        "deepspeed_version": deepspeed.__version__,
        "torch_version": torch.__version__,
        "accelerator": type(deepspeed.get_accelerator()).__name__,
        "backend": dist.get_backend(),
        "threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "optimizer": f"{type(inner).__module__}.{type(inner).__qualname__}",
        "zero_optimizer": f"{type(optimizer).__module__}.{type(optimizer).__qualname__}",
        "packages": {name: _version(name) for name in PACKAGES},
        "ds_config": config,
        "resolved_config": to_yaml(cfg),
        "num_parameters": count_parameters(cfg.model),
        "global_batch_size": global_batch,
        "seq_length": cfg.model.seq_length,
        "iterations": len(seconds),
        "warmup_iterations_excluded": warmup,
        "iteration_seconds": seconds,
        "median_iteration_seconds": median,
        "tokens_per_second": global_batch * cfg.model.seq_length / median,
        "losses": (loss_t / world).tolist(),
        "grad_norms": grad_norms,
        "rss_before_loop_bytes": rss_before,
        "peak_memory_bytes": peak.peak_allocated_bytes,
        "peak_memory_method": peak.method,
        "profile": profile,
    }
    path = Path(args.output.replace("{rank}", str(rank)))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1), encoding="utf-8")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
