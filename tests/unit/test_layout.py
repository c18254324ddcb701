"""Layout checks: every bad layout fails in resolve(), i.e. before any process group exists."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from scalable_transformer.config.load import ConfigError, load_config
from scalable_transformer.config.validate import resolve
from scalable_transformer.parallel.dims import ParallelDims, stage_layer_counts

TINY = ["model.num_layers=4", "model.hidden_size=64", "model.num_attention_heads=4", "model.vocab_size=1024"]


def layout(world: int, *overrides: str):
    return resolve(load_config("tiny-gpt", [*TINY, *overrides]), world_size=world)


def test_dp_is_inferred_and_batch_sizes_follow():
    cfg = layout(
        8,
        "parallel.tp=2",
        "parallel.pp=2",
        "parallel.zero_stage=3",
        "train.micro_batch_size=2",
        "train.global_batch_size=16",
    )
    assert (cfg.parallel.dp, cfg.train.gradient_accumulation_steps) == (2, 4)
    dims = ParallelDims.from_config(cfg)
    assert dims.world_size == 8
    # Megatron order: tp fastest, then dp, then pp
    assert dims.coordinates(0) == {"pp": 0, "dp": 0, "cp": 0, "tp": 0}
    assert dims.coordinates(1) == {"pp": 0, "dp": 0, "cp": 0, "tp": 1}
    assert dims.coordinates(2) == {"pp": 0, "dp": 1, "cp": 0, "tp": 0}
    assert dims.coordinates(5) == {"pp": 1, "dp": 0, "cp": 0, "tp": 1}


def test_megatron_and_neox_layout_names():
    cfg = load_config(None, ["tensor-model-parallel-size=2", "pipeline-model-parallel-size=4"])
    assert (cfg.parallel.tp, cfg.parallel.pp) == (2, 4)
    cfg = load_config(None, ["model-parallel-size=2", "pipe-parallel-size=2"])
    assert (cfg.parallel.tp, cfg.parallel.pp) == (2, 2)


def test_deepspeed_zero_block_with_offload(tmp_path):
    path = tmp_path / "ds.yaml"
    path.write_text(
        "zero_optimization:\n  stage: 3\n  offload_param: {device: cpu}\n  offload_optimizer: {device: cpu}\n"
    )
    p = load_config(str(path)).parallel
    assert (p.zero_stage, p.offload_param, p.offload_optimizer) == (3, True, True)
    path.write_text("zero_optimization:\n  stage: 3\n  offload_param: {device: nvme}\n")
    with pytest.raises(ConfigError, match=r"offload_param.device' = 'nvme'.*'cpu'"):
        load_config(str(path))


@pytest.mark.parametrize(
    "world, overrides, message",
    [
        (
            2,
            ["parallel.dp=4"],
            r"dp \(4\) x cp \(1\) x tp \(1\) x pp \(1\) = 4 must equal the world size \(2",
        ),
        (
            3,
            ["parallel.tp=2"],
            r"world size \(3 processes\) is not divisible by parallel.cp \(1\) x parallel.tp \(2\)",
        ),
        (2, ["parallel.tp=2", "model.num_attention_heads=1"], r"num_attention_heads \(1\) is not divisible"),
        (
            4,
            ["parallel.tp=4", "model.num_attention_heads=4", "model.ffn_hidden_size=66"],
            r"ffn_hidden_size \(66\)",
        ),
        (
            2,
            ["parallel.tp=2", "model.vocab_size=1001", "model.make_vocab_size_divisible_by=1"],
            r"padded vocabulary \(1001.*make_vocab_size_divisible_by to a multiple of 2",
        ),
        (
            2,
            ["parallel.tp=2", "parallel.sequence_parallel=true", "model.seq_length=33"],
            r"seq_length \(33\)",
        ),
        (1, ["parallel.sequence_parallel=true"], r"sequence_parallel needs parallel.tp > 1"),
        (
            2,
            ["parallel.pp=2", "model.num_layers=3"],
            r"num_layers \(3\) is not divisible by the 2 pipeline stages",
        ),
        (2, ["parallel.pp=2", "parallel.pipeline_layers=1,2"], r"must add up to model.num_layers \(4\)"),
        (2, ["parallel.pp=2", "parallel.pipeline_layers=4"], r"names 1 stages; the layout has .* = 2"),
        (
            2,
            ["parallel.pp=2", "parallel.pipeline_schedule=interleaved-1f1b"],
            r"virtual_pipeline_stages >= 2",
        ),
        (2, ["parallel.pp=2", "parallel.virtual_pipeline_stages=2"], r"needs an interleaved schedule"),
        (
            2,
            [
                "parallel.pp=2",
                "parallel.pipeline_schedule=interleaved-1f1b",
                "parallel.virtual_pipeline_stages=2",
                "train.micro_batch_size=1",
                "train.global_batch_size=3",
            ],
            r"gradient_accumulation_steps = 3\) must be a multiple of parallel.pp \(2\)",
        ),
        (1, ["parallel.virtual_pipeline_stages=2"], r"need pipeline parallelism"),
        (
            2,
            ["parallel.pp=2", "train.micro_batch_size=8", "train.global_batch_size=8"],
            r"1f1b needs at least as many micro-batches per step as pipeline stages \(2\)",
        ),
        (
            2,
            ["train.micro_batch_size=3", "train.global_batch_size=8"],
            r"global_batch_size \(8\) must be divisible",
        ),
        (1, ["parallel.zero_stage=4"], r"zero_stage must be 0, 1, 2 or 3"),
        (
            1,
            ["parallel.offload_param=true", "parallel.zero_stage=2"],
            r"offload_param needs parallel.zero_stage = 3",
        ),
        (
            1,
            ["parallel.offload_optimizer=true", "parallel.zero_stage=1"],
            r"offload_optimizer needs .* 2 or 3",
        ),
        (
            4,
            ["parallel.tp=2", "parallel.zero_stage=1"],
            r"ZeroRedundancyOptimizer cannot shard tensor-parallel",
        ),
        (4, ["parallel.pp=2", "parallel.zero_stage=1"], r"zero_stage = 1 with pipeline parallel"),
        (1, ["parallel.timeout_minutes=0"], r"'parallel.timeout_minutes' must be > 0"),
    ],
)
def test_bad_layouts_name_the_keys(world, overrides, message):
    with pytest.raises(ConfigError, match=message):
        layout(world, *overrides)


def test_explicit_and_even_stage_splits():
    assert stage_layer_counts(8, 4, None) == [2, 2, 2, 2]
    assert stage_layer_counts(8, 2, "3,5") == [3, 5]
    with pytest.raises(ConfigError, match="comma-separated integers"):
        stage_layer_counts(8, 2, "3;5")
    with pytest.raises(ConfigError, match=">= 1 layer"):
        stage_layer_counts(8, 2, "0,8")


@pytest.mark.slow
def test_bad_layout_fails_before_the_process_group(tmp_path):
    """Under a launcher's environment (WORLD_SIZE=2, no rendezvous reachable), a bad layout exits 2
    with the message at once: a process group init would instead wait for the missing peer."""
    env = {
        **os.environ,
        "RANK": "0",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "1",  # nothing listens there: any rendezvous attempt would fail or hang
    }
    result = subprocess.run(
        [sys.executable, "-m", "scalable_transformer.cli", "train", "tiny-gpt", "parallel.tp=2",
         "model.num_attention_heads=3", "model.hidden_size=96", f"logging.run_dir={tmp_path}"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "num_attention_heads (3) is not divisible by parallel.tp (2)" in result.stderr
    assert not any(tmp_path.iterdir())  # nothing was written
