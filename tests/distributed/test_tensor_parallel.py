"""Tensor (+ sequence) parallelism on 2 gloo processes reproduces the single-process training run.

Every case builds the model with the same seed (fp32, dropout 0), trains 5 AdamW steps on the same
fixed batches plainly (in the test process) and with `apply_tensor_parallel` on tp=2, and compares
the per-step losses, the MLM accuracy counts, the first step's gradients, the final (gathered)
weights and, for BERT, the final model's vocabulary argmax on the labelled rows.

Tolerance: the tp run computes the same sums in another order (each rank contracts over half of
the heads / MLP columns / vocabulary, then all-reduces or reduce-scatters; the softmax normalizer
is a sum of two partial sums), so fp32 results differ by a few ulps per reduction, ~1e-7..1e-6
relative. Limits and the largest differences measured over the five cases:
  loss          rtol 1e-5                                      measured <= 1.5e-7 relative
  gradients     atol 1e-5 * max|grad| of the parameter, rtol 1e-4   measured <= 9e-7 * max|grad|
  weights       atol 5e-5 + rtol 1e-4                          measured <= 1.5e-6 absolute, except one
                element of 16384 at 1.2e-5 (BERT, layers.1.mlp.down, name-seeded init of 2026-11-23)
The gradient check is the sharp one: Adam's update ignores a gradient's scale, so a doubled or
halved gradient (a reduction too many or too few) would pass the loss and weight checks but is off
by 100% here. The weight limit is 1/20 of one step: Adam divides by sqrt(v), so an element whose
gradient is near zero turns ulp-level reduction noise into a visible part of its step; a wrong
shard moves weights by ~1e-3 per step (lr) and still misses 5e-5 by orders of magnitude.
Argmax indices and MLM correct counts are integers and must be equal.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from harness import run_distributed
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from scalable_transformer.config.model_shapes import block_numel
from scalable_transformer.config.schema import ModelConfig
from scalable_transformer.models import build_model, compute_loss, model_inputs
from scalable_transformer.parallel.tensor import (
    apply_tensor_parallel,
    loss_ops,
    loss_parallel_context,
    vocab_parallel_argmax_rows,
)

STEPS, BATCH, SEED = 5, 4, 1234
LOSS_RTOL, GRAD_ATOL, WEIGHT_ATOL, WEIGHT_RTOL = 1e-5, 1e-5, 5e-5, 1e-4


def tiny(model_type: str, **overrides) -> ModelConfig:
    base = dict(
        type=model_type,
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        ffn_hidden_size=256,
        seq_length=32,
        max_position_embeddings=32,
        vocab_size=500,  # padded to 512: 12 rows no token uses, sharded like the rest
        make_vocab_size_divisible_by=128,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    base.update(overrides)
    return ModelConfig(**base)


def batches(cfg: ModelConfig) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(7)
    b, s = BATCH, cfg.seq_length
    assert cfg.vocab_size is not None
    out = []
    for _ in range(STEPS):
        if cfg.type == "gpt":
            tokens = torch.randint(0, cfg.vocab_size, (b, s + 1), generator=gen)
            out.append({"input_ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()})
            continue
        attention_mask = torch.ones(b, s, dtype=torch.long)
        attention_mask[0, -5:] = 0
        attention_mask[2, -11:] = 0
        masked = (torch.rand(b, s, generator=gen) < 0.15) & attention_mask.bool()
        input_ids = torch.randint(0, cfg.vocab_size, (b, s), generator=gen)
        labels = torch.where(masked, input_ids, torch.full_like(input_ids, -100))
        out.append(
            {
                "input_ids": torch.where(masked, torch.full_like(input_ids, 3), input_ids) * attention_mask,
                "token_type_ids": (torch.arange(s) >= s // 2).long().expand(b, s) * attention_mask,
                "attention_mask": attention_mask,
                "labels": labels,
                "nsp_labels": torch.randint(0, 2, (b,), generator=gen),
            }
        )
    return out


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


def train(cfg: ModelConfig, tp_mesh=None, sequence_parallel: bool = False) -> dict:
    """5 AdamW steps: per-step losses and MLM correct counts, the first step's gradients, the final
    weights (all full tensors) and, for BERT, the final model's argmax on the labelled rows."""
    torch.manual_seed(SEED)
    model = build_model(cfg)
    tp = 1 if tp_mesh is None else tp_mesh.size()
    if tp_mesh is not None:
        apply_tensor_parallel(model, tp_mesh, sequence_parallel)
    initial = {name: _full(p) for name, p in model.named_parameters()}
    block_local = sum(
        (p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.layers[0].parameters()
    )
    # foreach=False: the foreach kernels reject lists mixing DTensor and plain parameters.
    # eps=1e-6: gradients that are zero in exact arithmetic (the key bias: softmax ignores a per-query
    # constant) hold ~1e-10 of rounding noise, which Adam with eps=1e-8 would turn into 1e-5 steps.
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, eps=1e-6, foreach=False)
    losses, correct, grads = [], [], {}
    data = batches(cfg)
    for batch in data:
        optimizer.zero_grad()
        with loss_parallel_context(tp):
            outputs = model(*model_inputs(cfg.type, batch))
            # the TP reductions over vocabulary-sharded logits come from parallel/, through the loss seam
            loss, metrics = compute_loss(cfg.type, outputs, batch, None, loss_ops(tp))
            loss.backward()
        if not grads:
            grads = {name: _full(p.grad) for name, p in model.named_parameters() if p.grad is not None}
            for name, p in model.named_parameters():
                # replicated key/value groups (MQA): a Partial gradient would be a reduction left undone
                if isinstance(p, DTensor) and ".qkv." in name:
                    assert not any(pl.is_partial() for pl in p.grad.placements), (name, p.grad.placements)
        optimizer.step()
        losses.append(loss.item())
        correct.append(metrics.get("mlm_correct", torch.tensor(0.0)).item())
    argmax = None
    if cfg.type == "bert":  # random labels are almost never predicted: compare the predictions
        with torch.no_grad(), loss_parallel_context(tp):
            logits_bsv = model(*model_inputs(cfg.type, data[0]))[0]
            argmax = vocab_parallel_argmax_rows(
                logits_bsv.reshape(-1, logits_bsv.shape[-1]), data[0]["labels"].reshape(-1) != -100
            )
    weights = {name: _full(p) for name, p in model.named_parameters()}
    return {
        "losses": losses,
        "correct": correct,
        "grads": grads,
        "weights": weights,
        "argmax": argmax,
        "initial": initial,
        "block_local": block_local,
    }


def _tp_worker(rank: int, world_size: int, cfg: ModelConfig, sequence_parallel: bool) -> dict:
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    result = train(cfg, mesh["tp"], sequence_parallel)
    if cfg.type == "bert":
        _check_argmax_rows(mesh)
    return result


def _check_argmax_rows(mesh) -> None:
    """The sharded argmax equals torch.argmax, ties across shards included (lowest index wins)."""
    logits_nv = torch.randn(6, 8, generator=torch.Generator().manual_seed(0))
    logits_nv[1, [2, 6]] = 10.0  # tie between shard 0 and shard 1
    logits_nv[3, [5, 7]] = 10.0  # tie inside shard 1
    rows_n = torch.tensor([True, True, False, True, True, False])
    sharded = distribute_tensor(logits_nv, mesh, [Shard(1)])
    assert torch.equal(vocab_parallel_argmax_rows(sharded, rows_n), logits_nv[rows_n].argmax(-1))
    assert vocab_parallel_argmax_rows(sharded, torch.zeros(6, dtype=torch.bool)).numel() == 0


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], relative: bool = False) -> float:
    return max(
        (a[n] - t).abs().max().item() / (t.abs().max().item() if relative else 1.0) for n, t in b.items()
    )


def check_equivalent(tmp_path, cfg: ModelConfig, sequence_parallel: bool) -> None:
    torch.set_num_threads(1)
    plain = train(cfg)
    per_rank = run_distributed(_tp_worker, 2, cfg, sequence_parallel, tmp_dir=tmp_path, timeout=150)
    # the run moved the weights far beyond the tolerance (AdamW: ~lr = 1e-3 per step)
    assert _max_diff(plain["weights"], plain["initial"]) > 20 * WEIGHT_ATOL  # at least one lr-sized step
    for rank, result in enumerate(per_rank):
        where = f"rank {rank}"
        # the planner's torch-free count of a block's local shard (config/model_shapes.py)
        assert result["block_local"] == block_numel(cfg, tp=2), where
        assert result["losses"] == pytest.approx(plain["losses"], rel=LOSS_RTOL, abs=0), where
        assert result["correct"] == plain["correct"], where
        if plain["argmax"] is not None:
            assert torch.equal(result["argmax"], plain["argmax"]), where
        for key, atol_scale, atol, rtol in [
            ("grads", GRAD_ATOL, 0.0, 1e-4),
            ("weights", 0.0, WEIGHT_ATOL, WEIGHT_RTOL),
        ]:
            assert result[key].keys() == plain[key].keys(), where
            for name, expected in plain[key].items():
                scale_atol = atol + atol_scale * expected.abs().max().item()
                torch.testing.assert_close(
                    result[key][name],
                    expected,
                    atol=scale_atol,
                    rtol=rtol,
                    msg=lambda m, n=name, w=where: f"{w} {n}: {m}",
                )
    loss_diff = max(abs(a - b) / abs(b) for a, b in zip(per_rank[0]["losses"], plain["losses"], strict=True))
    grad_diff = _max_diff(per_rank[0]["grads"], plain["grads"], relative=True)
    weight_diff = _max_diff(per_rank[0]["weights"], plain["weights"])
    print(f"loss rel {loss_diff:.1e}, grad rel-to-max {grad_diff:.1e}, weight abs {weight_diff:.1e}")


@pytest.mark.distributed
@pytest.mark.slow
def test_gpt_tp2(tmp_path):
    check_equivalent(tmp_path, tiny("gpt"), sequence_parallel=False)


@pytest.mark.distributed
@pytest.mark.slow
def test_gpt_tp2_sequence_parallel(tmp_path):
    check_equivalent(tmp_path, tiny("gpt"), sequence_parallel=True)


@pytest.mark.distributed
@pytest.mark.slow
def test_gpt_rotary_rmsnorm_geglu_untied_tp2_sequence_parallel(tmp_path):
    cfg = tiny(
        "gpt", position_embedding_type="rotary", norm="rmsnorm", activation="geglu", tie_word_embeddings=False
    )
    check_equivalent(tmp_path, cfg, sequence_parallel=True)


@pytest.mark.distributed
@pytest.mark.slow
def test_bert_binary_head_tp2(tmp_path):
    check_equivalent(tmp_path, tiny("bert"), sequence_parallel=False)


@pytest.mark.distributed
@pytest.mark.slow
def test_bert_post_ln_untied_tp2_sequence_parallel(tmp_path):
    cfg = tiny("bert", apply_residual_connection_post_layernorm=True, tie_word_embeddings=False)
    check_equivalent(tmp_path, cfg, sequence_parallel=True)


def test_plan_skips_children_a_pipeline_stage_lacks():
    """A middle stage (ModuleDict of blocks keyed by global index, no embedding or heads) gets only
    block entries, and no gather at its end even for post-LN models; the model's last block does."""
    from torch import nn

    from scalable_transformer.parallel.tensor import tensor_parallel_plan

    cfg = tiny("bert", apply_residual_connection_post_layernorm=True)
    model = build_model(cfg)
    stage = nn.Module()
    stage.layers = nn.ModuleDict({"0": model.layers[0]})
    names = [name for name, _ in tensor_parallel_plan(stage, sequence_parallel=True)]
    assert names and all(name.startswith("layers.0.") for name in names)
    stage.cfg = dataclasses.replace(cfg)
    assert "layers.0" not in [name for name, _ in tensor_parallel_plan(stage, sequence_parallel=True)]
    stage.layers = nn.ModuleDict({"1": model.layers[1]})
    assert "layers.1" in [name for name, _ in tensor_parallel_plan(stage, sequence_parallel=True)]
    full = [name for name, _ in tensor_parallel_plan(model, sequence_parallel=False)]
    assert {"embedding.word", "lm_head.logits", "layers.1.mlp.down"} <= set(full)


LLAMA = dict(
    position_embedding_type="rotary",
    norm="rmsnorm",
    activation="swiglu",
    add_bias_linear=False,
    tie_word_embeddings=False,
)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2-sp"])
@pytest.mark.parametrize("groups", [2, 1], ids=["gqa-2-groups", "mqa"])
def test_gpt_llama_shape_tp2(tmp_path, groups, sequence_parallel):
    # 2 groups: each rank holds one whole group; 1 group (MQA): the qkv projection is replicated
    # and each rank keeps half the query heads and the shared key/value head.
    check_equivalent(tmp_path, tiny("gpt", num_query_groups=groups, **LLAMA), sequence_parallel)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("groups", [2, 1], ids=["gqa-2-groups-sp", "mqa"])
def test_gpt_qk_norm_per_head_with_own_head_size_tp2(tmp_path, groups):
    # Qwen3's attention: a head size of its own (model.kv_channels 24, not 64 / 4) and an RMSNorm over
    # each head's q and k whose replicated [24] weights get each rank's heads' Partial gradient; with
    # one group (MQA) the ranks share the key head, and k_norm's gradient is still their sum
    cfg = tiny("gpt", num_query_groups=groups, kv_channels=24, qk_norm="head", **LLAMA)
    check_equivalent(tmp_path, cfg, sequence_parallel=groups == 2)


def _partial_grads_worker(rank: int, world_size: int, cfg: ModelConfig) -> dict:
    """After a sequence-parallel backward: the norms' gradients are Partial; reduce_partial_grads
    makes them Replicate with the values DTensor's own reduction gives, in one all-reduce."""
    from unittest import mock

    import torch.distributed as dist

    from scalable_transformer.parallel.grads import reduce_partial_grads

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    torch.manual_seed(SEED)
    model = build_model(cfg)
    apply_tensor_parallel(model, mesh["tp"], True)
    batch = batches(cfg)[0]
    with loss_parallel_context(2):
        outputs = model(*model_inputs(cfg.type, batch))
        loss, _ = compute_loss(cfg.type, outputs, batch, None, loss_ops(2))
        loss.backward()
    partial = {
        n: p.grad.full_tensor()  # DTensor's own reduction, one all-reduce per tensor
        for n, p in model.named_parameters()
        if isinstance(p.grad, DTensor) and any(pl.is_partial() for pl in p.grad.placements)
    }
    before = {n: _full(p.grad) for n, p in model.named_parameters() if n not in partial}
    calls = []
    real = dist.all_reduce
    with mock.patch.object(dist, "all_reduce", side_effect=lambda *a, **k: calls.append(1) or real(*a, **k)):
        reduced = reduce_partial_grads(list(model.parameters()))
        again = reduce_partial_grads(list(model.parameters()))
    params = dict(model.named_parameters())
    return {
        "names": sorted(partial),
        "reduced": reduced,
        "again": again,
        "calls": len(calls),
        "placements": {n: tuple(type(pl).__name__ for pl in params[n].grad.placements) for n in partial},
        "equal": all(torch.equal(params[n].grad.to_local(), partial[n]) for n in partial),
        "others_unchanged": all(torch.equal(_full(params[n].grad), t) for n, t in before.items()),
    }


@pytest.mark.distributed
def test_sequence_parallel_partial_grads_reduced_in_one_all_reduce(tmp_path):
    cfg = tiny("gpt")
    for result in run_distributed(_partial_grads_worker, 2, cfg, tmp_dir=tmp_path, timeout=120):
        # two norms per block and the final norm, weight and bias each
        assert len(result["names"]) == 2 * 2 * cfg.num_layers + 2, result["names"]
        assert all(".norm" in n or n.startswith("final_norm") for n in result["names"]), result["names"]
        assert result["reduced"] == len(result["names"])
        assert result["again"] == 0  # nothing Partial is left
        assert result["calls"] == 1  # one flat buffer for all of them
        assert set(result["placements"].values()) == {("Replicate",)}
        assert result["equal"] and result["others_unchanged"]
