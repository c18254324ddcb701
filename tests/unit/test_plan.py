"""The planner (issue 13): the published formulas it reproduces, its parameter counts against the
built model, the 175B BERT verdicts, the search, --json, the emitted sweep and the torch-free path."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from scalable_transformer.bench.sweep_expand import expand
from scalable_transformer.bench.sweep_spec import load_sweep
from scalable_transformer.cli import main
from scalable_transformer.config.load import load_config
from scalable_transformer.config.model_shapes import stage_params, total_params
from scalable_transformer.config.validate import resolve
from scalable_transformer.errors import ConfigError
from scalable_transformer.plan.cluster import load_cluster, table_cluster
from scalable_transformer.plan.memory_model import (
    ActivationModel,
    inflight_microbatches,
    korthikanti,
    layer_activation_bytes,
    zero_paper_model_states,
)
from scalable_transformer.plan.search import plan_config, search_layouts

LAYOUT_KEYS = [
    "tp",
    "pp",
    "dp",
    "zero_stage",
    "offload_optimizer",
    "offload_param",
    "micro_batch_size",
    "gradient_accumulation_steps",
    "activation_checkpointing",
    "pipeline_schedule",
    "virtual_pipeline_stages",
]


@pytest.mark.parametrize("stage, want_gb", [(0, 120), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_paper_figure_1(stage: int, want_gb: float) -> None:
    """Rajbhandari et al. 2019, Figure 1: Psi = 7.5B, K = 12, Nd = 64."""
    got = zero_paper_model_states(7.5e9, 12, 64, stage) / 1e9
    assert round(got, 1) == want_gb


def test_korthikanti_per_layer_formulas() -> None:
    """Korthikanti et al. 2022, section 4: bytes per layer for 16-bit activations."""
    s, b, h, a, t = 2048, 4, 12288, 96, 8
    sbh = s * b * h
    assert korthikanti(b, s, h, a) == pytest.approx(sbh * (34 + 5 * a * s / h))
    assert korthikanti(b, s, h, a, t=t) == pytest.approx(sbh * (10 + 24 / t + 5 * a * s / (h * t)))
    assert korthikanti(b, s, h, a, t=t, sp=True) == pytest.approx(sbh / t * (34 + 5 * a * s / h))
    assert korthikanti(b, s, h, a, t=t, sp=True, selective=True) == pytest.approx(sbh * 34 / t)
    paper = ActivationModel(2, 1, flash=False)
    full = layer_activation_bytes(b, s, h, a, 4 * h, t, True, "full", paper)
    assert full == pytest.approx(2 * sbh / t)  # the layer input only, sequence-sharded


def test_engine_terms_found_by_the_cuda_dry_runs() -> None:
    """What the dry runs at scale showed the engine keeps (docs/PLANNER.md, "Memory per device")."""
    from scalable_transformer.plan.memory_model import activation_model, largest_param_group, stage_memory

    def cfg_of(overrides: list[str], world: int):
        return resolve(load_config("gpt-13b", overrides), world)

    # bf16 autocast, fp32 parameters: the norm inputs and the residual stream are fp32; SP shards them
    tp = cfg_of(["parallel.tp=4", "parallel.sequence_parallel=true"], 8)
    am = activation_model(tp, "cuda")
    assert (am.norm_input_bytes, am.residual_bytes) == (4, 4)
    # FSDP2's bf16 param_dtype makes the stream bf16 (the norms still save an fp32 copy)
    z3 = activation_model(cfg_of(["parallel.zero_stage=3"], 8), "cuda")
    assert (z3.norm_input_bytes, z3.residual_bytes) == (4, 2)
    # ZeRO-0 with tp > 1 and dp > 1 (FSDP2's replicate): an unsharded fp32 copy of the parameters
    rep = cfg_of(["parallel.tp=8", "train.micro_batch_size=1", "train.global_batch_size=8"], 64)
    st = stage_memory(rep, 0, "cuda", 0)
    P = stage_params(rep.model, 8, 1, 0).total
    assert st.breakdown["gathered_parameters"] == 4 * P
    # foreach AdamW's sqrt, one group at a time: with TP one weight kind (gpt-13b: the up projections)
    m = rep.model
    assert largest_param_group(rep, stage_params(m, 8, 1, 0)) == 40 * m.hidden_size * m.ffn_hidden_size // 8


def test_inflight_microbatches_follow_the_schedules() -> None:
    assert inflight_microbatches("gpipe", 4, 1, 8, 0) == 8
    assert [inflight_microbatches("1f1b", 4, 1, 8, r) for r in range(4)] == [4, 3, 2, 1]
    assert inflight_microbatches("1f1b", 4, 1, 2, 0) == 2
    # ScheduleInterleaved1F1B warm-up on rank 0 of pp=2, v=2: (2-1)*2 + (2-1)*2 = 4 chunks, + 1
    assert inflight_microbatches("interleaved-1f1b", 2, 2, 8, 0) == pytest.approx(5 / 2)


def _torch_schedule_peak(schedule: str, pp: int, v: int, m: int, rank: int) -> int:
    """The most chunks whose activations `rank` holds at once in torch's own action list for the schedule
    (torch.distributed.pipelining.schedules): a forward adds one, the pass that lets its graph go (the
    full backward; zero-bubble's weight pass, as its input pass keeps the graph) removes one."""
    from torch.distributed.pipelining import schedules as ts  # torch in the oracle only: plan/ is torch-free

    kind = {"interleaved-1f1b": ts.ScheduleInterleaved1F1B, "zero-bubble": ts.ScheduleInterleavedZeroBubble}
    sched = object.__new__(kind[schedule])  # the action list needs no process group or stage
    sched.n_local_stages, sched.pp_group_size, sched._n_microbatches, sched.rank = v, pp, m, rank
    sched.number_of_rounds = max(1, m // pp)
    sched.microbatches_per_round = m // sched.number_of_rounds
    frees = (
        ts._ComputationType.BACKWARD_WEIGHT
        if schedule == "zero-bubble"
        else ts._ComputationType.FULL_BACKWARD
    )
    live = peak = 0
    for action in sched._calculate_single_rank_operations(rank):
        if action is not None:
            kind_ = action.computation_type
            live += (kind_ == ts._ComputationType.FORWARD) - (kind_ == frees)
            peak = max(peak, live)
    return peak


@pytest.mark.parametrize("schedule", ["interleaved-1f1b", "zero-bubble"])
@pytest.mark.parametrize(("pp", "v"), [(2, 2), (4, 2), (4, 3), (8, 2), (8, 4)])
def test_interleaved_inflight_chunks_are_torchs_own_schedules(schedule, pp, v):
    for m in (pp, 2 * pp, 3 * pp):
        for rank in range(pp):
            chunks = inflight_microbatches(schedule, pp, v, m, rank) * v
            assert chunks == _torch_schedule_peak(schedule, pp, v, m, rank), (m, rank)


@pytest.mark.parametrize(
    "base, overrides",
    [
        ("tiny-bert", ["model.vocab_size=1000"]),
        ("tiny-bert", ["model.vocab_size=1000", "model.bert_binary_head=true", "model.norm=rmsnorm"]),
        ("tiny-gpt", ["model.vocab_size=1000", "model.activation=geglu", "model.tie_word_embeddings=false"]),
        ("tiny-gpt", ["model.vocab_size=1000", "model.position_embedding_type=rotary"]),
    ],
)
def test_parameter_counts_match_the_built_model(base: str, overrides: list[str]) -> None:
    from scalable_transformer.models import count_parameters

    cfg = resolve(load_config(base, overrides))
    assert total_params(cfg.model) == count_parameters(cfg.model)
    # two pipeline stages hold everything once, plus the tied word-embedding copy on the last
    stages = [stage_params(cfg.model, 1, 2, r) for r in range(2)]
    tied = cfg.model.tie_word_embeddings
    copy = 1024 * cfg.model.hidden_size if tied else 0  # 1000 padded to 1024
    assert sum(st.total for st in stages) == total_params(cfg.model) + copy


def test_tensor_parallel_shards_match_the_sharded_model() -> None:
    """Per-rank block parameters under tp=2: the DTensor plan's local shapes (parallel/tensor.py)."""
    cfg = resolve(load_config("tiny-gpt", ["model.vocab_size=1000", "parallel.tp=2"]), world_size=2)
    h, f = cfg.model.hidden_size, cfg.model.ffn_hidden_size
    local = (3 * h * h + 3 * h) // 2 + h * h // 2 + h + (h * f + f) // 2 + f * h // 2 + h + 4 * h
    assert stage_params(cfg.model, 2, 1, 0).block == local


@pytest.mark.parametrize("tp", [16, 32])
def test_bert_175b_zero0_tp16_and_tp32_say_oom_and_why(tp: int) -> None:
    cfg = load_config("bert-175b", [f"parallel.tp={tp}", "parallel.zero_stage=0"])
    result = plan_config(cfg, table_cluster("a100-40gb", 8, 8))
    assert not result.fits
    assert result.reason is not None and "OOM" in result.reason
    assert "optimizer state" in result.reason and "> 40.00 GiB a100-40gb" in result.reason
    assert result.peak_memory_bytes > 40 * 2**30


@pytest.mark.slow
def test_search_on_64_a100_40gb_finds_bert_175b_layouts_that_fit() -> None:
    results = search_layouts(load_config("bert-175b"), table_cluster("a100-40gb", 8, 8))
    fit = [r for r in results if r.fits]
    assert fit and len(fit) < len(results)
    assert all(r.peak_memory_bytes <= 40 * 2**30 for r in fit)
    speeds = [r.samples_per_second for r in fit]
    assert speeds == sorted(speeds, reverse=True)
    assert all(r.layout.world_size == 64 and r.layout.global_batch_size == 512 for r in results)
    assert not any(r.fits for r in results[len(fit) :])


def test_json_is_one_object_with_the_issue_shape(capsys) -> None:
    assert main(["plan", "gpt-13b", "--world-size", "8", "--device", "a100-80gb", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert list(data) == ["layouts"] and len(data["layouts"]) == 1
    layout = data["layouts"][0]
    for key, kind in [
        ("fits", bool),
        ("peak_memory_bytes", int),
        ("memory_breakdown_bytes", dict),
        ("step_seconds", float),
        ("samples_per_second", float),
        ("mfu", float),
        ("time_breakdown_seconds", dict),
    ]:
        assert isinstance(layout[key], kind), key
    assert list(layout["layout"]) == LAYOUT_KEYS
    assert layout["reason"] is None or isinstance(layout["reason"], str)
    assert layout["host_memory_bytes"] is None
    assert sum(layout["memory_breakdown_bytes"].values()) == layout["peak_memory_bytes"]


def test_human_output_names_units_convention_and_peak(capsys) -> None:
    assert main(["plan", "bert-175b", "parallel.tp=16", "--nodes", "8", "--gpus-per-node", "8",
                 "--device", "a100-40gb"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "DOES NOT FIT: OOM" in out and "GiB" in out and " ms" in out
    assert "samples/s" in out and "tokens/s" in out and "TFLOP/s per device" in out
    assert "megatron convention" in out and "peak 312.0 TFLOP/s fp16" in out


@pytest.mark.slow
def test_emitted_sweep_is_read_by_stx_sweep(tmp_path: Path, capsys) -> None:
    sweep = tmp_path / "plan-sweep.yaml"
    argv = ["plan", "bert-175b", "--nodes", "8", "--gpus-per-node", "8", "--device", "a100-40gb"]
    assert main([*argv, "--search", "--top", "3", "--emit-sweep", str(sweep)]) == 0
    assert "sweep file" in capsys.readouterr().out
    spec = load_sweep(sweep)
    members, filtered = expand(spec)
    assert filtered == 0 and len(members) == 4  # the best 3 that fit + 1 over the boundary
    assert all(m.invalid_reason is None and m.nproc == 64 for m in members)
    assert {m.cfg.parallel.tp for m in members if m.cfg} <= {1, 2, 4, 8, 16, 32, 64}


@pytest.mark.slow
def test_stx_plan_imports_no_torch_for_gpus() -> None:
    code = (
        "import sys\n"
        "from scalable_transformer.cli import main\n"
        "assert main(['plan', 'gpt-13b', '--world-size', '8', '--device', 'a100-80gb', '--json']) == 0\n"
        "assert main(['plan', 'bert-175b', '--world-size', '64', '--device', 'a100-40gb', '--search',"
        " '--top', '2']) == 0\n"
        "bad = [m for m in sys.modules if m == 'torch' or m.startswith('scalable_transformer.models')]\n"
        "assert not bad, bad\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr


THETAGPU = textwrap.dedent(
    """\
    name: thetagpu
    device: a100-40gb
    nodes: 8
    devices_per_node: 8
    intra_node_gbps: 300
    inter_node_gbps: 25
    host_memory_gb: 1024
    """
)


def test_cluster_yaml_thetagpu(tmp_path: Path) -> None:
    path = tmp_path / "thetagpu.yaml"
    path.write_text(THETAGPU)
    cluster = load_cluster(path)
    assert cluster.world_size == 64 and cluster.host_memory_bytes == 1024 * 2**30
    assert cluster.device.memory_bytes == 40 * 2**30 and cluster.peak("bf16") == 312e12
    cfg = load_config("bert-175b", ["parallel.zero_stage=3", "parallel.offload_optimizer=true"])
    result = plan_config(cfg, cluster)
    assert result.host_memory_bytes is not None and result.host_memory_bytes > 0
    path.write_text(THETAGPU + "nics: 8\n")
    with pytest.raises(ConfigError, match=r"unknown key.*nics"):
        load_cluster(path)


def test_unknown_device_names_the_valid_ones() -> None:
    with pytest.raises(ConfigError, match="a100-40gb"):
        table_cluster("a100-41gb", 1)


def test_sweep_members_and_axes_are_exclusive(tmp_path: Path) -> None:
    from scalable_transformer.errors import SweepError

    sweep = tmp_path / "s.yaml"
    sweep.write_text("base: tiny-gpt\nmembers: [{nproc: 1}]\naxes: {nproc: [1]}\n")
    with pytest.raises(SweepError, match="either axes"):
        load_sweep(sweep)
    sweep.write_text("base: tiny-gpt\nmembers: [3]\n")
    with pytest.raises(SweepError, match=r"members\[0\]"):
        load_sweep(sweep)


@pytest.mark.slow
def test_world_size_spans_whole_nodes_and_search_json_lists_top_fit_and_oom(capsys) -> None:
    argv = ["plan", "bert-175b", "--world-size", "64", "--device", "a100-40gb", "--search", "--top", "2"]
    assert main(argv) == 0
    assert capsys.readouterr().out.startswith("cluster: 8 x 8 a100-40gb")
    assert main([*argv, "--json"]) == 0
    layouts = json.loads(capsys.readouterr().out)["layouts"]
    assert [x["fits"] for x in layouts] == [True, True, False, False]
    assert main(["plan", "bert-175b", "--world-size", "12", "--device", "a100-40gb"]) == 2
    assert "--nodes K --gpus-per-node G" in capsys.readouterr().err
