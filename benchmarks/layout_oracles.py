"""Three oracles on randomly sampled layouts (issue 41): nobody picks the test set.

Layouts come from `plan.layout_sampler` (seeded: the seed is printed and written in the record). For
each "small" layout (2-4 processes on this CPU, tiny models):
  - the real run: `stx launch -n N train ...` for a few steps with `logging.track_tensor_bytes=true`
    (benchmarks/plan_accuracy.py `measure`: summary.json's peak live tensor bytes of the largest rank
    and the median step after the warm-up);
  - the dry run and the analytic planner: one `stx plan ... --world-size N --device cpu --no-probe
    --dry-run --json` (the planner alone, `stx plan ... --json`, when the dry run fails);
and the errors dry-run-vs-real and planner-vs-real of the peak tensor bytes (and the rate model's step
time against the measured one). For each "large" layout (64-1024 devices of a GPU table, presets up to
175B): `stx plan ... --dry-run --json` under a timeout; the planner's peak against the dry run's, and
the dry run's wall time. Every command runs as a user runs it, through the CLI; a crash in any of them
on a valid layout is a bug (its text is in the row).

Rows are appended to a JSON-lines file as each layout finishes and the Markdown record is rewritten
from it each time, so a long batch can be watched and stopped:

    python benchmarks/layout_oracles.py --scale small --count 5              # a fresh seed, printed
    python benchmarks/layout_oracles.py --scale small --count 100 --seed 41  # the same 100 every time
    python benchmarks/layout_oracles.py --scale large --count 20 --seed 41 --timeout 300
    python benchmarks/layout_oracles.py --scale small --render               # the record from the rows
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import secrets
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import plan_accuracy  # noqa: E402  (measure: the real run and its summary)
from scalable_transformer.plan.layout_sampler import SampledLayout, sample_layouts  # noqa: E402

MIB = 2**20
# every oracle of a small layout sees the same config: the run's length, its measurement and the
# vocabulary (the embedded tokenizer's may be smaller than its nominal size: plan and run agree on it)
SMALL_EXTRA = [
    "model.vocab_size=16384",
    "train.train_iters=7",
    "logging.warmup_iters=4",
    "logging.log_interval=7",
    "train.eval_interval=0",
    "train.eval_iters=0",
    "logging.tensorboard=false",
    "logging.track_tensor_bytes=true",
]


def run_stx(stx: str, argv: list[str], timeout: float) -> tuple[dict | None, str, float]:
    """One `stx` command with --json: (parsed output or None, error text, wall seconds); on a timeout
    every process it started is stopped (plan_accuracy.run_command)."""
    start = time.perf_counter()
    try:
        proc = plan_accuracy.run_command([stx, *argv], timeout)
    except subprocess.TimeoutExpired:
        return None, f"timeout after {timeout:.0f} s", time.perf_counter() - start
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        lines = (proc.stderr or proc.stdout).strip().splitlines()
        return None, f"exit {proc.returncode}: " + " | ".join(lines[-4:]), wall
    try:
        return json.loads(proc.stdout), "", wall
    except json.JSONDecodeError as e:
        return None, f"output is not JSON ({e}): {proc.stdout[-300:]}", wall


def plan_and_dry_run(stx: str, layout: SampledLayout, extra: list[str], timeout: float) -> dict:
    """The planner's and the dry run's figures of one layout (the planner alone when the dry run fails)."""
    argv = [*layout.plan_argv(extra), "--no-probe", "--json"]
    out: dict = {"plan_command": shlex.join(["stx", *argv, "--dry-run"])}
    data, error, wall = run_stx(stx, [*argv, "--dry-run"], timeout)
    out["dry_run_wall_seconds"] = wall
    if data is None:
        out["dry_run_error"] = error
        data, plan_error, _ = run_stx(stx, argv, timeout)
        if data is None:
            out["plan_error"] = plan_error
            return out
    row = data["layouts"][0]
    # the planner's tensor bytes, as the dry run and the real run count them: without the allocator's
    # reserve it adds to a device's figure (2 GiB on a GPU table; a bert-345m rank's peak is 0.35 GiB)
    reserve = (row.get("memory_breakdown_bytes") or {}).get("reserve", 0)
    out["plan_peak_bytes"] = row["peak_memory_bytes"] - reserve
    out["plan_step_seconds"] = row.get("step_seconds")
    out["plan_fits"] = row.get("fits")
    dry = row.get("dry_run")
    if dry and "error" in dry:  # the command succeeds, the engine's failure is in the JSON
        out["dry_run_error"] = dry["error"]
    elif dry:
        out["dry_peak_bytes"] = dry["peak_memory_bytes"]
        out["dry_ranks"] = [(r["rank"], r["stage"], r["peak_memory_bytes"]) for r in dry["ranks"]]
        out["dry_seconds"] = dry.get("seconds")
    return out


def oracle_row(stx: str, layout: SampledLayout, timeout: float) -> dict:
    """Every oracle of one layout, as one JSON-able row."""
    row: dict = {
        "name": layout.name,
        "seed": layout.seed,
        "index": layout.index,
        "scale": layout.scale,
        "family": layout.family,
        "layout": layout.text(),
        "rejections": layout.rejections,
    }
    extra = SMALL_EXTRA if layout.scale == "small" else []
    row.update(plan_and_dry_run(stx, layout, extra, timeout))
    if layout.scale == "small":
        with tempfile.TemporaryDirectory(prefix="stx-layout-oracles-") as tmp:
            overrides = [*layout.overrides, *SMALL_EXTRA]
            measured = plan_accuracy.measure(
                stx, layout.base, layout.world_size, overrides, Path(tmp), timeout
            )
        row["train_command"] = measured["command"]
        if "error" in measured:
            row["train_error"] = measured["error"]
        else:
            row["real_peak_bytes"] = measured["peak_tensor_bytes"]
            row["real_peak_per_rank"] = measured["peak_tensor_bytes_per_rank"]
            row["real_step_seconds"] = measured["step_seconds"]
    return row


def _error(pred: float | None, ref: float | None) -> float | None:
    return pred / ref - 1 if pred is not None and ref else None


def errors_of(row: dict) -> dict[str, float | None]:
    """The signed errors a row gives (None where an oracle has no figure)."""
    if row["scale"] == "small":
        real = row.get("real_peak_bytes")
        return {
            "dry_vs_real": _error(row.get("dry_peak_bytes"), real),
            "plan_vs_real": _error(row.get("plan_peak_bytes"), real),
            "time_vs_real": _error(row.get("plan_step_seconds"), row.get("real_step_seconds")),
        }
    return {"plan_vs_dry": _error(row.get("plan_peak_bytes"), row.get("dry_peak_bytes"))}


def crashes_of(row: dict) -> list[str]:
    """Where a valid layout failed: 'dry run: ...', 'plan: ...', 'train: ...' (timeouts are not crashes)."""
    out = []
    for key, what in (("dry_run_error", "dry run"), ("plan_error", "plan"), ("train_error", "train")):
        if row.get(key):
            out.append(f"{what}: {row[key]}")
    return out


def distribution(rows: list[dict], key: str) -> str:
    """median, 90th percentile and worst |error| (the worst layout named), and counts within 5 / 10%."""
    pairs = [(abs(errors_of(r)[key]), r) for r in rows if errors_of(r).get(key) is not None]  # type: ignore[arg-type]
    if not pairs:
        return f"- **{key}**: no layout has both figures."
    values = sorted(v for v, _ in pairs)
    worst, worst_row = max(pairs, key=lambda p: p[0])
    p90 = values[min(len(values) - 1, round(0.9 * (len(values) - 1)))]
    signed = statistics.median(errors_of(r)[key] for _, r in pairs)  # type: ignore[type-var]
    within5 = sum(v <= 0.05 for v in values)
    within10 = sum(v <= 0.10 for v in values)
    return (
        f"- **{key}** ({len(values)} layouts): median |error| {statistics.median(values):.1%} (signed "
        f"median {signed:+.1%}), 90th percentile {p90:.1%}, worst {worst:.1%} ({worst_row['name']}: "
        f"`{worst_row['layout']}`); within 5%: {within5}, within 10%: {within10}, within 25%: "
        f"{sum(v <= 0.25 for v in values)}."
    )


def _mib(value: float | None) -> str:
    return f"{value / MIB:.1f}" if value else "-"


def _pct(value: float | None) -> str:
    return f"{value:+.1%}" if value is not None else "-"


def table_row(row: dict) -> str:
    e = errors_of(row)
    crash = "; ".join(crashes_of(row)).replace("|", "/") or ""
    if row["scale"] == "small":
        real_s = row.get("real_step_seconds")
        cells = [
            row["name"],
            f"`{row['layout']}`",
            _mib(row.get("real_peak_bytes")),
            _mib(row.get("dry_peak_bytes")),
            _mib(row.get("plan_peak_bytes")),
            _pct(e["dry_vs_real"]),
            _pct(e["plan_vs_real"]),
            f"{real_s:.3f}" if real_s else "-",
            _pct(e["time_vs_real"]),
            crash,
        ]
    else:
        cells = [
            row["name"],
            f"`{row['layout']}`",
            _mib(row.get("dry_peak_bytes")),
            _mib(row.get("plan_peak_bytes")),
            _pct(e["plan_vs_dry"]),
            f"{row.get('dry_run_wall_seconds', 0):.1f}",
            crash,
        ]
    return "| " + " | ".join(cells) + " |"


def render(rows: list[dict], scale: str, command: str) -> str:
    seeds = sorted({r["seed"] for r in rows})
    crashes = [r for r in rows if crashes_of(r) and not _timed_out(r)]
    lines = [
        f"# Three oracles on sampled {scale} layouts (benchmarks/layout_oracles.py)",
        "",
        f"Written {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC; seeds {seeds}; {len(rows)} layouts; "
        f"{os.cpu_count()} cores shared with other work (wall times are noisy). Last command: `{command}`.",
        "Reproduce one layout: `python -c 'from scalable_transformer.plan.layout_sampler import "
        "draw_valid_layout as d; print(d(SCALE, SEED, INDEX).text())'` (name = scale-seed-index).",
        "",
        "## Distributions (|error| of peak tensor bytes per rank, largest rank; time: the rate model's "
        "step against the measured median step)"
        if scale == "small"
        else "## Distributions (|error| of the planner's peak bytes per device against the dry run's)",
        "",
    ]
    keys = ("dry_vs_real", "plan_vs_real", "time_vs_real") if scale == "small" else ("plan_vs_dry",)
    lines += [distribution(rows, k) for k in keys]
    lines.append(
        f"- crashes on valid layouts: {len(crashes)} of {len(rows)}; timeouts: "
        f"{sum(_timed_out(r) for r in rows)}."
    )
    if scale == "large":
        walls = sorted(r["dry_run_wall_seconds"] for r in rows if "dry_run_wall_seconds" in r)
        if walls:
            lines.append(
                "- dry run wall (the whole `stx plan --dry-run` command): median "
                f"{statistics.median(walls):.0f} s, "
                f"worst {walls[-1]:.0f} s, under 60 s: {sum(w < 60 for w in walls)} of {len(walls)}."
            )
        header = "| layout | config | dry MiB | plan MiB | plan vs dry | dry-run wall s | crash |"
    else:
        header = (
            "| layout | config | real MiB | dry MiB | plan MiB | dry vs real | plan vs real | real s/step "
            "| rate-model time vs real | crash |"
        )
    lines += ["", "## Every layout", "", header, "|" + "---|" * header.count(" | ") + "---|"]
    lines += [table_row(r) for r in rows]
    return "\n".join(lines) + "\n"


def _timed_out(row: dict) -> bool:
    return any("timeout after" in c for c in crashes_of(row))


def read_rows(path: Path) -> list[dict]:
    """The rows of a results file, the last one of each layout name (a layout run again replaces it)."""
    if not path.exists():
        return []
    by_name = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        by_name.pop(row["name"], None)
        by_name[row["name"]] = row
    return list(by_name.values())


def _write(rows: list[dict], scale: str, output: Path, command: str) -> None:
    tmp = output.with_suffix(".tmp")
    tmp.write_text(render(rows, scale, command), encoding="utf-8")
    tmp.replace(output)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scale", choices=("small", "large"), default="small")
    p.add_argument("--count", type=int, default=5, help="layouts to draw (default 5)")
    p.add_argument("--seed", type=int, help="sampler seed (default: a fresh one, printed)")
    p.add_argument("--start", type=int, default=0, help="index of the first layout (continue a batch)")
    p.add_argument("--timeout", type=float, default=600, help="seconds per command (default 600)")
    p.add_argument(
        "--results", help="rows as JSON lines (default benchmarks/results/layout_oracles-SCALE.jsonl)"
    )
    p.add_argument("--output", help="the record (default benchmarks/results/layout_oracles-SCALE.md)")
    p.add_argument("--render", action="store_true", help="only rewrite the record from the rows")
    args = p.parse_args()
    results = Path(args.results or ROOT / f"benchmarks/results/layout_oracles-{args.scale}.jsonl")
    output = Path(args.output or ROOT / f"benchmarks/results/layout_oracles-{args.scale}.md")
    command = "python benchmarks/layout_oracles.py " + shlex.join(sys.argv[1:])
    rows = read_rows(results)
    if args.render:
        _write(rows, args.scale, output, command)
        return 0
    seed = args.seed if args.seed is not None else secrets.randbelow(2**31)
    print(
        f"layout seed {seed} (scale {args.scale}, layouts {args.start}..{args.start + args.count - 1})",
        flush=True,
    )
    os.environ["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])
    )
    stx = str(Path(sys.executable).with_name("stx"))
    for layout in sample_layouts(args.scale, args.count, seed, args.start):
        print(f"{layout.name}: {layout.text()}", flush=True)
        row = oracle_row(stx, layout, args.timeout)
        rows = [r for r in rows if r["name"] != row["name"]] + [row]
        with results.open("a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        _write(rows, args.scale, output, command)
        e = {k: _pct(v) for k, v in errors_of(row).items()}
        print(f"  errors {e}; crashes {crashes_of(row) or 'none'}", flush=True)
    print(f"record: {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
