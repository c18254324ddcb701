"""The planner under context parallelism (parallel.cp): each rank's activations are its 1/cp share of
the sequence plus the keys and values of all of it; the attention is 1/cp of the work (causal
blocks) or all of it under an explicit mask; the key/value gathers are timed; gradients and shards
span dp x cp; and `--search` explores cp for long sequences. The engine's side is in
tests/unit/test_context_parallel.py and the equivalence suite."""

from __future__ import annotations

import pytest

from scalable_transformer.config.load import load_config
from scalable_transformer.plan.cluster import table_cluster
from scalable_transformer.plan.memory_model import (
    activation_model,
    config_layer_bytes,
    context_parallel_mask_bytes,
    layer_activation_bytes,
    stage_memory,
)
from scalable_transformer.plan.search import context_parallel_sizes, plan_config, prepare
from scalable_transformer.plan.speed import step_time

LONG = ["model.seq_length=131072", "model.max_position_embeddings=131072", "train.global_batch_size=32"]
LONG += ["train.precision=bf16", "parallel.zero_stage=3"]


def _cfg(preset: str, overrides: list[str], world: int):
    return prepare(load_config(preset, overrides), world)


def test_a_layer_keeps_its_share_of_the_sequence_and_the_keys_and_values_of_all_of_it():
    b, s, h, a, f = 1, 8192, 1024, 8, 4096
    am = activation_model(load_config("gpt-125m", ["train.precision=bf16"]), "gpu")
    whole = layer_activation_bytes(b, s, h, a, f, 1, False, "none", am, kv_ratio=0.25)
    half = layer_activation_bytes(b, s // 2, h, a, f, 1, False, "none", am, kv_ratio=0.25, key_seq=s)
    # everything per token halves, but k and v (2 x 0.25 of the q bytes per token) stay whole
    kv = 2 * 0.25 * b * s * h * am.act_bytes
    assert half == pytest.approx(whole / 2 + kv / 2)
    # without cp, key_seq is the sequence itself: the formula is unchanged
    assert layer_activation_bytes(b, s, h, a, f, 1, False, "none", am, key_seq=s) == layer_activation_bytes(
        b, s, h, a, f, 1, False, "none", am
    )


def test_cp2_lowers_the_planned_peak_and_shards_states_over_dp_x_cp():
    plain = _cfg(
        "llama-8b", ["model.seq_length=8192", "parallel.zero_stage=3", "train.global_batch_size=8"], 8
    )
    cp2 = _cfg(
        "llama-8b",
        ["model.seq_length=8192", "parallel.zero_stage=3", "train.global_batch_size=4", "parallel.cp=2"],
        8,
    )
    assert cp2.parallel.dp == 4 and plain.parallel.dp == 8
    m0, m2 = stage_memory(plain, 0, "gpu", 0), stage_memory(cp2, 0, "gpu", 0)
    # parameters and optimizer state are sharded over dp x cp = 8 ranks in both
    assert m2.breakdown["optimizer_state"] == m0.breakdown["optimizer_state"]
    assert m2.breakdown["activations"] < 0.6 * m0.breakdown["activations"]
    assert config_layer_bytes(cp2, "none", activation_model(cp2, "gpu")) < config_layer_bytes(
        plain, "none", activation_model(plain, "gpu")
    )


def test_the_mask_is_counted_only_where_the_attention_needs_one():
    causal = _cfg("llama-8b", ["model.seq_length=8192", "parallel.cp=2", "train.global_batch_size=4"], 8)
    assert context_parallel_mask_bytes(causal, "gpu") == (0, 0, 0)  # causal blocks: no mask
    # on a CPU the chunks' additive masks, made once for every layer and step: c^2 (2cp + 1) in bf16
    assert context_parallel_mask_bytes(causal, "cpu") == (2048 * 2048 * 5 * 2, 0, 0)
    packed = _cfg(
        "llama-8b",
        [
            "model.seq_length=8192",
            "parallel.cp=2",
            "train.global_batch_size=4",
            "model.reset_attention_mask=true",
        ],
        8,
    )
    # per sample: [b, 1, s / cp, s] booleans, converted to additive masks in the attention dtype (bf16:
    # the preset's precision) at each layer
    assert packed.train.precision == "bf16"
    assert context_parallel_mask_bytes(packed, "gpu") == (0, 0, 1 * 4096 * 8192 * 2)


def test_key_value_gathers_are_timed_and_masked_attention_costs_the_whole_square():
    cluster = table_cluster("h100-sxm", 2, 8)
    cp = _cfg(
        "llama-8b",
        [
            "model.seq_length=32768",
            "model.max_position_embeddings=32768",
            "parallel.cp=4",
            "train.global_batch_size=4",
        ],
        16,
    )
    st = step_time(cp, cluster)
    assert st.breakdown["cp_communication"] > 0
    packed = _cfg(
        "llama-8b",
        [
            "model.seq_length=32768",
            "model.max_position_embeddings=32768",
            "parallel.cp=4",
            "train.global_batch_size=4",
            "model.reset_attention_mask=true",
        ],
        16,
    )
    attention = st.classes["forward"]["attention"]
    masked = step_time(packed, cluster).classes["forward"]["attention"]
    assert masked == pytest.approx(2 * attention, rel=0.35)  # the masked half is computed too
    plain = _cfg(
        "llama-8b",
        [
            "model.seq_length=32768",
            "model.max_position_embeddings=32768",
            "train.global_batch_size=16",
        ],
        16,
    )
    assert "cp_communication" not in step_time(plain, cluster).breakdown or not step_time(
        plain, cluster
    ).breakdown.get("cp_communication")


def test_search_tries_cp_only_for_long_sequences():
    assert context_parallel_sizes(2048, 1024) == [1]
    assert context_parallel_sizes(8192, 64) == [1, 2]
    assert context_parallel_sizes(131072, 512) == [1, 2, 4, 8, 16, 32]


def test_at_128k_tokens_a_cp_layout_beats_the_best_tensor_parallel_one_on_512_h100s():
    """Llama 3.1 70B at seq 131072 on 64 x 8 H100: cp 16 x tp 4 against the tp 16 + SP + full recompute
    layout that ranks first without cp (the full search, `stx plan ... --search`, also ranks a cp 16
    layout first: benchmarks/results/plan_context_parallel.md)."""
    cluster = table_cluster("h100-sxm", 64, 8)
    cp = plan_config(
        load_config(
            "llama-70b",
            [
                *LONG,
                "parallel.cp=16",
                "parallel.tp=4",
                "parallel.sequence_parallel=true",
                "parallel.reduce_each_micro_batch=true",
            ],
        ),
        cluster,
    )
    tp = plan_config(
        load_config(
            "llama-70b",
            [
                *LONG,
                "parallel.tp=16",
                "parallel.sequence_parallel=true",
                "parallel.activation_checkpointing=full",
            ],
        ),
        cluster,
    )
    assert cp.fits and tp.fits
    assert cp.samples_per_second > tp.samples_per_second
