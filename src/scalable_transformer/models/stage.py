"""A pipeline stage is the model with the parts it does not hold removed.

`make_stage` returns an instance of the model's own class sharing the model's submodules: the
transformer layers it holds in an nn.ModuleDict keyed by the global layer index, the embedding only
on the first stage, the head only on the last; a removed part is None and `has_embedding` /
`has_head` say what the forward runs. So parameter names (checkpoint keys) are the full model's in
every layout: `layers.5.mlp.up.weight` on whichever stage holds block 5.

A tied model's last stage (when it is not also the first) holds its own copy of the word embedding
under the same key, `embedding.word.weight` (Megatron's scheme); parallel/pipeline.py sums the two
copies' gradients so they stay identical under the optimizer.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

from torch import nn


class TiedWordCopy(nn.Module):
    """The last stage's own copy of the word embedding: key `embedding.word.weight`, as on stage 0."""

    def __init__(self, word: nn.Module) -> None:
        super().__init__()
        self.word = copy.deepcopy(word)


def make_stage(
    model: nn.Module,
    layer_ids: Sequence[int],
    *,
    first: bool,
    last: bool,
    embedding_parts: tuple[str, ...],
    head_parts: tuple[str, ...],
    word_embedding: str,
) -> nn.Module:
    """`model` pruned to a pipeline stage (see the module docstring). Children that are neither
    layers, embedding nor head (rotary tables) must be parameter-free: each stage gets a private copy,
    which keeps FSDP roots disjoint."""
    cls = type(model)
    stage = cls.__new__(cls)
    nn.Module.__init__(stage)
    # plain attributes (cfg, recompute_chunk, ...): the same values, the module registries are our own
    for key, value in vars(model).items():
        if not key.startswith("_") and key != "training":
            stage.__dict__[key] = value
    stage.training = model.training
    layers = model.get_submodule("layers")
    held = {int(name): block for name, block in layers.named_children()}
    tied = bool(getattr(getattr(model, "cfg", None), "tie_word_embeddings", False))
    for name, child in model.named_children():
        if name == "layers":
            stage.layers = nn.ModuleDict({str(i): held[i] for i in layer_ids})
        elif name in embedding_parts:
            if first:
                stage.register_module(name, child)
            elif last and tied and word_embedding.startswith(f"{name}."):
                stage.register_module(name, TiedWordCopy(model.get_submodule(word_embedding)))
            else:
                stage.register_module(name, None)
        elif name in head_parts:
            stage.register_module(name, child if last else None)
        else:
            if any(True for _ in child.parameters()):
                raise ValueError(
                    f"{cls.__name__}.{name} has parameters but is neither a layer, embedding nor head part"
                )
            stage.register_module(name, copy.deepcopy(child))
    # plain attributes of the family's class (nn.Module's typing only knows submodules and tensors);
    # recompute_chunk is set by parallel.apply for chunked full recompute
    vars(stage).update(has_embedding=first, has_head=last, recompute_chunk=0, recompute_checkpoint=None)
    return stage
