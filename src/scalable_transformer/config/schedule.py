"""The learning-rate schedule: a pure function of the config, checked when the config is resolved (so
`stx plan`, its dry run and `stx train` refuse the same schedules).

Iterations are 0-based optimizer steps: `lr_at(i, ...)` is the learning rate used by the i-th call of
`optimizer.step()`. Three schedules, each matching the framework it is named after, step for step:
  megatron         -- Megatron-LM `OptimizerParamScheduler.get_lr`: linear warmup from 0, then constant,
                      linear or cosine decay to `min_lr` at `lr_decay_iters`, then `min_lr`.
  warmup_lr        -- DeepSpeed `WarmupLR` as driven by the DeepSpeed engine: log or linear warmup from
                      `warmup_min_lr` to `lr`, then constant.
  warmup_decay_lr  -- DeepSpeed `WarmupDecayLR`: as warmup_lr, then linear decay to `warmup_min_lr`.
"""

from __future__ import annotations

import math

from ..errors import ConfigError
from .schema import OptimConfig

SCHEDULERS = ("megatron", "warmup_lr", "warmup_decay_lr")


def check_schedule(cfg: OptimConfig, train_iters: int) -> None:
    """Raise ConfigError naming the key when the schedule cannot run (what `lr_at` would raise)."""
    if cfg.scheduler == "megatron":
        _megatron_lengths(cfg, train_iters)
    elif cfg.scheduler in SCHEDULERS:
        _check_warmup(cfg)
    else:
        raise ConfigError(
            f"optim.scheduler must be 'megatron', 'warmup_lr' or 'warmup_decay_lr', got {cfg.scheduler!r}"
        )


def _megatron_lengths(cfg: OptimConfig, train_iters: int) -> tuple[float, int]:
    """(warmup iterations, decay iterations) of the megatron schedule, checked."""
    if cfg.lr < 0:
        raise ConfigError(f"optim.lr must be >= 0, got {cfg.lr}")
    if cfg.min_lr < 0:
        raise ConfigError(f"optim.min_lr must be >= 0, got {cfg.min_lr}")
    if cfg.min_lr > cfg.lr:
        raise ConfigError(f"optim.min_lr ({cfg.min_lr}) must be <= optim.lr ({cfg.lr})")
    if cfg.lr_decay_style not in ("constant", "linear", "cosine"):
        raise ConfigError(
            f"optim.lr_decay_style must be one of constant, linear, cosine; got {cfg.lr_decay_style!r}"
        )
    if cfg.lr_decay_iters is None:
        decay_key, decay_iters = "train.train_iters (the default of optim.lr_decay_iters)", train_iters
    else:
        decay_key, decay_iters = "optim.lr_decay_iters", cfg.lr_decay_iters
    if decay_iters <= 0:
        raise ConfigError(f"{decay_key} must be > 0, got {decay_iters}")
    if cfg.lr_warmup_fraction is not None:
        if not 0.0 <= cfg.lr_warmup_fraction < 1.0:
            raise ConfigError(f"optim.lr_warmup_fraction must be in [0, 1), got {cfg.lr_warmup_fraction}")
        # Megatron keeps the product unrounded (it counts in samples), so a fractional warmup is honoured.
        warmup_key, warmup = "optim.lr_warmup_fraction", cfg.lr_warmup_fraction * decay_iters
    else:
        if cfg.lr_warmup_iters < 0:
            raise ConfigError(f"optim.lr_warmup_iters must be >= 0, got {cfg.lr_warmup_iters}")
        warmup_key, warmup = "optim.lr_warmup_iters", float(cfg.lr_warmup_iters)
    if warmup >= decay_iters:  # Megatron asserts lr_warmup_steps < lr_decay_steps
        raise ConfigError(
            f"warmup ({warmup:g} iterations, from {warmup_key}) must be shorter than the decay "
            f"({decay_iters} iterations, from {decay_key})"
        )
    return warmup, decay_iters


def _megatron_lr(iteration: int, cfg: OptimConfig, train_iters: int) -> float:
    warmup, decay_iters = _megatron_lengths(cfg, train_iters)
    # Megatron builds its scheduler with step(0) and steps it after each optimizer step, so step i runs
    # at num_steps = i: the first step has lr 0 and the peak is reached at i == warmup (inclusive).
    if warmup > 0 and iteration <= warmup:
        return cfg.lr * iteration / warmup
    if cfg.lr_decay_style == "constant":  # checked before the end of decay, as Megatron: lr for ever
        return cfg.lr
    if iteration > decay_iters:
        return cfg.min_lr
    ratio = (iteration - warmup) / (decay_iters - warmup)
    coeff = 1.0 - ratio if cfg.lr_decay_style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
    return cfg.min_lr + coeff * (cfg.lr - cfg.min_lr)


def _check_warmup(cfg: OptimConfig) -> None:
    if cfg.lr < 0:
        raise ConfigError(f"optim.lr must be >= 0, got {cfg.lr}")
    if cfg.warmup_min_lr < 0:
        raise ConfigError(f"optim.warmup_min_lr must be >= 0, got {cfg.warmup_min_lr}")
    if cfg.warmup_min_lr > cfg.lr:
        raise ConfigError(f"optim.warmup_min_lr ({cfg.warmup_min_lr}) must be <= optim.lr ({cfg.lr})")
    if cfg.lr_warmup_iters < 0:
        raise ConfigError(f"optim.lr_warmup_iters must be >= 0, got {cfg.lr_warmup_iters}")
    if cfg.lr_warmup_fraction is not None:
        raise ConfigError(
            "optim.lr_warmup_fraction applies to scheduler 'megatron' only; with "
            f"optim.scheduler={cfg.scheduler!r} set optim.lr_warmup_iters"
        )
    if cfg.warmup_type not in ("log", "linear"):
        raise ConfigError(f"optim.warmup_type must be 'log' or 'linear', got {cfg.warmup_type!r}")


def _warmup_lr(iteration: int, cfg: OptimConfig, decay_total: int | None = None) -> float:
    _check_warmup(cfg)
    # DeepSpeed clamps warmup_num_steps to >= 2 (log(1) would divide by zero) and sets the optimizer lr
    # to warmup_min_lr at construction; its engine then calls scheduler.step() after each optimizer
    # step, so step i (i >= 1) runs with gamma(last_batch_iteration = i - 1).
    warmup = max(2, cfg.lr_warmup_iters)
    last = max(iteration - 1, 0)
    if last >= warmup and decay_total is not None:  # WarmupDecayLR: linear to warmup_min_lr at the total
        gamma = max(0.0, (decay_total - last) / max(1.0, decay_total - warmup))
    elif last >= warmup:
        gamma = 1.0
    elif cfg.warmup_type == "log":
        gamma = math.log(last + 1) / math.log(warmup)
    else:
        gamma = last / warmup
    return cfg.warmup_min_lr + gamma * (cfg.lr - cfg.warmup_min_lr)


def lr_at(iteration: int, cfg: OptimConfig, train_iters: int) -> float:
    """Learning rate of the optimizer step `iteration` (0-based), a pure function of the config.

    scheduler 'megatron' (Megatron-LM `OptimizerParamScheduler.get_lr`, `lr_warmup_init` = 0):
      warmup W = lr_warmup_fraction * D if lr_warmup_fraction is set (not rounded) else lr_warmup_iters,
      D = lr_decay_iters, default `train_iters`; W < D is required.
      it <= W (and W > 0): lr * it / W -- `it`, not `it + 1`, as Megatron: step 0 has lr 0 and step W
                           the peak lr.
      constant:            lr after warmup, for ever.
      it > D:              min_lr.
      otherwise:           min_lr + coeff * (lr - min_lr), ratio = (it - W) / (D - W),
                           linear coeff = 1 - ratio, cosine coeff = 0.5 * (cos(pi * ratio) + 1).
    scheduler 'warmup_lr' (DeepSpeed `WarmupLR` as the DeepSpeed engine applies it):
      N = max(2, lr_warmup_iters), s = max(it - 1, 0) (DeepSpeed steps its scheduler after the optimizer,
      so step `it` sees last_batch_iteration = it - 1; steps 0 and 1 both run at warmup_min_lr);
      gamma = log(s + 1) / log(N) (log) or s / N (linear) while s < N, else 1;
      lr = warmup_min_lr + gamma * (lr - warmup_min_lr). Log reaches the peak at step N, linear at N + 1.
    scheduler 'warmup_decay_lr' (DeepSpeed `WarmupDecayLR`): as 'warmup_lr' while s < N, then
      gamma = max(0, (T - s) / max(1, T - N)), T = lr_decay_iters (default train_iters).

    Raises ConfigError (a ValueError) naming the config key for impossible settings.
    """
    if iteration < 0:
        raise ValueError(f"iteration must be >= 0, got {iteration}")
    if cfg.scheduler == "megatron":
        return _megatron_lr(iteration, cfg, train_iters)
    if cfg.scheduler == "warmup_lr":
        return _warmup_lr(iteration, cfg)
    if cfg.scheduler == "warmup_decay_lr":
        return _warmup_lr(iteration, cfg, cfg.lr_decay_iters or train_iters)
    raise ConfigError(
        f"optim.scheduler must be 'megatron', 'warmup_lr' or 'warmup_decay_lr', got {cfg.scheduler!r}"
    )
