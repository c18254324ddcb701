"""Issue 21's memory options: their config keys (Megatron, NeoX and DeepSpeed spellings), the layouts
they refuse, and what the planner charges for them in memory and time."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from scalable_transformer.config.load import ConfigError, load_config
from scalable_transformer.config.validate import resolve
from scalable_transformer.plan.cluster import table_cluster
from scalable_transformer.plan.search import predict, prepare, search_layouts


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return str(path)


def test_megatron_neox_and_deepspeed_names(tmp_path):
    p = load_config(None, ["distribute-checkpointed-activations=true", "checkpoint_in_cpu=true"]).parallel
    assert p.distribute_saved_activations and p.cpu_checkpointing
    assert load_config(None, ["partition_activations=true"]).parallel.distribute_saved_activations
    # DeepSpeed's block in a config file; a flat activation_checkpointing is still the recompute mode
    path = write(
        tmp_path,
        """
activation_checkpointing:
  partition_activations: true
  cpu_checkpointing: true
  contiguous_memory_optimization: false
parallel: {activation_checkpointing: full}
""",
    )
    p = load_config(path).parallel
    assert (p.distribute_saved_activations, p.cpu_checkpointing, p.activation_checkpointing) == (
        True,
        True,
        "full",
    )
    assert load_config(None, ["activation_checkpointing=selective"]).parallel.activation_checkpointing == (
        "selective"
    )


@pytest.mark.parametrize("stage, reduce_each", [(1, False), (2, True), (3, True)])
def test_a_deepspeed_zero_block_partitions_gradients_every_micro_batch(tmp_path, stage, reduce_each):
    path = write(tmp_path, f"zero_optimization: {{stage: {stage}}}\n")
    assert load_config(path).parallel.reduce_each_micro_batch is reduce_each


@pytest.mark.parametrize(
    "overrides, names",
    [
        (["parallel.distribute_saved_activations=true"], ["distribute_saved_activations", "full"]),
        (
            ["parallel.cpu_checkpointing=true", "parallel.activation_checkpointing=selective"],
            ["cpu_checkpointing", "full", "'selective'"],
        ),
        (
            [
                "parallel.tp=2",
                "parallel.sequence_parallel=true",
                "parallel.activation_checkpointing=full",
                "parallel.distribute_saved_activations=true",
            ],
            ["distribute_saved_activations", "sequence_parallel", "set one"],
        ),
        (["parallel.reduce_each_micro_batch=true", "parallel.zero_stage=1"], ["zero_stage 2 or 3", "got 1"]),
        (
            ["parallel.reduce_each_micro_batch=true", "parallel.zero_stage=3", "parallel.pp=2"],
            ["reduce_each_micro_batch", "parallel.pp", "= false"],
        ),
    ],
)
def test_what_does_not_compose_is_a_config_error_naming_the_keys(overrides, names):
    with pytest.raises(ConfigError) as e:
        resolve(
            load_config("tiny-gpt", ["train.micro_batch_size=2", "train.global_batch_size=16", *overrides]), 4
        )
    for name in names:
        assert name in str(e.value)


def _predict(overrides: list[str], world: int = 64, device: str = "a100-40gb"):
    cluster = table_cluster(device, world // 8, 8)
    return predict(prepare(load_config("bert-175b", overrides), world), cluster)


SEEDS = [  # the seeds' 175B layout that DeepSpeed fitted on 64 A100-40GB (issue 21)
    "parallel.tp=16",
    "parallel.zero_stage=3",
    "parallel.offload_param=true",
    "parallel.offload_optimizer=true",
    "parallel.activation_checkpointing=full",
    "train.micro_batch_size=32",
    "train.global_batch_size=128",
]


def test_distributed_and_host_kept_checkpoints_in_the_planner():
    whole = _predict(SEEDS)
    distributed = _predict([*SEEDS, "parallel.distribute_saved_activations=true"])
    host = _predict([*SEEDS, "parallel.cpu_checkpointing=true"])
    act = [r.peak_stage.breakdown.get("activations", 0) for r in (whole, distributed, host)]
    # 96 layers x [32, 512, 12288] inputs per GPU (fp16: FSDP2's param_dtype), then 1/16 of them, then
    # none on the device
    inputs = 96 * 32 * 512 * 12288 * 2
    assert act[0] == pytest.approx(inputs, rel=0.02)
    assert act[0] - act[1] == pytest.approx(inputs * 15 / 16, rel=0.001)
    assert act[0] - act[2] == pytest.approx(inputs, rel=0.001)
    assert host.host_memory_bytes is not None and whole.host_memory_bytes is not None
    assert host.host_memory_bytes > whole.host_memory_bytes + 8 * act[0] * 0.9  # 8 GPUs per node
    # and each costs time: the all-gathers of the slices; the PCIe copies
    assert distributed.time.breakdown["tp_communication"] > whole.time.breakdown["tp_communication"]
    assert host.time.breakdown["checkpoint_transfers"] > 0
    assert not whole.fits and distributed.fits, (whole.reason, distributed.reason)


def test_reducing_every_micro_batch_in_the_planner():
    layout = ["parallel.zero_stage=3", "train.micro_batch_size=1", "train.global_batch_size=64"]
    once = _predict(["model.num_layers=8", *layout], world=8, device="a100-80gb")
    each = _predict(["model.num_layers=8", *layout, "parallel.reduce_each_micro_batch=true"], 8, "a100-80gb")
    grads_once, grads_each = (r.peak_stage.breakdown.get("gradients", 0) for r in (once, each))
    # unsharded fp32 gradients accumulated on every rank, or fp32 shards of them
    assert grads_each == pytest.approx(grads_once / 8, rel=0.01)
    assert each.time.breakdown["dp_communication"] > once.time.breakdown["dp_communication"]


def test_search_tries_each_option_where_it_changes_something():
    cfg = load_config("gpt-13b", ["train.global_batch_size=64"])
    results = search_layouts(cfg, table_cluster("a100-40gb", 1, 8))
    layouts = [r.layout for r in results]
    assert any(lay.reduce_each_micro_batch for lay in layouts)
    assert any(lay.distribute_saved_activations for lay in layouts)
    assert any(lay.cpu_checkpointing for lay in layouts)
    for lay in layouts:
        if lay.reduce_each_micro_batch:
            assert lay.zero_stage >= 2 and lay.gradient_accumulation_steps > 1 and lay.pp == 1
        if lay.distribute_saved_activations:
            assert lay.activation_checkpointing == "full" and lay.tp > 1 and not lay.sequence_parallel
    twins = {dataclasses.replace(lay, cpu_checkpointing=False) for lay in layouts if lay.cpu_checkpointing}
    assert twins <= set(layouts)
    # --json prints the options beside the fixed "layout" object
    d = results[0].to_dict()
    assert {"reduce_each_micro_batch", "distribute_saved_activations", "cpu_checkpointing"} <= set(d)
    assert "reduce_each_micro_batch" not in d["layout"]
