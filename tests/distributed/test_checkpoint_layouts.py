"""A checkpoint saved under one layout resumes under another and continues the uninterrupted run.

Each resumed run must train iterations 4-6 with the losses of the uninterrupted single-process run
(the tolerance of test_equivalence.py: the layouts only reorder fp32 sums), starting at 24 consumed
samples: a repeated or skipped sample changes the step's loss by far more than the tolerance.
Pairs (the issue's minimum): dp2-zero3 -> 1 process, 1 process -> tp2, pp2 -> dp2-zero1; plus
same-layout resumes of dp2-zero3 and pp2-zbv (two stages on one rank: the tied embedding twice), and
hybrid sharding both ways (dp2-zero3 -> HSDP, HSDP -> 1 process).
Saves happen at iteration 3 (`train.exit_interval=3` stops there; the final save is the checkpoint).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
from harness import run_distributed
from test_equivalence import BASE as EQUIVALENCE_BASE
from test_equivalence import RTOL

from scalable_transformer.config.load import load_config
from scalable_transformer.train.run import run_training

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

# the equivalence suite's tiny model, batch and tolerance, with a 1-step warm-up so the LR moves
BASE = ["model.type=gpt", *EQUIVALENCE_BASE, "optim.lr_warmup_iters=1"]
LAYOUTS = {
    "single": [],
    "dp2-zero3": ["parallel.zero_stage=3"],
    "dp2-zero1": ["parallel.zero_stage=1"],
    # hybrid sharding on 2 ranks: two replicas of 1-way shards (FSDP2 on a 2 x 1 replicate x shard mesh)
    "dp2-hsdp1-zero3": ["parallel.zero_stage=3", "parallel.dp_shard=1"],
    "tp2": ["parallel.tp=2"],
    "pp2": ["parallel.pp=2", "parallel.pipeline_schedule=1f1b"],
    "pp2-zbv": ["parallel.pp=2", "parallel.pipeline_schedule=zbv", "parallel.virtual_pipeline_stages=2"],
    # context parallelism: parameters replicated over the cp ranks, FSDP2 shards over dp x cp
    "cp2": ["parallel.cp=2"],
    "cp2-zero3": ["parallel.cp=2", "parallel.zero_stage=3"],
}


def records(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == "train"]


def train(layout: str, root: Path, name: str, *extra: str) -> list[dict] | None:
    cfg = load_config(
        None, [*BASE, *LAYOUTS[layout], f"logging.run_dir={root}", f"logging.run_name={name}", *extra]
    )
    out, _ = run_training(cfg)
    return records(out) if out is not None else None


def save_at_3(layout: str, root: Path) -> list[dict] | None:
    return train(
        layout,
        root,
        f"save-{layout}",
        f"checkpoint.save={root / ('ckpt-' + layout)}",
        "train.exit_interval=3",
    )


def resume(layout: str, root: Path, source: str) -> list[dict] | None:
    return train(layout, root, f"{source}-to-{layout}", f"checkpoint.load={root / ('ckpt-' + source)}")


def _two_processes(rank: int, world: int, root: str) -> dict:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    r = Path(root)
    out = {}
    for layout in ("dp2-zero3", "pp2", "pp2-zbv", "dp2-hsdp1-zero3"):
        out[f"save-{layout}"] = save_at_3(layout, r)
    out["single-to-tp2"] = resume("tp2", r, "single")
    out["dp2-zero3-to-dp2-hsdp1-zero3"] = resume("dp2-hsdp1-zero3", r, "dp2-zero3")
    out["pp2-to-dp2-zero1"] = resume("dp2-zero1", r, "pp2")
    out["dp2-zero3-to-dp2-zero3"] = resume("dp2-zero3", r, "dp2-zero3")
    out["pp2-zbv-to-pp2-zbv"] = resume("pp2-zbv", r, "pp2-zbv")
    return out


def _context_parallel(rank: int, world: int, root: str) -> dict:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    r = Path(root)
    out = {"save-cp2-zero3": save_at_3("cp2-zero3", r)}
    out["single-to-cp2"] = resume("cp2", r, "single")
    out["dp2-zero3-to-cp2-zero3"] = resume("cp2-zero3", r, "dp2-zero3")
    out["cp2-zero3-to-dp2-zero3"] = resume("dp2-zero3", r, "cp2-zero3")
    return out


def assert_continues(name: str, got: list[dict] | None, want: list[dict]) -> None:
    assert got is not None, name
    assert [r["iteration"] for r in got] == [4, 5, 6], name
    assert got[0]["consumed_samples"] == 32, f"{name}: the data position did not carry over"
    for g, w in zip(got, want[3:], strict=True):
        for key in ("loss", "lr"):
            assert math.isclose(g[key], w[key], rel_tol=RTOL), (
                f"{name}: iteration {g['iteration']} {key} {g[key]!r} != {w[key]!r}"
            )


def test_resume_across_layouts(tmp_path):
    reference = train("single", tmp_path, "reference")
    assert reference is not None and len(reference) == 6
    first = save_at_3("single", tmp_path)
    assert first is not None and [r["loss"] for r in first] == [r["loss"] for r in reference[:3]]

    results = run_distributed(_two_processes, 2, str(tmp_path), tmp_dir=tmp_path, timeout=900)[0]
    for layout in ("dp2-zero3", "pp2", "pp2-zbv", "dp2-hsdp1-zero3"):
        saved = results[f"save-{layout}"]
        assert [r["iteration"] for r in saved] == [1, 2, 3]
        assert (tmp_path / f"ckpt-{layout}" / "latest").read_text().strip() == "iter_0000003"
    for name in (
        "single-to-tp2", "pp2-to-dp2-zero1", "dp2-zero3-to-dp2-zero3", "pp2-zbv-to-pp2-zbv",
        "dp2-zero3-to-dp2-hsdp1-zero3",
    ):  # fmt: skip
        assert_continues(name, results[name], reference)
    assert_continues("hsdp-to-single", resume("single", tmp_path, "dp2-hsdp1-zero3"), reference)

    assert_continues("dp2-zero3-to-single", resume("single", tmp_path, "dp2-zero3"), reference)


def test_resume_across_context_parallel_layouts(tmp_path):
    """cp2 x ZeRO-3 saves shards over dp x cp; it resumes under dp2-zero3 and on one process, and a
    single-process and a dp2-zero3 checkpoint resume under cp2 and cp2-zero3."""
    reference = train("single", tmp_path, "reference")
    assert reference is not None and len(reference) == 6
    assert save_at_3("single", tmp_path) is not None
    assert run_distributed(save_at_3_on_two, 2, "dp2-zero3", str(tmp_path), tmp_dir=tmp_path, timeout=600)
    results = run_distributed(_context_parallel, 2, str(tmp_path), tmp_dir=tmp_path, timeout=900)[0]
    assert [r["iteration"] for r in results["save-cp2-zero3"]] == [1, 2, 3]
    for name in ("single-to-cp2", "dp2-zero3-to-cp2-zero3", "cp2-zero3-to-dp2-zero3"):
        assert_continues(name, results[name], reference)
    assert_continues("cp2-zero3-to-single", resume("single", tmp_path, "cp2-zero3"), reference)


def save_at_3_on_two(rank: int, world: int, layout: str, root: str) -> bool:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    return save_at_3(layout, Path(root)) is not None or rank != 0
