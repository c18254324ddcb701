"""What a torch.profiler window shows, read back from its Chrome trace (the file Perfetto opens).

`analyze_trace` returns the top operators by self time and the shares of the window spent computing,
communicating and idle:
  - on CPU (gloo): communication is the time any range whose name marks a collective or P2P (gloo's
    `gloo:all_reduce`, c10d's `allreduce_`, `nccl:*`, send/recv) is in flight, on any thread (gloo works
    on its own threads); compute is the rest of the time the training thread's ops cover; idle is what
    neither covers (Python between ops, waits outside any op);
  - on GPU, the same over the device's kernels (NCCL kernels are communication).
Overlapping ranges count once (interval union), so the three shares add up to 1.
Times in the trace are microseconds; the table shows milliseconds.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

COMM_PATTERN = re.compile(
    r"gloo|nccl|c10d|record_param_comms|all_?reduce|all_?gather|reduce_?scatter|broadcast|"
    r"all_to_all|alltoall|batch_isend_irecv|\bsend\b|\brecv\b|isend|irecv|_wait_batch_p2p|barrier",
    re.IGNORECASE,
)
STEP_PATTERN = re.compile(r"^ProfilerStep#\d+$")


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in intervals)


def _clip(intervals: list[tuple[float, float]], lo: float, hi: float) -> list[tuple[float, float]]:
    return [(max(s, lo), min(e, hi)) for s, e in intervals if e > lo and s < hi]


def load_events(path: Path) -> list[dict[str, Any]]:
    """The complete ('X') events of a Chrome trace file."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    events = data["traceEvents"] if isinstance(data, dict) else data
    return [e for e in events if e.get("ph") == "X" and "dur" in e and "ts" in e]


def self_times(events: list[dict[str, Any]]) -> dict[str, tuple[int, float]]:
    """name -> (calls, self microseconds) over CPU ops, user annotations and kernels: each event's
    duration minus that of the events nested directly inside it on the same thread."""
    by_thread: dict[tuple, list[dict[str, Any]]] = {}
    for e in events:
        if STEP_PATTERN.match(str(e.get("name", ""))):
            continue
        by_thread.setdefault((e.get("pid"), e.get("tid")), []).append(e)
    out: dict[str, tuple[int, float]] = {}
    for thread in by_thread.values():
        thread.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[list[Any]] = []  # [end, name, self]
        finished: list[tuple[str, float]] = []
        for e in thread:
            start, end = float(e["ts"]), float(e["ts"]) + float(e["dur"])
            while stack and stack[-1][0] <= start:
                done = stack.pop()
                finished.append((done[1], done[2]))
            if stack:
                stack[-1][2] -= min(end, stack[-1][0]) - start
            stack.append([end, str(e["name"]), float(e["dur"])])
        finished += [(name, own) for _, name, own in stack]
        for name, own in finished:
            calls, total = out.get(name, (0, 0.0))
            out[name] = (calls + 1, total + max(own, 0.0))
    return out


def analyze_trace(path: Path, top: int = 10) -> dict[str, Any]:
    """Top operators by self time, and compute / communication / idle shares of the profiled steps."""
    events = load_events(path)
    steps = [e for e in events if STEP_PATTERN.match(str(e.get("name", "")))]
    kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    host = [
        e
        for e in events
        if e.get("cat") in ("cpu_op", "user_annotation", "python_function")
        and not STEP_PATTERN.match(str(e.get("name", "")))
    ]
    if steps:
        lo = min(float(e["ts"]) for e in steps)
        hi = max(float(e["ts"]) + float(e["dur"]) for e in steps)
        main = {(e.get("pid"), e.get("tid")) for e in steps}
    else:  # no step markers: the span of all events, every thread
        spans = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events] or [(0.0, 0.0)]
        lo, hi = min(s for s, _ in spans), max(e for _, e in spans)
        main = {(e.get("pid"), e.get("tid")) for e in host}

    def span(e: dict[str, Any]) -> tuple[float, float]:
        return float(e["ts"]), float(e["ts"]) + float(e["dur"])

    if kernels:
        timeline, comm_events = kernels, [e for e in kernels if COMM_PATTERN.search(str(e["name"]))]
    else:  # the training thread's ops, and collectives in flight on any thread (gloo runs its own)
        timeline = [e for e in host if (e.get("pid"), e.get("tid")) in main]
        comm_events = [e for e in host if COMM_PATTERN.search(str(e["name"]))]
    comm = [span(e) for e in comm_events]
    busy = _union(_clip([span(e) for e in timeline] + comm, lo, hi))
    comm_union = _union(_clip(comm, lo, hi))
    window = max(hi - lo, 1e-9)
    comm_us = _length(comm_union)
    compute_us = max(_length(busy) - comm_us, 0.0)
    idle_us = max(window - _length(busy), 0.0)
    ops = self_times([e for e in events if e in host or e in kernels])
    ranked = sorted(ops.items(), key=lambda kv: kv[1][1], reverse=True)[:top]
    return {
        "trace": str(path),
        "timeline": "device kernels" if kernels else "host ops of the training thread",
        "window_ms": window / 1000,
        "steps": len(steps),
        "compute_share": compute_us / window,
        "communication_share": comm_us / window,
        "idle_share": idle_us / window,
        "top_operators": [
            {
                "name": name,
                "calls": calls,
                "self_ms": us / 1000,
                "communication": bool(COMM_PATTERN.search(name)),
            }
            for name, (calls, us) in ranked
        ],
    }


def format_table(analysis: dict[str, Any]) -> str:
    """The short table printed at the end of a profiled run."""
    lines = [
        f"profile ({analysis['steps']} steps, {analysis['window_ms']:.1f} ms, {analysis['timeline']}): "
        f"compute {100 * analysis['compute_share']:.1f}%, communication "
        f"{100 * analysis['communication_share']:.1f}%, idle {100 * analysis['idle_share']:.1f}%",
        f"  {'operator':<48} {'calls':>7} {'self (ms)':>10}",
    ]
    for op in analysis["top_operators"]:
        name = op["name"] if len(op["name"]) <= 48 else op["name"][:45] + "..."
        lines.append(f"  {name:<48} {op['calls']:>7d} {op['self_ms']:>10.2f}")
    lines.append(f"  trace: {analysis['trace']} (open in https://ui.perfetto.dev)")
    return "\n".join(lines)
