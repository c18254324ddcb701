"""Dropout masks follow Megatron's stream rules (parallel/rng.py), checked on the masks themselves.

Replicated activations: the same mask on every tp rank. Tensor-parallel regions (the attention core on
head shards; the block's hidden dropout on sequence shards under sequence parallelism): a different
mask per tp rank. Pipeline stages: not each other's masks. And activation checkpointing recomputes
the regions with the masks of the forward (the gradients equal those of the run without it).

Hidden-dropout masks are read from the nn.Dropout modules (output zero where the input is not). The
attention core's dropout is inside scaled_dot_product_attention; its stream is probed by a dropout of
a fixed shape drawn inside the core's forward (a pre-hook registered after the stream's), which is the
mask any dropout in that region draws.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from harness import run_distributed
from torch.distributed.tensor import DTensor

from scalable_transformer.config.load import load_config
from scalable_transformer.config.validate import resolve
from scalable_transformer.models.layers import CoreAttention, Embedding, TransformerBlock
from scalable_transformer.parallel.dims import ParallelDims
from scalable_transformer.train.build import build_parallel_model, set_seed

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

SEED = 99
BASE = [
    "model.type=gpt",
    "model.num_layers=4",
    "model.hidden_size=64",
    "model.num_attention_heads=4",
    "model.seq_length=32",
    "model.vocab_size=500",
    "model.hidden_dropout=0.5",
    "model.attention_dropout=0.5",
    "train.micro_batch_size=1",
    "train.global_batch_size=8",
    f"train.seed={SEED}",
]


def _build(rank: int, world: int, overrides: list[str]):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    cfg = resolve(load_config(None, [*BASE, *overrides]), world_size=world)
    set_seed(cfg.train.seed)  # as run_training does, right before the model
    dims = ParallelDims.build(cfg, "cpu")
    model, _ = build_parallel_model(cfg, dims, torch.device("cpu"))
    return model.train()


def _masks(rank: int, world: int, overrides: list[str]) -> dict[str, list[torch.Tensor]]:
    model = _build(rank, world, overrides)
    masks: dict[str, list[torch.Tensor]] = {"hidden": [], "core": []}

    def hidden(module, args, output):
        masks["hidden"].append((output == 0) & (args[0] != 0))

    def core(module, args):
        masks["core"].append(F.dropout(torch.ones(256), 0.5) == 0)

    for module in model.modules():
        if isinstance(module, TransformerBlock | Embedding):
            module.dropout.register_forward_hook(hidden)
        if isinstance(module, CoreAttention):
            module.register_forward_pre_hook(core)
    stage = model[0] if isinstance(model, torch.nn.ModuleList) else model
    ids = torch.randint(0, 500, (1, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        stage(ids if stage.has_embedding else torch.randn(1, 32, 64))
    return masks


def test_tensor_parallel_masks(tmp_path):
    ranks = run_distributed(_masks, 2, ["parallel.tp=2"], tmp_dir=tmp_path, timeout=300)
    # the embedding's and 4 blocks x 2 hidden dropouts on the replicated [b, s, h] stream: the same
    # mask on both tp ranks
    assert len(ranks[0]["hidden"]) == 9
    for a, b in zip(ranks[0]["hidden"], ranks[1]["hidden"], strict=True):
        assert torch.equal(a, b) and 0.3 < a.float().mean() < 0.7
    # the attention core (head shards): each rank its own stream, and a fresh mask per layer
    cores = [torch.stack(r["core"]) for r in ranks]
    assert not torch.equal(cores[0], cores[1])
    assert all(not torch.equal(c[0], c[1]) for c in cores)


def test_sequence_parallel_masks(tmp_path):
    overrides = ["parallel.tp=2", "parallel.sequence_parallel=true"]
    ranks = run_distributed(_masks, 2, overrides, tmp_dir=tmp_path, timeout=300)
    embedding = [r["hidden"].pop(0) for r in ranks]
    assert torch.equal(*embedding)  # it runs on the replicated [b, s, h] before SP slices it
    assert len(ranks[0]["hidden"]) == 8
    for a, b in zip(ranks[0]["hidden"], ranks[1]["hidden"], strict=True):
        assert a.shape == (1, 16, 64)  # the local sequence shard
        assert not torch.equal(a, b)  # two shards of one activation: two masks


def test_pipeline_stages_do_not_repeat_masks(tmp_path):
    ranks = run_distributed(_masks, 2, ["parallel.pp=2"], tmp_dir=tmp_path, timeout=300)
    # stage 0's embedding and blocks 0-1 and stage 1's blocks 2-3 draw [1, 32, 64] masks; equal seeds
    # would make stage 1's first mask repeat stage 0's first (the embedding's)
    assert len(ranks[0]["hidden"]) == 5 and len(ranks[1]["hidden"]) == 4
    for a in ranks[0]["hidden"]:
        for b in ranks[1]["hidden"]:
            assert not torch.equal(a, b)


def _grads(rank: int, world: int, overrides: list[str]) -> dict[str, torch.Tensor]:
    model = _build(rank, world, overrides)
    torch.manual_seed(5)
    ids = torch.randint(0, 500, (2, 32), generator=torch.Generator().manual_seed(0))
    logits = model(ids)
    (logits.full_tensor() if isinstance(logits, DTensor) else logits).float().pow(2).mean().backward()
    return {
        name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
        for name, p in model.named_parameters()
    }


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_recompute_reproduces_the_region_masks(recompute, tmp_path):
    """Under tp2 + SP with dropout on, checkpointing recomputes with the forward's masks: the same
    gradients as without it (a different mask in the recompute would change them by O(1))."""
    from scalable_transformer.parallel.init import canonical_name

    base = ["parallel.tp=2", "parallel.sequence_parallel=true"]
    plain = run_distributed(_grads, 2, base, tmp_dir=tmp_path, timeout=300)[0]
    overrides = [*base, f"parallel.activation_checkpointing={recompute}"]
    checkpointed = run_distributed(_grads, 2, overrides, tmp_dir=tmp_path, timeout=300)[0]
    got = {canonical_name(k): v for k, v in checkpointed.items()}
    for name, grad in plain.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=1e-7, msg=name)
