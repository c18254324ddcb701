"""The engine on a real GPU, in one short script: train a few single-GPU configs as `stx train` does,
count the host synchronizations of every step that does not log (torch.cuda.set_sync_debug_mode),
and compare each run's step time and peak memory with the planner's prediction for that GPU (the
`prediction` that `stx train` stores in summary.json: the built-in profile of the GPU's table entry).
Optionally ends with `stx calibrate --quick` on the same GPU.

    python benchmarks/gpu_check.py --out /tmp/gpu-check            # every case, ~5-7 min on an H100/H200
    python benchmarks/gpu_check.py --out /tmp/gpu-check --cases gpt-125m,gpt-1b --calibrate

Each case runs in its own process (a failure or OOM in one is reported, the others still run); the
record is `OUT/gpu_check.md` plus one JSON line per case in `OUT/gpu_check.jsonl`, written as each
case ends. Needs a CUDA device (`--smoke` runs tiny-gpt on CPU to check the script itself). The record
of the first run, on an H200: benchmarks/results/gpu_check-h200.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

# name -> `stx train` arguments (config and overrides). One GPU, so dp=tp=pp=1; the global batch is a
# few micro-batches so a step has accumulation but stays short.
COMMON = ["train.train_iters=30", "logging.log_interval=10", "train.eval_interval=0", "train.eval_iters=1"]
COMMON += ["logging.tensorboard=false", "train.device=cuda", "train.precision=bf16"]
CASES: dict[str, list[str]] = {
    "gpt-125m": [
        "gpt-125m",
        "model.seq_length=1024",
        "train.micro_batch_size=16",
        "train.global_batch_size=32",
    ],
    "gpt-350m": [
        "gpt-350m",
        "model.seq_length=1024",
        "train.micro_batch_size=16",
        "train.global_batch_size=32",
    ],
    "gpt-350m-zero3": [
        "gpt-350m",
        "model.seq_length=1024",
        "train.micro_batch_size=16",
        "train.global_batch_size=32",
        "parallel.zero_stage=3",
    ],
    "gpt-1b": ["gpt-1b", "train.micro_batch_size=8", "train.global_batch_size=16"],
    "gpt-1b-recompute": [
        "gpt-1b",
        "train.micro_batch_size=8",
        "train.global_batch_size=16",
        "parallel.activation_checkpointing=full",
    ],
    "llama-1b": ["llama-1b", "train.micro_batch_size=2", "train.global_batch_size=4"],
    "gpt-350m-fp16": [
        "gpt-350m",
        "model.seq_length=1024",
        "train.micro_batch_size=16",
        "train.global_batch_size=32",
        "train.precision=fp16",
    ],
    "gpt-350m-zero3-offload": [
        "gpt-350m",
        "model.seq_length=1024",
        "train.micro_batch_size=16",
        "train.global_batch_size=32",
        "parallel.zero_stage=3",
        "parallel.offload_optimizer=true",
        "parallel.offload_param=true",
    ],
    # llm-foundry's MPT-7b rows at one GPU's share: 4 of the 32 layers (the layer's GEMMs, attention and
    # elementwise work at the published shape; no FSDP communication on one GPU)
    "gpt-7b-4l": ["gpt-7b", "model.num_layers=4", "train.micro_batch_size=6", "train.global_batch_size=12"],
    "gpt-7b-4l-seq4096-ac": [
        "gpt-7b",
        "model.num_layers=4",
        "model.seq_length=4096",
        "model.max_position_embeddings=4096",
        "train.micro_batch_size=16",
        "train.global_batch_size=32",
        "parallel.activation_checkpointing=full",
    ],
    # the preset warms up for 10,000 iterations, longer than the run: a config error without this
    "bert-large": [
        "bert-large",
        "train.micro_batch_size=32",
        "train.global_batch_size=64",
        "optim.lr_warmup_iters=3",
    ],
}
SYNC_MESSAGE = "called a synchronizing CUDA operation"


class HostSyncCounter:
    """A trainer callback: at every step that will not log, turns torch's CUDA sync debug mode on
    ("warn") from its start to its end and records each synchronizing call with where it came from."""

    def __init__(self, log_interval: int, train_iters: int) -> None:
        self.log_interval, self.train_iters = log_interval, train_iters
        self.per_step: dict[int, list[str]] = {}
        self._catcher: Any = None
        self._caught: list[warnings.WarningMessage] | None = None

    def on_step_start(self, trainer: Any) -> None:
        import torch

        upcoming = trainer.iteration + 1
        if upcoming % self.log_interval == 0 or upcoming == self.train_iters:
            return
        self._catcher = warnings.catch_warnings(record=True)
        self._caught = self._catcher.__enter__()
        warnings.simplefilter("always")
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode("warn")

    def on_step_end(self, trainer: Any, result: Any) -> None:
        import torch

        if self._catcher is None:
            return
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode("default")
        caught = self._caught or []
        self._catcher.__exit__(None, None, None)
        self._catcher = self._caught = None
        self.per_step[trainer.iteration] = [
            f"{Path(w.filename).name}:{w.lineno}" for w in caught if SYNC_MESSAGE in str(w.message)
        ]

    def __getattr__(self, name: str) -> Any:  # the other Callback hooks: nothing to do
        if name.startswith("on_"):
            return lambda *args, **kwargs: None
        raise AttributeError(name)


def child(label: str, args: list[str], out: Path) -> int:
    """One case, in this process, as `stx train` runs it, with the sync counter added."""
    import scalable_transformer.train.run as run_module
    from scalable_transformer.cli import main as cli_main

    counter: HostSyncCounter | None = None
    original = run_module.run_training

    def counted(cfg, console=None, callbacks=(), predict=None):
        nonlocal counter
        counter = HostSyncCounter(cfg.logging.log_interval, cfg.train.train_iters)
        return original(cfg, console, [*callbacks, counter], predict)

    run_module.run_training = counted
    run_dir = out / "runs"
    status = cli_main(["train", *args, f"logging.run_dir={run_dir}", f"logging.run_name={label}"])
    steps = counter.per_step if counter is not None else {}
    measured_after_warmup = {i: s for i, s in steps.items() if i > 3}
    (out / f"{label}.syncs.json").write_text(
        json.dumps({"status": status, "per_step": steps, "after_warmup": measured_after_warmup})
    )
    return int(status or 0)


def stx_command() -> list[str]:
    stx = Path(sys.executable).with_name("stx")
    return (
        [str(stx)]
        if stx.exists()
        else [sys.executable, "-c", "from scalable_transformer.cli import entry; entry()"]
    )


def plan(train_args: list[str], device: str) -> dict[str, Any]:
    """`stx plan` of the case on one device of the table entry (time model only): step seconds and
    peak memory per device, or why not."""
    cmd = [
        *stx_command(),
        "plan",
        *train_args,
        "--world-size",
        "1",
        "--device",
        device,
        "--json",
        "--no-probe",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    try:
        layout = json.loads(proc.stdout)["layouts"][0]
    except (ValueError, KeyError, IndexError):
        return {"error": (proc.stdout + proc.stderr)[-1500:]}
    keep = ("label", "fits", "reason", "peak_memory_bytes", "memory_breakdown_bytes", "step_seconds")
    return {
        "device": device,
        **{k: layout.get(k) for k in keep},
        "time": layout.get("time_breakdown_seconds"),
        "classes": layout.get("time_classes_seconds"),
    }


def summarize(label: str, out: Path, seconds: float, returncode: int, tail: str) -> dict[str, Any]:
    row: dict[str, Any] = {"case": label, "returncode": returncode, "wall_seconds": round(seconds, 1)}
    syncs_file = out / f"{label}.syncs.json"
    if syncs_file.is_file():
        syncs = json.loads(syncs_file.read_text())
        after = syncs["after_warmup"]
        row["plain_steps_checked"] = len(after)
        row["host_syncs_per_plain_step_max"] = max((len(v) for v in after.values()), default=None)
        sites: dict[str, int] = {}
        for v in after.values():
            for site in v:
                sites[site] = sites.get(site, 0) + 1
        row["host_sync_sites"] = sites
        row["host_syncs_first_steps"] = {i: len(v) for i, v in syncs["per_step"].items() if int(i) <= 3}
    summary_file = out / "runs" / label / "summary.json"
    if summary_file.is_file():
        s = json.loads(summary_file.read_text())
        keep = ("median_iteration_seconds", "iteration_seconds_iqr", "tokens_per_second", "mfu", "hfu")
        keep += (
            "peak_memory_bytes",
            "peak_memory_method",
            "peak_tensor_bytes_per_rank",
            "peak_flops_per_device",
        )
        keep += ("peak_flops_source", "num_parameters", "global_batch_size", "seq_length", "final_train_loss")
        keep += ("prediction_error", "device_util", "device_power_w")
        row.update({k: s.get(k) for k in keep})
        row["prediction"] = s.get("prediction")  # stx train's own, the same model as `plan` below
    if returncode != 0:
        row["tail"] = tail[-2500:]
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument("--calibrate", action="store_true", help="end with `stx calibrate gpt-1b --quick`")
    parser.add_argument(
        "--calibrate-with",
        action="append",
        default=[],
        metavar="ARGS",
        help="first run `stx calibrate ARGS` (a config and overrides, `--quick` allowed; repeatable), "
        "each profile written as OUT/calibrated-N.yaml",
    )
    parser.add_argument(
        "--smoke", action="store_true", help="tiny-gpt on CPU through the same machinery (checks this script)"
    )
    parser.add_argument("--case-timeout", type=float, default=240, help="seconds per case (and calibrate)")
    parser.add_argument("--child", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.child:
        return child(args.child[0], args.child[1:], args.out)

    import torch

    env = {"torch": torch.__version__, "cuda": torch.version.cuda}
    env["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    cases, common = dict(CASES), list(COMMON)
    if args.smoke:
        cases = {"tiny-gpt": ["tiny-gpt", "model.num_layers=1"]}
        common = [c for c in common if not c.startswith(("train.device", "train.precision"))]
        common.append("train.device=cpu")
        args.cases = "tiny-gpt"
    from scalable_transformer.metrics.device_specs import detect_device_name

    # the device table's entry for this GPU, as stx train names it (none: the plan is for this CPU)
    plan_device = (detect_device_name(env["device"]) if env["device"] else None) or "cpu"
    rows: list[dict[str, Any]] = []
    with (args.out / "gpu_check.jsonl").open("a") as sink:
        sink.write(json.dumps({"environment": env}) + "\n")
        for i, text in enumerate(args.calibrate_with, 1):
            words = text.split()
            rc, took = calibrate(
                words, args.out / f"calibrated-{i}.yaml", args.out / f"calibrate-{i}.log", args.case_timeout
            )
            sink.write(json.dumps({"calibrate": words, "returncode": rc, "seconds": round(took, 1)}) + "\n")
            sink.flush()
        for label in args.cases.split(","):
            start = time.monotonic()
            train_args = [cases[label][0], *common, *cases[label][1:]]  # the case's overrides win
            cmd = [sys.executable, __file__, "--out", str(args.out), "--child", label, *train_args]
            try:
                proc = subprocess.run(
                    cmd,
                    capture_output=True,
                    text=True,
                    env={**os.environ, "PYTHONUNBUFFERED": "1"},
                    timeout=args.case_timeout,
                )
            except subprocess.TimeoutExpired as e:
                out_text = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
                proc = subprocess.CompletedProcess(
                    cmd, 124, out_text, f"timed out after {args.case_timeout} s"
                )
            (args.out / f"{label}.log").write_text(proc.stdout + proc.stderr)
            row = summarize(
                label, args.out, time.monotonic() - start, proc.returncode, proc.stdout + proc.stderr
            )
            row["plan"] = plan(train_args, plan_device)
            planned, measured = row["plan"].get("step_seconds"), row.get("median_iteration_seconds")
            if planned and measured:
                row["plan_step_time_error"] = planned / measured - 1
            rows.append(row)
            sink.write(json.dumps(row) + "\n")
            sink.flush()
            write_record(args.out / "gpu_check.md", env, rows)  # after each case: a killed run keeps it
            print(json.dumps({k: v for k, v in row.items() if k not in ("tail", "prediction")}), flush=True)
        if args.calibrate:
            rc, took = calibrate(
                ["gpt-1b", "--quick"],
                args.out / "calibrated.yaml",
                args.out / "calibrate.log",
                args.case_timeout,
            )
            sink.write(json.dumps({"calibrate": rc, "seconds": took}) + "\n")
    return 0


def calibrate(words: list[str], profile: Path, log: Path, timeout: float) -> tuple[int, float]:
    """`stx calibrate WORDS --output PROFILE` within `timeout` seconds: (return code, seconds)."""
    start = time.monotonic()
    try:
        proc = subprocess.run(
            [*stx_command(), "calibrate", *words, "--output", str(profile)],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        log.write_text(proc.stdout + proc.stderr)
        rc: int = proc.returncode
    except subprocess.TimeoutExpired:
        rc = 124
    return rc, time.monotonic() - start


def write_record(path: Path, env: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    lines = [
        "# gpu_check: single-GPU runs, host syncs per plain step, planned vs measured",
        "",
        f"Environment: torch {env['torch']}, CUDA {env['cuda']}, {env['device']}. Command: "
        f"`python benchmarks/gpu_check.py {' '.join(sys.argv[1:])}`",
        "",
        "| case | rc | host syncs / plain step (max, steps 4+) | step s measured | step s planned | error "
        "| MFU | peak GiB measured (live tensors; RSS on CPU) | planned (no reserve) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        tensors = r.get("peak_tensor_bytes_per_rank")  # on a GPU; a CPU run has its RSS only
        measured_mem = (max(tensors) if tensors else r.get("peak_memory_bytes") or 0) / 2**30
        plan_ = r.get("plan") or {}
        # live tensor bytes against live tensor bytes: the plan without the device's reserve
        reserve = (plan_.get("memory_breakdown_bytes") or {}).get("reserve") or 0
        planned_mem = ((plan_.get("peak_memory_bytes") or 0) - reserve) / 2**30
        err = r.get("plan_step_time_error")
        lines.append(
            f"| {r['case']} | {r['returncode']} | {r.get('host_syncs_per_plain_step_max')} "
            f"| {r.get('median_iteration_seconds') or float('nan'):.3f} "
            f"| {plan_.get('step_seconds') or float('nan'):.3f} "
            f"| {'' if err is None else f'{err:+.1%}'} | {r.get('mfu') or float('nan'):.1%} "
            f"| {measured_mem:.2f} | {planned_mem:.2f} |"
        )
    path.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
