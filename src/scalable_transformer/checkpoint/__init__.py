"""Checkpoints: sharded save/load through torch.distributed.checkpoint, atomic, reshardable."""

from .manager import CheckpointError, find_checkpoint, latest_checkpoint, read_metadata

__all__ = ["CheckpointError", "find_checkpoint", "latest_checkpoint", "read_metadata"]
