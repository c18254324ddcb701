"""Export the ok runs of a results store as the refit test's fixture (tests/fixtures/refit/*.json):
per run its label, process count, resolved config, measured median step (s), iteration-time IQR (s),
measured phase timers (ms) and the planner's prediction (summary.json `prediction`).

With --repredict the prediction is made again by the current time model (`plan.refit.prediction_record`
on this CPU as the run's process count, at the CPU share the stored prediction assumed): for runs
stored before the model split its seconds by op class.

    python benchmarks/refit_fixture.py /tmp/sweep/results.sqlite tests/fixtures/refit/*.json
    python benchmarks/refit_fixture.py STORE OUT.json --repredict
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))


def repredict(config_yaml: str, nproc: int, share: float | None) -> dict:
    from scalable_transformer.calibrate.this_machine import cpu_cluster
    from scalable_transformer.config.load import load_config
    from scalable_transformer.config.validate import resolve
    from scalable_transformer.plan.refit import prediction_record

    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(config_yaml)
    cfg = resolve(load_config(f.name), world_size=nproc)
    Path(f.name).unlink()
    cluster = cpu_cluster(nproc, cfg.train.precision)
    if share is not None:
        cluster = dataclasses.replace(cluster, cpu_share=share)
    return prediction_record(cfg, cluster)


def stored_share(prediction: dict) -> float | None:
    """The CPU share the stored prediction assumed; for records older than its `cpu_share` key, from
    the load average its cluster name states, the run's own threads taken out (plan/refit.py)."""
    import os
    import re

    if prediction.get("cpu_share") is not None:
        return float(prediction["cpu_share"])
    pattern = r"x (\d+) process\(es\), (\d+) thread\(s\) each, load average ([\d.]+)"
    found = re.search(pattern, prediction.get("cluster", ""))
    if not found:
        return None
    own = int(found[1]) * int(found[2])
    cores = os.cpu_count() or 1
    return min(1.0, cores / (max(0.0, float(found[3]) - own) + own))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("store")
    parser.add_argument("output")
    parser.add_argument("--repredict", action="store_true", help="predict again with the current time model")
    args = parser.parse_args()
    from scalable_transformer.bench.results import ResultsStore

    with ResultsStore(args.store, create=False) as store:
        rows = store.rows("status = 'ok'")
    runs = []
    for r in rows:
        summary = json.loads(r["summary_json"] or "{}")
        prediction = summary.get("prediction")
        if args.repredict:
            share = stored_share(prediction or {})
            prediction = repredict(r["config_yaml"], r["nproc"], share)
        runs.append(
            {
                "label": r["label"],
                "nproc": r["nproc"],
                "measured_step_seconds": summary.get("median_iteration_seconds"),
                "iteration_seconds_iqr": summary.get("iteration_seconds_iqr"),
                "phase_time_ms_median": summary.get("phase_time_ms_median"),
                "prediction": prediction,
                "finished_at": r["finished_at"],
            }
        )
    Path(args.output).write_text(json.dumps({"store": str(args.store), "runs": runs}, indent=1) + "\n")
    print(f"{len(runs)} run(s) -> {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
