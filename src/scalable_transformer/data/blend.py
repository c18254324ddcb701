"""Weighted blends of datasets (Megatron-LM's `--data-path "0.3 A 0.7 B"`).

The blend is a deterministic interleaving, no random draws: at position n, the next sample comes
from the dataset whose share so far lags its weight the most (largest weight * n - taken, ties to
the first dataset), and it is that dataset's next sample. So every prefix of the blend holds each
dataset within about one sample of its weight, and each dataset is read in its own (shuffled) order.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from scalable_transformer.config.rules import parse_blend
from scalable_transformer.data.gpt_dataset import CachedIndexMixin, load_or_build_index

__all__ = ["BlendedDataset", "blend_sizes", "build_blending_indices", "parse_blend"]


def blend_sizes(weights: Sequence[float], size: int, surplus: float = 0.005) -> tuple[list[int], list[int]]:
    """(samples the blend takes from each dataset, samples to build per dataset) for a blend of
    `size` samples: ceil(size * weight), and that plus Megatron's 0.5% surplus."""
    taken = [math.ceil(size * w) for w in weights]
    return taken, [math.ceil(n * (1 + surplus)) for n in taken]


def build_blending_indices(weights: Sequence[float], size: int) -> dict[str, np.ndarray]:
    """dataset_index [size] (int16) and dataset_sample_index [size] (int64): position n of the blend is
    sample dataset_sample_index[n] of dataset dataset_index[n] (see the module docstring)."""
    w = [float(x) for x in weights]
    counts = [0] * len(w)
    which = np.zeros(size, dtype=np.int16)
    nth = np.zeros(size, dtype=np.int64)
    for n in range(size):
        scale = max(n, 1)  # Megatron's: position 0 is compared as if it were 1
        best, best_error = 0, w[0] * scale - counts[0]
        for k in range(1, len(w)):
            error = w[k] * scale - counts[k]
            if error > best_error:
                best, best_error = k, error
        which[n] = best
        nth[n] = counts[best]
        counts[best] += 1
    return {"dataset_index": which, "dataset_sample_index": nth}


class BlendedDataset(CachedIndexMixin, Dataset):
    """`size` samples interleaved from `datasets` in proportion to `weights` (normalised here).

    Each dataset must hold at least the samples the blend takes from it. The index arrays are cached
    beside the first dataset's data, like the datasets' own mappings.
    """

    INDEX_NAMES = ("dataset_index", "dataset_sample_index")

    def __init__(self, datasets: Sequence[Dataset], weights: Sequence[float], size: int) -> None:
        if not datasets or len(datasets) != len(weights):
            raise ValueError(
                f"need one weight per dataset, got {len(datasets)} datasets and {len(weights)} weights"
            )
        if len(datasets) >= np.iinfo(np.int16).max:
            raise ValueError(f"too many datasets in a blend: {len(datasets)}")
        if any(not (math.isfinite(w) and w > 0) for w in weights):
            raise ValueError(f"blend weights must be positive numbers, got {list(weights)}")
        if size < 0:
            raise ValueError(f"size must be non-negative, got {size}")
        total = float(sum(weights))
        self.datasets = list(datasets)
        self.weights = [float(w) / total for w in weights]
        self.size = size
        children: list[Any] = [getattr(d, "description", None) for d in self.datasets]
        indexed = getattr(self.datasets[0], "indexed", None)
        build = lambda: build_blending_indices(self.weights, size)  # noqa: E731
        if indexed is not None and all(c is not None for c in children):
            arrays, self.cache_path, self.cache_hit = load_or_build_index(
                indexed.path_prefix,
                "blend",
                {"datasets": children, "weights": self.weights, "size": size},
                self.INDEX_NAMES,
                build,
            )
        else:  # datasets without a description cannot be keyed: build every time
            arrays, self.cache_path, self.cache_hit = build(), None, False
        self.dataset_index = arrays["dataset_index"]
        self.dataset_sample_index = arrays["dataset_sample_index"]
        taken = np.bincount(np.asarray(self.dataset_index), minlength=len(self.datasets))
        for k, (dataset, need) in enumerate(zip(self.datasets, taken.tolist(), strict=True)):
            have = len(dataset)  # type: ignore[arg-type]
            if need > have:
                raise ValueError(
                    f"blend dataset {k} has {have} samples but the blend takes {need} from it; "
                    "build it with more samples (see blend_sizes)"
                )

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        if not 0 <= idx < self.size:
            raise IndexError(f"sample {idx} out of range for {self.size} samples")
        dataset = self.datasets[int(self.dataset_index[idx])]
        return dataset[int(self.dataset_sample_index[idx])]
