"""`stx report RUN_DIR`: one run's jobs (segments: a `stx submit --requeue` chain, restarts, resumes
by hand) and its goodput, from the run directory's summary.json."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..errors import UsageError


def read_run_summary(run_dir: Path) -> dict[str, Any]:
    path = run_dir / "summary.json"
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UsageError(
            f"{run_dir}: no summary.json; a run directory has one once a job of the run finished or "
            "was stopped (stx report takes a run directory or a results store such as results.sqlite)"
        ) from None
    except ValueError as e:
        raise UsageError(f"{path}: not a summary written by stx train ({e})") from None


def segments_report(run_dir: Path) -> str:
    """Markdown: a row per segment (job, iterations, how it ended, wall and train-step seconds), then
    goodput and where the rest of the wall time went."""
    summary = read_run_summary(run_dir)
    segments = summary.get("segments") or []
    lines = [
        f"# {run_dir}",
        "",
        "| segment | job | restart | iterations | ended by | started (UTC) | wall (s) | train steps (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for i, s in enumerate(segments, 1):
        ended = s.get("stopped_by") or ("finished" if i == len(segments) else "-")
        lines.append(
            f"| {i} | {s.get('job_id') or '-'} | {s.get('restart', 0)} | "
            f"{s['first_iteration']}-{s['last_iteration']} | {ended} | {s['started_at']} | "
            f"{s['wall_seconds']:.1f} | {s['step_seconds']:.1f} |"
        )
    lines.append("")
    goodput = summary.get("goodput")
    if goodput is None:
        lines.append("goodput: not recorded (a summary written before segments were kept)")
        return "\n".join(lines) + "\n"
    lost = summary.get("lost_seconds") or {}
    lines.append(
        f"goodput: {100 * goodput:.1f}% (productive train-step time "
        f"{summary['productive_step_seconds']:.1f} s of {summary['run_wall_seconds']:.1f} s from the first "
        "segment's start to the last's end)"
    )
    lines.append(
        f"lost: {lost.get('between_segments', 0.0):.1f} s between segments (queueing, restarts, crashed "
        f"jobs), {lost.get('inside_segments', 0.0):.1f} s inside them (start-up, evaluation, "
        f"checkpoints), {lost.get('redone_steps', 0.0):.1f} s of redone steps"
    )
    lines.append(f"iterations: {summary.get('final_iteration', '?')} reached in {len(segments)} segment(s)")
    return "\n".join(lines) + "\n"
