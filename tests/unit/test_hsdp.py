"""Hybrid sharding (HSDP, parallel.dp_shard < dp): the layout rules, the planner's memory and the
engine on fake tensors at 8 ranks. Its training equivalence is in tests/distributed/test_equivalence.py
(FOUR: dp4-hsdp2-zero3, dp2-tp2-sp-hsdp1-zero2) and its checkpoints in test_checkpoint_layouts.py."""

from __future__ import annotations

import pytest

from scalable_transformer.config.load import load_config
from scalable_transformer.config.validate import resolve
from scalable_transformer.dryrun import dry_run as dry
from scalable_transformer.errors import ConfigError
from scalable_transformer.plan.memory_model import stage_memory

TINY = [
    "model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=2", "model.seq_length=32",
    "model.vocab_size=512", "train.micro_batch_size=2", "train.global_batch_size=16",
]  # fmt: skip


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (["parallel.zero_stage=3", "parallel.dp_shard=3"], r"dp_shard = 3 must divide .*\(8\).*1, 2, 4, 8"),
        (["parallel.zero_stage=1", "parallel.dp_shard=4"], r"dp_shard = 4 < dp = 8 .*zero_stage 2 or 3"),
        (["parallel.zero_stage=3", "parallel.dp_shard=0"], r"dp_shard = 0 must divide"),
    ],
)  # fmt: skip
def test_a_shard_size_that_does_not_fit_the_layout_is_refused_naming_it(overrides, named):
    with pytest.raises(ConfigError, match=named):
        resolve(load_config("tiny-gpt", [*TINY, *overrides]), 8)


def test_minus_one_is_all_of_dp_and_the_label_names_hybrid_sharding():
    plain = resolve(load_config("tiny-gpt", [*TINY, "parallel.zero_stage=3"]), 8).parallel
    hybrid = resolve(load_config("tiny-gpt", [*TINY, "parallel.zero_stage=3", "parallel.dp_shard=4"]), 8)
    assert plain.dp_shard == 8 and "dp_shard" not in plain.layout_label
    assert hybrid.parallel.layout_label == "dp=8 tp=1 pp=1 zero3 dp_shard=4"
    # the torchtitan name is an alias
    titan = load_config("tiny-gpt", [*TINY, "parallel.zero_stage=3", "data_parallel_shard_degree=2"])
    assert titan.parallel.dp_shard == 2


def _states(cfg) -> dict[str, int]:
    stage = stage_memory(cfg, 0, "cpu", 0)
    return {k: stage.breakdown.get(k, 0) for k in ("parameters", "optimizer_state")}


@pytest.fixture(scope="module")
def hsdp_dry_run():
    cfg = resolve(load_config("tiny-gpt", [*TINY, "parallel.zero_stage=3", "parallel.dp_shard=4"]), 8)
    return cfg, dry.dry_run(cfg, 8, "cpu").to_dict()


@pytest.mark.slow
def test_hybrid_sharding_shards_over_its_group_and_reduces_across_replicas(hsdp_dry_run):
    """8 ranks as 2 replicas of 4-way shards: each rank holds a quarter of the states (as ZeRO-3 over
    4 ranks, twice an 8-way shard), all-gathers and reduce-scatters within its 4 shard ranks and
    all-reduces its gradient shard with the other replica; the planner says the same states."""
    cfg, out = hsdp_dry_run
    rank = out["ranks"][0]["memory_breakdown_bytes"]
    four_way = resolve(
        load_config("tiny-gpt", [*TINY, "parallel.zero_stage=3", "train.global_batch_size=8"]), 4
    )
    eight_way = resolve(load_config("tiny-gpt", [*TINY, "parallel.zero_stage=3"]), 8)
    assert _states(cfg) == _states(four_way) != _states(eight_way)
    for key, predicted in _states(cfg).items():
        assert abs(rank[key] - predicted) <= 0.02 * predicted, (key, rank[key], predicted)
    kinds = {(c["group"], c["kind"]) for c in out["collectives"]}
    assert {
        ("dp_shard", "all_gather"),
        ("dp_shard", "reduce_scatter"),
        ("dp_replicate", "all_reduce"),
    } <= kinds
    assert not {k for k in kinds if k[0] == "dp" and k[1] in ("all_gather", "reduce_scatter")}, kinds


def test_the_planner_prices_gathers_within_a_node_and_the_all_reduce_across_nodes():
    """gpt-7b on 128 x 8 A100s: ZeRO-3 over all 1024 ranks pays latency-bound gathers across nodes;
    sharded within each node (dp_shard 8) they stay on NVLink and only each gradient shard crosses
    nodes, once per step. More memory per rank (1/8 of the states instead of 1/1024), less time."""
    from scalable_transformer.plan.cluster import table_cluster
    from scalable_transformer.plan.search import plan_config

    cluster = table_cluster("a100-80gb", 128, 8)
    base = ["parallel.zero_stage=3", "train.micro_batch_size=2", "train.global_batch_size=2048"]
    world = plan_config(load_config("gpt-7b", base), cluster)
    hybrid = plan_config(load_config("gpt-7b", [*base, "parallel.dp_shard=8"]), cluster)
    assert hybrid.time.total < world.time.total
    assert hybrid.time.breakdown["dp_communication"] < world.time.breakdown["dp_communication"]
    assert hybrid.peak_memory_bytes > world.peak_memory_bytes
    assert "dp_shard=8" in hybrid.layout.label()
    # the cross-node all-reduce is priced: without it the hybrid layout's communication would be a
    # one-node ZeRO-3's (8 ranks), which it exceeds
    node = plan_config(
        load_config("gpt-7b", [*base, "train.global_batch_size=16"]), table_cluster("a100-80gb", 1, 8)
    )
    assert hybrid.time.breakdown["dp_communication"] + hybrid.time.dp_overlapped_seconds > (
        node.time.breakdown["dp_communication"] + node.time.dp_overlapped_seconds
    )


@pytest.mark.slow
def test_hybrid_sharding_with_context_parallelism_names_its_groups():
    """dp 2 x cp 2 with dp_shard 1: FSDP2 shards over dp_shard x cp (2 ranks) and all-reduces across the
    2 replicas, on groups of their own that the dry run names (it listed them by number before)."""
    overrides = [*TINY, "parallel.zero_stage=3", "parallel.dp_shard=1", "parallel.cp=2"]
    cfg = resolve(load_config("tiny-gpt", overrides), 4)
    kinds = {(c["group"], c["kind"]) for c in dry.dry_run(cfg, 4, "cpu").to_dict()["collectives"]}
    assert {
        ("dp_shard_cp", "all_gather"),
        ("dp_shard_cp", "reduce_scatter"),
        ("dp_replicate", "all_reduce"),
    } <= kinds
    assert all(not group.isdigit() for group, _ in kinds), kinds
