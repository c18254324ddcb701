"""Context parallelism's memory, three ways: a seq-4096 GPT on one process and with cp 2 on two (gloo), each
measured (`stx launch ... logging.track_tensor_bytes=true`: the peak of live tensor bytes per rank),
planned (`stx plan --no-probe`) and dry-run (`stx plan --dry-run`, the engine on fake tensors). Issue 42
asks that cp 2 lower the per-rank peak as the planner says, the three figures within 10% of each other.

    python benchmarks/cp_memory.py [--output benchmarks/results/cp_memory.md]

Causal GPT attention under cp runs as causal blocks without a mask (models/layers.py); the same with
packed documents (`--documents`) builds the [b, 1, s, S] mask of global positions instead.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import plan_accuracy  # noqa: E402  (measure: the real run and its summary)
from layout_oracles import run_stx  # noqa: E402

MIB = 2**20
MODEL = [
    "model.num_layers=2",
    "model.hidden_size=256",
    "model.num_attention_heads=4",
    "model.seq_length=4096",
    "model.max_position_embeddings=4096",
    "model.hidden_dropout=0",
    "model.attention_dropout=0",
    "data.tokenizer_vocab_size=1024",  # small logits: the layers, not the vocabulary, hold the peak
    "model.vocab_size=1024",
    "train.micro_batch_size=1",
    "train.global_batch_size=1",
]
RUN = [
    "train.train_iters=4",
    "logging.warmup_iters=2",
    "logging.log_interval=4",
    "train.eval_interval=0",
    "train.eval_iters=0",
    "logging.tensorboard=false",
    "logging.track_tensor_bytes=true",
]


def figures(cp: int, documents: bool, timeout: float) -> dict:
    stx = str(Path(sys.executable).with_name("stx"))
    overrides = [*MODEL, f"parallel.cp={cp}"]
    if documents:
        overrides += ["model.reset_attention_mask=true", "model.reset_position_ids=true"]
    argv = ["plan", "tiny-gpt", *overrides, *RUN, "--world-size", str(cp), "--device", "cpu", "--no-probe"]
    data, error, _ = run_stx(stx, [*argv, "--json", "--dry-run"], timeout)
    row: dict = {"cp": cp, "plan_command": shlex.join(["stx", *argv, "--dry-run"])}
    if data is None:
        row["error"] = error
        return row
    layout = data["layouts"][0]
    row["planned"] = layout["peak_memory_bytes"]
    dry = layout.get("dry_run") or {}
    row["dry_run"] = dry.get("peak_memory_bytes")
    row["dry_run_error"] = dry.get("error")
    with tempfile.TemporaryDirectory(prefix="stx-cp-memory-") as tmp:
        measured = plan_accuracy.measure(stx, "tiny-gpt", cp, [*overrides, *RUN], Path(tmp), timeout)
    row["train_command"] = measured["command"]
    row["measured"] = measured.get("peak_tensor_bytes")
    row["train_error"] = measured.get("error")
    return row


def _pct(a: float | None, b: float | None) -> str:
    return "n/a" if a is None or not b else f"{a / b - 1:+.1%}"


def render(rows: list[dict], documents: bool) -> str:
    lines = [
        "# Context parallelism's memory: measured, planned, dry-run",
        "",
        "Written by `python benchmarks/cp_memory.py"
        + (" --documents" if documents else "")
        + "`. GPT, 2 layers,",
        "hidden 256, 4 heads, seq 4096, vocabulary 1024, micro-batch 1, fp32, on this CPU (gloo). Peak live",
        "tensor bytes per rank (MiB).",
        "",
        "| cp | ranks | measured | planned | dry run | planned vs measured | dry run vs measured |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        m, p, d = r.get("measured"), r.get("planned"), r.get("dry_run")
        cells = [f"{v / MIB:.1f}" if v else "n/a" for v in (m, p, d)]
        lines.append(f"| {r['cp']} | {r['cp']} | {' | '.join(cells)} | {_pct(p, m)} | {_pct(d, m)} |")
    if len(rows) == 2 and all(r.get("measured") for r in rows):
        one, two = rows
        lines += [
            "",
            f"cp 2 against cp 1: measured x{two['measured'] / one['measured']:.2f}, planned "
            f"x{two['planned'] / one['planned']:.2f}, dry run "
            + (
                f"x{two['dry_run'] / one['dry_run']:.2f}"
                if one.get("dry_run") and two.get("dry_run")
                else "n/a"
            ),
        ]
    errors = [
        f"- cp {r['cp']}: {r[k]}" for r in rows for k in ("error", "dry_run_error", "train_error") if r.get(k)
    ]
    if errors:
        lines += ["", "Errors:", *errors]
    lines += [
        "",
        "Commands:",
        *(f"- `{r.get(k)}`" for r in rows for k in ("plan_command", "train_command") if r.get(k)),
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=ROOT / "benchmarks/results/cp_memory.md")
    parser.add_argument("--documents", action="store_true", help="packed documents: the cp mask path")
    parser.add_argument("--timeout", type=float, default=900.0)
    args = parser.parse_args()
    rows = [figures(cp, args.documents, args.timeout) for cp in (1, 2)]
    text = render(rows, args.documents)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text)
    print(text)
    print(json.dumps(rows, indent=1), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
