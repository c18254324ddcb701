"""The Callback that feeds `metrics.live_tensor_bytes.TensorBytesTracker` the step boundaries."""

from __future__ import annotations

import torch

from ..config.schema import ResolvedConfig
from ..metrics.live_tensor_bytes import TensorBytesTracker
from .trainer import Callback, Trainer


class TensorBytesCallback(Callback):
    def __init__(self, tracker: TensorBytesTracker) -> None:
        self.tracker = tracker
        self.steps = 0

    def on_step_start(self, trainer: Trainer) -> None:
        self.steps += 1
        self.tracker.step_started(self.steps)


def tensor_bytes_tracker(cfg: ResolvedConfig, device: torch.device) -> TensorBytesTracker | None:
    """A started tracker when this CPU run measures live tensor bytes (logging.track_tensor_bytes).
    On CUDA none is needed: the trainer's peak allocated bytes (torch.cuda.max_memory_allocated over
    every log interval) are the live tensor bytes, and `run.py` records those."""
    if device.type == "cuda" or not cfg.logging.track_tensor_bytes:
        return None
    tracker = TensorBytesTracker(device)
    tracker.start()
    return tracker
