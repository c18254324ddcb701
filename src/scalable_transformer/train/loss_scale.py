"""Loss scaling for fp16: torch's dynamic GradScaler, or a static scale (Megatron's --loss-scale).

torch.amp.GradScaler cannot hold a scale fixed (it requires growth > 1 and backoff < 1), so the
static case is this small class with the same four calls the trainer makes.
"""

from __future__ import annotations

import torch

from ..config.schema import TrainConfig


class StaticLossScaler:
    """Multiply the loss by a constant, divide the grads by it, skip the step when they overflow."""

    def __init__(self, scale: float):
        self._scale = float(scale)
        self._found_inf = False

    def is_enabled(self) -> bool:
        return True

    def get_scale(self) -> float:
        return self._scale

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self._scale

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        if not grads:
            return
        # The fused kernel GradScaler itself uses: unscale and detect inf/nan with one host sync.
        found_inf = torch.zeros(1, device=grads[0].device)
        inv_scale = torch.full((1,), 1.0 / self._scale, device=grads[0].device)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
        self._found_inf = bool(found_inf.item())

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        if not self._found_inf:
            optimizer.step()

    def update(self) -> None:
        self._found_inf = False


def build_loss_scaler(cfg: TrainConfig, device: torch.device) -> torch.amp.GradScaler | StaticLossScaler:
    """Dynamic scaling (DeepSpeed/Megatron knobs initial_scale_power, loss_scale_window) unless a static
    loss_scale is set; a disabled GradScaler (a no-op) for fp32 and bf16."""
    if cfg.precision == "fp16" and cfg.loss_scale is not None:
        return StaticLossScaler(cfg.loss_scale)
    return torch.amp.GradScaler(
        device.type,
        enabled=cfg.precision == "fp16",
        init_scale=2.0**cfg.initial_scale_power,
        growth_interval=cfg.loss_scale_window,
    )
