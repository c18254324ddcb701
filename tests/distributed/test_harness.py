"""The multi-process harness: per-rank results come back in rank order, child errors surface."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from harness import run_distributed


def _sum_ranks(rank: int, world_size: int, offset: int) -> tuple[int, int, float]:
    total = torch.tensor(float(rank))
    dist.all_reduce(total)
    return rank, world_size, total.item() + offset


def _fail_on_rank_1(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("boom from rank 1")
    dist.barrier()  # rank 0 waits for a peer that died: the harness must not hang


@pytest.mark.distributed
def test_results_in_rank_order(tmp_path):
    assert run_distributed(_sum_ranks, 2, 10, tmp_dir=tmp_path) == [(0, 2, 11.0), (1, 2, 11.0)]


@pytest.mark.distributed
def test_child_traceback_is_raised(tmp_path):
    with pytest.raises(RuntimeError, match="ValueError: boom from rank 1"):
        run_distributed(_fail_on_rank_1, 2, tmp_dir=tmp_path, timeout=60)
