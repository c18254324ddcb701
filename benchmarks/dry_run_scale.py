"""`stx plan --dry-run` at scale: the real engine on fake tensors over a fake process group of 64-1024
ranks (A100-40GB / A100-80GB nodes of 8 GPUs), beside the analytic planner, for layouts of gpt-13b,
gpt-7b and bert-175b across ZeRO-0/1/2/3, offload, tensor/sequence/pipeline parallelism, every
pipeline schedule, recompute modes and micro-batch sizes.

For every layout: `plan.search.plan_config` on `plan.cluster.table_cluster(device, nodes, 8)`, then
`dryrun.dry_run.verify` (the dry run in a child process, `dry_run_isolated`: one simulated rank per
pipeline rank, plus ZeRO-1's heaviest optimizer shard). Per simulated rank the record has the dry
run's peak live tensor bytes against the analytic stage total less its reserve, and where the peak
is; per layout the dry run's seconds, host syncs in a non-logging step, the child's peak RSS, and
whether the layout fits the device. Layouts run one after the other (one dry run at a time); a
layout whose plan or dry run fails is a row with its error.

Global batch sizes keep gradient accumulation small (1-16; pipeline layouts need accumulation >= pp)
because a dry run's time grows with micro-batches x layers, not with the micro-batch size.

    python benchmarks/dry_run_scale.py                                   # every layout, ~9 min on 2 cores
    python benchmarks/dry_run_scale.py --only gpt13b-z0-tp8 gpt7b-pp16-1f1b
    python benchmarks/dry_run_scale.py --output /tmp/scale.md --json /tmp/scale.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

GIB = 2**30
GPUS_PER_NODE = 8
TARGET = 0.05  # |dry run / analytic - 1| above this is called out
RECOMPUTE = "parallel.activation_checkpointing"
SCHEDULE = "parallel.pipeline_schedule"

# name: (preset, device, nodes, overrides)
LAYOUTS: dict[str, tuple[str, str, int, list[str]]] = {
    "gpt13b-z0-tp8": (
        "gpt-13b", "a100-40gb", 8,
        ["parallel.tp=8", "train.micro_batch_size=1", "train.global_batch_size=8"],
    ),
    "gpt13b-z1-mb2": (
        "gpt-13b", "a100-80gb", 16,
        ["parallel.zero_stage=1", "train.micro_batch_size=2", "train.global_batch_size=256"],
    ),
    "gpt13b-z2-tp4-sp": (
        "gpt-13b", "a100-40gb", 16,
        ["parallel.zero_stage=2", "parallel.tp=4", "parallel.sequence_parallel=true",
         "train.micro_batch_size=2", "train.global_batch_size=128"],
    ),
    "gpt13b-z2-tp2-selective": (
        "gpt-13b", "a100-80gb", 32,
        ["parallel.zero_stage=2", "parallel.tp=2", f"{RECOMPUTE}=selective",
         "train.micro_batch_size=4", "train.global_batch_size=512"],
    ),
    "gpt13b-z3-tp2-full-mb8": (
        "gpt-13b", "a100-40gb", 8,
        ["parallel.zero_stage=3", "parallel.tp=2", f"{RECOMPUTE}=full",
         "train.micro_batch_size=8", "train.global_batch_size=256"],
    ),
    "gpt13b-tp4-pp2-gpipe": (
        "gpt-13b", "a100-80gb", 8,
        ["parallel.tp=4", "parallel.pp=2", f"{SCHEDULE}=gpipe",
         "train.micro_batch_size=2", "train.global_batch_size=32"],
    ),
    "gpt13b-tp8-pp4-1f1b": (
        "gpt-13b", "a100-40gb", 32,
        ["parallel.tp=8", "parallel.pp=4", f"{SCHEDULE}=1f1b",
         "train.micro_batch_size=1", "train.global_batch_size=32"],
    ),
    "gpt7b-tp2-pp8-interleaved": (
        "gpt-7b", "a100-40gb", 128,
        ["parallel.tp=2", "parallel.pp=8", f"{SCHEDULE}=interleaved-1f1b",
         "parallel.virtual_pipeline_stages=2", "train.micro_batch_size=1", "train.global_batch_size=512"],
    ),
    "gpt7b-tp2-pp16-1f1b": (
        "gpt-7b", "a100-80gb", 64,
        ["parallel.tp=2", "parallel.pp=16", f"{SCHEDULE}=1f1b",
         "train.micro_batch_size=1", "train.global_batch_size=256"],
    ),
    "gpt7b-z2-offload-opt-tp2-mb16": (
        "gpt-7b", "a100-40gb", 16,
        ["parallel.zero_stage=2", "parallel.offload_optimizer=true", "parallel.tp=2",
         "train.micro_batch_size=16", "train.global_batch_size=1024"],
    ),
    "gpt7b-z3-offload-param-opt": (
        "gpt-7b", "a100-40gb", 64,
        ["parallel.zero_stage=3", "parallel.offload_optimizer=true", "parallel.offload_param=true",
         "train.micro_batch_size=4", "train.global_batch_size=2048"],
    ),
    "gpt7b-tp16-sp-mb32": (
        "gpt-7b", "a100-80gb", 32,
        ["parallel.tp=16", "parallel.sequence_parallel=true",
         "train.micro_batch_size=32", "train.global_batch_size=512"],
    ),
    "bert175b-tp8-pp4-selective": (
        "bert-175b", "a100-80gb", 64,
        ["parallel.tp=8", "parallel.pp=4", f"{RECOMPUTE}=selective",
         "train.micro_batch_size=4", "train.global_batch_size=256"],
    ),
    "bert175b-z3-tp16-full-mb32": (
        "bert-175b", "a100-40gb", 64,
        ["parallel.zero_stage=3", "parallel.tp=16", f"{RECOMPUTE}=full",
         "train.micro_batch_size=32", "train.global_batch_size=1024"],
    ),
    "bert175b-z2-offload-opt-tp8": (
        "bert-175b", "a100-80gb", 16,
        ["parallel.zero_stage=2", "parallel.offload_optimizer=true", "parallel.tp=8",
         "train.micro_batch_size=2", "train.global_batch_size=32"],
    ),
}  # fmt: skip


def run_layout(name: str) -> dict:
    """Plan and dry-run one layout; every failure becomes the row's `error`."""
    from scalable_transformer.config.load import load_config
    from scalable_transformer.dryrun.dry_run import verify
    from scalable_transformer.plan.cluster import table_cluster
    from scalable_transformer.plan.search import plan_config

    preset, device, nodes, overrides = LAYOUTS[name]
    row: dict = {
        "name": name,
        "model": preset,
        "device": device,
        "nodes": nodes,
        "gpus_per_node": GPUS_PER_NODE,
        "overrides": overrides,
    }
    start = time.perf_counter()
    try:
        cfg = load_config(preset, overrides)
        cluster = table_cluster(device, nodes, GPUS_PER_NODE)
        pred = plan_config(cfg, cluster)
        row.update(
            label=pred.layout.label(),
            fits=pred.fits,
            reason=pred.reason,
            device_memory_bytes=cluster.device.memory_bytes,
            stages={st.pp_rank: dict(st.breakdown) | {"total": st.total} for st in pred.stages},
        )
        pred = verify(pred, cfg, cluster)
        row["dry_run"] = pred.dry_run
        if pred.dry_run and "error" in pred.dry_run:
            row["error"] = pred.dry_run["error"]
    except Exception as e:  # a plan that cannot be made is a row too
        row["error"] = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:400]}"
    row["wall_seconds"] = time.perf_counter() - start
    return row


def _gib(n: float | None) -> str:
    return "n/a" if n is None else f"{n / GIB:.2f}"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _peak_where(peak_at: dict) -> str:
    where = peak_at.get("phase") or "?"
    if peak_at.get("module"):
        where += f" ({peak_at['module']})"
    return f"{where} / {peak_at.get('op') or '?'}, step {peak_at.get('step')}"


def _fits_text(row: dict, rank: dict) -> str:
    """The planner's verdict, and the dry run's peak plus the planner's reserve against the device."""
    planner = "yes" if row["fits"] else "no"
    reserve = row["stages"].get(rank["stage"], {}).get("reserve", 0)
    dry = "yes" if rank["peak_memory_bytes"] + reserve <= row["device_memory_bytes"] else "no"
    return f"{planner} / {dry}"


def render(rows: list[dict], args: argparse.Namespace, env: dict, total_seconds: float) -> str:
    cmd = shlex.join(["python", "benchmarks/dry_run_scale.py", *sys.argv[1:]])
    lines = [
        f"# Dry runs at scale ({env['date']})",
        "",
        f"Command: `{cmd}` (total {total_seconds / 60:.1f} min, one dry run at a time).",
        "",
        "Every layout: `stx plan` for the preset with the overrides listed below on "
        f"`table_cluster(device, nodes, {GPUS_PER_NODE})`, then `dryrun.dry_run.verify`: the engine "
        "(`Trainer.fit`, two steps, the second a logging step) on fake tensors over a fake process group "
        "of the target world size, one simulated rank per pipeline rank (dp = tp = 0; under ZeRO-1 also "
        "the dp rank with the largest optimizer shard), in a child process. *Dry run GiB* = that rank's "
        "peak live tensor bytes; *analytic GiB* = the planner's total for its pipeline rank less the "
        "reserve (CUDA context, allocator slack), which no tensor holds; *difference* = dry / analytic - 1. "
        "*Peak at* = phase (module) / op and step of the dry run's peak. *Seconds* = the dry run's own "
        "time (all simulated ranks); *wall* adds the plan and the child process's start. *Host syncs* = "
        "host reads of device values in the first (non-logging) step of rank 0. *RSS* = the dry run "
        "process's peak resident set. *Fits* = the planner's verdict / the dry run's peak plus the "
        "planner's reserve within the device's memory.",
        "",
        "| layout | model | ranks | device | label | pp rank (rank) | dry run GiB | analytic GiB | "
        "difference | peak at | seconds (wall) | host syncs/step | RSS GiB | fits (planner / dry) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    diffs: list[float] = []
    beyond: list[str] = []
    failed: list[dict] = []
    timed: list[tuple[float, str]] = []
    for r in rows:
        ranks_text = f"{r['nodes'] * r['gpus_per_node']} ({r['nodes']} x {r['gpus_per_node']})"
        head = f"| {r['name']} | {r['model']} | {ranks_text} | {r['device']} | {r.get('label', '')} |"
        if "error" in r:
            failed.append(r)
            lines.append(f"{head} | | | | failed: {_cell(r['error'])} | ({r['wall_seconds']:.0f}) | | | |")
            continue
        d = r["dry_run"]
        timed.append((d["seconds"], r["name"]))
        worst = 0.0
        for i, rank in enumerate(d["ranks"]):
            diff = rank.get("difference")
            if diff is not None:
                diffs.append(abs(diff))
                worst = max(worst, abs(diff))
            per_layout = (
                f"{d['seconds']:.1f} ({r['wall_seconds']:.0f}) | {d['host_syncs_per_step']} | "
                f"{_gib(d.get('process_peak_rss_bytes'))}"
                if i == 0
                else " | | "
            )
            lines.append(
                f"{head if i == 0 else '| | | | | |'} {rank['stage']} ({rank['rank']}) | "
                f"{_gib(rank['peak_memory_bytes'])} | {_gib(rank.get('predicted_bytes'))} | "
                f"{'n/a' if diff is None else f'{diff:+.1%}'} | {_cell(_peak_where(rank['peak_at']))} | "
                f"{per_layout} | {_fits_text(r, rank)} |"
            )
        if worst > TARGET:
            beyond.append(f"{r['name']} ({worst:.1%})")
    lines += ["", "## What it shows", ""]
    ok = len(rows) - len(failed)
    summary = [f"{ok} of {len(rows)} layouts dry-ran ({len(diffs)} simulated ranks)."]
    if diffs:
        summary.append(
            f"|difference| between the dry run's peak and the analytic prediction: median "
            f"{statistics.median(diffs):.1%}, max {max(diffs):.1%}."
        )
        summary.append(
            f"Layouts with a rank beyond {TARGET:.0%}: "
            + (", ".join(beyond) if beyond else "none")
            + f" ({len(beyond)} of {ok})."
        )
    if timed:
        slow, slow_name = max(timed)
        median = statistics.median(t for t, _ in timed)
        summary.append(f"Slowest dry run: {slow_name}, {slow:.0f} s; median {median:.0f} s.")
    rss = [r["dry_run"].get("process_peak_rss_bytes") or 0 for r in rows if "error" not in r]
    if rss:
        summary.append(f"Largest dry-run process: {max(rss) / GIB:.2f} GiB peak RSS.")
    if failed:
        summary.append("Failed: " + "; ".join(f"{r['name']}: {r['error']}" for r in failed) + ".")
    lines += [" ".join(summary), "", "## Layouts", ""]
    for r in rows:
        notes = r.get("dry_run", {}).get("notes") if isinstance(r.get("dry_run"), dict) else None
        reason = f"; planner: {r['reason']}" if r.get("reason") else ""
        lines.append(f"- **{r['name']}**: `{r['model']} {shlex.join(r['overrides'])}`{reason}")
        for note in notes or []:
            lines.append(f"  - {note}")
    lines += ["", "## Environment", "", "```json", json.dumps(env, indent=1), "```", ""]
    return "\n".join(lines)


def environment() -> dict:
    import torch

    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        cpu = next(
            (ln.split(":", 1)[1].strip() for ln in lscpu.splitlines() if ln.startswith("Model name")),
            platform.processor(),
        )
    except (OSError, subprocess.SubprocessError):
        cpu = platform.processor()
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        rev = ""
    return {
        "date": f"{dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_model": cpu,
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "git_revision": rev,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", nargs="*", help=f"layouts to run (default all): {', '.join(LAYOUTS)}")
    p.add_argument("--output", default=str(ROOT / "benchmarks/results/dry_run_scale.md"))
    p.add_argument("--json", help="also write the raw rows as JSON here")
    args = p.parse_args()
    names = args.only or list(LAYOUTS)
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        p.error(f"unknown layouts {unknown}; known: {', '.join(LAYOUTS)}")
    env = environment()
    start = time.perf_counter()
    rows = []
    for name in names:
        row = run_layout(name)
        rows.append(row)
        if "error" in row:
            print(f"{name}: failed after {row['wall_seconds']:.0f} s: {row['error']}", flush=True)
        else:
            d = row["dry_run"]
            diffs = ", ".join(
                f"pp{r['stage']} {_gib(r['peak_memory_bytes'])}/{_gib(r.get('predicted_bytes'))} GiB "
                f"({r['difference']:+.1%})"
                if r.get("difference") is not None
                else f"pp{r['stage']} {_gib(r['peak_memory_bytes'])} GiB"
                for r in d["ranks"]
            )
            print(f"{name}: {d['seconds']:.0f} s ({row['wall_seconds']:.0f} s wall): {diffs}", flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1, default=str))
    total = time.perf_counter() - start
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    # a failed run leaves nothing half-made: write beside the target, then move into place
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", dir=out.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(render(rows, args, env, total))
        os.chmod(tmp, 0o644)  # mkstemp's 0600 otherwise
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    print(f"wrote {out} ({total / 60:.1f} min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
