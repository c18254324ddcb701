"""The planner for mixture-of-experts models (issue 43): expert parallelism divides the routed experts'
parameters, gradients and optimizer state by ep (their ZeRO sharding over the expert-data-parallel
ranks), MoE layers keep their routed tokens' activations at the busiest rank's imbalance, the
all-to-all dispatch and combine are timed inside or across nodes, the experts' gradients are reduced
over dp x cp / ep ranks, and `--search` explores ep. The FLOPs and parameter counts are in
tests/unit/test_flops_moe.py."""

from __future__ import annotations

import dataclasses
import json

import pytest

from scalable_transformer.cli import main
from scalable_transformer.config.load import load_config
from scalable_transformer.config.model_shapes import expert_numel, moe_layers, stage_params
from scalable_transformer.plan.cluster import table_cluster
from scalable_transformer.plan.memory_model import (
    DEFAULT_MOE_IMBALANCE,
    activation_model,
    config_layer_bytes,
    moe_layer_extra_bytes,
    stage_memory,
)
from scalable_transformer.plan.search import candidate_layouts, expert_parallel_sizes, prepare, search_layouts
from scalable_transformer.plan.speed import _rates, step_time

# the shipped preset, at the batch these figures were first planned at
MIXTRAL = ["train.global_batch_size=512"]


def _mixtral(world: int, *overrides: str):
    return prepare(load_config("mixtral-8x7b", [*MIXTRAL, *overrides]), world)


def test_expert_memory_falls_with_ep_as_counted_by_hand():
    """ZeRO-0 on 64 ranks: each rank holds every parameter but the experts, and 1/ep of the experts,
    with their gradients and optimizer state; with ep > 1 the engine replicates through FSDP2's
    replicate (parallel/expert.py), which keeps an unsharded copy from forward to backward, where
    DDP (ep = 1) keeps its gradient buckets."""
    base = ["parallel.zero_stage=0", "train.global_batch_size=64"]
    by_ep = {ep: stage_memory(_mixtral(64, *base, f"parallel.ep={ep}"), 0, "gpu", 0) for ep in (1, 2, 8)}
    m = _mixtral(64, *base).model
    experts = len(moe_layers(m)) * m.num_experts * expert_numel(m)
    total = stage_params(m, 1, 1, 0).total
    for ep, mem in by_ep.items():
        held = total - experts + experts // ep
        assert mem.breakdown["parameters"] == 4 * held  # fp32 master weights
        assert mem.breakdown["optimizer_state"] == 8 * held  # AdamW's two fp32 moments
        # DDP's buckets at ep = 1; FSDP2's replicate has none (its unsharded copy is freed before the step)
        assert mem.breakdown["communication_buffers"] == (4 * held if ep == 1 else 0)
        if mem.phase == "backward":
            assert mem.breakdown["gathered_parameters"] == (4 * held if ep > 1 else 0)
    assert (
        by_ep[8].breakdown["parameters"] < by_ep[2].breakdown["parameters"] < by_ep[1].breakdown["parameters"]
    )
    # with ep = 1 the 46.7B parameters' fp32 weights alone (174 GiB) do not fit an 80 GB H100; with
    # ep = 8 they are 4 x (1.6B + 45.1B / 8) bytes, 27 GiB
    assert by_ep[1].breakdown["parameters"] > 80 * 2**30
    assert by_ep[8].breakdown["parameters"] == 4 * (total - experts + experts // 8) < 28 * 2**30


def test_zero3_shards_the_experts_over_the_expert_data_parallel_ranks():
    """Under ZeRO-3 a rank keeps 1/(dp x cp) of every parameter either way: 1/ep of the experts over
    dp / ep ranks is the same share; what ep changes is what a rank gathers (its own experts only)."""
    base = ["parallel.zero_stage=3", "train.global_batch_size=64"]
    one, eight = (stage_memory(_mixtral(64, *base, f"parallel.ep={ep}"), 0, "gpu", 0) for ep in (1, 8))
    assert eight.breakdown["parameters"] == pytest.approx(one.breakdown["parameters"], abs=8)
    assert eight.breakdown["optimizer_state"] == pytest.approx(one.breakdown["optimizer_state"], abs=16)
    # at the loss's backward the last block and the root stay gathered: with ep = 8 its experts are 1/8
    m = _mixtral(64, *base).model
    block_experts = m.num_experts * expert_numel(m)
    gathered = one.breakdown["gathered_parameters"] - eight.breakdown["gathered_parameters"]
    assert gathered == 2 * block_experts * 7 // 8  # bf16 gathers


def test_moe_activations_are_the_routed_tokens_times_the_imbalance():
    """The formula by hand (bf16 on a GPU). It was checked against the moe-model branch's MoELayer on the
    CPU (fp32, saved tensors counted by storage with torch.autograd.graph.saved_tensors_hooks): within
    1.0% on tiny-moe and two variants, one with a shared expert (docs/PLANNER.md#mixture-of-experts)."""
    cfg = _mixtral(64, "parallel.ep=8", "train.global_batch_size=64", "parallel.zero_stage=3")
    am = activation_model(cfg, "gpu")
    tokens, h, f, e = 4096, 4096, 14336, 2
    one, more = (moe_layer_extra_bytes(cfg, "none", am, x) for x in (1.0, 2.0))
    # doubling the imbalance adds one more copy of the k x tokens routed rows' saved tensors: three h
    # wide (sorted input, w_down's output, the weighted output) and the gated activation's 2f input,
    # f gate output and f product
    per_row = e * (3 * h + 4 * f)
    assert more - one == 2 * tokens * per_row
    # against the dense MLP it replaces (what the dense layer's count holds for it: 4f per token of the
    # dense size, the preset's derived ffn_hidden_size), plus the router's fp32 copy of its bf16 input
    # (tokens x h) and two fp32 tokens x E tensors (logits, scores)
    no_mlp = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, ffn_hidden_size=0))
    dense = config_layer_bytes(cfg, "none", am) - config_layer_bytes(no_mlp, "none", am)
    assert dense == tokens * e * 4 * cfg.model.ffn_hidden_size
    router = 4 * tokens * h + 2 * 4 * tokens * 8
    assert one == 2 * tokens * per_row + router - dense
    # full recompute keeps the layer input only, MoE or not
    assert moe_layer_extra_bytes(cfg, "full", am, 2.0) == 0
    # without expert parallelism one rank runs every routed token: no busiest rank
    no_ep = _mixtral(64, "train.global_batch_size=64", "parallel.zero_stage=3")
    assert moe_layer_extra_bytes(no_ep, "none", am, 2.0) == one


def _ep_ms(cfg, cluster) -> float:
    return step_time(cfg, cluster).breakdown.get("ep_communication", 0.0)


def test_all_to_all_bytes_and_crossing_nodes():
    """The ep ranks are consecutive in the dp x cp order (parallel/dims.py): ep = 8 sits in one 8-GPU
    node (NVLink); ep = 16 (a Mixtral shape with 16 experts) spans two, and half of each rank's rows
    leave its node through its NIC (400 Gb/s)."""
    cluster = table_cluster("h100-sxm", 8, 8)
    sixteen = ["model.num_experts=16", "parallel.zero_stage=3", "train.global_batch_size=64"]
    inside = _ep_ms(_mixtral(64, *sixteen, "parallel.ep=8"), cluster)
    across = _ep_ms(_mixtral(64, *sixteen, "parallel.ep=16"), cluster)
    # 32 MoE layers x (2 forward + 2 backward) all-to-alls of k x tokens x imbalance rows of h bf16
    nbytes = 2 * 4096 * DEFAULT_MOE_IMBALANCE * 4096 * 2
    rates = _rates(cluster)
    assert inside == pytest.approx(32 * 4 * rates.collective("all_to_all", 8, nbytes, 1))
    topo = cluster.profile.topology  # 8 NICs per node, their measured GB/s each (one per GPU)
    assert topo["nics_per_node"] == 8
    assert across == pytest.approx(32 * 4 * 0.5 * nbytes / (topo["nic_gbps"] * 1e9))  # 8 of 16 elsewhere
    assert across > 3 * inside
    # full recompute dispatches and combines again in backward
    eight = _mixtral(64, "parallel.ep=8", "parallel.zero_stage=3", "train.global_batch_size=64")
    full = dataclasses.replace(
        eight, parallel=dataclasses.replace(eight.parallel, activation_checkpointing="full")
    )
    assert _ep_ms(full, cluster) == pytest.approx(_ep_ms(eight, cluster) * 6 / 4)
    # no expert parallelism, no all-to-all
    assert _ep_ms(_mixtral(64, "parallel.zero_stage=3", "train.global_batch_size=64"), cluster) == 0


def test_imbalance_slows_the_busiest_rank_and_is_a_planner_option():
    cfg = _mixtral(64, "parallel.ep=8", "parallel.zero_stage=3", "train.global_batch_size=64")
    cluster = table_cluster("h100-sxm", 8, 8)
    balanced = step_time(cfg, dataclasses.replace(cluster, moe_imbalance=1.0))
    skewed = step_time(cfg, dataclasses.replace(cluster, moe_imbalance=2.0))
    assert skewed.breakdown["compute"] > 1.3 * balanced.breakdown["compute"]
    # twice the bytes: more time, at most twice (the bandwidth curve rises with the size)
    assert 1.5 * balanced.breakdown["ep_communication"] < skewed.breakdown["ep_communication"]
    assert skewed.breakdown["ep_communication"] <= 2 * balanced.breakdown["ep_communication"]
    # the FLOPs are the model's, whatever the imbalance: one sample's active work, not the busiest rank's
    assert skewed.model_flops == balanced.model_flops


def test_expert_gradients_are_reduced_over_the_expert_data_parallel_ranks():
    """ZeRO-0 (DDP): each rank all-reduces the non-expert gradients over all dp ranks and its 1/ep of
    the experts' over the dp / ep ranks holding the same experts, which sit ep apart (on 8 nodes of 8
    with ep = 8: one per node, each on its own NIC); on one node with ep = dp = 8 no rank shares its
    experts, so their gradients are not reduced at all."""
    base = ["parallel.zero_stage=0", "train.global_batch_size=64"]
    cluster = table_cluster("h100-sxm", 8, 8)
    eight = step_time(_mixtral(64, *base, "parallel.ep=8"), cluster)
    m = _mixtral(64, *base).model
    experts = len(moe_layers(m)) * m.num_experts * expert_numel(m)
    rest = stage_params(m, 1, 1, 0).total - experts
    rates = _rates(cluster)
    hand = rates.collective("all_reduce", 64, 4 * rest, 1) + rates.collective(
        "all_reduce", 8, 4 * experts / 8, 8
    )
    assert eight.breakdown["dp_communication"] + eight.dp_overlapped_seconds == pytest.approx(hand)
    node = table_cluster("h100-sxm", 1, 8)
    one_node = {ep: step_time(_mixtral(8, *base, f"parallel.ep={ep}"), node) for ep in (1, 8)}
    alone = rates.collective("all_reduce", 8, 4 * rest, 1)
    assert one_node[8].breakdown["dp_communication"] + one_node[8].dp_overlapped_seconds == pytest.approx(
        alone
    )
    assert one_node[1].breakdown["dp_communication"] + one_node[1].dp_overlapped_seconds > 10 * alone


def test_the_search_tries_every_ep_that_divides_the_experts_and_dp_x_cp():
    assert expert_parallel_sizes(8, 64) == [1, 2, 4, 8]
    assert expert_parallel_sizes(64, 24) == [1, 2, 4, 8]
    assert expert_parallel_sizes(0, 64) == [1]
    cfg = _mixtral(16, "train.global_batch_size=16")
    eps = {layout.ep for layout in candidate_layouts(cfg, 16, 16, 8)}
    assert eps == {1, 2, 4, 8}
    dense = prepare(load_config("llama-8b", ["train.global_batch_size=16"]), 16)
    assert {layout.ep for layout in candidate_layouts(dense, 16, 16, 8)} == {1}


@pytest.mark.slow
def test_search_picks_expert_parallelism_for_mixtral_on_64_h100():
    """Where memory forces it (ZeRO-2 without tensor or pipeline parallelism keeps every parameter it
    holds gathered from forward to backward: 46.7B in bf16 do not fit beside the rest, 1/8 of the
    experts do) and overall: the best layout that fits has ep > 1."""
    cluster = table_cluster("h100-sxm", 8, 8)
    results = search_layouts(load_config("mixtral-8x7b", [*MIXTRAL, "train.global_batch_size=64"]), cluster)
    best = next(r for r in results if r.fits)
    assert best.layout.ep > 1, best.layout.label()
    plain = [
        r
        for r in results
        if r.layout.zero_stage == 2 and r.layout.tp == r.layout.pp == 1 and not r.layout.offload_optimizer
    ]
    assert plain and all(not r.fits for r in plain if r.layout.ep == 1)
    assert any(r.fits for r in plain if r.layout.ep == 8)


def _cli_plan(capsys, *extra: str) -> dict:
    args = [
        "plan",
        "mixtral-8x7b",
        *MIXTRAL,
        "parallel.ep=8",
        "parallel.zero_stage=3",
        "train.global_batch_size=64",
    ]
    assert main([*args, "--world-size", "64", "--device", "h100-sxm", "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)["layouts"][0]


def test_cli_takes_the_imbalance_and_prints_ep(capsys):
    default, skewed = _cli_plan(capsys), _cli_plan(capsys, "--moe-imbalance", "2")
    assert default["ep"] == 8 and "ep=8" in default["label"]
    assert "ep" not in default["layout"]  # the layout keys stay as they were; ep sits beside them
    assert default["time_breakdown_seconds"]["ep_communication"] > 0
    assert skewed["step_seconds"] > default["step_seconds"]
    assert skewed["memory_breakdown_bytes"]["activations"] > default["memory_breakdown_bytes"]["activations"]
    assert (
        main(
            [
                "plan",
                "mixtral-8x7b",
                *MIXTRAL,
                "--world-size",
                "8",
                "--device",
                "h100-sxm",
                "--moe-imbalance",
                "0.5",
            ]
        )
        == 2
    )
    assert "--moe-imbalance" in capsys.readouterr().err


def test_human_output_says_the_imbalance_it_planned_at(capsys):
    args = [
        "plan",
        "mixtral-8x7b",
        *MIXTRAL,
        "parallel.ep=8",
        "parallel.zero_stage=3",
        "train.global_batch_size=64",
    ]
    assert main([*args, "--world-size", "64", "--device", "h100-sxm", "--moe-imbalance", "1.5"]) == 0
    out = capsys.readouterr().out
    assert "1.5x the mean routed tokens" in out and "ep communication" in out


def test_hybrid_sharding_shards_the_experts_over_all_their_expert_data_parallel_ranks():
    """HSDP (dp_shard 16 of dp 64): the dense parameters' states over the 16-rank shard group, the
    experts' (1/8 of them on each rank) over all 64 / 8 = 8 ranks holding the same experts, as
    parallel/expert.py shards them on the edp mesh."""
    cfg = _mixtral(
        64, "parallel.ep=8", "parallel.zero_stage=3", "parallel.dp_shard=16", "train.global_batch_size=64"
    )
    m = cfg.model
    experts = len(moe_layers(m)) * m.num_experts * expert_numel(m)
    rest = stage_params(m, 1, 1, 0).total - experts
    mem = stage_memory(cfg, 0, "gpu", 0)
    assert mem.breakdown["optimizer_state"] == int(8 * (rest / 16 + (experts // 8) / 8))
