"""Expert parallelism's pure parts: where the ep / edp ranks sit in the global order (the arithmetic
against the meshes ParallelDims builds over a fake process group), the row re-sorting between rank-major
and expert-major order, the layouts the rules refuse, and the experts under the dry run's fake tensors."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.testing._internal.distributed.fake_pg import FakeStore

from scalable_transformer.config.load import load_config
from scalable_transformer.config.validate import resolve
from scalable_transformer.dryrun import dry_run as dry
from scalable_transformer.dryrun.dry_run_trace import DryRunTrace
from scalable_transformer.dryrun.engine_stubs import engine_stubs, patched
from scalable_transformer.errors import ConfigError
from scalable_transformer.models.moe import GroupedExperts
from scalable_transformer.parallel import expert
from scalable_transformer.parallel.dims import ParallelDims

MOE = ["model.num_experts=8"]
PP2 = ["parallel.pp=2", "train.gradient_accumulation_steps=2"]


@pytest.mark.parametrize(
    "world, overrides, ep_groups",
    [
        # dp 4 x cp 2: an ep group is ep consecutive dp x cp ranks (the cp pair of one dp rank first)
        (8, ["parallel.cp=2", "parallel.ep=2"], [[0, 1], [2, 3], [4, 5], [6, 7]]),
        (8, ["parallel.cp=2", "parallel.ep=4"], [[0, 1, 2, 3], [4, 5, 6, 7]]),
        # pp 2 x dp 4: ep stays within one pipeline stage's data-parallel ranks
        (8, [*PP2, "parallel.ep=2"], [[0, 1], [2, 3], [4, 5], [6, 7]]),
        (8, [*PP2, "parallel.ep=4"], [[0, 1, 2, 3], [4, 5, 6, 7]]),
    ],
)
def test_ep_groups_are_consecutive_dp_cp_ranks_and_the_meshes_agree(world, overrides, ep_groups):
    cfg = resolve(load_config("tiny-gpt", [*MOE, "model.num_layers=2", *overrides]), world)
    ep = cfg.parallel.ep
    for rank in range(world):
        dims = ParallelDims.from_config(cfg, rank)
        group = next(g for g in ep_groups if rank in g)
        assert dims.ep_rank == group.index(rank)
        # edp: the ranks with the same experts, the same ep rank in the other groups of this stage
        stage = dims.pp_rank * (world // cfg.parallel.pp)
        assert dims.edp_rank == (rank - stage) // ep
    for rank in (0, world - 1):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        try:
            dims = ParallelDims.build(cfg, "cpu")
            group = next(g for g in ep_groups if rank in g)
            assert dims.ep_mesh.mesh.tolist() == group
            stage = [r for r in range(world) if r // (world // cfg.parallel.pp) == dims.pp_rank]
            assert dims.edp_mesh.mesh.tolist() == [r for r in stage if r % ep == rank % ep]
            assert dims.expert_mesh.mesh_dim_names == ("edp", "ep")
        finally:
            dist.destroy_process_group()


def test_rows_move_between_rank_major_and_expert_major_order_and_back():
    # 2 ep ranks x 3 local experts: rows tagged by (rank, expert), sizes with empty blocks
    sizes_rank_major = [2, 0, 1, 3, 1, 0]  # (r0: e0 e1 e2), (r1: e0 e1 e2)
    tags = [(r, e) for r in range(2) for e in range(3)]
    tagged = [10 * r + e for (r, e), n in zip(tags, sizes_rank_major, strict=True) for _ in range(n)]
    rows = torch.tensor(tagged)
    by_expert = expert._reorder(rows, sizes_rank_major, 2, 3)
    assert by_expert.tolist() == [0, 0, 10, 10, 10, 11, 2]
    sizes_expert_major = [sizes_rank_major[r * 3 + e] for e in range(3) for r in range(2)]
    assert expert._reorder(by_expert, sizes_expert_major, 3, 2).tolist() == rows.tolist()


def test_the_plan_splits_rows_by_destination_rank():
    # 4 experts over ep 2: this rank sends [3, 1 | 0, 2]; receives (r0: 3, 1), (r1: 4, 0)
    plan = expert._Plan([3, 1, 0, 2], [3, 1, 4, 0], torch.tensor([7, 1]), ep=2)
    assert plan.send_splits == [4, 2]
    assert plan.recv_splits == [4, 4]
    assert plan.local_rows == [3, 4, 1, 0]


def test_under_tensor_parallelism_ep_groups_join_ranks_of_one_tp_index():
    """ep 2 x tp 2 on 8 ranks (dp 4; global rank = 2 dp + tp): each ep group holds the ranks of one tp
    index and neighbouring dp ranks, the experts' weights live on the (ep, tp) mesh of the (edp, ep,
    tp) expert mesh, and edp joins the same ep rank and tp index in the other ep groups."""
    world = 8
    cfg = resolve(load_config("tiny-gpt", [*MOE, "parallel.ep=2", "parallel.tp=2"]), world)
    expected = {  # rank: (ep group, edp group, (ep, tp) weight mesh)
        0: ([0, 2], [0, 4], [[0, 1], [2, 3]]),
        3: ([1, 3], [3, 7], [[0, 1], [2, 3]]),
        5: ([5, 7], [1, 5], [[4, 5], [6, 7]]),
    }
    for rank, (ep_group, edp_group, weights) in expected.items():
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        try:
            dims = ParallelDims.build(cfg, "cpu")
            assert dims.expert_mesh.mesh_dim_names == ("edp", "ep", "tp")
            assert dims.ep_mesh.mesh.tolist() == ep_group
            assert dims.edp_mesh.mesh.tolist() == edp_group
            assert dims.expert_weight_mesh.mesh_dim_names == ("ep", "tp")
            assert dims.expert_weight_mesh.mesh.tolist() == weights
            assert dims.ep_rank == ep_group.index(rank)
        finally:
            dist.destroy_process_group()


@pytest.mark.parametrize(
    "overrides, says",
    [
        (["parallel.ep=2", "parallel.zero_stage=1"], "ZeroRedundancyOptimizer"),
    ],
)
def test_layouts_expert_parallelism_does_not_build_with_are_refused(overrides, says):
    with pytest.raises(ConfigError, match=says):
        resolve(load_config("tiny-gpt", [*MOE, *overrides]), 4)


@pytest.mark.parametrize(
    "overrides",
    [
        ["parallel.zero_stage=0"],
        ["parallel.zero_stage=2"],
        ["parallel.zero_stage=3", "parallel.dp_shard=2"],
        ["parallel.zero_stage=3", "parallel.cp=2"],
        [*PP2, "model.num_layers=2"],
        ["parallel.tp=2"],  # ep 2 of dp 2: the experts' weights on the (ep, tp) mesh
    ],
)
def test_layouts_expert_parallelism_builds_with_resolve(overrides):
    cfg = resolve(load_config("tiny-gpt", [*MOE, "parallel.ep=2", *overrides]), 4)
    assert cfg.parallel.ep == 2


def test_a_dry_run_sizes_the_expert_all_to_all_for_balanced_routing():
    """Under the dry run's fake tensors the row counts have no value: the engine stub answers their
    host read as balanced routing (dryrun/engine_stubs.py), so the layer returns as many rows as it
    got, the counts' and rows' all-to-alls are recorded on the group named "ep", and the read once."""
    world, rows, hidden = 4, 24, 8  # ep 2 of dp 4: the ep group is not the dp group
    cfg = resolve(
        load_config("tiny-gpt", ["model.num_experts=4", f"model.hidden_size={hidden}", "parallel.ep=2"]),
        world,
    )
    with dry.fake_process_group(0, world), patched(engine_stubs("cpu", holder := {})):
        dims = ParallelDims.build(cfg, "cpu")
        trace = DryRunTrace(dry._group_names(dims), backend="gloo", device_type="cpu")
        holder["trace"] = trace
        with FakeTensorMode(allow_non_fake_inputs=True), trace:
            experts = GroupedExperts(cfg.model)
            expert.apply_expert_parallel(experts, dims.ep_mesh)
            # bf16: the meta function of torch 2.13's grouped GEMM takes nothing else (a GPU's dtype)
            x = torch.randn(rows, hidden, dtype=torch.bfloat16, requires_grad=True)
            y = experts(x, torch.zeros(4, dtype=torch.int64))
            y.sum().backward()
            assert tuple(y.shape) == (rows, hidden) and tuple(x.grad.shape) == (rows, hidden)
    kinds = [(c.group, c.kind) for c in trace.collectives]
    # counts, rows there, rows back; backward: the rows' gradients back and there
    assert kinds.count(("ep", "all_to_all")) >= 3, kinds
    reads = [r.where for r in trace.host_reads]
    assert len(reads) == 1 and "parallel/expert.py" in reads[0], reads
