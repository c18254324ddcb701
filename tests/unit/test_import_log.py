"""`stx report import-log`: Megatron-LM and DeepSpeed log excerpts (hand-written in those tools' formats:
Megatron's `training_log` iteration line, timers line and argument dump; DeepSpeed's engine /
ThroughputTimer `SamplesPerSec=` lines and the FLOPs profiler summary) into the results store."""

# ruff: noqa: E501  (the log excerpts keep the tools' own long lines)
from __future__ import annotations

from pathlib import Path

import pytest

from scalable_transformer.bench import report
from scalable_transformer.bench.log_import import import_log, parse_deepspeed, parse_megatron
from scalable_transformer.bench.results import ResultsStore
from scalable_transformer.cli import main

MEGATRON = """\
using world size: 8, data-parallel-size: 4, tensor-model-parallel size: 2, pipeline-model-parallel size: 1
------------------------ arguments ------------------------
  checkpoint_activations .......................... True
  data_parallel_size .............................. 4
  fp16 ............................................ True
  global_batch_size ............................... 32
  hidden_size ..................................... 1024
  micro_batch_size ................................ 4
  num_layers ...................................... 24
  pipeline_model_parallel_size .................... 1
  seq_length ...................................... 512
  tensor_model_parallel_size ...................... 2
  world_size ...................................... 8
-------------------- end of arguments ---------------------
[after model, optimizer, and learning rate scheduler are built] datetime: 2021-09-12 10:00:00
 iteration       10/ 2000000 | consumed samples:          320 | elapsed time per iteration (ms): 900.0 | learning rate: 9.900E-07 | global batch size:    32 | lm loss: 1.045E+01 | sop loss: 7.107E-01 | loss scale: 4294967296.0 | number of skipped iterations:   0 | number of nan iterations:   0 |
time (ms) | forward-compute: 300.00 | backward-compute: 500.00 | optimizer: 60.00 | batch-generator: 9.00
 iteration       20/ 2000000 | consumed samples:          640 | elapsed time per iteration (ms): 250.0 | learning rate: 1.900E-06 | global batch size:    32 | lm loss: 9.812E+00 | sop loss: 6.995E-01 | loss scale: 4294967296.0 | number of skipped iterations:   0 | number of nan iterations:   0 |
time (ms) | forward-compute: 80.00 | backward-compute: 150.00 | backward-params-all-reduce: 10.86 | optimizer: 12.00 | batch-generator: 1.00
 iteration       30/ 2000000 | consumed samples:          960 | elapsed time per iteration (ms): 200.0 | learning rate: 2.900E-06 | global batch size:    32 | lm loss: 9.101E+00 | sop loss: 6.903E-01 | loss scale: 4294967296.0 | number of skipped iterations:   0 | number of nan iterations:   0 |
time (ms) | forward-compute: 60.00 | backward-compute: 110.00 | backward-params-all-reduce: 11.00 | optimizer: 14.00 | batch-generator: 3.00
 iteration       40/ 2000000 | consumed samples:         1280 | elapsed time per iteration (ms): 210.0 | learning rate: 3.900E-06 | global batch size:    32 | lm loss: 8.733E+00 | sop loss: 6.911E-01 | loss scale: 4294967296.0 | number of skipped iterations:   0 | number of nan iterations:   0 |
time (ms) | forward-compute: 70.00 | backward-compute: 120.00 | backward-params-all-reduce: 12.00 | optimizer: 13.00 | batch-generator: 2.00
"""

# Megatron-DeepSpeed adds samples per second and TFLOPs to the iteration line.
MEGATRON_DS = """\
 iteration      100/  500000 | consumed samples:        51200 | consumed tokens:     26214400 | elapsed time per iteration (ms): 512.3 | learning rate: 1.000E-04 | global batch size:   512 | lm loss: 7.123456E+00 | loss scale: 65536.0 | grad norm: 1.234 | actual seqlen:   512 | number of skipped iterations:   0 | number of nan iterations:   0 | samples per second: 999.414 | TFLOPs: 140.11 |
 iteration      200/  500000 | consumed samples:       102400 | consumed tokens:     52428800 | elapsed time per iteration (ms): 500.0 | learning rate: 1.000E-04 | global batch size:   512 | lm loss: 6.523456E+00 | loss scale: 65536.0 | grad norm: 1.034 | actual seqlen:   512 | number of skipped iterations:   0 | number of nan iterations:   0 | samples per second: 1024.000 | TFLOPs: 143.50 |
 iteration      300/  500000 | consumed samples:       153600 | consumed tokens:     78643200 | elapsed time per iteration (ms): 490.0 | learning rate: 1.000E-04 | global batch size:   512 | lm loss: 6.223456E+00 | loss scale: 65536.0 | grad norm: 0.934 | actual seqlen:   512 | number of skipped iterations:   0 | number of nan iterations:   0 | samples per second: 1044.898 | TFLOPs: 146.40 |
"""

DEEPSPEED = """\
[2023-03-01 10:00:00,000] [INFO] [config.py:1020:print]   train_batch_size ............. 32
[2023-03-01 10:00:05,123] [INFO] [logging.py:96:log_dist] [Rank 0] step=10, skipped=0, lr=[0.0001], mom=[(0.9, 0.999)]
[2023-03-01 10:00:05,124] [INFO] [timer.py:199:stop] epoch=0/micro_step=10/global_step=10, RunningAvgSamplesPerSec=20.5, CurrSamplesPerSec=10.0, MemAllocated=1.2GB, MaxMemAllocated=3.5GB
[2023-03-01 10:00:09,124] [INFO] [timer.py:199:stop] epoch=0/micro_step=20/global_step=20, RunningAvgSamplesPerSec=30.1, CurrSamplesPerSec=40.0, MemAllocated=1.2GB, MaxMemAllocated=3.75GB
[2023-03-01 10:00:13,124] [INFO] [timer.py:199:stop] epoch=0/micro_step=30/global_step=30, RunningAvgSamplesPerSec=33.3, CurrSamplesPerSec=42.0, MemAllocated=1.2GB, MaxMemAllocated=3.75GB
[2023-03-01 10:00:17,124] [INFO] [timer.py:199:stop] epoch=0/micro_step=40/global_step=40, RunningAvgSamplesPerSec=35.0, CurrSamplesPerSec=44.0, MemAllocated=1.2GB, MaxMemAllocated=3.75GB

-------------------------- DeepSpeed Flops Profiler --------------------------
Profile Summary at step 10:
Notations:
data parallel size (dp_size), model parallel size(mp_size),
number of parameters (params), number of multiply-accumulate operations(MACs),
number of floating-point operations (flops), floating-point operations per second (FLOPS),
fwd latency (forward propagation latency), bwd latency (backward propagation latency),
step (weights update latency), iter latency (sum of fwd, bwd and step latency)

world size:                                                   8
data parallel size:                                           8
model parallel size:                                          1
batch size per GPU:                                           4
params per gpu:                                               336.23 M
params of model = params per GPU * mp_size:                   336.23 M
fwd MACs per GPU:                                             3139.93 G
fwd flops per GPU:                                            6279.86 G
fwd flops of model = fwd flops per GPU * mp_size:             6279.86 G
fwd latency:                                                  76.67 ms
bwd latency:                                                  108.02 ms
fwd FLOPS per GPU = fwd flops per GPU / fwd latency:          81.9 TFLOPS
bwd FLOPS per GPU = 2 * fwd flops per GPU / bwd latency:      116.27 TFLOPS
fwd+bwd FLOPS per GPU = 3 * fwd flops per GPU / (fwd+bwd latency):   102.0 TFLOPS
step latency:                                                 34.09 ms
iter latency:                                                 218.78 ms
FLOPS per GPU = 3 * fwd flops per GPU / iter latency:         86.11 TFLOPS
samples/second:                                               146.27

----------------------------- Aggregated Profile per GPU -----------------------------
Top 1 modules in terms of params, MACs or fwd latency at different model depths:
depth 0:
    params      - {'BertForPreTraining': '336.23 M'}
------------------------------------------------------------------------------
"""


def test_megatron_iteration_lines_timers_and_arguments() -> None:
    s = parse_megatron(MEGATRON)
    assert s["iterations"] == 4 and s["warmup_iterations_excluded"] == 1
    # median of 250, 200, 210 ms (the first interval is warm-up) -> 210 ms for 32 samples
    assert s["median_iteration_seconds"] == pytest.approx(0.210)
    assert s["samples_per_second"] == pytest.approx(32 / 0.210)
    assert s["tokens_per_second"] == pytest.approx(32 / 0.210 * 512)
    assert s["tflops_per_device"] is None  # plain Megatron-LM of that age does not print TFLOPs
    assert s["phase_time_ms_median"]["forward-compute"] == pytest.approx(70.0)
    # the old timer name is stored under Megatron's current one, as our runs log it
    assert s["phase_time_ms_median"]["all-grads-sync"] == pytest.approx(11.0)
    assert "backward-params-all-reduce" not in s["phase_time_ms_median"]
    assert s["phase_names_mapped"] == {"backward-params-all-reduce": "all-grads-sync"}
    assert (s["world_size"], s["tp"], s["pp"], s["dp"]) == (8, 2, 1, 4)
    assert (s["micro_batch_size"], s["global_batch_size"], s["seq_length"]) == (4, 32, 512)
    assert s["precision"] == "fp16" and s["activation_checkpointing"] == "full"


def test_megatron_deepspeed_samples_per_second_and_tflops() -> None:
    s = parse_megatron(MEGATRON_DS)
    assert s["samples_per_second"] == pytest.approx((1024.0 + 1044.898) / 2)
    assert s["tflops_per_device"] == pytest.approx((143.50 + 146.40) / 2)
    assert s["global_batch_size"] == 512


def test_deepspeed_samples_per_sec_memory_and_flops_profiler() -> None:
    s = parse_deepspeed(DEEPSPEED)
    assert s["samples_per_second"] == pytest.approx(42.0)  # CurrSamplesPerSec after the first: 40, 42, 44
    assert s["peak_memory_bytes_per_rank"] == [3.75 * 2**30]
    assert s["tflops_per_device"] == pytest.approx(86.11)
    assert s["world_size"] == 8 and s["micro_batch_size"] == 4 and s["num_parameters"] == 336_230_000
    assert s["median_iteration_seconds"] == pytest.approx(0.21878)
    assert s["phase_time_ms_median"] == pytest.approx(
        {"forward": 76.67, "backward": 108.02, "optimizer": 34.09}
    )


def test_deepspeed_engine_samples_per_sec_only() -> None:
    text = "\n".join(
        f"[Rank 0] step={i}, skipped=0, lr=[1e-4], SamplesPerSec={v}" for i, v in enumerate([5, 9, 11])
    )
    assert parse_deepspeed(text)["samples_per_second"] == pytest.approx(10.0)


def test_wrong_format_is_a_clear_error(tmp_path: Path) -> None:
    log = tmp_path / "ds.log"
    log.write_text(DEEPSPEED)
    with pytest.raises(ValueError, match="no Megatron-LM lines found"):
        import_log(log, "megatron", tmp_path / "r.sqlite")


def test_imported_logs_sit_beside_our_runs_in_one_table(tmp_path: Path, capsys) -> None:
    store = tmp_path / "r.sqlite"
    (tmp_path / "m.log").write_text(MEGATRON_DS)
    (tmp_path / "d.log").write_text(DEEPSPEED)
    assert (
        main(
            [
                "report",
                "import-log",
                str(tmp_path / "m.log"),
                "--format",
                "megatron",
                "--store",
                str(store),
                "--label",
                "gpt megatron-deepspeed",
                "--devices",
                "32",
                "--nnodes",
                "4",
            ]
        )
        == 0
    )
    assert "1034.45 samples/s, 144.95 TFLOPs/dev" in capsys.readouterr().out
    assert (
        main(
            [
                "report",
                "import-log",
                str(tmp_path / "d.log"),
                "--format",
                "deepspeed",
                "--store",
                str(store),
                "--label",
                "bert-345m deepspeed",
            ]
        )
        == 0
    )
    # importing the same log again replaces its row
    assert (
        main(
            [
                "report",
                "import-log",
                str(tmp_path / "d.log"),
                "--format",
                "deepspeed",
                "--store",
                str(store),
                "--label",
                "bert-345m deepspeed",
            ]
        )
        == 0
    )
    with ResultsStore(store) as s:
        rows = s.rows()
        s.put(
            {
                "config_hash": "ours",
                "repeat": 0,
                "status": "ok",
                "label": "tiny-gpt tp=1 zero0",
                "nproc": 8,
                "samples_per_second": 12.0,
                "tflops_per_device": 0.5,
            }
        )
    assert sorted(r["source"] for r in rows) == ["deepspeed", "megatron"]
    text = report.build_report(
        store, ["label"], ["devices"], ["samples_per_second", "tflops_per_device"], None
    )
    table = {line[0]: line[1:] for line in report.parse_markdown_table(text)}
    assert table["label \\ devices"] == ["8", "4*8"]
    assert table["gpt megatron-deepspeed"] == ["", "1034.45 samples/s, 144.95 TFLOPs/dev"]
    assert table["bert-345m deepspeed"] == ["42.00 samples/s, 86.11 TFLOPs/dev", ""]
    assert table["tiny-gpt tp=1 zero0"] == ["12.00 samples/s, 0.50 TFLOPs/dev", ""]
    assert "deepspeed flops profiler" in text


# Megatron-DeepSpeed, BERT-345M on 8 GPUs with activation checkpointing, as the users' ZeRO-3 table
# row "megatron bert 345m (mp=1)": 1658.93 samples/s next to 2.94 tflops/gpu.
BERT_345M_ARGS = """\
------------------------ arguments ------------------------
  checkpoint_activations .......................... True
  global_batch_size ............................... 32
  hidden_size ..................................... 1024
  micro_batch_size ................................ 4
  num_layers ...................................... 24
  seq_length ...................................... 512
  tensor_model_parallel_size ...................... 1
  world_size ...................................... 8
-------------------- end of arguments ---------------------
 > padded vocab (size: 28996) with 60 dummy tokens (new size: 29056)
"""


def bert_345m_log(tflops: float) -> str:
    line = (
        " iteration {i:>8d}/ 2000000 | consumed samples: {c:>12d} | elapsed time per iteration (ms): 19.3 | "
        "global batch size:    32 | lm loss: 7.1E+00 | samples per second: 1658.930 | TFLOPs: {t} |"
    )
    return BERT_345M_ARGS + "\n".join(line.format(i=i, c=32 * i, t=tflops) for i in (10, 20, 30)) + "\n"


def test_logged_tflops_that_disagree_with_samples_per_second_are_flagged(tmp_path: Path, capsys) -> None:
    log, store = tmp_path / "zero3.log", tmp_path / "results.sqlite"
    log.write_text(bert_345m_log(2.94))
    assert main(["report", "import-log", str(log), "--format", "megatron", "--store", str(store)]) == 0
    assert "warning" in capsys.readouterr().out
    with ResultsStore(store) as s:
        (row,) = s.rows()
    # 96*s*L*h^2*(1 + s/(6h) + V/(16*L*h)) = 1.4314 TFLOP per sample, x 1658.93 / 8 GPUs
    assert row["tflops_recomputed"] == pytest.approx(296.8, abs=0.1)
    assert row["tflops_mismatch"] == 1 and row["tflops_per_device"] == pytest.approx(2.94)
    text = report.build_report(store, ["label"], ["devices"], ["tflops_per_device"], None)
    assert "disagree" in text and "296.8 recomputed" in text  # the note under the table


def test_logged_tflops_that_agree_are_not_flagged(tmp_path: Path) -> None:
    log, store = tmp_path / "ok.log", tmp_path / "results.sqlite"
    log.write_text(bert_345m_log(290.0))  # 2.3% below the recomputed 296.8: within 10%
    record = import_log(log, "megatron", store)
    assert record["tflops_mismatch"] == 0 and "agree" in record["summary_json"]
    assert record["flops_convention"] == "megatron (as logged)"


def test_tflops_not_checkable_without_the_shape(tmp_path: Path) -> None:
    log = tmp_path / "ds.log"
    log.write_text(MEGATRON_DS)  # samples/s and TFLOPs, but no argument dump
    record = import_log(log, "megatron", tmp_path / "results.sqlite", devices=64)
    assert record["tflops_mismatch"] is None and record["tflops_recomputed"] is None
    assert "not checked: no num_layers, hidden_size, seq_length, padded vocabulary" in record["summary_json"]


def test_a_store_from_before_the_cross_check_columns_is_migrated_on_open(tmp_path: Path) -> None:
    import sqlite3

    from scalable_transformer.bench.results import APP_ID, COLUMNS, SCHEMA_VERSION

    path = tmp_path / "old.sqlite"
    conn = sqlite3.connect(path)
    old = [(c, t) for c, t in COLUMNS if not c.startswith("tflops_")]
    conn.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
    conn.executemany(
        "INSERT INTO meta VALUES (?, ?)", [("application", APP_ID), ("schema_version", str(SCHEMA_VERSION))]
    )
    cols = ", ".join(f'"{c}" {t}' for c, t in old)
    conn.execute(f"CREATE TABLE results (id INTEGER PRIMARY KEY, {cols}, UNIQUE(config_hash, repeat))")
    conn.execute("INSERT INTO results (config_hash, repeat, status) VALUES ('old', 0, 'ok')")
    conn.commit()
    conn.close()
    with ResultsStore(path, create=False) as s:  # a reader does not migrate
        assert "tflops_mismatch" not in s.rows()[0]
    log = tmp_path / "zero3.log"
    log.write_text(bert_345m_log(2.94))
    import_log(log, "megatron", path)  # a writer does
    with ResultsStore(path) as s:
        rows = {r["config_hash"]: r for r in s.rows()}
    assert rows["old"]["tflops_mismatch"] is None and rows["old"]["status"] == "ok"
    assert [r["tflops_mismatch"] for h, r in rows.items() if h != "old"] == [1]
