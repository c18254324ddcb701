"""The Callback that feeds `metrics.tensor_memory.TensorBytesTracker` the step boundaries."""

from __future__ import annotations

import torch

from ..config.schema import ResolvedConfig
from ..metrics.tensor_memory import TensorBytesTracker
from .trainer import Callback, Trainer


class TensorBytesCallback(Callback):
    def __init__(self, tracker: TensorBytesTracker) -> None:
        self.tracker = tracker
        self.steps = 0

    def on_step_start(self, trainer: Trainer) -> None:
        self.steps += 1
        self.tracker.step_started(self.steps)


def tensor_bytes_tracker(cfg: ResolvedConfig, device: torch.device) -> TensorBytesTracker | None:
    """A started tracker when this run measures live tensor bytes (always on CUDA, opt-in on CPU)."""
    if device.type != "cuda" and not cfg.logging.track_tensor_bytes:
        return None
    tracker = TensorBytesTracker(device)
    tracker.start()
    return tracker
