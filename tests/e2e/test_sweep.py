"""`stx sweep` and `stx report` as a user runs them: a 6-member grid of tiny GPTs on CPU with one member
out of memory under the memory limit, one timed out and two invalid layouts; the sweep is interrupted
after its first finished member and resumed; then the report's table and plots are checked against the
store.
"""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from scalable_transformer.bench.report import parse_markdown_table

STX = str(Path(sys.executable).with_name("stx"))

SWEEP = textwrap.dedent(
    """\
    base: tiny-gpt
    overrides: [model.num_layers=1, model.num_attention_heads=2, model.seq_length=32,
      train.micro_batch_size=2, logging.log_interval=1, train.eval_interval=0, train.eval_iters=1,
      logging.tensorboard=false]
    axes:
      nproc: [1, 2]
      parallel.tp: [1, 2]               # tp=2 on 1 process: invalid
      model.hidden_size: [32, 4096]     # 4096: ~1 GB of fp32 weights alone, over its 1500 MiB limit
    filters:
      - {nproc: 2, model.hidden_size: 4096}
    limits:
      - {when: {nproc: 2, parallel.tp: 2}, timeout_seconds: 3}     # cannot even start in 3 s
      - {when: {model.hidden_size: 4096}, memory_limit_mb: 1500}
    steps: 4
    warmup_steps: 1
    timeout_seconds: 240
    memory_limit_mb: 3000
    """
)

# (label, nproc) -> status: every member of the grid after the filters
EXPECTED = {
    ("tiny-gpt hidden_size=32 tp=1 pp=1 zero0", 1): "ok",
    ("tiny-gpt hidden_size=4096 tp=1 pp=1 zero0", 1): "oom",
    ("tiny-gpt hidden_size=32 tp=2 pp=1 zero0", 1): "invalid",
    ("tiny-gpt hidden_size=4096 tp=2 pp=1 zero0", 1): "invalid",
    ("tiny-gpt hidden_size=32 tp=1 pp=1 zero0", 2): "ok",
    ("tiny-gpt hidden_size=32 tp=2 pp=1 zero0", 2): "timeout",
}


def stored(store: Path) -> list[dict]:
    if not store.exists():
        return []
    conn = sqlite3.connect(f"file:{store}?mode=ro", uri=True, timeout=10)
    conn.row_factory = sqlite3.Row
    try:
        return [dict(r) for r in conn.execute("SELECT * FROM results ORDER BY id")]
    except sqlite3.OperationalError:  # the schema is being created
        return []
    finally:
        conn.close()


@pytest.mark.slow
def test_sweep_interrupted_resumed_and_reported(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(SWEEP, encoding="utf-8")
    store = tmp_path / "results.sqlite"

    # 1. Start, wait for the first member that ran to be stored, interrupt (Ctrl-C).
    log1 = tmp_path / "first.log"
    with open(log1, "w") as err:
        # as a terminal's foreground job gets it: a shell's background job (`pytest ... &` in a script)
        # starts with SIGINT ignored, which its children inherit, and Ctrl-C would then never arrive
        proc = subprocess.Popen(
            [STX, "sweep", str(sweep)],
            cwd=tmp_path,
            stderr=err,
            stdout=err,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            if any(r["status"] != "invalid" for r in stored(store)):
                break
            time.sleep(0.3)
        assert proc.poll() is None, log1.read_text()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 130, log1.read_text()
    first = {(r["label"], r["nproc"]): r for r in stored(store)}
    ran_first = [k for k, r in first.items() if r["status"] != "invalid"]
    assert len(ran_first) == 1, first
    assert "sweep interrupted after 1 member(s)" in log1.read_text()

    # 2. Run again: only the 3 members not yet stored run.
    t0 = time.perf_counter()
    second = subprocess.run(
        [STX, "sweep", str(sweep)], cwd=tmp_path, capture_output=True, text=True, timeout=400
    )
    assert second.returncode == 0, second.stderr
    assert "to run: 3; already in the store: 1" in second.stderr, second.stderr
    assert second.stderr.count("] running ") == 3
    assert "ETA" in second.stderr and "[3/3 done]" in second.stderr
    rows = stored(store)
    assert len(rows) == 6
    got = {(r["label"], r["nproc"]): r for r in rows}
    assert {k: r["status"] for k, r in got.items()} == EXPECTED, {
        k: (r["status"], r["error"]) for k, r in got.items()
    }
    # The member finished before the interruption was not run again.
    (done_key,) = ran_first
    assert got[done_key]["started_at"] == first[done_key]["started_at"]
    assert len(list((tmp_path / "runs").glob("*.log"))) == 4
    print(f"resumed sweep (3 members) took {time.perf_counter() - t0:.1f} s")

    ok = [r for r in rows if r["status"] == "ok"]
    for r in ok:
        assert r["samples_per_second"] > 0 and r["tflops_per_device"] > 0 and r["mfu"] > 0
        assert r["flops_convention"] == "megatron" and r["peak_memory_bytes_max"] > 0
        assert json.loads(r["env_json"])["torch"] and "train:" in r["config_yaml"]
        assert 0 < r["loop_seconds"] < r["wall_seconds"]
        assert r["overhead_seconds"] == pytest.approx(r["wall_seconds"] - r["loop_seconds"])
        summary = json.loads(r["summary_json"])
        assert summary["warmup_iterations_excluded"] == 1 and summary["iterations"] == 4
        print(f"overhead per member: {r['label']} nproc {r['nproc']}: {r['overhead_seconds']:.1f} s")
    oom = got[("tiny-gpt hidden_size=4096 tp=1 pp=1 zero0", 1)]
    assert "allocate memory" in oom["error"] or "MemoryError" in oom["error"], oom["error"]
    assert "timed out after 3 s" in got[("tiny-gpt hidden_size=32 tp=2 pp=1 zero0", 2)]["error"]
    assert "not divisible" in got[("tiny-gpt hidden_size=32 tp=2 pp=1 zero0", 1)]["error"]

    # 3. The report: the markdown table holds the stored values; the plots are PNGs.
    out = tmp_path / "report"
    rep = subprocess.run(
        [STX, "report", str(store), "--output", str(out)], capture_output=True, text=True, timeout=120
    )
    assert rep.returncode == 0, rep.stderr
    table = parse_markdown_table((out / "table.md").read_text())
    assert table[0] == ["label \\ devices", "1", "2"]
    cells = {
        (line[0], int(col)): c for line in table[1:] for col, c in zip(table[0][1:], line[1:], strict=True)
    }
    for key, r in got.items():
        text = cells[key]
        if r["status"] == "ok":
            # a member measured more than 2x off its prediction is flagged (stx report --suspect-factor):
            # on a loaded machine a tiny member can be, which is the flag working, not a wrong cell
            sps, tflops = text.removesuffix(" [suspect]").split(", ")
            assert sps.endswith(" samples/s") and tflops.endswith(" TFLOPs/dev")
            assert float(sps.split()[0]) == pytest.approx(r["samples_per_second"], rel=0.01, abs=0.006)
            assert float(tflops.split()[0]) == pytest.approx(r["tflops_per_device"], rel=0.01)
        else:
            assert text == {"oom": "OOM", "timeout": "timeout", "invalid": "invalid"}[r["status"]]
    assert "FLOPs convention 'megatron'" in rep.stdout and "TFLOP/s per device" in rep.stdout
    for name in ("throughput_scaling.png", "mfu_by_layout.png", "memory_by_layout.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    html = (out / "report.html").read_text()
    assert "data:image/png;base64," in html and "<style>" in html
