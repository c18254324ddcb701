"""The dry run against the real run, on every layout of benchmarks/plan_accuracy.py (issue 20).

For each layout: `dryrun.dry_run.dry_run_isolated` (the engine on fake tensors over a fake process group
of the layout's size, device cpu) and one real `stx launch -n N train ...` of the same config with
`logging.track_tensor_bytes=true`, whose summary.json gives `peak_tensor_bytes_per_rank`. Each
simulated rank is compared with the same rank of the real run (target: within 3%), and the ranks the
dry run does not simulate are compared with the simulated rank of their memory class (same pipeline
rank). Layouts run one after the other (never more than 4 processes).

    python benchmarks/dry_run_fidelity.py                         # every layout, ~10 min on 2 cores
    python benchmarks/dry_run_fidelity.py --only gpt-z3-dp2 gpt-tp2-sp --output /tmp/fidelity.md
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import plan_accuracy  # noqa: E402  (the layouts and their model)
from scalable_transformer.metrics.device_table import cpu_model  # noqa: E402

TARGET = 0.03
EXTRA = ["train.train_iters=4", "logging.log_interval=2"]


def real_run(stx: str, base: str, nproc: int, overrides: list[str], run_dir: Path) -> tuple[list, str]:
    measured = plan_accuracy.measure(stx, base, nproc, overrides, run_dir, timeout=900)
    if "error" in measured:
        raise RuntimeError(measured["error"])
    return measured["peak_tensor_bytes_per_rank"], measured["command"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="layout names (default: all)")
    parser.add_argument("--output", default=str(ROOT / "benchmarks" / "results" / "dry_run_fidelity.md"))
    args = parser.parse_args()
    import torch

    from scalable_transformer.config.load import load_config
    from scalable_transformer.config.validate import resolve
    from scalable_transformer.dryrun.dry_run import DryRunError, dry_run_isolated

    stx = str(Path(sys.executable).with_name("stx"))
    names = args.only or list(plan_accuracy.LAYOUTS)
    rows, within, compared = [], 0, 0
    started = time.perf_counter()
    for name in names:
        base, nproc, layout = plan_accuracy.LAYOUTS[name]
        overrides = [*plan_accuracy.COMMON, *layout, *EXTRA]
        cfg = resolve(load_config(base, overrides), nproc)
        try:
            dry = dry_run_isolated(cfg, nproc, "cpu")
            with tempfile.TemporaryDirectory() as tmp:
                real, command = real_run(stx, base, nproc, overrides, Path(tmp))
        except (DryRunError, RuntimeError, subprocess.TimeoutExpired) as e:
            rows.append(f"| {name} | {nproc} | - | - | - | failed: {e} |")
            print(name, "failed:", e, flush=True)
            continue
        by_stage = {r["stage"]: r for r in dry["ranks"]}
        p = cfg.parallel
        cells = []
        for rank, measured in enumerate(real):
            stage = rank // (p.dp * p.tp)
            simulated = next((r for r in dry["ranks"] if r["rank"] == rank), None)
            ref = simulated or by_stage[stage]
            error = ref["peak_memory_bytes"] / measured - 1 if measured else None
            if error is not None:
                compared += 1
                within += abs(error) <= TARGET
            mark = "" if simulated else " (class)"
            cells.append(
                f"r{rank}: {ref['peak_memory_bytes'] / 2**20:.1f} / {measured / 2**20:.1f} "
                f"({error:+.2%}){mark}"
                if error is not None
                else f"r{rank}: n/a"
            )
        worst = max(abs(r["peak_memory_bytes"] / m - 1) for r, m in _pairs(dry, real, p) if m)
        rows.append(
            f"| {name} | {nproc} | {'; '.join(cells)} | {worst:.2%} | {dry['seconds']:.1f} | `{command}` |"
        )
        print(name, f"worst {worst:.2%}", flush=True)
    header = [
        "# Dry run vs real run: peak live tensor bytes per rank (benchmarks/dry_run_fidelity.py)",
        "",
        f"Date {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC; {cpu_model()}, {os.cpu_count()} cores; "
        f"torch {torch.__version__}, Python {platform.python_version()}; "
        f"{time.perf_counter() - started:.0f} s.",
        f"Model: {' '.join(plan_accuracy.COMMON)} {' '.join(EXTRA)}. Real: `logging.track_tensor_bytes` "
        "(torch.profiler allocation events, metrics/live_tensor_bytes.py). Dry: `stx plan --dry-run`'s "
        "engine on fake tensors, device cpu (dryrun/dry_run.py); a rank not simulated is compared with the "
        "simulated rank of its pipeline stage ('class').",
        "",
        f"Within {TARGET:.0%}: {within} of {compared} ranks.",
        "",
        "| layout | processes | dry / real MiB per rank (error) | worst | dry-run s | real run |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    out = Path(args.output)
    tmp = out.with_suffix(".tmp")
    tmp.write_text("\n".join([*header, *rows]) + "\n", encoding="utf-8")
    tmp.chmod(0o644)
    tmp.replace(out)
    print(f"{within} of {compared} ranks within {TARGET:.0%}; record: {out}")
    return 0


def _pairs(dry: dict, real: list, p) -> list[tuple[dict, int]]:
    by_stage = {r["stage"]: r for r in dry["ranks"]}
    out = []
    for rank, measured in enumerate(real):
        simulated = next((r for r in dry["ranks"] if r["rank"] == rank), None)
        out.append((simulated or by_stage[rank // (p.dp * p.tp)], measured))
    return out


if __name__ == "__main__":
    sys.exit(main())
