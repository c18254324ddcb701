"""The planner against measurements on this machine: predicted vs measured peak live tensor bytes per
rank and step time, for layouts on 1-4 CPU processes (issue 13's "must show").

For every layout: the prediction (`plan.search.plan_config` on `calibrate.this_machine.cpu_cluster(nproc)`:
this CPU's measured GEMM, memory-bandwidth, op-overhead and gloo rates) and one run of
`stx launch -n N train BASE ... logging.track_tensor_bytes=true`, whose summary.json gives the
measured `peak_tensor_bytes_per_rank` (torch.profiler allocation events, steps 1-3, the largest rank)
and `median_iteration_seconds` (steps after the warm-up, run without the profiler). Targets: memory
within 10%, step time within 25%. Layouts run one after the other (never more than 4 processes).

    python benchmarks/plan_accuracy.py                        # every layout, ~25 min on 2 idle cores
    python benchmarks/plan_accuracy.py --only bert-z0 gpt-tp2 # some of them
    python benchmarks/plan_accuracy.py --iters 10 --output /tmp/plan.md
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

# the model of every layout: small enough for 2 cores, with layers, attention and logits all mattering
COMMON = [
    "model.num_layers=12",
    "model.hidden_size=256",
    "model.num_attention_heads=4",
    "model.seq_length=128",
    "model.vocab_size=16384",  # the embedded tokenizer's may be smaller: plan and run see the same
    "train.eval_interval=0",
    "train.eval_iters=1",
    "logging.tensorboard=false",
    "logging.track_tensor_bytes=true",
]

RECOMPUTE = "parallel.activation_checkpointing"
# name: (base preset, processes, overrides)
LAYOUTS: dict[str, tuple[str, int, list[str]]] = {
    "bert-z0-mb4": ("tiny-bert", 1, ["train.micro_batch_size=4"]),
    "bert-z0-mb8": ("tiny-bert", 1, ["train.micro_batch_size=8"]),
    "bert-selective": ("tiny-bert", 1, ["train.micro_batch_size=8", f"{RECOMPUTE}=selective"]),
    "bert-full": ("tiny-bert", 1, ["train.micro_batch_size=8", f"{RECOMPUTE}=full"]),
    "gpt-z0-dp2": ("tiny-gpt", 2, ["train.micro_batch_size=4"]),
    "gpt-z1-dp2": ("tiny-gpt", 2, ["train.micro_batch_size=4", "parallel.zero_stage=1"]),
    "gpt-z2-dp2": ("tiny-gpt", 2, ["train.micro_batch_size=4", "parallel.zero_stage=2"]),
    "gpt-z3-dp2": ("tiny-gpt", 2, ["train.micro_batch_size=4", "parallel.zero_stage=3"]),
    "gpt-z3-offload": (
        "tiny-gpt", 2, ["train.micro_batch_size=4", "parallel.zero_stage=3", "offload_optimizer=true"]
    ),
    "gpt-tp2": ("tiny-gpt", 2, ["train.micro_batch_size=4", "parallel.tp=2"]),
    "gpt-tp2-sp": ("tiny-gpt", 2, ["train.micro_batch_size=4", "parallel.tp=2", "sequence-parallel=true"]),
    "gpt-pp2-1f1b": (
        "tiny-gpt", 2, ["train.micro_batch_size=2", "train.gradient_accumulation_steps=4", "parallel.pp=2"]
    ),
    "gpt-pp2-gpipe": (
        "tiny-gpt",
        2,
        ["train.micro_batch_size=2", "train.gradient_accumulation_steps=4", "parallel.pp=2",
         "parallel.pipeline_schedule=gpipe"],
    ),
    "gpt-pp2-interleaved": (
        "tiny-gpt",
        2,
        ["train.micro_batch_size=2", "train.gradient_accumulation_steps=4", "parallel.pp=2",
         "parallel.pipeline_schedule=interleaved-1f1b", "parallel.virtual_pipeline_stages=2"],
    ),
    "bert-dp2-tp2-z2": (
        "tiny-bert", 4, ["train.micro_batch_size=4", "parallel.tp=2", "parallel.zero_stage=2"]
    ),
}  # fmt: skip


def predict(
    base: str, nproc: int, overrides: list[str], profiles: dict[int, str], probe: bool = True
) -> dict:
    """The planner's prediction: memory and the probed step time on this CPU; the time model's step
    (`--no-probe`) on `cpu_cluster` or, where `profiles` has one for `nproc` processes (`--hardware`),
    on that hardware profile (`stx calibrate`'s)."""
    from scalable_transformer.calibrate.this_machine import cpu_cluster, fingerprint_here
    from scalable_transformer.config.load import load_config
    from scalable_transformer.plan.cluster import load_hardware, with_nodes
    from scalable_transformer.plan.search import plan_config

    cfg = load_config(base, overrides)
    cluster = cpu_cluster(nproc, cfg.train.precision)
    timed = (
        with_nodes(load_hardware(profiles[nproc], here=fingerprint_here), 1, nproc)
        if nproc in profiles
        else cluster
    )
    rate = plan_config(cfg, timed).to_dict()
    probed = plan_config(cfg, cluster, probe=True, remeasure=True).to_dict() if probe else rate
    return {
        **probed,
        "rate_model_step_seconds": rate["step_seconds"],
        "rate_model_classes": rate["time_classes_seconds"],
        "rate_model_source": profiles.get(nproc, "cpu_cluster (metrics/cpu_rates.py)"),
    }


def _profiles(paths: list[str]) -> dict[int, str]:
    """--hardware files by the process count their fingerprint was measured with."""
    from scalable_transformer.plan.hardware_profile import load_profile

    out = {}
    for path in paths:
        processes = load_profile(path).fingerprint.get("processes")
        if not isinstance(processes, int):
            raise SystemExit(f"{path}: fingerprint.processes is not set; cannot match it to a layout")
        out[processes] = path
    return out


def run_command(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    """`cmd` with its output captured; on a timeout every process it started is stopped (SIGTERM,
    then SIGKILL 10 s later) before TimeoutExpired is raised: killing `stx launch` or `stx plan
    --dry-run` alone left their training ranks or dry-run workers (own sessions) running for minutes."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        tree = [proc.pid, *_descendants(proc.pid)]
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in tree:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.communicate(timeout=10)
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def _descendants(pid: int) -> list[int]:
    """Every process below `pid` (from /proc: children first found, then theirs)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        found = children.get(todo.pop(), [])
        out += found
        todo += found
    return out


def measure(stx: str, base: str, nproc: int, overrides: list[str], run_dir: Path, timeout: float) -> dict:
    cmd = [stx, "launch", "-n", str(nproc), "train", base, *overrides, f"logging.run_dir={run_dir}"]
    start = time.perf_counter()
    try:
        proc = run_command(cmd, timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timeout after {timeout:.0f} s", "command": shlex.join(cmd)}
    wall = time.perf_counter() - start
    load_after = os.getloadavg()[0]
    summaries = sorted(run_dir.glob("*/summary.json"))
    if proc.returncode != 0 or not summaries:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        return {"error": f"exit {proc.returncode}: " + " | ".join(tail), "command": shlex.join(cmd)}
    summary = json.loads(summaries[-1].read_text())
    per_rank = summary.get("peak_tensor_bytes_per_rank") or []
    return {
        "command": shlex.join(cmd),
        "peak_tensor_bytes_per_rank": per_rank,
        "peak_tensor_bytes": max((v for v in per_rank if v is not None), default=None),
        "step_seconds": summary["median_iteration_seconds"],
        "wall_seconds": wall,
        "load_after": load_after,
        "phase_time_ms_median": summary.get("phase_time_ms_median"),
    }


def ratio_text(pred: float | None, meas: float | None, target: float) -> tuple[str, bool]:
    if pred is None or meas is None or meas <= 0:
        return "n/a", False
    err = pred / meas - 1
    ok = abs(err) <= target
    return f"{err:+.1%}{'' if ok else ' (outside)'}", ok


def search_timing() -> str:
    """`--search` over every layout of 8 x 8 A100-40GB for bert-175b: wall and CPU seconds."""
    from scalable_transformer.config.load import load_config
    from scalable_transformer.plan.cluster import table_cluster
    from scalable_transformer.plan.search import search_layouts

    wall, cpu = time.perf_counter(), time.process_time()
    results = search_layouts(load_config("bert-175b"), table_cluster("a100-40gb", 8, 8))
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    fit = sum(r.fits for r in results)
    return (
        f"Search: bert-175b on 8 x 8 A100-40GB, {len(results)} valid layouts ({fit} fit) in "
        f"{wall:.2f} s wall, {cpu:.2f} s CPU "
        f"(load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)."
    )


def render(rows: list[dict], args: argparse.Namespace, env: dict) -> str:
    mib = 2**20
    lines = [
        f"# Planner accuracy on this machine ({dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC)",
        "",
        f"Command: `python benchmarks/plan_accuracy.py {' '.join(sys.argv[1:])}`",
        "",
        f"Every layout: `{shlex.join(COMMON)}` plus its own overrides, `train.train_iters={args.iters}`, "
        f"`logging.warmup_iters={args.warmup}`; measured memory = the largest rank's peak live tensor bytes "
        "(torch.profiler allocation events over steps 1-3, `summary.json` `peak_tensor_bytes_per_rank`), "
        "measured time = rank 0's median step after the warm-up (steps without the profiler). "
        "Predicted: `stx plan ... --device cpu` for the same config and process count: memory by the "
        "analytic model, step time measured by its depth probes (plan/probe.py: the engine at 1 and 4 "
        "layers per pipeline chunk, 16 iterations each (median after 3), extrapolated to 12 layers; "
        "taken fresh right before the measured run, never from the cache); the rate model's step time "
        "(plan/speed.py, what "
        "`--search` and `--no-probe` use) is in its own column. Targets: memory within 10%, step time "
        "within 25%. The last column shows the 1-minute load average before and after each run.",
        "",
        "Time-model column: "
        + (
            ", ".join(f"{n} process(es): `{f}`" for n, f in sorted(_profiles(args.hardware).items()))
            or "this CPU's cached rates (metrics/cpu_rates.py)"
        )
        + ".",
        "",
        "| layout | processes | predicted MiB | measured MiB | memory error | predicted s/step | "
        "measured s/step | time error | time model s/step (error) | load before / after |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    mem_ok = time_ok = total = 0
    for r in rows:
        p, m = r["predicted"], r["measured"]
        if "error" in m:
            predicted = p["peak_memory_bytes"] / mib
            failed = f"failed: {m['error']}"
            lines.append(f"| {r['name']} | {r['nproc']} | {predicted:.1f} | {failed} | | | | | | |")
            continue
        total += 1
        mem_text, ok_m = ratio_text(p["peak_memory_bytes"], m["peak_tensor_bytes"], 0.10)
        time_text, ok_t = ratio_text(p["step_seconds"], m["step_seconds"], 0.25)
        rate = p["rate_model_step_seconds"]
        mem_ok += ok_m
        time_ok += ok_t
        measured_mib = m["peak_tensor_bytes"] / mib if m["peak_tensor_bytes"] else float("nan")
        lines.append(
            f"| {r['name']} | {r['nproc']} | {p['peak_memory_bytes'] / mib:.1f} | {measured_mib:.1f} | "
            f"{mem_text} | {p['step_seconds']:.3f} | {m['step_seconds']:.3f} | {time_text} | "
            f"{rate:.3f} ({rate / m['step_seconds'] - 1:+.0%}) | "
            f"{r['load_before']:.1f} / {m['load_after']:.1f} |"
        )
    lines += [
        "",
        f"Within target: memory {mem_ok}/{total}, step time {time_ok}/{total}.",
        "",
        search_timing(),
        "",
        "## Predicted breakdowns",
        "",
    ]
    for r in rows:
        p = r["predicted"]
        mem = ", ".join(f"{k} {v / mib:.1f}" for k, v in p["memory_breakdown_bytes"].items() if v)
        tim = ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in p["time_breakdown_seconds"].items() if v)
        lines.append(f"- **{r['name']}** ({p['label']}): memory MiB: {mem}; time: {tim} ({p['time_method']})")
        if "command" in r["measured"]:
            lines.append(f"  - measured by `{r['measured']['command']}`")
            if r["measured"].get("peak_tensor_bytes_per_rank"):
                per = ", ".join(f"{(v or 0) / mib:.1f}" for v in r["measured"]["peak_tensor_bytes_per_rank"])
                lines.append(
                    f"  - per rank MiB: {per}; phases ms: {r['measured'].get('phase_time_ms_median')}"
                )
    lines += ["", "## Environment", "", "```json", json.dumps(env, indent=1), "```", ""]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", nargs="*", help=f"layouts to run (default all): {', '.join(LAYOUTS)}")
    p.add_argument("--iters", type=int, default=16, help="training iterations per layout (default 16)")
    p.add_argument(
        "--warmup", type=int, default=4, help="iterations left out of the median (default 4, >= 3)"
    )
    p.add_argument("--timeout", type=float, default=900, help="seconds per layout (default 900)")
    p.add_argument("--output", default=str(ROOT / "benchmarks/results/plan_accuracy.md"))
    p.add_argument("--json", help="also write the raw rows as JSON here")
    p.add_argument("--stx", help="the stx command (default: the one beside this python)")
    p.add_argument(
        "--hardware",
        action="append",
        default=[],
        metavar="PROFILE",
        help="a hardware profile (stx calibrate) for the time-model column, used for the layouts of the "
        "process count it was measured with; repeat for several counts",
    )
    p.add_argument(
        "--no-probe",
        action="store_true",
        help="skip the depth probes: the predicted column is the time model's",
    )
    args = p.parse_args()
    profiles = _profiles(args.hardware)
    if args.warmup < 3:
        p.error("--warmup must be >= 3: the first 3 steps run under the memory profiler")
    stx = args.stx or str(Path(sys.executable).parent / "stx")
    if not Path(stx).exists():
        stx = shutil.which("stx") or "stx"
    from scalable_transformer.metrics.environment import environment

    names = args.only or list(LAYOUTS)
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        p.error(f"unknown layouts {unknown}; known: {', '.join(LAYOUTS)}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="stx-plan-accuracy-") as tmp:
        for name in names:
            base, nproc, own = LAYOUTS[name]
            overrides = [
                *COMMON,
                *own,
                f"train.train_iters={args.iters}",
                f"logging.warmup_iters={args.warmup}",
            ]
            load_before = os.getloadavg()[0]
            predicted = predict(base, nproc, overrides, profiles, probe=not args.no_probe)
            measured = measure(stx, base, nproc, overrides, Path(tmp) / name, args.timeout)
            rows.append(
                {
                    "name": name,
                    "nproc": nproc,
                    "predicted": predicted,
                    "measured": measured,
                    "load_before": load_before,
                }
            )
            m = measured.get("peak_tensor_bytes")
            print(
                f"{name}: predicted {predicted['peak_memory_bytes'] / 2**20:.1f} MiB "
                f"{predicted['step_seconds']:.3f} s; measured "
                + (
                    f"{m / 2**20:.1f} MiB {measured['step_seconds']:.3f} s"
                    if m
                    else str(measured.get("error"))
                ),
                flush=True,
            )
            if args.json:
                Path(args.json).write_text(json.dumps(rows, indent=1))
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render(rows, args, environment()))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONPATH", str(ROOT / "src"))
    sys.exit(main())
