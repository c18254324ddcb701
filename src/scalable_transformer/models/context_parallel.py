"""Context parallelism, the model's side: which tokens a cp rank holds, and the attention mask of its
queries against every key, from global positions.

Shape legend: b batch, s local sequence (this rank's tokens), S whole sequence, n heads, d head dim,
c chunk (S / 2cp tokens).

Each of the cp ranks keeps two of the 2cp equal chunks of every sample: rank r keeps chunks r and
2cp-1-r (Megatron's and torchtitan's load balance: under a causal mask, early chunks attend to few
keys and late ones to many, so every rank gets one of each). The model runs on these s = S / cp
tokens; each attention layer all-gathers keys and values over the cp ranks (`ContextParallel.gather`,
autograd: the backward reduce-scatters their gradients), puts them back into sequence order and
attends with an explicit mask built from the global positions of the local queries and of all keys:
causality, sliding window, ALiBi's distance bias, packed documents' boundaries and BERT's padding are
all functions of those positions. Positions (rotary, learned, sinusoidal) are the tokens' global ones.

The collective itself belongs to parallel/ (parallel/context.py builds a `ContextParallel` and hands
it to the model and its attention modules), so models/ stays free of process groups.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch


def chunk_positions(seq: int, cp: int, rank: int, device: torch.device | None = None) -> torch.Tensor:
    """The global positions [S / cp] of the tokens cp rank `rank` holds: chunks rank and 2cp-1-rank of
    2cp, in that order (int64)."""
    if cp < 1 or not 0 <= rank < cp:
        raise ValueError(f"context-parallel rank {rank} of {cp}: need 0 <= rank < cp")
    if seq % (2 * cp):
        raise ValueError(f"sequence length {seq} is not divisible by 2 x cp = {2 * cp}")
    c = seq // (2 * cp)
    first = torch.arange(rank * c, (rank + 1) * c, device=device)
    second = torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c, device=device)
    return torch.cat([first, second])


def split_sequence(x: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's two chunks of `x` along `dim` (the whole sequence there), concatenated."""
    seq = x.shape[dim]
    if seq % (2 * cp):
        raise ValueError(f"sequence length {seq} is not divisible by 2 x cp = {2 * cp}")
    c = seq // (2 * cp)
    return torch.cat([x.narrow(dim, rank * c, c), x.narrow(dim, (2 * cp - 1 - rank) * c, c)], dim=dim)


def sequence_order(seq: int, cp: int, device: torch.device | None = None) -> torch.Tensor:
    """The permutation [S] that puts the cp ranks' concatenated local sequences (rank 0's two chunks,
    then rank 1's, ...) back into sequence order: gathered.index_select(dim, order)."""
    held = torch.cat([chunk_positions(seq, cp, r) for r in range(cp)])
    return torch.argsort(held).to(device)


def restore_sequence(gathered: torch.Tensor, cp: int, dim: int) -> torch.Tensor:
    """The ranks' local sequences, concatenated in rank order along `dim`, in sequence order."""
    return gathered.index_select(dim, sequence_order(gathered.shape[dim], cp, gathered.device))


def context_parallel_mask(
    query_positions_s: torch.Tensor,
    seq: int,
    *,
    causal: bool,
    window: int | None = None,
    slopes: list[float] | None = None,
    document_ids_bS: torch.Tensor | None = None,
    padding_bS: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The attention mask of local queries (global positions query_positions_s) against all `seq`
    keys in sequence order: boolean (True: may attend) [1 or b, 1, s, S], or with ALiBi `slopes` an
    additive bias [1 or b, n, s, S] in `dtype` (-inf where masked). Causal: key j <= query i; window:
    i - j < window; document ids (whole sequence): same document; padding (whole sequence, 1 = real
    token): real keys only. The same mask the single process uses, restricted to this rank's rows."""
    device = query_positions_s.device
    i_s1 = query_positions_s.unsqueeze(1)
    j_1S = torch.arange(seq, device=device).unsqueeze(0)
    allowed = torch.ones(i_s1.shape[0], seq, dtype=torch.bool, device=device)
    if causal:
        allowed = j_1S <= i_s1
    if window is not None:
        allowed = allowed & (i_s1 - j_1S < window)
    allowed_b1sS = allowed[None, None]
    if document_ids_bS is not None:
        docs_q_bs = document_ids_bS.index_select(1, query_positions_s)
        allowed_b1sS = allowed_b1sS & (docs_q_bs.unsqueeze(2) == document_ids_bS.unsqueeze(1)).unsqueeze(1)
    if padding_bS is not None:
        allowed_b1sS = allowed_b1sS & padding_bS.bool()[:, None, None, :]
    if slopes is None:
        return allowed_b1sS
    slopes_1n11 = torch.tensor(slopes, dtype=torch.float32, device=device).view(1, -1, 1, 1)
    bias_1nsS = slopes_1n11 * (j_1S - i_s1).float()[None, None]
    return bias_1nsS.masked_fill(~allowed_b1sS, float("-inf")).to(dtype)


@dataclass
class ContextParallel:
    """A model's context-parallel setting: `size` ranks, this one `rank`, and `gather(x, dim)`, which
    concatenates the ranks' tensors along `dim` in rank order with autograd (its backward returns each
    rank the sum of the gradients of its part), supplied by parallel/context.py."""

    size: int
    rank: int
    gather: Callable[[torch.Tensor, int], torch.Tensor] = field(repr=False)
    _masks: dict = field(default_factory=dict, repr=False, compare=False)

    def lower_right_mask(self, c: int, keys: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The additive [c, keys] mask of a chunk's c queries against the keys up to its end (0 where
        key j <= the query's place, lower-right aligned; -inf elsewhere), made once per shape, dtype and
        device and shared by every layer and step: a CPU's attention kernels take no lower-right causal
        bias, and a boolean mask is converted to an additive copy that each layer keeps."""
        key = (c, keys, dtype, device)
        mask = self._masks.get(key)
        if mask is None:
            allowed = torch.ones(c, keys, dtype=torch.bool, device=device).tril(keys - c)
            mask = torch.zeros(c, keys, dtype=dtype, device=device).masked_fill(~allowed, float("-inf"))
            self._masks[key] = mask
        return mask

    def positions(self, local_seq: int, device: torch.device) -> torch.Tensor:
        """The global positions [s] of this rank's `local_seq` tokens."""
        return chunk_positions(local_seq * self.size, self.size, self.rank, device)

    def gather_sequence(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's local sequence of x along `dim`, in sequence order (with autograd)."""
        return restore_sequence(self.gather(x.contiguous(), dim), self.size, dim)
