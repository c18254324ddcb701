"""Device telemetry, the profile window and the report cells, on the CPU (no GPU here: the NVML and
amdsmi adapters are the only parts not exercised; a fake adapter stands in for them)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from rich.console import Console

from scalable_transformer.bench.report import cell, parse_values
from scalable_transformer.bench.results import ResultsStore
from scalable_transformer.bench.sweep_record import record_from_summary
from scalable_transformer.config.load import load_config
from scalable_transformer.config.validate import resolve
from scalable_transformer.errors import ConfigError
from scalable_transformer.metrics.device_sampler import GPU_FIELDS, Rapl, Telemetry, short
from scalable_transformer.metrics.trace_analysis import analyze_trace, format_table
from scalable_transformer.train.measurement import straggler


class FakeGpu:
    """Stands in for NvmlDevice: fixed readings and an energy counter that rises 100 J per read."""

    name = "fake"

    def __init__(self) -> None:
        self.energy = 1000.0

    def read(self, r) -> None:
        r.values.update(
            device_util=0.79,
            device_power_w=140.0,
            device_power_limit_w=400.0,
            device_memory_used_bytes=34.6 * 2**30,
            device_memory_total_bytes=40.5 * 2**30,
            device_sm_clock_mhz=1410.0,
        )
        self.energy += 100.0
        r.device_energy_j = self.energy
        r.clock_reasons = 0x4 | 0x1  # sw_power_cap, gpu_idle


def no_rapl(tmp_path: Path) -> Rapl:
    return Rapl(str(tmp_path / "no-powercap"))


def test_cpu_telemetry_fills_cpu_fields_and_leaves_gpu_fields_none(tmp_path):
    t = Telemetry("cpu", period=0.05, rapl=no_rapl(tmp_path)).start()
    sum(i * i for i in range(200_000))  # some CPU work for the process figure
    figures = t.interval()
    t.stop()
    assert t.source == "cpu"
    assert all(figures[k] is None for k in GPU_FIELDS)
    assert figures["device_energy_j"] is None and figures["cpu_energy_j"] is None
    assert 0.0 <= figures["cpu_process_util"] <= 1.0 and 0.0 <= figures["cpu_system_util"] <= 1.0
    assert "no GPU" in t.reasons["gpu"]
    assert "does not exist" in t.reasons["cpu_energy"]
    assert short(figures).startswith("CPU ")


def test_gpu_adapter_figures_energy_and_clock_reasons(tmp_path):
    t = Telemetry("cuda", gpu=FakeGpu(), rapl=no_rapl(tmp_path))
    t.start()  # one baseline read (energy 1100 J)
    t.sample()
    t.sample()
    figures = t.interval()  # the closing read: 1400 J
    t.stop()
    assert figures["device_util"] == pytest.approx(0.79)
    assert figures["device_memory_total_bytes"] == pytest.approx(40.5 * 2**30)
    # the counter difference over the interval (NVML's total-energy counter), not a sum of readings
    assert figures["device_energy_j"] == pytest.approx(300.0, abs=100.0)
    assert figures["device_clock_event_reasons"] == "gpu_idle,sw_power_cap"
    assert short(figures).startswith("GPU 79% 140/400 W 34.6/40.5 GiB")


def test_rapl_counter_wraps_and_unreadable_states_its_reason(tmp_path):
    pkg = tmp_path / "intel-rapl:0"
    pkg.mkdir()
    (pkg / "energy_uj").write_text("900000000\n")
    (pkg / "max_energy_range_uj").write_text("1000000000\n")
    (tmp_path / "intel-rapl:0:0").mkdir()  # a subdomain: included in its package, not counted again
    rapl = Rapl(str(tmp_path))
    assert rapl.reason is None and len(rapl.domains) == 1
    assert rapl.read_j() == 0.0
    (pkg / "energy_uj").write_text("50000000\n")  # wrapped: +100 J to the range end, +50 J after
    assert rapl.read_j() == pytest.approx(150.0)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "no intel-rapl package domain" in (Rapl(str(empty)).reason or "")


def test_straggler_is_the_busiest_rank_beyond_the_margin():
    assert straggler([100.0, 150.0]) == 1
    assert straggler([100.0, 105.0]) is None  # within 10%
    assert straggler([100.0, 101.0, 99.0, 300.0]) == 3
    assert straggler([50.0]) is None


def test_users_cell_format_and_cpu_rows():
    gpu_row = {
        "status": "ok",
        "samples_per_second": 0.61,
        "tflops_per_device": 1.41,
        "device_memory_used_bytes": 34.6 * 2**30,
        "device_memory_total_bytes": 40.5 * 2**30,
        "device_power_w": 140.0,
        "device_power_limit_w": 400.0,
        "device_util": 0.79,
        "cpu_process_util": 0.5,
    }
    assert cell([gpu_row], parse_values("users")) == (
        "0.61 samples/s, 1.41 TFLOPs/dev, 34.6/40.5 GiB, 140/400 W, 79%"
    )
    cpu_row = {**gpu_row, **dict.fromkeys(GPU_FIELDS), "energy_j_per_sample": None}
    assert cell([cpu_row], parse_values("users")) == "0.61 samples/s, 1.41 TFLOPs/dev, -, -, 50% CPU"
    assert (
        cell([{**gpu_row, "energy_j_per_sample": 2.5}], parse_values("energy_per_sample")) == "2.50 J/sample"
    )
    with pytest.raises(ValueError, match="users"):
        parse_values("watts")


def test_profile_config_mapping_and_bad_values():
    cfg = load_config("tiny-gpt", ["logging.profile={start_step: 2, end_step: 3, ranks: [0], memory: false}"])
    assert (cfg.logging.profile_start_step, cfg.logging.profile_end_step) == (2, 3)
    assert cfg.logging.profile_ranks == "0" and cfg.logging.profile_memory is False
    with pytest.raises(ConfigError, match=r"profile\.stop_step"):
        load_config("tiny-gpt", ["logging.profile={stop_step: 2}"])
    with pytest.raises(ConfigError, match=r"before logging\.profile_start_step"):
        resolve(load_config("tiny-gpt", ["logging.profile.start_step=5", "logging.profile.end_step=4"]), 1)
    with pytest.raises(ConfigError, match="'1' is not a rank of this run"):
        resolve(load_config("tiny-gpt", ["logging.profile.start_step=5", "logging.profile.ranks=1"]), 1)


def _trace(path: Path, events: list[dict]) -> Path:
    path.write_text(json.dumps({"traceEvents": events}))
    return path


def test_trace_analysis_shares_and_self_times(tmp_path):
    def x(name, ts, dur, tid=1, cat="cpu_op"):
        return {"ph": "X", "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid, "cat": cat}

    events = [
        x("ProfilerStep#1", 0, 1000, cat="user_annotation"),
        x("aten::mm", 0, 400),  # compute 0-400, with a nested 100 us op
        x("aten::add", 100, 100),
        x("c10d::allreduce_", 500, 50),  # launch on the training thread
        x("gloo:all_reduce", 500, 300, tid=2, cat="user_annotation"),  # in flight on gloo's thread
        # 400-500 and 800-1000 nothing runs: idle
    ]
    a = analyze_trace(_trace(tmp_path / "t.json", events))
    assert a["steps"] == 1 and a["window_ms"] == pytest.approx(1.0)
    assert a["compute_share"] == pytest.approx(0.4)
    assert a["communication_share"] == pytest.approx(0.3)
    assert a["idle_share"] == pytest.approx(0.3)
    ops = {op["name"]: op for op in a["top_operators"]}
    assert ops["aten::mm"]["self_ms"] == pytest.approx(0.3)  # 400 us minus the nested add
    assert ops["gloo:all_reduce"]["communication"] and not ops["aten::mm"]["communication"]
    assert "compute 40.0%, communication 30.0%, idle 30.0%" in format_table(a)


def tiny(tmp_path: Path, *extra: str):
    return load_config(
        "tiny-gpt",
        [
            "train.train_iters=6",
            "logging.log_interval=2",
            "logging.warmup_iters=1",
            "train.eval_interval=0",
            "train.eval_iters=1",
            "model.num_layers=1",
            "model.hidden_size=32",
            "model.num_attention_heads=2",
            "model.seq_length=16",
            "train.micro_batch_size=2",
            "logging.telemetry_interval=0.05",
            f"logging.run_dir={tmp_path}",
            "logging.tensorboard=false",
            *extra,
        ],
    )


@pytest.mark.slow
def test_cpu_run_summary_store_row_and_profile_window(tmp_path):
    from scalable_transformer.train.run import run_training

    out = io.StringIO()
    cfg = tiny(tmp_path, "logging.profile.start_step=3", "logging.profile.end_step=4")
    run_dir, summary = run_training(cfg, Console(file=out, width=300))
    assert run_dir is not None
    # telemetry: CPU utilisation measured, GPU fields None (not invented), energy or the reason
    assert summary["telemetry_source"] == "cpu"
    assert 0 < summary["cpu_process_util"] <= 1
    assert all(summary[k] is None for k in GPU_FIELDS)
    assert summary["telemetry_per_rank"]["cpu_process_util"]["median"][0] is not None
    if summary["energy_j_per_sample"] is None:
        assert any("RAPL" in note for note in summary["telemetry_notes"])
    else:
        assert summary["energy_j_per_sample"] > 0
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert all("cpu_process_util" in r and r["device_util"] is None for r in train)
    with ResultsStore(tmp_path / "results.sqlite") as store:
        store.put({"config_hash": "a", "status": "ok", **record_from_summary(summary, cfg)})
        row = store.rows()[0]
    assert row["cpu_process_util"] == pytest.approx(summary["cpu_process_util"])
    assert row["device_util"] is None and row["device_memory_used_bytes"] is None
    assert row["telemetry_note"] and "no GPU" in row["telemetry_note"]
    # profile: the trace of rank 0 loads as JSON with the window's steps, the table was printed
    trace = json.loads((run_dir / "profile" / "trace_rank0.json").read_text())
    steps = {e["name"] for e in trace["traceEvents"] if e.get("name", "").startswith("ProfilerStep#")}
    assert steps == {"ProfilerStep#3", "ProfilerStep#4"}
    assert summary["profiled_iterations_excluded"] == [3, 4]
    assert summary["profile"]["top_operators"]
    assert "aten::" in out.getvalue() and "compute" in out.getvalue()
    assert [r.get("profiled_steps", 0) for r in train] == [0, 2, 0]


def test_profiled_steps_are_left_out_of_the_median():
    from scalable_transformer.metrics.sinks import LogRecord
    from scalable_transformer.train.measurement import History
    from scalable_transformer.train.outputs import summarize

    cfg = resolve(load_config("tiny-gpt", ["train.train_iters=6", "logging.warmup_iters=1"]), 1)
    history = History(iteration_seconds=[9.0, 1.0, 50.0, 60.0, 1.0, 1.0], excluded_iterations={3, 4})
    history.records = [LogRecord({"iteration": 6, "loss": 1.0})]

    class Flops:
        convention, model_flops, hardware_flops = "megatron", 1e9, 1e9

    class Peak:
        flops_per_second, source = 1e12, "test"

    summary = summarize(cfg, history, Flops(), Peak(), 1000, 10.0)
    assert summary["median_iteration_seconds"] == 1.0  # 9 s is warm-up, 50 and 60 s were profiled


def test_a_resumed_runs_summary_leaves_out_its_own_warmup_and_profiled_steps():
    """Iterations are counted from the resumed one: warm-up is the job's first 2 (1001-1002), the
    profiler slowed 1003-1004, and the first interval's phase means carry the warm-up's one-off cost."""
    from scalable_transformer.metrics.sinks import LogRecord
    from scalable_transformer.train.measurement import History
    from scalable_transformer.train.outputs import summarize

    cfg = resolve(load_config("tiny-gpt", ["train.train_iters=1008", "logging.warmup_iters=2"]), 1)
    history = History(
        iteration_seconds=[9.0, 9.0, 50.0, 60.0, 1.0, 1.0, 1.0, 1.0],
        first_iteration=1001,
        excluded_iterations={1003, 1004},
    )
    history.records = [
        LogRecord({"iteration": 1002, "first_iteration": 1001, "loss": 1.0}, phase_ms={"optimizer": 900.0}),
        LogRecord(
            {"iteration": 1004, "first_iteration": 1003, "loss": 1.0, "profiled_steps": 2},
            phase_ms={"optimizer": 700.0},
        ),
        LogRecord({"iteration": 1006, "first_iteration": 1005, "loss": 1.0}, phase_ms={"optimizer": 60.0}),
        LogRecord({"iteration": 1008, "first_iteration": 1007, "loss": 1.0}, phase_ms={"optimizer": 40.0}),
    ]

    class Flops:
        convention, model_flops, hardware_flops = "megatron", 1e9, 1e9

    class Peak:
        flops_per_second, source = 1e12, "test"

    summary = summarize(cfg, history, Flops(), Peak(), 1000, 10.0)
    assert summary["median_iteration_seconds"] == 1.0
    assert summary["phase_time_ms_median"] == {"optimizer": 50.0}


@pytest.mark.slow
def test_energy_per_sample_from_the_counter_over_the_post_warmup_intervals(tmp_path):
    """A fake GPU adapter (its energy counter rises 100 J per read) stands in for NVML in a CPU run."""
    import torch

    from scalable_transformer.train.callbacks import TelemetryCallback
    from scalable_transformer.train.run import run_training

    telemetry = Telemetry("cuda", gpu=FakeGpu(), rapl=no_rapl(tmp_path), period=60.0)  # no thread reads
    callback = TelemetryCallback(torch.device("cpu"), telemetry=telemetry)
    cfg = tiny(tmp_path, "logging.telemetry=false")
    run_dir, summary = run_training(cfg, Console(file=io.StringIO()), callbacks=[callback])
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    # each interval reads once (its closing sample): 100 J per 2 steps of 2 samples
    assert [r["energy_j_per_sample"] for r in train] == pytest.approx([25.0, 25.0, 25.0])
    assert [r["energy_j_per_token"] for r in train] == pytest.approx([25.0 / 16] * 3)
    assert train[0]["device_util"] == pytest.approx(0.79)
    assert summary["energy_j_per_sample"] == pytest.approx(25.0)  # intervals 2 and 3 (warm-up: 1 step)
    assert summary["device_power_w"] == pytest.approx(140.0)
    assert summary["telemetry_per_rank"]["device_memory_used_bytes"]["max"] == [pytest.approx(34.6 * 2**30)]
    assert summary["telemetry_source"] == "fake"


def test_stx_report_renders_the_users_cell_from_a_store(tmp_path):
    from scalable_transformer.bench.report import build_report

    store_path = tmp_path / "results.sqlite"
    row = {
        "config_hash": "h",
        "status": "ok",
        "label": "bert-345m zero3",
        "nproc": 8,
        "samples_per_second": 0.61,
        "tflops_per_device": 1.41,
        "device_memory_used_bytes": 34.6 * 2**30,
        "device_memory_total_bytes": 40.5 * 2**30,
        "device_power_w": 140.0,
        "device_power_limit_w": 400.0,
        "device_util": 0.79,
    }
    with ResultsStore(store_path) as store:
        store.put(row)
    text = build_report(store_path, ["label"], ["devices"], parse_values("users"), None)
    assert "| bert-345m zero3 | 0.61 samples/s, 1.41 TFLOPs/dev, 34.6/40.5 GiB, 140/400 W, 79% |" in text
    assert "device memory used/total (GiB), power/limit (W), utilisation (%)" in text
