"""plan/layout_sampler.py: seeded random layouts, each one the config accepts, covering every axis."""

from __future__ import annotations

import pytest

from scalable_transformer.config.load import load_config
from scalable_transformer.config.validate import resolve
from scalable_transformer.errors import ConfigError
from scalable_transformer.plan.layout_sampler import (
    FAMILIES,
    PRECISIONS,
    RECOMPUTE,
    SCHEDULES,
    draw_valid_layout,
    sample_layouts,
)


@pytest.fixture(scope="module")
def small() -> list:
    return sample_layouts("small", 120, seed=3)


@pytest.fixture(scope="module")
def large() -> list:
    return sample_layouts("large", 120, seed=3)


def test_the_same_seed_draws_the_same_layouts_and_another_seed_others() -> None:
    first, again = sample_layouts("small", 6, seed=11), sample_layouts("small", 6, seed=11)
    assert [(s.base, s.overrides, s.world_size) for s in first] == [
        (s.base, s.overrides, s.world_size) for s in again
    ]
    other = sample_layouts("small", 6, seed=12)
    assert [s.overrides for s in first] != [s.overrides for s in other]


def test_one_layout_is_reproduced_from_its_seed_and_index_alone() -> None:
    batch = sample_layouts("large", 5, seed=7)
    alone = draw_valid_layout("large", 7, 3)
    assert (alone.base, alone.overrides, alone.world_size, alone.device) == (
        batch[3].base,
        batch[3].overrides,
        batch[3].world_size,
        batch[3].device,
    )
    assert sample_layouts("large", 2, seed=7, start=3)[0].overrides == batch[3].overrides


@pytest.mark.parametrize("scale", ["small", "large"])
def test_every_sampled_layout_resolves_at_its_world_size(scale: str, small: list, large: list) -> None:
    for layout in small if scale == "small" else large:
        cfg = resolve(load_config(layout.base, list(layout.overrides)), layout.world_size)
        p = cfg.parallel
        assert p.dp * p.cp * p.tp * p.pp == layout.world_size
        assert layout.axes["dp"] == p.dp
        for override in layout.overrides:  # each override reached the config as drawn
            key, value = override.split("=", 1)
            section, name = key.split(".")
            assert str(getattr(getattr(cfg, section), name)).lower() == value.lower(), override


def test_small_layouts_stay_small_and_large_ones_large(small: list, large: list) -> None:
    assert {s.world_size for s in small} <= {2, 3, 4} and {s.device for s in small} == {"cpu"}
    for s in small:
        m = load_config(s.base, list(s.overrides)).model
        assert 64 <= m.hidden_size <= 256 and 64 <= m.seq_length <= 256 and m.num_layers <= 6
    assert {s.world_size for s in large} <= {64, 128, 256, 512, 1024}
    assert "cpu" not in {s.device for s in large}
    assert "bert-175b" in {s.base for s in large} and "llama-70b" in {s.base for s in large}


def _values(layouts: list, key: str) -> set[str]:
    return {str(s.axes[key]) for s in layouts if s.axes.get(key) is not None}


def test_every_axis_value_appears_over_a_batch(small: list, large: list) -> None:
    for layouts in (small, large):
        assert {s.family for s in layouts} == set(FAMILIES)
        assert _values(layouts, "parallel.zero_stage") == {"0", "1", "2", "3"}
        assert _values(layouts, "parallel.activation_checkpointing") == set(RECOMPUTE)
        assert _values(layouts, "parallel.pipeline_schedule") == set(SCHEDULES)
        for flag in ("offload_optimizer", "offload_param", "sequence_parallel", "cpu_checkpointing"):
            assert _values(layouts, f"parallel.{flag}") == {"True"}, flag
        assert {"1", "2"} <= _values(layouts, "parallel.tp") and {"1", "2"} <= _values(layouts, "parallel.pp")
        assert len({s.axes["dp"] for s in layouts}) >= 3
        assert len(_values(layouts, "train.gradient_accumulation_steps")) >= 3
        assert _values(layouts, "train.micro_batch_size") == {"1", "2", "4"}
    for layouts in (small, large):  # the newer axes (_extend), drawn beside the first ones
        assert _values(layouts, "parallel.cp") == {"2"}
        assert _values(layouts, "model.num_experts") == {"4", "8"}
        assert _values(layouts, "model.reset_attention_mask") == {"True"}
    assert _values(small, "parallel.ep") and _values(large, "train.fp8") == {"tensorwise", "rowwise"}
    assert len(_values(large, "parallel.dp_shard")) >= 2  # small layouts rarely have dp >= 4 to split
    assert _values(small, "train.precision") == set(PRECISIONS)
    assert len(_values(small, "model.num_query_groups")) >= 3  # GQA, MQA (1) and plain heads
    assert len(_values(small, "model.hidden_size")) == 4 and len(_values(small, "model.seq_length")) == 4


def test_the_newer_axes_leave_a_seeds_earlier_draws_as_they_were() -> None:
    """The layouts recorded before cp, HSDP, MoE, document masking and FP8 were drawn (seed 41's in
    benchmarks/results/layout_oracles-*.md) keep every axis they had: the new ones come beside them."""
    small = draw_valid_layout("small", 41, 10)
    recorded = [
        "model.num_layers=4",
        "model.hidden_size=128",
        "model.num_attention_heads=8",
        "model.seq_length=64",
        "parallel.tp=1",
        "parallel.pp=1",
        "parallel.zero_stage=1",
        "parallel.activation_checkpointing=selective",
        "train.micro_batch_size=1",
        "train.gradient_accumulation_steps=3",
        "train.precision=fp32",
    ]
    assert (small.base, small.world_size) == ("tiny-gpt", 3)
    assert list(small.overrides[: len(recorded)]) == recorded


def test_refused_draws_are_counted_and_redrawn(small: list) -> None:
    """Some draws are refused (e.g. ZeRO-1 with tp and dp > 1): the sampler redraws and counts them."""
    assert sum(s.rejections for s in small) > 0


def test_an_unknown_scale_is_refused_naming_the_valid_ones() -> None:
    with pytest.raises(ConfigError, match="small, large"):
        sample_layouts("huge", 1, seed=1)
