"""Build the planner's built-in GPU hardware profiles (src/scalable_transformer/plan/profiles/*.yaml)
from the kernel-level data in benchmarks/data/gpu_kernels/ ONLY (never the end-to-end tables of
gpu_validation/): public kernel measurements, and `stx calibrate` profiles measured on one H100 and
one H200 (gpu_kernels/measured/: GEMMs at training shapes, SDPA attention, elementwise bandwidth and
the cost of one op). Every point keeps its source; every assumption says so in its `source` and in
docs/PLANNER.md#built-in-gpu-profiles.

    python benchmarks/build_gpu_profiles.py        # rewrites the profiles; a test checks they load
"""

from __future__ import annotations

import csv
import math
import statistics
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from scalable_transformer.plan.hardware_profile import profile_from_dict, save_profile  # noqa: E402

DATA = ROOT / "benchmarks" / "data" / "gpu_kernels"
MEASURED = DATA / "measured"  # stx calibrate profiles, one GPU each: FILE names start with the device key
OUT = ROOT / "src" / "scalable_transformer" / "plan" / "profiles"
MLE = "stas00/ml-engineering@744d01e18b79512572f64a6bbd8b5f4a725203a7"
# Assumptions where the public data have gaps (docs/PLANNER.md#built-in-gpu-profiles)
HBM_ACHIEVABLE = 1800 / 2039  # the one measured HBM read (A100 80GB forum post, devices.yaml), as a share
PCIE_ACHIEVABLE = 55.43 / 63  # nvbandwidth H2D on H200 PCIe 5 (devices.yaml) over the PCIe 5 x16 spec
N_HALF = 192.0  # GEMM efficiency below the best shape: n / (n + 192) in the smallest dimension (assumed)
ASSUMED_DIMS = (64, 128, 256, 512, 1024)
ATTENTION_KERNELS = {
    "FlashAttention-2": "flash",
    "xformers": "mem_efficient",
    "PyTorch standard attention": "math",
    "FlashAttention Triton": "triton",
    # FlashAttention 1 (flash-attn 0.2.x, CUDA): what MosaicGPT's `attn_impl: flash` ran in early 2023
    "FlashAttention (v1)": "flash1",
}


def gemm_points(best: dict, dtype: str) -> list[dict]:
    """The best-shape point of gemm_mamf.csv, and assumed points below its smallest dimension."""
    m, n, k = (int(x) for x in best["best_shape_MxNxK"].split("x"))
    tflops = float(best["mamf_tflops"])
    small = min(m, n, k)
    src = f"gemm_mamf.csv: {best['gpu']} {best['dtype']} {tflops} TFLOPS at {m}x{n}x{k} ({best['source']})"
    points = [{"dtype": dtype, "m": m, "n": n, "k": k, "tflops": tflops, "source": src}]
    for dim in ASSUMED_DIMS:
        if dim >= small:
            continue
        scale = (dim / (dim + N_HALF)) / (small / (small + N_HALF))
        points.append(
            {
                "dtype": dtype,
                "m": dim,
                "n": max(n, k),
                "k": max(n, k),
                "tflops": round(tflops * scale, 1),
                "source": f"assumption: the best point scaled by n/(n+{N_HALF:g}) in the smallest dimension",
            }
        )
    return points


def measured_profiles(device: str) -> list[tuple[str, dict]]:
    """The `stx calibrate` profiles measured on this device (measured/DEVICE-*.yaml), with their names."""
    return [(p.name, yaml.safe_load(p.read_text())) for p in sorted(MEASURED.glob(f"{device}-*.yaml"))]


def _measured_source(name: str, prof: dict) -> str:
    fp = prof["fingerprint"]
    return f"measured/{name}: stx calibrate on one {fp['device_name']} (torch {fp['torch']}, {fp['created']})"


def measured_points(profs: list[tuple[str, dict]], key: str, dtype: str = "bf16") -> list[dict]:
    """Every `key` (gemm or attention) point of dtype the calibrations measured, each citing its file."""
    return [
        {**point, "source": _measured_source(name, prof)}
        for name, prof in profs
        for point in prof[key]
        if point["dtype"] == dtype
    ]


def measured_memory_bound(profs: list[tuple[str, dict]]) -> dict:
    """Elementwise bandwidth and cost per op: the medians over the calibrations."""
    return {
        "bandwidth_gbps": round(statistics.median(p["memory_bound"]["bandwidth_gbps"] for _, p in profs)),
        "op_overhead_us": round(statistics.median(p["memory_bound"]["op_overhead_us"] for _, p in profs), 1),
    }


def transferred_gemm(measured: list[dict], measured_best: dict, best: dict) -> list[dict]:
    """A GPU without a measured surface: each measured point's share of its own GPU's best-shape rate
    (gemm_mamf.csv) times this GPU's best-shape rate (an assumption: the same shapes lose the same share
    of the best on both; it replaces the n/(n+192) curve, which no measurement supported)."""
    ratio = float(best["mamf_tflops"]) / float(measured_best["mamf_tflops"])
    note = (
        f"assumption: {best['gpu']} best {best['mamf_tflops']} / {measured_best['gpu']} best "
        f"{measured_best['mamf_tflops']} TFLOPS (gemm_mamf.csv) x the rate "
    )
    return [{**p, "tflops": round(p["tflops"] * ratio, 1), "source": note + p["source"]} for p in measured]


def attention_points(gpu: str) -> list[dict]:
    """FA2-figure fwd+bwd TFLOPS as both the fwd and the bwd rate (assumed equal; the figure counts
    fwd + bwd as 3.5x forward FLOPs, the convention the model uses)."""
    out = []
    with open(DATA / "flash_attention_tflops.csv") as f:
        for r in csv.DictReader(f):
            kernel = ATTENTION_KERNELS.get(r["implementation"])
            if r["gpu"] != gpu or kernel is None or r["passes"] != "fwd+bwd" or not r["tflops"]:
                continue
            d, s = int(r["head_dim"]), int(r["seq_len"])
            for pass_ in ("fwd", "bwd"):
                out.append(
                    {
                        "kernel": kernel,
                        "dtype": "bf16",
                        "batch": 16384 // s,
                        "heads": 2048 // d,
                        "seq_len": s,
                        "head_dim": d,
                        "causal": r["causal"] == "yes",
                        "pass": pass_,
                        "tflops": float(r["tflops"]),
                        "source": f"flash_attention_tflops.csv {r['implementation']} fwd+bwd "
                        f"({r['source'].split(' ')[0]}); fwd and bwd assumed at the fwd+bwd rate",
                    }
                )
    return out


def transferred_triton(gpu: str, measured_gpu: str = "A100 SXM4 80GB") -> list[dict]:
    """Triton FlashAttention (2022) on a GPU without a figure for it: its fwd+bwd rate on
    `measured_gpu` x this GPU's FlashAttention-2 fwd+bwd rate / measured_gpu's, per (causal, head dim,
    seq) of the flash-attention README figures (an assumption: Triton loses the same share against
    FA2 on both GPUs)."""

    def fa2(points: list[dict]) -> dict[tuple, float]:
        return {
            (p["causal"], p["head_dim"], p["seq_len"]): p["tflops"]
            for p in points
            if p["kernel"] == "flash" and p["pass"] == "fwd"
        }

    measured = attention_points(measured_gpu)
    here, ref = fa2(attention_points(gpu)), fa2(measured)
    out = []
    for p in measured:
        key = (p["causal"], p["head_dim"], p["seq_len"])
        if p["kernel"] != "triton" or key not in here:
            continue
        note = (
            f"assumption: {measured_gpu} Triton x {gpu} FA2 / {measured_gpu} FA2 ({here[key]:g} / "
            f"{ref[key]:g}) at this causality, head dim and seq; "
        )
        out.append(
            {**p, "tflops": round(p["tflops"] * here[key] / ref[key], 1), "source": note + p["source"]}
        )
    return out


def collective_points(system: str, scale: dict[str, float] | None = None) -> list[dict]:
    """The all_reduce size sweep of one 8-GPU node; all_gather / reduce_scatter as the same sweep
    scaled by their ratio to all_reduce at 16 GiB (`scale`, an assumption: only 16 GiB is published)."""
    out = []
    with open(DATA / "nccl_collectives.csv") as f:
        rows = [r for r in csv.DictReader(f) if r["system"] == system and r["collective"] == "all_reduce"]
    for op, factor in {"all_reduce": 1.0, **(scale or {})}.items():
        for r in rows:
            size = int(r["size_bytes"])
            point = {
                "op": op,
                "scope": "intra_node",
                "ranks": int(r["gpus_per_node"]),
                "size_bytes": size,
                "busbw_gbps": round(float(r["busbw_GBps"]) * factor, 2),
                "source": f"nccl_collectives.csv {system} all_reduce ({r['source']})"
                + ("" if op == "all_reduce" else f" x {factor:.3f} (assumed: {op}/all_reduce at 16 GiB)"),
            }
            if r["time_us"] and op == "all_reduce":
                point["time_us"] = float(r["time_us"])
            out.append(point)
    return out


def profile(
    name: str, device: dict, gemm: list[dict], attention: list[dict], colls: list[dict], **kw
) -> dict:
    return {
        "format": 1,
        "name": name,
        "kind": "gpu",
        "source": "public kernel data: benchmarks/data/gpu_kernels (benchmarks/build_gpu_profiles.py); "
        + kw["note"],
        "fingerprint": {"device_name": kw["device_name"], "device_count": 8},
        "peak_tflops": kw["peaks"],
        "device_memory_gb": device["memory_gb"],
        "host_link_gbps": round(kw["pcie_gbps"] * PCIE_ACHIEVABLE, 1),
        "gemm": gemm,
        "attention": attention,
        "memory_bound": kw.get("memory_bound")
        or {
            "bandwidth_gbps": round(kw["hbm_gbps"] * HBM_ACHIEVABLE, 0),
            "op_overhead_us": round(kw["op_overhead_us"], 1),
        },
        "collectives": colls,
        "corrections": dict.fromkeys(("gemm", "attention", "memory_bound", "overhead", "communication"), 1.0),
        "corrections_source": None,
        "topology": {"devices_per_node": 8, "nics_per_node": 8, "nic_gbps": kw["nic_gbps"]},
    }


def main() -> None:
    with open(DATA / "gemm_mamf.csv") as f:
        mamf = {(r["gpu"], r["dtype"]): r for r in csv.DictReader(f)}
    h100, h200 = measured_profiles("h100"), measured_profiles("h200")
    fp8 = gemm_points(mamf[("NVIDIA H100 SXM", "fp8_e4m3fn")], "fp8")  # no fp8 measured: the public point
    h100_bf16 = measured_points(h100, "gemm")
    h100_gemm = h100_bf16 + fp8
    h200_gemm = measured_points(h200, "gemm") + fp8
    a100_gemm = transferred_gemm(
        h100_bf16, mamf[("NVIDIA H100 SXM", "bf16")], mamf[("NVIDIA A100 SXM", "bf16")]
    )
    # the cost of one op is the host's: each measured GPU its own, the A100s the median of all of them
    op_overhead = statistics.median(p["memory_bound"]["op_overhead_us"] for _, p in h100 + h200)
    a100_coll = collective_points("A100 node (8 GPUs)")
    # H200 sweep (NVLS all_reduce); ring all_gather 361.4 and reduce_scatter 362.9 vs NVLS 482.26 at 16 GiB
    h_coll = collective_points(
        "8x H200 node", {"all_gather": 361.4 / 482.26, "reduce_scatter": 362.9 / 482.26}
    )
    # Triton FlashAttention has a figure on the A100 only; the H200 shares the H100's SMs
    h_triton = transferred_triton("H100 SXM5 80GB")
    a100_peaks = {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5}
    h100_peaks = {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0, "fp8": 1979.0}
    specs = {
        "a100-40gb": profile(
            "a100-40gb", {"memory_gb": 40}, a100_gemm, attention_points("A100 SXM4 80GB"), a100_coll,
            device_name="NVIDIA A100-SXM4-40GB", peaks=a100_peaks, pcie_gbps=31.5, hbm_gbps=1555,
            nic_gbps=22.75, op_overhead_us=op_overhead, note="A100 GEMM (best point; the H100's measured "
            "surface), attention (80GB part) and NVLink 3 data; HDR NIC 22.75 GB/s (reporter figure, "
            "nccl_collectives.csv 2x HGX A100)",
        ),
        "a100-80gb": profile(
            "a100-80gb", {"memory_gb": 80}, a100_gemm, attention_points("A100 SXM4 80GB"), a100_coll,
            device_name="NVIDIA A100-SXM4-80GB", peaks=a100_peaks, pcie_gbps=31.5, hbm_gbps=2039,
            nic_gbps=22.75, op_overhead_us=op_overhead, note="A100 GEMM (best point; the H100's measured "
            "surface), attention and NVLink 3 data; HDR NIC 22.75 GB/s",
        ),
        "h100-sxm": profile(
            "h100-sxm", {"memory_gb": 80}, h100_gemm, measured_points(h100, "attention") + h_triton, h_coll,
            device_name="NVIDIA H100 80GB HBM3", peaks=h100_peaks, pcie_gbps=63, hbm_gbps=3350,
            nic_gbps=47.0, memory_bound=measured_memory_bound(h100), note="H100 GEMM, attention and "
            "elementwise work measured (stx calibrate, one GPU); NVLink 4 sweep measured on H200 (same "
            "fabric); NDR NIC 47 GB/s (maintainer, nccl-tests issue 290)",
        ),
        "h200-sxm": profile(
            "h200-sxm", {"memory_gb": 141}, h200_gemm, measured_points(h200, "attention") + h_triton, h_coll,
            device_name="NVIDIA H200", peaks=h100_peaks, pcie_gbps=63, hbm_gbps=4800, nic_gbps=47.0,
            memory_bound=measured_memory_bound(h200), note="H200 GEMM, attention and elementwise work "
            "measured (stx calibrate, one GPU); H200 NVLink 4 sweep",
        ),
    }  # fmt: skip
    OUT.mkdir(parents=True, exist_ok=True)
    for key, data in specs.items():
        path = OUT / f"{key}.yaml"
        save_profile(profile_from_dict(data, str(path)), path)
        assert math.isfinite(yaml.safe_load(path.read_text())["memory_bound"]["bandwidth_gbps"])
        print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
