"""A mixture-of-experts GPT trains the same under data, pipeline, tensor (with and without sequence
parallelism) and expert x tensor parallelism as in one process (issue 43): the losses, gradient norms
and the router's figures (aux and z losses, dropped assignments, load imbalance) of every step, with
dropless routing and with a capacity factor, as test_equivalence.py checks the dense layouts (its
BASE, harness and tolerances; expert parallelism alone is in test_expert_parallel.py).

The aux losses are strong here (1.0 and 0.1, a hundred times the usual) so that a wrong gradient scale
of theirs shows: leaving out the 1 / micro-batches of `MoEStep.begin` moved dp2's third loss by 2e-4
relative, ten times the tolerance (with coefficients ten times smaller: 3e-5, too close to it)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import test_checkpoint_layouts as checkpoint_layouts
import test_tensor_parallel as tensor_parallel
import torch
from harness import run_distributed
from test_equivalence import BASE, GRAD_NORM_RTOL, RTOL
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from scalable_transformer.config.load import load_config
from scalable_transformer.config.model_shapes import block_numel
from scalable_transformer.models import build_model, compute_loss, model_inputs
from scalable_transformer.models.moe import MoELayer
from scalable_transformer.parallel.expert import apply_expert_parallel
from scalable_transformer.parallel.tensor import apply_tensor_parallel, loss_ops, loss_parallel_context
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
    # tensor parallelism: every tp rank routes the same tokens and holds half of every expert
    # (parallel/expert.py, parallel/tensor.py); under SP the sequence is gathered before the router
    "tp2-dropless": ["parallel.tp=2"],
    "tp2-sp-dropless": ["parallel.tp=2", "parallel.sequence_parallel=true"],
    "tp2-sp-recompute-capacity": [
        "parallel.tp=2",
        "parallel.sequence_parallel=true",
        "parallel.activation_checkpointing=full",  # the seams' collectives run again in backward
        *ROUTINGS["capacity"],
    ],
}
# 4 ranks: the experts' weights over the (ep, tp) mesh, the all-to-all among ranks of one tp index;
# tp with pipeline stages (SP across stage boundaries) and with context parallelism (the aux loss
# reads whole sequences gathered over cp, every tp rank the same)
FOUR = {
    "pp2xtp2-sp-dropless": [
        "parallel.pp=2",
        "parallel.pipeline_schedule=1f1b",
        "parallel.tp=2",
        "parallel.sequence_parallel=true",
    ],
    "cp2xtp2-dropless": ["parallel.cp=2", "parallel.tp=2"],
    "ep2xtp2-zero0-dropless": ["parallel.ep=2", "parallel.tp=2", "parallel.zero_stage=0"],
    "ep2xtp2-sp-zero3-capacity": [
        "parallel.ep=2",
        "parallel.tp=2",
        "parallel.sequence_parallel=true",
        "parallel.zero_stage=3",
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


def _layouts(rank: int, world_size: int, root: str, cases: dict[str, list[str]]) -> dict:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    return {name: train(overrides, Path(root) / name) for name, overrides in cases.items()}


def _single_process(tmp_path: Path) -> dict[str, dict[str, list[float]]]:
    want = {name: train(overrides, tmp_path / name) for name, overrides in ROUTINGS.items()}
    assert all(want.values())
    assert sum(want["capacity"]["moe_dropped_tokens"]) > 0  # the capacity factor did drop assignments
    assert set(want["dropless"]["moe_dropped_tokens"]) == {0.0}
    return want  # type: ignore[return-value]


def _assert_match(results: dict, want: dict[str, dict[str, list[float]]]) -> None:
    for name, got in results.items():
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


def test_moe_layouts_match_single_process(tmp_path):
    want = _single_process(tmp_path)
    results = run_distributed(_layouts, 2, str(tmp_path), CASES, tmp_dir=tmp_path, timeout=900)
    assert results[0] is not None
    _assert_match(results[0], want)


def test_moe_under_expert_and_tensor_parallelism_matches_single_process(tmp_path):
    """ep2 x tp2 (dp 2 = ep 2, so edp 1), with ZeRO-0 and dropless routing, and with sequence
    parallelism, ZeRO-3 and a capacity factor (the same dropped assignments as the one process);
    pp2 x tp2 and cp2 x tp2."""
    want = _single_process(tmp_path)
    results = run_distributed(_layouts, 4, str(tmp_path), FOUR, tmp_dir=tmp_path, timeout=900)
    assert results[0] is not None
    _assert_match(results[0], want)


# One step's gradients, parameter by parameter, under tensor parallelism (test_tensor_parallel.py's
# harness and tolerances), with a shared expert (the routed layouts above have none): the router's
# gradient must be whole and the same on every tp rank (each rank routes all the tokens, and the
# top-k weights' gradients are summed over tp), the experts' shards the slices of the one-process
# gradient. A missing sum leaves the router's gradient a partial one (off by about half); a sum too
# many doubles the aux losses' share.
TP_MOE = {
    "num_experts": 4,
    "moe_router_topk": 2,
    "moe_ffn_hidden_size": 32,
    "moe_shared_expert_size": 64,
    "moe_aux_loss_coeff": 1.0,
    "moe_z_loss_coeff": 0.1,
    "activation": "swiglu",
    "add_bias_linear": False,
    "position_embedding_type": "rotary",
}


def _one_step(cfg, tp_mesh=None, sequence_parallel: bool = False) -> dict:
    torch.manual_seed(tensor_parallel.SEED)
    model = build_model(cfg)
    tp = 1 if tp_mesh is None else tp_mesh.size()
    if tp_mesh is not None:
        apply_tensor_parallel(model, tp_mesh, sequence_parallel)
        apply_expert_parallel(model, tp_mesh)
    for layer in model.modules():
        if isinstance(layer, MoELayer):
            layer.backward_scale = 1.0
    batch = tensor_parallel.batches(cfg)[0]
    with loss_parallel_context(tp):
        outputs = model(*model_inputs(cfg.type, batch))
        loss, _ = compute_loss(cfg.type, outputs, batch, None, loss_ops(tp))
        loss.backward()
    grads = {name: tensor_parallel._full(p.grad) for name, p in model.named_parameters()}
    routers = {name: p.grad.clone() for name, p in model.named_parameters() if name.endswith("router.weight")}
    block = model.layers[0]
    assert isinstance(block.mlp, MoELayer)
    local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in block.parameters())
    return {"loss": loss.item(), "grads": grads, "routers": routers, "block_local": local}


def _tp_step(rank: int, world_size: int, cfg, sequence_parallel: bool) -> dict:
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    return _one_step(cfg, mesh["tp"], sequence_parallel)


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2-sp"])
def test_moe_gradients_under_tensor_parallelism_equal_one_process(tmp_path, sequence_parallel):
    torch.set_num_threads(1)
    cfg = tensor_parallel.tiny("gpt", **TP_MOE)
    plain = _one_step(cfg)
    assert any(name.endswith("router.weight") for name in plain["grads"])
    per_rank = run_distributed(_tp_step, 2, cfg, sequence_parallel, tmp_dir=tmp_path, timeout=150)
    for rank, got in enumerate(per_rank):
        assert math.isclose(got["loss"], plain["loss"], rel_tol=tensor_parallel.LOSS_RTOL), rank
        # the planner's torch-free count of an MoE block's local shard (experts / tp, router whole)
        assert got["block_local"] == block_numel(cfg, tp=2, moe=True), rank
        assert got["grads"].keys() == plain["grads"].keys()
        for name, expected in plain["grads"].items():
            atol = tensor_parallel.GRAD_ATOL * expected.abs().max().item()
            torch.testing.assert_close(
                got["grads"][name],
                expected,
                atol=atol,
                rtol=1e-4,
                msg=lambda m, n=name, r=rank: f"rank {r} {n}: {m}",
            )
    for name, grad in per_rank[0]["routers"].items():  # bitwise the same on both tp ranks
        torch.testing.assert_close(per_rank[1]["routers"][name], grad, rtol=0, atol=0)


# A checkpoint saved under ep2 x tp2 (ZeRO-3: the experts' weights on the (edp, ep, tp) mesh) resumes
# in one process and continues the uninterrupted run (test_checkpoint_layouts.py's bar), and one
# saved by one process resumes under ep2 x tp2 with sequence parallelism.
EP_TP_ZERO3 = ["parallel.ep=2", "parallel.tp=2", "parallel.zero_stage=3"]


def _records(overrides: list[str], root: Path, name: str, *extra: str) -> list[dict] | None:
    config = [*BASE, *MOE, *overrides, f"logging.run_dir={root}", f"logging.run_name={name}", *extra]
    out, _ = run_training(load_config(None, config))
    return checkpoint_layouts.records(out) if out is not None else None


def _save_at_3(overrides: list[str], root: Path, name: str) -> list[dict] | None:
    return _records(overrides, root, name, f"checkpoint.save={root / name}", "train.exit_interval=3")


def _expert_tensor_checkpoints(rank: int, world: int, root: str) -> dict:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    r = Path(root)
    saved = _save_at_3(EP_TP_ZERO3, r, "ckpt-ep2xtp2")
    sp = [*EP_TP_ZERO3, "parallel.sequence_parallel=true"]
    resumed = _records(sp, r, "single-to-ep2xtp2-sp", f"checkpoint.load={r / 'ckpt-single'}")
    return {"saved": saved, "resumed": resumed}


def test_an_expert_and_tensor_parallel_checkpoint_resumes_in_one_process_and_back(tmp_path):
    reference = _records([], tmp_path, "reference")
    assert reference is not None and len(reference) == 6
    assert _save_at_3([], tmp_path, "ckpt-single") is not None
    results = run_distributed(_expert_tensor_checkpoints, 4, str(tmp_path), tmp_dir=tmp_path, timeout=900)[0]
    assert [r["iteration"] for r in results["saved"]] == [1, 2, 3]
    checkpoint_layouts.assert_continues("single-to-ep2xtp2-sp", results["resumed"], reference)
    resumed = _records([], tmp_path, "ep2xtp2-to-single", f"checkpoint.load={tmp_path / 'ckpt-ep2xtp2'}")
    checkpoint_layouts.assert_continues("ep2xtp2-to-single", resumed, reference)
