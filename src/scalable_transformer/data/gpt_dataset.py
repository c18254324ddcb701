"""GPT pretraining samples, held in memory, with Megatron-LM's packing.

Documents are concatenated, each followed by the end-of-document token, and cut into windows of
seq_length + 1 tokens that cross document boundaries. Consecutive windows share one token (stride
seq_length, as Megatron), so every token but the first is a target exactly once; the leftover tail
shorter than a window is dropped. The order of the windows is a permutation drawn from `seed`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch.utils.data import Dataset


class GPTDataset(Dataset):
    """Map-style GPT dataset. Item i is {"input_ids": [s], "labels": [s]} (LongTensors), where
    labels are the input shifted left by one token (s = seq_length)."""

    def __init__(
        self, documents_tokens: Sequence[Sequence[int] | np.ndarray], seq_length: int, eod_id: int, seed: int
    ) -> None:
        if seq_length < 1:
            raise ValueError(f"seq_length must be positive, got {seq_length}")
        self.seq_length = seq_length
        self.eod_id = eod_id
        self.seed = seed
        pieces: list[np.ndarray] = []
        for doc in documents_tokens:
            pieces.append(np.asarray(doc, dtype=np.int64))
            pieces.append(np.array([eod_id], dtype=np.int64))
        self._tokens = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)
        num_samples = max(0, (len(self._tokens) - 1) // seq_length)
        self._order = np.random.default_rng([seed, 2]).permutation(num_samples)

    @property
    def num_tokens(self) -> int:
        """Tokens in the packed stream, end-of-document tokens included."""
        return len(self._tokens)

    def __len__(self) -> int:
        return len(self._order)

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        if not 0 <= idx < len(self):
            raise IndexError(f"sample {idx} out of range for {len(self)} samples")
        start = int(self._order[idx]) * self.seq_length
        window = torch.from_numpy(self._tokens[start : start + self.seq_length + 1].copy())
        return {"input_ids": window[:-1], "labels": window[1:]}
