"""The seams of `stx sweep`: expand is pure and deterministic, a member is a launcher-neutral job, and
run_sweep records whatever a `Launcher` reports (here one that starts nothing) as ok / oom / timeout."""

from __future__ import annotations

import io
import json
import textwrap
from collections.abc import Mapping
from pathlib import Path

import pytest
from rich.console import Console

from scalable_transformer.bench.results import ResultsStore
from scalable_transformer.bench.sweep import load_sweep, run_sweep
from scalable_transformer.bench.sweep_execute import member_job
from scalable_transformer.bench.sweep_expand import expand
from scalable_transformer.bench.sweep_present import SweepConsole
from scalable_transformer.bench.sweep_types import SweepOptions
from scalable_transformer.launch.launcher import JobSpec, LaunchResult

SWEEP = """\
    base: tiny-gpt
    overrides: [model.num_layers=1]
    axes: {nproc: [1, 2], parallel.tp: [1, 2], model.hidden_size: [32, 64]}
    limits: [{when: {model.hidden_size: 64}, timeout_seconds: 7, memory_limit_mb: 900}]
    steps: 3
    warmup_steps: 1
    """


def _spec(tmp_path: Path):
    path = tmp_path / "sweep.yaml"
    path.write_text(textwrap.dedent(SWEEP))
    return load_sweep(path)


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_expand_is_pure_and_deterministic(tmp_path: Path) -> None:
    spec = _spec(tmp_path)
    before = _files(tmp_path)
    first, filtered = expand(spec)
    second, _ = expand(spec)
    assert _files(tmp_path) == before  # plans only: no store, no run directory
    key = [(m.label, m.nproc, m.repeat, m.config_hash, m.run_name, m.invalid_reason) for m in first]
    assert key == [(m.label, m.nproc, m.repeat, m.config_hash, m.run_name, m.invalid_reason) for m in second]
    assert filtered == 0 and len(first) == 8
    assert sum(1 for m in first if m.invalid_reason) == 2  # tp=2 on one process


def test_member_job_is_the_train_command_not_a_launcher_command(tmp_path: Path) -> None:
    spec = _spec(tmp_path)
    members, _ = expand(spec)
    m = next(m for m in members if m.nproc == 2 and m.point["model.hidden_size"] == "64")
    job = member_job(spec, m)
    assert job.subcommand == "train" and job.nproc == 2 and job.memory_limit_mb == 900
    assert "launch" not in job.args and "-n" not in job.args
    assert job.args[0] == "tiny-gpt"
    for override in ("model.num_layers=1", "train.train_iters=3", "logging.warmup_iters=1"):
        assert override in job.args
    assert f"logging.run_dir={tmp_path / 'runs'}" in job.args
    assert f"logging.run_name={m.run_name}" in job.args


class ScriptedLauncher:
    """A `Launcher` that starts nothing: member hidden_size=32 succeeds (writing the run directory a
    real job would), nproc 2 with hidden_size 64 is SIGKILLed, the other one runs past its timeout."""

    def __init__(self) -> None:
        self.jobs: list[tuple[JobSpec, float]] = []

    def launch(
        self, job: JobSpec, log_path: Path, timeout_seconds: float, env: Mapping[str, str] | None = None
    ) -> LaunchResult:
        self.jobs.append((job, timeout_seconds))
        args = dict(a.split("=", 1) for a in job.args if "=" in a)
        run_dir = Path(args["logging.run_dir"]) / args["logging.run_name"]
        log_path.write_text("$ train ...\n")
        if args.get("model.hidden_size") == "32":
            run_dir.mkdir(parents=True)
            summary = {"samples_per_second": 12.5, "peak_memory_bytes": 1000, "layout": "dp=1"}
            (run_dir / "summary.json").write_text(json.dumps(summary))
            lines = [{"kind": "train", "iteration": 3, "iteration_time_ms": 100.0}]
            (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
            return LaunchResult(0, "done\n", False, 1.5)
        if job.nproc == 2:
            killed = "stx launch: rank 1 was killed by signal SIGKILL (exit code -9)"
            return LaunchResult(1, killed, False, 2.0)
        return LaunchResult(None, "still loading\n", True, timeout_seconds)


@pytest.mark.slow
def test_run_sweep_records_what_the_launcher_reports(tmp_path: Path) -> None:
    spec = _spec(tmp_path)
    launcher = ScriptedLauncher()
    console = Console(file=io.StringIO(), markup=False)
    outcome = run_sweep(spec, SweepOptions(spec.path), launcher=launcher, present=SweepConsole(console))
    assert outcome.exit_code == 0 and outcome.counts == {"ok": 3, "oom": 2, "timeout": 1}
    assert all(timeout == 7 for job, timeout in launcher.jobs if "model.hidden_size=64" in job.args)
    with ResultsStore(spec.store) as store:
        rows = {(r["label"], r["nproc"]): r for r in store.rows()}
    assert len(rows) == 8
    ok = rows[("tiny-gpt hidden_size=32 tp=1 pp=1 zero0", 1)]
    assert ok["status"] == "ok" and ok["samples_per_second"] == 12.5
    assert ok["wall_seconds"] == 1.5 and ok["loop_seconds"] == pytest.approx(0.3)
    assert ok["overhead_seconds"] == pytest.approx(1.2) and ok["peak_memory_bytes_max"] == 1000
    timed_out = rows[("tiny-gpt hidden_size=64 tp=1 pp=1 zero0", 1)]
    assert timed_out["status"] == "timeout" and timed_out["error"].startswith("timed out after 7 s")
    assert rows[("tiny-gpt hidden_size=64 tp=2 pp=1 zero0", 2)]["status"] == "oom"
    # a second call finds everything stored and launches nothing
    again = ScriptedLauncher()
    run_sweep(spec, SweepOptions(spec.path), launcher=again, present=SweepConsole(console))
    assert again.jobs == []
