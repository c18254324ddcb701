"""`stx calibrate` in one process: the shapes it measures, the profile it writes (contract of
plan/hardware_profile.py), how `stx plan --hardware` takes that profile, and bad profiles.
The multi-process runs (gloo collectives, a failing rank) are in tests/e2e/test_calibrate_e2e.py."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import yaml

from scalable_transformer.calibrate import calibration, kernels, layer_factor, parallel_overheads, timing
from scalable_transformer.calibrate.this_machine import fingerprint_here
from scalable_transformer.cli import main
from scalable_transformer.config.load import load_config
from scalable_transformer.errors import ConfigError, UsageError
from scalable_transformer.plan.hardware_profile import (
    ATTENTION_KERNELS,
    load_profile,
    profile_from_dict,
    profile_mismatch,
    save_profile,
)

# a model small enough that every quick section finishes in well under its budget
TINY = ["model.num_layers=1", "model.hidden_size=64", "model.num_attention_heads=2", "model.seq_length=32",
        "train.micro_batch_size=2", "model.vocab_size=512"]  # fmt: skip


@pytest.fixture(scope="module")
def measured() -> dict:
    """One quick calibration of the tiny model in this process (no process group)."""
    cfg = load_config("tiny-gpt", TINY)
    job = timing.Job(torch.device("cpu"), quick=True, hosts=["this-host"])
    lines: list[str] = []
    with pytest.MonkeyPatch.context() as mp:
        # budgets no busy machine runs out of: every point is measured (their tiny shapes stop at
        # MAX_REPEATS calls each, long before); what a spent budget does is tested on its own
        mp.setattr(timing, "QUICK_BUDGET_SECONDS", dict.fromkeys(timing.SECTIONS, 600.0))
        mapping = calibration.calibrate(cfg, job, lines.append)
    mapping["_lines"] = lines
    return mapping


def test_a_section_whose_budget_is_spent_measures_its_first_point_and_says_what_it_skipped(monkeypatch):
    monkeypatch.setattr(timing, "QUICK_BUDGET_SECONDS", dict.fromkeys(timing.SECTIONS, 0.0))
    lines: list[str] = []
    shapes = [(8, 8, 8), (16, 16, 16), (32, 32, 32)]
    points = kernels.measure_gemm(timing.Job(torch.device("cpu"), quick=True), shapes, "fp32", lines.append)
    assert [(p["m"], p["n"], p["k"]) for p in points] == [(8, 8, 8)]
    assert lines[0].startswith("calibrate: gemm: 1 shapes, best ")
    assert lines[0].endswith("(budget 0 s); 2 point(s) skipped: budget spent")


def test_gemm_shapes_are_the_layer_gemms_at_tp_1_and_2_with_their_backward_gemms():
    cfg = load_config("tiny-gpt", TINY)
    shapes = kernels.gemm_shapes(cfg)
    rows, h, f, v = 2 * 32, 64, 256, 512  # b s, hidden, 4 h, the vocabulary padded to 128
    for tp in (1, 2):
        for m, n, k in [(rows, 3 * h // tp, h), (rows, h, h // tp), (rows, f // tp, h), (rows, h, f // tp),
                        (rows, v // tp, h)]:  # fmt: skip
            assert (m, n, k) in shapes  # forward
            assert (m, k, n) in shapes  # grad-input
            assert (n, k, m) in shapes  # grad-weight
    assert (rows // 4, f, h) in shapes and (2 * rows, f, h) in shapes  # around the rows, to interpolate
    work = [m * n * k for m, n, k in shapes]
    assert work == sorted(work)  # a section out of budget drops the largest
    assert len(kernels.gemm_shapes(cfg, quick=True)) < len(shapes)


def test_attention_cases_cover_tp_splits_sequence_lengths_and_both_masks():
    cases = kernels.attention_cases(load_config("tiny-gpt", TINY))
    assert {(c["heads"], c["seq_len"], c["causal"]) for c in cases} == {
        (n, s, causal) for n in (2, 1) for s in (16, 32, 64) for causal in (True, False)
    }
    assert {c["batch"] for c in cases} == {2} and {c["head_dim"] for c in cases} == {32}
    assert kernels.attention_flops({**cases[0], "causal": False}) == 2 * kernels.attention_flops(
        {**cases[0], "causal": True}
    )


def test_a_quick_calibration_gives_every_section_in_the_contract_shape(measured):
    assert measured["format"] == 1 and measured["kind"] == "cpu"
    assert measured["source"].startswith("measured by stx calibrate ")
    fp = measured["fingerprint"]
    assert fp["processes"] == 1 and fp["threads_per_process"] == torch.get_num_threads()
    assert fp["hostname"] == "this-host" and fp["torch"] == str(torch.__version__)
    assert set(measured["peak_tflops"]) == {"fp32"} and measured["peak_tflops"]["fp32"] > 0
    assert measured["gemm"] and all(set(p) == {"dtype", "m", "n", "k", "tflops"} for p in measured["gemm"])
    assert all(p["tflops"] > 0 for p in measured["gemm"])
    kernels = {p["kernel"] for p in measured["attention"]}
    assert "math" in kernels and kernels <= {"flash", "mem_efficient", "math"}  # cudnn: CUDA only
    # tiny-gpt has attention dropout: on a CPU SDPA takes the math path for it
    assert measured["attention_kernel"] == (
        "math" if load_config("tiny-gpt", TINY).model.attention_dropout else "flash"
    )
    assert {p["pass"] for p in measured["attention"]} == {"fwd", "bwd"}
    assert {p["causal"] for p in measured["attention"]} == {True, False}
    assert measured["memory_bound"]["bandwidth_gbps"] > 0 and measured["memory_bound"]["op_overhead_us"] > 0
    assert measured["memory_bound"]["activation_gbps"] > 0  # a CPU: the model's own elementwise ops
    assert set(measured["layer_factors"]) == {"layer", "head"}  # and its own layer and head
    assert all(x > 0 for x in measured["layer_factors"].values())
    assert measured["collectives"] == []  # one process: nothing to measure
    assert set(measured["corrections"].values()) == {1.0} and measured["corrections_source"] is None
    lines = measured["_lines"]
    for section in ("gemm", "attention", "memory_bound", "model_layer", "collectives"):
        assert any(line.startswith(f"calibrate: {section}: ") for line in lines), lines
    assert lines[-1].startswith("calibrate: all sections in ") and lines[-1].endswith(" s")


def _profile_file(mapping: dict, path: Path) -> Path:
    data = {k: v for k, v in mapping.items() if not k.startswith("_")}
    save_profile(profile_from_dict(data, str(path)), path)
    return path


def test_the_profile_round_trips_through_load_profile(measured, tmp_path):
    path = _profile_file(measured, tmp_path / "p.yaml")
    loaded = load_profile(path)
    assert loaded == profile_from_dict({k: v for k, v in measured.items() if not k.startswith("_")}, "x")
    assert len(loaded.gemm) == len(measured["gemm"]) and len(loaded.attention) == len(measured["attention"])
    save_profile(loaded, tmp_path / "again.yaml")
    assert (tmp_path / "again.yaml").read_text() == path.read_text()
    assert not list(tmp_path.glob(".*.tmp"))  # written atomically: no temporary left


def test_a_profile_from_another_machine_or_torch_names_each_difference(measured):
    data = copy.deepcopy({k: v for k, v in measured.items() if not k.startswith("_")})
    data["fingerprint"].update(cpu_model="Some Other CPU", device_name="Some Other CPU", torch="1.0.0")
    differences = profile_mismatch(profile_from_dict(data, "p.yaml"), fingerprint_here())
    assert any(d.startswith("torch: profile '1.0.0'") for d in differences), differences
    assert any(d.startswith("cpu_model: profile 'Some Other CPU'") for d in differences), differences
    assert not profile_mismatch(
        profile_from_dict({k: v for k, v in measured.items() if k[0] != "_"}, "p"), fingerprint_here()
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d["memory_bound"].pop("bandwidth_gbps"), r"memory_bound\.bandwidth_gbps is required"),
        (
            lambda d: d["memory_bound"].update(activation_gbps=0),
            r"memory_bound\.activation_gbps must be a positive number, got 0",
        ),
        (lambda d: d["gemm"][1].update(tflops=-1), r"gemm\[1\]\.tflops must be a positive number, got -1"),
        (lambda d: d["layer_factors"].update(layer=0), r"layer_factors\.layer must be a positive number"),
        (lambda d: d["layer_factors"].update(mlp=1.0), r"unknown key layer_factors\.mlp; valid: layer, head"),
        (lambda d: d.update(layer_factors=1.2), r"layer_factors must be a mapping like \{layer: 1\.2"),
        (lambda d: d["attention"][0].update(causal="yes"), r"attention\[0\]\.causal must be true or false"),
        (lambda d: d.update(device_memory_gb="lots"), r"device_memory_gb must be a positive number"),
        (lambda d: d.pop("gemm"), r"gemm must be a non-empty list"),
    ],
)
def test_a_malformed_profile_is_an_error_naming_the_file_and_the_key(measured, tmp_path, change, message):
    data = copy.deepcopy({k: v for k, v in measured.items() if not k.startswith("_")})
    change(data)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ConfigError, match=message) as info:
        load_profile(path)
    assert str(path) in str(info.value)


def test_output_is_checked_before_measuring(tmp_path):
    with pytest.raises(UsageError, match="is a directory"):
        cal_cli().check_output(tmp_path)
    (tmp_path / "file").write_text("")
    with pytest.raises(UsageError, match="cannot create its directory"):
        cal_cli().check_output(tmp_path / "file" / "p.yaml")
    cal_cli().check_output(tmp_path / "new" / "p.yaml")  # a missing directory is made
    assert (tmp_path / "new").is_dir()


def test_an_output_rank0_cannot_write_stops_the_job_before_it_measures(tmp_path):
    (tmp_path / "file").write_text("")
    job = timing.Job(torch.device("cpu"), hosts=["h"])
    with pytest.raises(UsageError, match="cannot create its directory"):
        cal_cli().output_ok(job, tmp_path / "file" / "p.yaml")
    other = timing.Job(torch.device("cpu"), rank=1, hosts=["h"])  # not rank 0: it writes nothing
    cal_cli().output_ok(other, tmp_path / "file" / "p.yaml")


def cal_cli():
    from scalable_transformer.cli import calibrate

    return calibrate


def test_calibrate_is_a_command_with_its_options(capsys):
    from scalable_transformer.cli import build_parser

    args = build_parser().parse_args(["calibrate", "tiny-gpt", "train.precision=bf16", "--quick"])
    opts = cal_cli().CalibrateOptions.from_args(args)
    assert opts == cal_cli().CalibrateOptions(
        "tiny-gpt", ("train.precision=bf16",), Path("hardware-profile.yaml"), True
    )
    with pytest.raises(SystemExit):
        main(["calibrate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--output FILE" in text and "--quick" in text and "stx launch -n N calibrate" in text


def _plan(capsys, *hardware: str) -> dict:
    """`stx plan --json` of the tiny model on one CPU process: its layout, and its stderr as "stderr"."""
    argv = ["plan", "tiny-gpt", *TINY, "--world-size", "1", "--device", "cpu", "--no-probe", "--json"]
    assert main([*argv, *hardware]) == 0
    out = capsys.readouterr()
    return {**json.loads(out.out)["layouts"][0], "stderr": out.err}


def _slower(data: dict, factor: float) -> dict:
    """The same profile with every measured rate `factor` times slower."""
    data = copy.deepcopy(data)
    for point in data["gemm"] + data["attention"]:
        point["tflops"] /= factor
    data["memory_bound"]["bandwidth_gbps"] /= factor
    data["memory_bound"]["activation_gbps"] /= factor
    data["memory_bound"]["op_overhead_us"] *= factor
    data["peak_tflops"] = {k: v / factor for k, v in data["peak_tflops"].items()}
    return data


def test_stx_plan_reads_the_profile_and_a_slower_profile_predicts_a_slower_step(measured, tmp_path, capsys):
    data = {k: v for k, v in measured.items() if not k.startswith("_")}
    path = _profile_file(data, tmp_path / "p.yaml")
    slow = _profile_file(_slower(data, 4.0), tmp_path / "slow.yaml")
    without = _plan(capsys)
    with_profile = _plan(capsys, "--hardware", str(path))
    with_slow = _plan(capsys, "--hardware", str(slow))
    assert with_profile["time_breakdown_seconds"] != without["time_breakdown_seconds"]
    assert with_slow["step_seconds"] > 1.5 * with_profile["step_seconds"]


@pytest.mark.parametrize(
    "layout",
    [
        ["parallel.tp=2", "parallel.dp=2", "parallel.sequence_parallel=true", "parallel.zero_stage=3"],
        ["train.global_batch_size=16", "train.gradient_accumulation_steps=2"],  # dp 2 implied
    ],
)
def test_the_elementwise_point_measures_the_model_whatever_layout_the_config_names(layout):
    """The job's config may name the layout of a bigger job (its dp, tp, batch): the point measures
    the model on one rank at tp 1 and does not fail on the config's own world size."""
    cfg = load_config("tiny-gpt", [*TINY, *layout])
    assert kernels._activation_gbps(timing.Job(torch.device("cpu"), quick=True, hosts=["h"]), cfg, 0.2) > 0


@pytest.mark.parametrize(
    ("model", "layout"),
    [
        ("tiny-gpt", ["parallel.tp=2", "parallel.dp=2", "parallel.activation_checkpointing=full"]),
        ("tiny-bert", []),  # bidirectional, with its padding mask
        ("llama-tiny", []),  # rotary tables, a gated MLP, grouped-query attention
    ],
)
def test_the_model_layer_point_times_the_model_s_own_blocks_whatever_layout_the_config_names(
    measured, model, layout, monkeypatch
):
    monkeypatch.setattr(timing, "QUICK_BUDGET_SECONDS", dict.fromkeys(timing.SECTIONS, 600.0))  # both points
    cfg = load_config(model, [*TINY, *layout])
    data = {k: v for k, v in measured.items() if not k.startswith("_")}
    lines: list[str] = []
    job = timing.Job(torch.device("cpu"), quick=True, hosts=["h"])
    factors = layer_factor.measure_model_layer(job, cfg, data, lines.append)
    assert set(factors) == {"layer", "head"} and all(x > 0 for x in factors.values())
    assert lines[-1].startswith("calibrate: model_layer: the model's own layer ")


def test_the_layers_elementwise_ops_are_planned_at_their_own_rate_and_the_optimizer_at_the_bandwidth(
    measured, tmp_path, capsys
):
    """activation_gbps times the layers' and the loss's memory-bound work, bandwidth_gbps the
    optimizer's: a quarter of the one makes that work 4x longer and leaves the optimizer as it was;
    a profile without it (as GPU profiles are) plans that work at the bandwidth."""
    data = copy.deepcopy({k: v for k, v in measured.items() if not k.startswith("_")})
    bandwidth = data["memory_bound"]["bandwidth_gbps"]
    data["memory_bound"]["activation_gbps"] = bandwidth
    same = _plan(capsys, "--hardware", str(_profile_file(data, tmp_path / "same.yaml")))
    data["memory_bound"]["activation_gbps"] = bandwidth / 4
    slow = _plan(capsys, "--hardware", str(_profile_file(data, tmp_path / "slow.yaml")))
    del data["memory_bound"]["activation_gbps"]
    absent = _plan(capsys, "--hardware", str(_profile_file(data, tmp_path / "absent.yaml")))
    for phase in ("forward", "backward"):
        base = same["time_classes_seconds"][phase]["memory_bound"]
        assert base > 0
        assert slow["time_classes_seconds"][phase]["memory_bound"] == pytest.approx(4 * base)
        assert absent["time_classes_seconds"][phase]["memory_bound"] == pytest.approx(base)
    assert slow["time_classes_seconds"]["optimizer"] == same["time_classes_seconds"]["optimizer"]
    assert slow["step_seconds"] > same["step_seconds"]


def test_stx_plan_warns_naming_each_difference_of_a_profile_from_elsewhere(measured, tmp_path, capsys):
    data = copy.deepcopy({k: v for k, v in measured.items() if not k.startswith("_")})
    data["fingerprint"].update(
        hostname="far-away", cpu_model="Other CPU", device_name="Other CPU", torch="2.0.1"
    )
    path = _profile_file(data, tmp_path / "elsewhere.yaml")
    text = _plan(capsys, "--hardware", str(path))["stderr"]
    assert text.startswith(f"stx: warning: {path}: ")
    assert "torch: profile '2.0.1'" in text and "cpu_model: profile 'Other CPU'" in text
    assert "far-away" not in text  # the host name alone changes no rate
    assert (
        "warning"
        not in _plan(capsys, "--hardware", str(_profile_file(measured, tmp_path / "here.yaml")))["stderr"]
    )


def test_stx_plan_with_a_malformed_profile_exits_2_naming_the_file_and_key(measured, tmp_path, capsys):
    data = copy.deepcopy({k: v for k, v in measured.items() if not k.startswith("_")})
    data["memory_bound"]["op_overhead_us"] = "fast"
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    argv = ["plan", "tiny-gpt", "--world-size", "1", "--device", "cpu", "--no-probe", "--hardware", str(path)]
    assert main(argv) == 2
    assert (
        f"{path}: memory_bound.op_overhead_us must be a non-negative number, got 'fast'"
        in capsys.readouterr().err
    )


def test_stx_submit_writes_a_batch_job_that_calibrates_every_rank(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = ["submit", "--scheduler", "slurm", "--nodes", "2", "--gpus-per-node", "4", "--dry-run"]
    assert main([*argv, "calibrate", "tiny-gpt", "train.precision=bf16", "--output", "p/a.yaml"]) == 0
    script = capsys.readouterr().out
    assert "#SBATCH --nodes=2" in script and "#SBATCH --ntasks-per-node=4" in script
    output = tmp_path / "p" / "a.yaml"  # absolute: the job runs elsewhere
    expected = f"scalable_transformer.cli calibrate tiny-gpt train.precision=bf16 --output {output}"
    assert script.rstrip().endswith(expected)
    assert main([*argv, "--requeue", "calibrate", "tiny-gpt"]) == 2
    assert "--requeue continues a training run" in capsys.readouterr().err


def test_a_gpu_profile_keeps_the_table_peak_of_every_dtype_so_another_dtype_can_be_planned(monkeypatch):
    """An H200 calibrated in bf16 could not plan an fp16 run ('no gemm points for fp16 and no
    peak_tflops pair'): the profile now carries the device table's peak of each dtype beside it."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    job = timing.Job(torch.device("cuda", 0), quick=True, hosts=["gpu-host"])
    peaks = calibration._peak_tflops_by_dtype(job, "bf16", [{"tflops": 790.0}])
    assert peaks["bf16"] == pytest.approx(989.4)  # MFU's convention: the datasheet peak, not the best GEMM
    assert peaks["fp16"] == pytest.approx(989.4) and peaks["fp32"] < peaks["tf32"] < peaks["bf16"]
    cpu = timing.Job(torch.device("cpu"), quick=True, hosts=["this-host"])
    assert calibration._peak_tflops_by_dtype(cpu, "fp32", [{"tflops": 0.5}, {"tflops": 0.7}]) == {"fp32": 0.7}


def test_a_point_is_the_median_of_its_repeats_not_the_fastest(monkeypatch):
    """Each call of the timed function advances a fake clock by its own duration: the warm-up call
    is not counted, and the figure is the median of the rest (a fastest-repeat rule would give 1.0)."""
    durations = iter([50.0, 3.0, 1.0, 2.0, 9.0, 4.0])  # warm-up, then five repeats: median 3.0
    now = [0.0]
    monkeypatch.setattr(timing.time, "perf_counter", lambda: now[0])

    def call() -> None:
        now[0] += next(durations)

    job = timing.Job(torch.device("cpu"))
    assert timing.median_seconds(job, call, seconds=1e9, repeats=5) == 3.0


def test_the_fsdp_unit_cost_is_the_measured_extra_less_the_collectives_bytes_per_collective(measured):
    data = {k: v for k, v in measured.items() if not k.startswith("_")}
    data["collectives"] = [
        {"op": op, "scope": "intra_node", "ranks": 2, "size_bytes": size, "time_us": us, "busbw_gbps": bw}
        for op in ("all_gather", "reduce_scatter")
        for size, us, bw in ((4096, 400.0, 0.005), (2**20, 1000.0, 0.524288))
    ]
    profile = profile_from_dict(data, "synthetic")
    calls = [("all_gather", 2**20)] * 4 + [("reduce_scatter", 2**20)] * 2
    moved = 6 * profile.collective_seconds("all_gather", "intra_node", 2, 2**20)
    assert moved == pytest.approx(6e-3)  # the curve's own 1 MiB point: 1 ms each
    timing = parallel_overheads.FsdpUnitTiming(moved + 6 * 2.5e-3, calls, "intra_node")
    assert parallel_overheads.unit_overhead_us(profile, timing, 2) == pytest.approx(2500.0)
    # noisier than the cost it looks for: no negative cost
    assert (
        parallel_overheads.unit_overhead_us(
            profile, parallel_overheads.FsdpUnitTiming(moved / 2, calls, "intra_node"), 2
        )
        == 0.0
    )
    assert (
        parallel_overheads.unit_overhead_us(
            profile, parallel_overheads.FsdpUnitTiming(1.0, [], "intra_node"), 2
        )
        == 0.0
    )


def test_the_fsdp_unit_point_keeps_a_gpu_models_blocks_small_and_a_small_models_as_they_are():
    rows, h, f = parallel_overheads._unit_dims(load_config("tiny-gpt", TINY))
    assert (rows, h, f) == (2 * 32, 64, 256)
    _, h, f = parallel_overheads._unit_dims(load_config("gpt-13b", []))
    assert 4 * h * h + 2 * h * f <= timing.FSDP_UNIT_MAX_PARAMS and f == pytest.approx(4 * h, abs=1)


def test_the_tp_layer_cost_is_the_measured_extra_less_the_layers_collectives_as_the_planner_counts_them(
    measured,
):
    from scalable_transformer.plan.speed import tp_layer_collectives

    data = {k: v for k, v in measured.items() if not k.startswith("_")}
    data["collectives"] = [
        {"op": op, "scope": "intra_node", "ranks": 2, "size_bytes": size, "time_us": us, "busbw_gbps": bw}
        for op in ("all_reduce", "all_gather", "reduce_scatter")
        for size, us, bw in ((4096, 400.0, 0.005), (2**20, 1000.0, 0.5 * 2**20 / 1e6))
    ]
    profile = profile_from_dict(data, "synthetic")
    # the planner's count: 4 all-reduces per layer; SP: 4 all-gathers (2 re-gathers), 2 reduce-scatters
    assert tp_layer_collectives(False, False) == [("all_reduce", 4)]
    assert tp_layer_collectives(True, False) == [("all_gather", 4), ("reduce_scatter", 2)]
    one = {op: profile.collective_seconds(op, "intra_node", 2, 2**20) for op in ("all_reduce", "all_gather")}
    extra = {"tp": 4 * one["all_reduce"] + 0.003, "sp": 6 * one["all_gather"] + 0.005}
    timing = parallel_overheads.TpLayerTiming(extra, 2, 2**20)
    assert parallel_overheads.tp_layer_overhead_us(profile, timing) == pytest.approx(
        {"tp_layer_overhead_us": 3000.0, "sp_layer_overhead_us": 5000.0}
    )
    assert parallel_overheads.tp_layer_overhead_us(
        profile, parallel_overheads.TpLayerTiming({"tp": 0.0}, 2, 2**20)
    ) == {"tp_layer_overhead_us": 0.0}


@pytest.mark.parametrize(
    ("m", "n", "k", "copies"), [(64, 64, 64, 64), (1024, 1024, 2048, 2), (2048, 2048, 2048, 1)]
)
def test_a_gemm_point_reads_operands_that_are_not_in_cache(monkeypatch, m, n, k, copies):
    """The timed calls rotate through copies of a and b that together take at least COLD_BYTES (a
    training step's GEMMs read weights a whole step of other work evicted), at most MAX_COPIES; a
    pair larger than COLD_BYTES alone would take one."""
    seen: list[tuple[int, int]] = []
    real_mm = torch.mm

    def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        seen.append((a.data_ptr(), b.data_ptr()))
        return real_mm(a, b)

    def calls(job: timing.Job, fn, seconds: float) -> float:
        for _ in range(2 * copies):
            fn()
        return 1.0

    monkeypatch.setattr(kernels.torch, "mm", mm)
    monkeypatch.setattr(kernels, "median_seconds", calls)
    monkeypatch.setattr(kernels, "COLD_BYTES", 32 * 2**20)
    kernels._gemm_seconds(timing.Job(torch.device("cpu")), m, n, k, "fp32", seconds=1.0)
    assert len(set(seen)) == copies and seen[:copies] == seen[copies:]  # every copy, in turn
    pair_bytes = 4 * (m * k + k * n)
    assert copies == min(kernels.MAX_COPIES, -(-32 * 2**20 // pair_bytes))


def test_every_profile_kernel_names_an_sdpa_backend():
    """calibrate.BACKENDS maps each kernel it measures (and reads back from torch._fused_sdp_choice)
    to a member of torch.nn.attention.SDPBackend; a member torch renames fails here, naming it."""
    from torch.nn.attention import SDPBackend

    for kernel, name in kernels.BACKENDS.items():
        assert hasattr(SDPBackend, name), f"torch {torch.__version__} has no SDPBackend.{name} ({kernel})"
        assert kernels._backend(kernel) == getattr(SDPBackend, name)
    assert set(kernels.KERNELS) <= set(ATTENTION_KERNELS)


def test_the_layer_factors_scale_the_model_s_own_layers_and_head_and_nothing_else(measured):
    """`layer_factors` multiply what the time model predicts for each layer and for the logits GEMM
    with its loss (`speed.model_layer_seconds`, what calibrate measured them against); the rest of the
    step (embedding, optimizer) stays; a profile without them plans as with factors of 1."""
    from scalable_transformer.cli.plan import corrections_line
    from scalable_transformer.config.validate import resolve
    from scalable_transformer.plan import speed
    from scalable_transformer.plan.cluster import profile_cluster

    overrides = [*TINY, "model.num_layers=3", "train.global_batch_size=4"]  # 3 layers, 2 micro-batches
    cfg = resolve(load_config("tiny-gpt", overrides), 1)
    data = {k: v for k, v in measured.items() if not k.startswith("_") and k != "layer_factors"}

    def cluster(**factors: float):
        return profile_cluster(profile_from_dict({**data, "layer_factors": factors} if factors else data), 1)

    def step(**factors: float):
        return speed.step_time(cfg, cluster(**factors))

    shape = kernels._one_rank(load_config("tiny-gpt", overrides))[1]
    layer_s, head_s = speed.model_layer_seconds(cluster(), shape)
    assert layer_s > 0 and head_s > 0
    said = corrections_line(cluster(layer=2.5, head=1))
    assert "; layer factors: layer 2.5, head 1 (the model's own layer" in said
    assert "layer factors" not in corrections_line(cluster())
    base = step(layer=1.0, head=1.0)
    assert step().total == pytest.approx(base.total)
    layers, head = step(layer=2.5, head=1.0), step(layer=1.0, head=2.5)
    assert layers.total - base.total == pytest.approx(1.5 * 3 * 2 * layer_s)
    assert head.total - base.total == pytest.approx(1.5 * 2 * head_s)
    for changed in (layers, head):
        assert changed.breakdown["optimizer"] == base.breakdown["optimizer"]
