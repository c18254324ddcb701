"""Where a GPU step's time goes, by the time model's op classes: GEMM, attention, memory-bound (every
other kernel: elementwise, norms, softmax, the loss, the optimizer, copies), communication; and how much
of the step the GPU is idle (launch gaps, host work). Runs `stx train` cases of benchmarks/gpu_check.py
with a torch.profiler window (logging.profile_*), reads each Chrome trace back and prints one JSON line
per case with the kernel milliseconds per step by class, beside `stx plan`'s `time_classes_seconds`
for the same config (the built-in profile of the GPU's table entry).

    python benchmarks/gpu_kernel_classes.py --out /tmp/kc --cases gpt-7b-4l,gpt-125m     # on a GPU
    python benchmarks/gpu_kernel_classes.py --trace run/profile/trace_rank0.json         # one trace

Kernels are classified by name (cuBLAS/CUTLASS GEMM kernels, flash / memory-efficient attention, NCCL);
the window's steps are the `ProfilerStep#N` ranges. Record: benchmarks/results/gpu_check-h100.md.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from gpu_check import CASES, COMMON, plan, stx_command  # noqa: E402
from scalable_transformer.metrics.trace_analysis import (  # noqa: E402
    COMM_PATTERN,
    STEP_PATTERN,
    _length,
    _union,
    load_events,
)

ATTENTION = re.compile(r"flash|fmha|attention|attn", re.IGNORECASE)
GEMM = re.compile(r"gemm|nvjet|cutlass|xmma|cublas|wgmma|splitk", re.IGNORECASE)
KERNEL_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def kernel_class(name: str) -> str:
    if COMM_PATTERN.search(name):
        return "communication"
    if ATTENTION.search(name):
        return "attention"
    if GEMM.search(name):
        return "gemm"
    return "memory_bound"


def kernel_classes(path: Path) -> dict[str, Any]:
    """Per profiled step: kernel milliseconds by class, GPU busy (union of kernels) and the host's
    step time (the ProfilerStep ranges), from one trace."""
    events = load_events(path)
    steps = [e for e in events if STEP_PATTERN.match(str(e.get("name", "")))]
    kernels = [e for e in events if e.get("cat") in KERNEL_CATEGORIES]
    # one range per step on the host and one on the GPU (gpu_user_annotation): count the names
    n = max(len({str(e["name"]) for e in steps}), 1)
    per_name: dict[str, float] = {}  # microseconds per kernel name
    for e in kernels:
        per_name[str(e["name"])] = per_name.get(str(e["name"]), 0.0) + float(e["dur"])
    by_class: dict[str, float] = {}
    for name, us in per_name.items():
        by_class[kernel_class(name)] = by_class.get(kernel_class(name), 0.0) + us
    busy_spans = _union([(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in kernels])
    span = busy_spans[-1][1] - busy_spans[0][0] if busy_spans else 0.0
    return {
        "steps": n,
        "kernel_ms_per_step": {k: round(v / n / 1000, 3) for k, v in sorted(by_class.items())},
        "gpu_busy_ms_per_step": round(_length(busy_spans) / n / 1000, 3),
        "kernel_span_ms_per_step": round(span / n / 1000, 3),
        "host_step_ms": round(
            sum(float(e["dur"]) for e in steps if e.get("cat") != "gpu_user_annotation") / n / 1000, 3
        ),
        "gpu_step_ms": round(
            sum(float(e["dur"]) for e in steps if e.get("cat") == "gpu_user_annotation") / n / 1000, 3
        ),
        "top_kernels_ms_per_step": {
            k[:90]: round(v / n / 1000, 3) for k, v in sorted(per_name.items(), key=lambda kv: -kv[1])[:12]
        },
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, help="run directory root (with --cases)")
    p.add_argument("--cases", help=f"comma-separated, of {', '.join(CASES)}")
    p.add_argument("--trace", type=Path, action="append", default=[], help="analyse this trace only")
    p.add_argument("--iters", type=int, default=8, help="iterations per case; steps 5-6 are profiled")
    args = p.parse_args()
    for trace in args.trace:
        print(json.dumps({"trace": str(trace), **kernel_classes(trace)}))
    if not args.cases:
        return 0
    import torch

    from scalable_transformer.metrics.device_specs import detect_device_name

    device = detect_device_name(torch.cuda.get_device_name(0)) if torch.cuda.is_available() else "cpu"
    common = [c for c in COMMON if not c.startswith("train.train_iters")]
    for case in args.cases.split(","):
        train_args = [CASES[case][0], *common, *CASES[case][1:], f"train.train_iters={args.iters}"]
        run = [
            *train_args,
            "logging.profile_start_step=5",
            "logging.profile_end_step=6",
            f"logging.run_dir={args.out}",
            f"logging.run_name={case}",
        ]
        proc = subprocess.run([*stx_command(), "train", *run], capture_output=True, text=True)
        row: dict[str, Any] = {"case": case, "returncode": proc.returncode}
        trace = args.out / case / "profile" / "trace_rank0.json"
        if trace.is_file():
            row.update(kernel_classes(trace))
        else:
            row["tail"] = (proc.stdout + proc.stderr)[-1500:]
        planned = plan(train_args, device) if device != "cpu" else {}
        row["plan_classes_seconds"] = planned.get("classes")
        row["plan_step_seconds"] = planned.get("step_seconds")
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
