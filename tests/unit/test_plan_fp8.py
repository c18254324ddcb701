"""The planner under FP8 training (train.fp8): the blocks' GEMMs at the profile's fp8 rate, the casts
as memory-bound work, tensorwise weights all-gathered in float8 under ZeRO-3, and MFU against both
peaks. The engine's side is tests/unit/test_fp8.py and tests/distributed/test_fp8_layouts.py."""

from __future__ import annotations

from scalable_transformer.config.load import load_config
from scalable_transformer.plan.cluster import table_cluster
from scalable_transformer.plan.search import plan_config

H100 = table_cluster("h100-sxm", 8, 8)


def _plan(fp8: str, zero: int = 3):
    cfg = load_config("gpt-7b", ["train.precision=bf16", f"train.fp8={fp8}", f"parallel.zero_stage={zero}"])
    return plan_config(cfg, H100)


def test_fp8_gemms_run_at_the_fp8_rate_and_the_casts_cost_memory_traffic():
    bf16, fp8 = _plan("none"), _plan("tensorwise")
    gemm = {
        p: r.time.classes["forward"]["gemm"] + r.time.classes["backward"]["gemm"]
        for p, r in (("bf16", bf16), ("fp8", fp8))
    }
    assert gemm["fp8"] < 0.8 * gemm["bf16"]  # the H100 profile's fp8 points: ~1.4-2x the bf16 ones
    mem = {p: r.time.classes["forward"]["memory_bound"] for p, r in (("bf16", bf16), ("fp8", fp8))}
    assert mem["fp8"] > mem["bf16"]  # amax and casts
    assert fp8.time.total < bf16.time.total


def test_tensorwise_gathers_the_blocks_in_float8_and_rowwise_in_bf16():
    tensorwise, rowwise = _plan("tensorwise"), _plan("rowwise")
    comm = {
        r.fp8: r.time.breakdown["dp_communication"] + r.time.dp_overlapped_seconds
        for r in (tensorwise, rowwise)
    }
    assert comm["tensorwise"] < 0.8 * comm["rowwise"]


def test_fp8_mfu_is_reported_against_both_peaks():
    fp8 = _plan("tensorwise")
    assert fp8.peak_flops_fp8 is not None and fp8.peak_flops_fp8 > 1.9 * fp8.peak_flops
    assert (
        fp8.mfu_fp8 is not None and abs(fp8.mfu_fp8 - fp8.mfu * fp8.peak_flops / fp8.peak_flops_fp8) < 1e-12
    )
    d = fp8.to_dict()
    assert d["fp8"] == "tensorwise" and d["mfu_fp8"] == fp8.mfu_fp8
    assert "mfu_fp8" not in _plan("none").to_dict()
