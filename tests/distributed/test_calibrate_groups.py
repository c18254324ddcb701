"""`stx calibrate`'s collectives on 4 gloo processes: besides the whole node, each node's ranks split
into smaller groups timed side by side (plan/calibrate.py `collective_groups`), so that a layout's
2-rank tensor- or data-parallel groups are planned at a 2-rank measurement, not at the 4-rank curve
scaled by its ring factor. Two "nodes" of 2 ranks each have no smaller groups, and their cross-node
groups span all ranks."""

from __future__ import annotations

import pytest
import torch
from harness import run_distributed

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def _measure(rank: int, world_size: int, hosts: list[str]) -> list[tuple[str, int, int, float]]:
    from scalable_transformer.plan import calibrate as cal

    job = cal.Job(torch.device("cpu"), rank, world_size, quick=True, hosts=hosts)
    points = cal.measure_collectives(job, say=lambda _: None)
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
