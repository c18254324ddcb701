"""`stx calibrate`'s collectives on 4 gloo processes: besides the whole node, each node's ranks split
into smaller groups timed side by side (calibrate/collective_rates.py `collective_groups`), so that a layout's
2-rank tensor- or data-parallel groups are planned at a 2-rank measurement, not at the 4-rank curve
scaled by its ring factor. Two "nodes" of 2 ranks each have no smaller groups, and their cross-node
groups span all ranks."""

from __future__ import annotations

import pytest
import torch
from harness import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def _measure(rank: int, world_size: int, hosts: list[str]) -> list[tuple[str, int, int, float]]:
    from scalable_transformer.calibrate import collective_rates, timing

    job = timing.Job(torch.device("cpu"), rank, world_size, quick=True, hosts=hosts)
    points = collective_rates.measure_collectives(job, say=lambda _: None)
    ours = [p for p in points if p["op"] == "all_reduce"]
    return [(p["scope"], p["ranks"], p["size_bytes"], p["time_us"]) for p in ours]


@pytest.mark.parametrize(
    ("hosts", "expected"),
    [
        (["a"] * 4, {("intra_node", 4), ("intra_node", 2)}),
        (["a", "a", "b", "b"], {("intra_node", 2), ("inter_node", 4)}),
    ],
    ids=["one-node", "two-nodes"],
)
def test_four_ranks_time_every_group_size_a_node_holds_and_agree(tmp_path, hosts, expected):
    results = run_distributed(_measure, 4, hosts, tmp_dir=tmp_path, timeout=180)
    assert all(r == results[0] for r in results)  # every rank holds the same figures
    points = results[0]
    assert {(scope, ranks) for scope, ranks, _, _ in points} == expected
    sizes = {size for _, _, size, _ in points}
    for scope, ranks in expected:  # every size at every group size, each a positive time
        assert sorted(s for sc, r, s, _ in points if (sc, r) == (scope, ranks)) == sorted(sizes)
    assert all(us > 0 for *_, us in points)


def _pairs(rank: int, world_size: int) -> int:
    from scalable_transformer.calibrate import parallel_overheads, timing

    job = timing.Job(torch.device("cpu"), rank, world_size, quick=True, hosts=["a"] * world_size)
    calls: list[int] = []

    def test() -> None:  # a layer whose forward meets its peers in a collective, as a sharded one does
        calls.append(1)
        torch.distributed.all_reduce(torch.ones(4))

    # the ranks' time is up at different calls, as when their clocks cross a deadline apart
    parallel_overheads._paired_extra(job, lambda: None, test, seconds=0.0 if rank else 3.0)
    return len(calls)


def test_paired_timing_runs_the_same_calls_on_every_rank_whatever_their_clocks(tmp_path):
    """`_paired_extra` (the FSDP unit and tensor-parallel layer points): a rank whose time is up
    stops every rank, or its peers' collectives go unmatched (a hang until gloo's timeout)."""
    counts = run_distributed(_pairs, 2, tmp_dir=tmp_path, timeout=120)
    assert counts == [1 + 3, 1 + 3]  # the untimed call, then the 3 pairs every point times
