"""The whole suite as `make test` runs it: two pytest processes side by side.

    python scripts/run_tests.py            # everything: tests/cluster beside the rest
    python scripts/run_tests.py -x -k foo  # extra arguments go to both pytest runs

Why two lanes: tests/cluster spends most of its ~9 minutes waiting on Slurm (slurmctld looks at time
limits and --signal every 30 s; a requeue chain is a row of 1-minute jobs), with the cores half idle;
the rest of the suite is CPU-bound. Run one after the other they took 22 minutes on 2 cores; side by
side the rest fills the cluster's waits. pytest-xdist was tried for this (stop 34): its load groups
did not group under pytest 9, and a third or fourth CPU-bound worker only oversubscribes 2 cores.

What the lanes share is prepared first, once, on an idle machine: the CPU GEMM peaks (MFU's
denominator, cached per dtype and thread count: measured while the other lane trains, a peak comes
out low and MFU above 100%), the embedded corpus and the default tokenizer (built twice at once,
they can differ: the tokenizer training is not deterministic). Each lane then works in its own copy
of that cache and its own pytest base directory.

The cluster lane's output is printed after the main lane's; the exit status is the main lane's,
or the cluster lane's when the main lane passed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = "tests/cluster"
NO_TESTS = 5  # pytest's exit status when a run collected no test

PREPARE = """
import torch
from scalable_transformer.data.tokenizers import load_tokenizer
from scalable_transformer.metrics.device_specs import cpu_peak

for threads in sorted({1, torch.get_num_threads()}):
    for dtype in ("fp32", "bf16", "fp16"):
        cpu_peak(dtype, threads)
load_tokenizer("embedded", 16384)
"""


def prepare(cache: Path) -> None:
    """The shared cache contents (see the module docstring), measured and built here, now."""
    env = {**os.environ, "STX_CACHE_DIR": str(cache)}
    subprocess.run([sys.executable, "-c", PREPARE], env=env, check=True)


def lane(
    name: str, args: list[str], cache: Path, base: Path, log: Path | None, nice: int = 0
) -> subprocess.Popen:
    lane_cache = base / f"cache-{name}"
    shutil.copytree(cache, lane_cache)
    env = {**os.environ, "STX_CACHE_DIR": str(lane_cache)}
    cmd = ["nice", "-n", str(nice)] if nice else []
    cmd += [sys.executable, "-m", "pytest", f"--basetemp={base / f'tmp-{name}'}", *args]
    out = None if log is None else log.open("w")
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)


def main(extra: list[str]) -> int:
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="stx-suite-") as tmp:
        base = Path(tmp)
        cache = Path(os.environ.get("STX_CACHE_DIR") or base / "cache")
        cache.mkdir(parents=True, exist_ok=True)
        prepare(cache)
        log = base / "cluster.log"
        cluster = lane("cluster", [CLUSTER, *extra], cache, base, log)
        # The rest yields to the cluster lane where both want the cores: the cluster's tests size their
        # runs in seconds of training and wait on Slurm's clock (a requeue chain must end in 8 minutes).
        main_lane = lane("main", [f"--ignore={CLUSTER}", *extra], cache, base, None, nice=10)
        try:
            main_status = main_lane.wait()
            cluster_status = cluster.wait()
        except BaseException:
            for proc in (main_lane, cluster):
                proc.terminate()
            raise
        print(f"\n===== {CLUSTER} (run beside the rest) =====", flush=True)
        sys.stdout.write(log.read_text(errors="replace"))
    print(f"suite: {time.monotonic() - start:.0f} s wall (both lanes)", flush=True)
    statuses = [main_status, cluster_status]
    if NO_TESTS in statuses and any(s == 0 for s in statuses):  # e.g. -k matched only one lane's tests
        statuses = [0 if s == NO_TESTS else s for s in statuses]
    return next((s for s in statuses if s), 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
