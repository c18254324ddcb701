"""Peak-FLOPs table, GPU name detection, the cache directory and the cached CPU peak."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from scalable_transformer import cache, files
from scalable_transformer.cache import cache_dir
from scalable_transformer.metrics import device_specs, device_table
from scalable_transformer.metrics.device_specs import (
    CPU_PEAK_METHOD,
    cpu_fingerprint,
    cpu_peak,
    cpu_precision_warning,
    detect_device_name,
    measure_cpu_kernels,
    measure_cpu_peak,
    resolve_peak,
)
from scalable_transformer.metrics.device_table import PEAK_TFLOPS, lookup_peak


def test_lookup_peak_dense_values_in_flop_per_second():
    assert lookup_peak("a100-40gb", "bf16") == pytest.approx(312e12)
    assert lookup_peak("a100-80gb", "tf32") == pytest.approx(156e12)
    assert lookup_peak("a100-80gb", "fp32") == pytest.approx(19.5e12)
    assert lookup_peak("h100-sxm", "bf16") == pytest.approx(989.4e12)
    assert lookup_peak("h100-sxm", "tf32") == pytest.approx(494.7e12)
    assert lookup_peak("H100_SXM", "bfloat16") == pytest.approx(989.4e12)  # names and dtypes normalised
    assert lookup_peak("v100-32gb", "fp16") == pytest.approx(125e12)
    assert lookup_peak("v100-32gb", "fp32") == pytest.approx(15.7e12)


def test_lookup_peak_errors_name_the_valid_choices():
    with pytest.raises(ValueError, match="Did you mean 'a100-80gb'") as info:
        lookup_peak("a100-80", "bf16")
    assert "h100-sxm" in str(info.value)  # lists the valid names
    with pytest.raises(ValueError, match="fp16, fp32"):
        lookup_peak("v100-32gb", "bf16")  # no bf16 on Volta
    with pytest.raises(ValueError, match="bf16, fp16, tf32, fp32"):
        lookup_peak("a100-80gb", "fp8")


def test_table_is_dense_and_consistent():
    for name, row in PEAK_TFLOPS.items():
        assert row, name
        for dtype, value in row.items():
            # fp8: the float8 rate a train.fp8 run's second MFU divides by (not a --dtype choice)
            assert dtype in (*device_table.DTYPES, "fp8") and value > 0, (name, dtype)
        if "bf16" in row and "fp32" in row:
            assert row["bf16"] >= row["fp32"], name


@pytest.mark.parametrize(
    ("raw", "key"),
    [
        ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
        ("NVIDIA A100-SXM4-80GB", "a100-80gb"),
        ("NVIDIA A100 80GB PCIe", "a100-80gb"),
        ("NVIDIA A100-PCIE-40GB", "a100-40gb"),
        ("NVIDIA H100 80GB HBM3", "h100-sxm"),
        ("NVIDIA H100 PCIe", "h100-pcie"),
        ("NVIDIA H100 NVL", "h100-nvl"),
        ("NVIDIA H200", "h200-sxm"),
        ("NVIDIA GH200 480GB", "gh200"),
        ("Tesla V100-SXM2-32GB", "v100-32gb"),
        ("Tesla V100-SXM2-16GB", "v100-16gb"),
        ("Tesla V100-PCIE-16GB", "v100-pcie"),
        ("NVIDIA A10", "a10"),
        ("NVIDIA A40", "a40"),
        ("NVIDIA RTX A6000", "rtx-a6000"),
        ("NVIDIA L4", "l4"),
        ("NVIDIA L40S", "l40s"),
        ("Tesla T4", "t4"),
        ("NVIDIA GeForce RTX 3090", "rtx-3090"),
        ("NVIDIA GeForce RTX 4090", "rtx-4090"),
        ("AMD Instinct MI250X", "mi250x"),
        ("AMD Instinct MI300X", "mi300x"),
        ("NVIDIA A10G", None),  # AWS part with other clocks: not guessed
        ("NVIDIA GeForce RTX 3090 Ti", None),
        ("Some Future Accelerator", None),
    ],
)
def test_detect_device_name(raw, key):
    assert detect_device_name(raw) == key
    if key is not None:
        assert key in PEAK_TFLOPS


def test_cache_dir_precedence(tmp_path, monkeypatch):
    monkeypatch.setenv("STX_CACHE_DIR", str(tmp_path / "stx"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "stx"
    monkeypatch.delenv("STX_CACHE_DIR")
    assert cache_dir() == tmp_path / "xdg" / "scalable-transformer"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "scalable-transformer"


def test_cache_module_imports_nothing_of_the_package_but_the_atomic_writer():
    # data/ and metrics/ both use it: it must not pull one layer into the other
    source = Path(cache.__file__).read_text().replace("from .files import write_atomic\n", "")
    assert "scalable_transformer" not in source and "from ." not in source
    writer = Path(files.__file__).read_text()
    assert "scalable_transformer" not in writer and "from ." not in writer


@pytest.fixture
def fake_measure(tmp_path, monkeypatch):
    monkeypatch.setenv("STX_CACHE_DIR", str(tmp_path / "cache"))
    calls: list[str] = []

    def measure(dtype: str, threads: int | None = None) -> float:
        calls.append(dtype)
        return {"bf16": 1.0e12, "fp32": 2.0e11, "fp16": 2.1e11}[dtype]

    monkeypatch.setattr(device_specs, "measure_cpu_peak", measure)
    return calls


def test_cpu_peak_is_measured_once_then_read_from_the_cache(fake_measure, tmp_path):
    assert cpu_peak("bf16") == pytest.approx(1.0e12)
    assert cpu_peak("bfloat16") == pytest.approx(1.0e12)
    assert fake_measure == ["bf16"]
    path = tmp_path / "cache" / "cpu_peak.json"
    entries = json.loads(path.read_text())
    (key,) = entries
    assert "torch=" in key and "threads=" in key and key.endswith("bf16") and key.startswith(CPU_PEAK_METHOD)
    assert cpu_peak("fp32") == pytest.approx(2.0e11)  # another dtype, another entry
    assert fake_measure == ["bf16", "fp32"]
    assert len(json.loads(path.read_text())) == 2


def test_cpu_peak_refresh_never_lowers_the_peak(fake_measure, monkeypatch):
    assert cpu_peak("bf16") == pytest.approx(1.0e12)
    # a loaded machine
    monkeypatch.setattr(device_specs, "measure_cpu_peak", lambda dtype, threads=None: 0.4e12)
    assert cpu_peak("bf16", refresh=True) == pytest.approx(1.0e12)
    monkeypatch.setattr(device_specs, "measure_cpu_peak", lambda dtype, threads=None: 1.5e12)
    assert cpu_peak("bf16", refresh=True) == pytest.approx(1.5e12)
    assert cpu_peak("bf16") == pytest.approx(1.5e12)


def test_cpu_peak_remeasures_a_corrupt_cache(fake_measure, tmp_path):
    path = tmp_path / "cache" / "cpu_peak.json"
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    assert cpu_peak("fp16") == pytest.approx(2.1e11)
    assert fake_measure == ["fp16"]
    assert json.loads(path.read_text())  # rewritten, valid


def test_resolve_peak_sources(fake_measure, tmp_path):
    info = resolve_peak("cuda", "bf16", None, 123.0)
    assert info.flops_per_second == pytest.approx(123e12) and "user override" in info.source
    info = resolve_peak("cuda", "bf16", "a100-80gb", None)
    assert info.flops_per_second == pytest.approx(312e12)
    assert info.source == "a100-80gb bf16 dense table"
    first = resolve_peak("cpu", "bf16", None, None)
    second = resolve_peak("cpu", "bf16", None, None)
    assert first.flops_per_second == second.flops_per_second == pytest.approx(1.0e12)
    assert "measured CPU bf16 GEMM peak" in first.source and "measured now" in first.source
    assert "cached" in second.source and str(Path(tmp_path) / "cache" / "cpu_peak.json") in second.source
    with pytest.raises(ValueError, match="> 0"):
        resolve_peak("cpu", "bf16", None, 0.0)


def test_a_peak_cached_by_the_old_measurement_is_not_reused(fake_measure, tmp_path):
    # v1 keys had no method prefix and held a bf16 torch.mm rate, 20x too low on a CPU without native
    # bf16: reusing one would bring back MFU > 100%.
    old_key = cpu_fingerprint("bf16").split(" | ", 1)[1]
    path = tmp_path / "cache" / "cpu_peak.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({old_key: {"flops_per_second": 1.0e9}}))
    assert cpu_peak("bf16") == pytest.approx(1.0e12)
    assert fake_measure == ["bf16"]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_measure_cpu_peak_times_every_gemm_of_a_linear_layer(dtype):
    rates = measure_cpu_kernels(dtype, budget_seconds=0.2)
    assert set(rates) == {"forward", "grad_input", "grad_weight"}
    assert all(r > 0 and math.isfinite(r) for r in rates.values())
    with pytest.raises(ValueError, match="tf32"):
        measure_cpu_peak("tf32")


def test_measure_cpu_peak_is_the_best_of_the_kernels(monkeypatch):
    rates = {"forward": 2.0e10, "grad_input": 1.0e9, "grad_weight": 1.9e10}
    monkeypatch.setattr(
        device_specs, "measure_cpu_kernels", lambda dtype, threads=None, budget_seconds=2.0: rates
    )
    assert measure_cpu_peak("bf16") == pytest.approx(2.0e10)


@pytest.fixture
def fake_peaks(monkeypatch):
    peaks = {"fp32": 1.5e11, "bf16": 2.0e10, "fp16": 1.4e11}
    monkeypatch.setattr(device_specs, "cpu_peak", lambda dtype, threads=None: peaks[dtype])
    return peaks


def test_precision_warning_names_both_rates_and_the_missing_flags(fake_peaks, monkeypatch):
    monkeypatch.setattr(device_specs, "_cpu_flags", lambda: {"avx2", "fma"})
    line = cpu_precision_warning("bfloat16", threads=2)
    assert line is not None and "\n" not in line
    assert "bf16 runs at 20 GFLOP/s" in line and "fp32 150 GFLOP/s" in line and "2 threads" in line
    assert "no native bf16 (no amx_bf16/avx512_bf16)" in line and "8x slower" in line
    assert cpu_precision_warning("fp32") is None
    assert cpu_precision_warning("fp16") is None  # not clearly slower than fp32: nothing to say
    monkeypatch.setattr(device_specs, "_cpu_flags", lambda: {"amx_bf16"})
    line = cpu_precision_warning("bf16", threads=2)
    assert line is not None and "despite amx_bf16" in line
    fake_peaks["bf16"] = 1.0e12  # an AMX machine: bf16 faster than fp32
    assert cpu_precision_warning("bf16", threads=2) is None


def test_an_atomic_write_that_fails_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "summary.json"
    files.write_atomic(path, "old")
    with pytest.raises(RuntimeError), files.atomic_output(path) as f:
        f.write(b"half of the new")
        raise RuntimeError("the writer died")
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]
    files.write_atomic(path, b"new", durable=True)
    assert path.read_bytes() == b"new" and oct(path.stat().st_mode & 0o777) == "0o644"
