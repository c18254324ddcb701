"""A mixture-of-experts GPT trains the same under data and pipeline parallelism as in one process
(issue 43): the losses, gradient norms and the router's figures (aux and z losses, dropped
assignments, load imbalance) of every step, with dropless routing and with a capacity factor, as
test_equivalence.py checks the dense layouts (its BASE, harness and tolerances; expert parallelism's
cases are parallel/'s tests).

The aux losses are strong here (1.0 and 0.1, a hundred times the usual) so that a wrong gradient scale
of theirs shows: leaving out the 1 / micro-batches of `MoEStep.begin` moved dp2's third loss by 2e-4
relative, ten times the tolerance (with coefficients ten times smaller: 3e-5, too close to it)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
from harness import run_distributed
from test_equivalence import BASE, GRAD_NORM_RTOL, RTOL

from scalable_transformer.config.load import load_config
from scalable_transformer.train.run import run_training

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

MOE = [
    "model.type=gpt",
    "model.num_attention_heads=4",
    "model.position_embedding_type=rotary",
    "model.norm=rmsnorm",
    "model.activation=swiglu",
    "model.add_bias_linear=false",
    "model.num_experts=4",
    "model.moe_router_topk=2",
    "model.moe_ffn_hidden_size=32",
    "model.moe_layer_freq=2",  # layers 0 and 2 MoE, 1 and 3 dense
    "model.moe_aux_loss_coeff=1.0",
    "model.moe_z_loss_coeff=0.1",
]
ROUTINGS = {"dropless": [], "capacity": ["model.moe_capacity_factor=1.0"]}
CASES = {
    "dp2-zero0-dropless": ["parallel.zero_stage=0"],
    "dp2-zero3-dropless": ["parallel.zero_stage=3"],
    # the router figures of each stage's MoE layers summed over pp, the aux gradient inside the schedule
    "pp2-1f1b-dropless": ["parallel.pp=2", "parallel.pipeline_schedule=1f1b"],
    "dp2-zero3-recompute-capacity": [
        "parallel.zero_stage=3",
        "parallel.activation_checkpointing=full",
        *ROUTINGS["capacity"],
    ],
}
ROUTER = ("moe_aux_loss", "moe_z_loss", "moe_dropped_tokens", "moe_load_imbalance")


def curves(run_dir: Path) -> dict[str, list[float]]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    out = {key: [r[key] for r in train] for key in ("loss", "grad_norm", *ROUTER)}
    out["valid"] = [r["loss"] for r in records if r["kind"] == "valid"]
    return out


def train(overrides: list[str], run_dir: Path) -> dict[str, list[float]] | None:
    out, _ = run_training(load_config(None, [*BASE, *MOE, *overrides, f"logging.run_dir={run_dir}"]))
    return curves(out) if out is not None else None


def _layouts(rank: int, world_size: int, root: str) -> dict:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    return {name: train(overrides, Path(root) / name) for name, overrides in CASES.items()}


def test_moe_layouts_match_single_process(tmp_path):
    want = {name: train(overrides, tmp_path / name) for name, overrides in ROUTINGS.items()}
    assert sum(want["capacity"]["moe_dropped_tokens"]) > 0  # the capacity factor did drop assignments
    assert set(want["dropless"]["moe_dropped_tokens"]) == {0.0}
    results = run_distributed(_layouts, 2, str(tmp_path), tmp_dir=tmp_path, timeout=900)
    assert results[0] is not None
    for name, got in results[0].items():
        ref = want[name.rsplit("-", 1)[1]]
        assert len(got["loss"]) == 6, name
        for key in ("loss", "valid", *ROUTER):
            for step, (a, b) in enumerate(zip(got[key], ref[key], strict=True)):
                assert math.isclose(a, b, rel_tol=RTOL, abs_tol=1e-9), (
                    f"{name}: {key} {step + 1}: {a!r} != {b!r}"
                )
        for step, (a, b) in enumerate(zip(got["grad_norm"], ref["grad_norm"], strict=True)):
            assert math.isclose(a, b, rel_tol=GRAD_NORM_RTOL["fp32"]), (
                f"{name}: grad norm {step + 1}: {a} != {b}"
            )
