"""ModelSpec: everything the rest of the package may know about a model family, in one object.

Layers above models/ (parallel/, data/, train/, checkpoint/, metrics/) ask the family's spec
(`models.registry.spec_for(cfg)`) instead of branching on `model.type`. A spec holds facts (names,
keys, shapes) and plain functions; the parallel machinery itself (DTensor styles, schedules,
collectives) stays in parallel/ and reads only these facts.

Shape legend: b batch, s sequence, h hidden, v padded vocabulary, n rows (b * s flattened).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from scalable_transformer.config.schema import ModelConfig
from scalable_transformer.models.stage import make_stage

Batch = dict[str, torch.Tensor]
IGNORE_INDEX = -100


class _CrossEntropySum(torch.autograd.Function):
    """F.cross_entropy(logits.float(), labels, reduction="sum") with one [n, v] fp32 buffer instead of
    four. torch's composite saves the log-softmax, then its backward allocates the NLL's zero-filled
    gradient and log-softmax's gradient, both [n, v] fp32, per micro-batch. Here the log-softmax is
    written over the fp32 logits (the logits themselves when they are fp32 and only this loss reads
    them: `in_place`, marked dirty so that autograd knows), and the backward writes softmax - one-hot
    over it in turn and returns that buffer (fp32 logits) or its cast (bf16/fp16 logits). On a CPU
    with an 8 MiB mmap threshold (FSDP2's steps, parallel.init.step_allocation) each fresh [n, v]
    buffer is mapped and zero-filled page by page by the kernel; on a GPU the loss's peak loses
    three [n, v] fp32 buffers. Liger-Kernel's fused linear cross-entropy goes further (no logits at
    all) but is Triton-only."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, logits: torch.Tensor, labels_n: torch.Tensor, ignore_index: int, in_place: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.set_materialize_grads(False)
        ctx.logits_dtype = logits.dtype
        out = logits.float()
        if (in_place or out is not logits) and out.is_contiguous():
            # the logits themselves, or the fresh fp32 copy of bf16/fp16 logits: written over
            logp_nv = out.view(-1, out.shape[-1])
            torch.log_softmax(logp_nv, dim=-1, out=logp_nv)
        else:
            out = torch.log_softmax(out, dim=-1).contiguous()  # the backward writes over it by rows
            logp_nv = out.view(-1, out.shape[-1])
        valid_n = labels_n != ignore_index
        rows_n1 = torch.where(valid_n, labels_n, 0).unsqueeze(1)
        picked_n = logp_nv.gather(1, rows_n1).squeeze(1)
        loss = torch.where(valid_n, -picked_n, 0.0).sum()
        if in_place:
            ctx.mark_dirty(out)
        ctx.save_for_backward(out, rows_n1, valid_n)
        return loss, out

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: Any, grad_loss: torch.Tensor | None, _grad_logp: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, None, None, None]:
        logp, rows_n1, valid_n = ctx.saved_tensors
        if not ctx.needs_input_grad[0] or grad_loss is None:
            return None, None, None, None
        # d(sum of -log p[label]) / d logits = softmax - one-hot, for the labelled rows only; the
        # version counter makes a second backward through this graph an error, never a wrong value
        grad = logp.exp_()
        grad_nv = grad.view(-1, grad.shape[-1])
        grad_nv.scatter_add_(1, rows_n1, torch.full_like(rows_n1, -1, dtype=grad_nv.dtype))
        grad_nv.mul_((valid_n.to(grad_nv.dtype) * grad_loss.to(grad_nv.dtype)).unsqueeze(1))
        return grad.to(ctx.logits_dtype), None, None, None


def cross_entropy_sum(logits: torch.Tensor, labels_n: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """Summed fp32 cross-entropy over the rows whose label is not ignore_index (a scalar), as
    F.cross_entropy(reduction="sum") on the fp32 logits [..., v] (n rows in all) computes it
    (`_CrossEntropySum`). Fp32 logits that need a gradient hold the log-probabilities afterwards:
    read anything else from them (an argmax) before."""
    in_place = (
        logits.dtype == torch.float32
        and torch.is_grad_enabled()
        and logits.grad_fn is not None  # neither a leaf nor a tensor without history
        and logits._base is None  # not a view: autograd would re-route its base's gradient
        and logits.is_contiguous()
    )
    return _CrossEntropySum.apply(logits, labels_n, ignore_index, in_place)[0]


def argmax_rows(logits_nv: torch.Tensor, rows_n: torch.Tensor) -> torch.Tensor:
    """Vocabulary argmax [m] of the rows selected by the boolean mask rows_n (m = rows_n.sum())."""
    return logits_nv[rows_n].argmax(-1)


@dataclass(frozen=True)
class LossOps:
    """The two reductions over the vocabulary that a loss needs, as a seam: plain torch by default;
    tensor parallelism (`parallel.tensor.loss_ops`) supplies versions for vocabulary-sharded logits,
    so models/ never sees a DTensor."""

    cross_entropy_sum: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor] = cross_entropy_sum
    argmax_rows: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = argmax_rows
    # count correct predictions (evaluation's accuracies): an argmax over the labelled rows, whose
    # boolean-mask selection is a host synchronization on a GPU, so a training step leaves it out
    accuracy: bool = True

    def for_training(self) -> LossOps:
        """The same reductions without the accuracy counts (a training step logs losses only)."""
        return dataclasses.replace(self, accuracy=False)


PLAIN_LOSS_OPS = LossOps()

LossFn = Callable[
    [Any, Batch, "dict[str, int] | None", LossOps], tuple[torch.Tensor, dict[str, torch.Tensor]]
]


@dataclass(frozen=True)
class TensorParallelNames:
    """Module and parameter names that `parallel/tensor.py` shards (relative to the model or a
    pipeline stage of it; a name a stage lacks is skipped). The blocks are always `layers.<i>` with
    the `TransformerBlock` contract of models/layers.py.

    embedding       the embedding module: its output is the stack's input (sequence parallel shards it)
    word_embedding  the vocabulary-row embedding table (row-parallel lookup)
    final_norm      the norm after the last block (absent in post-LN models)
    untied_outputs  Linear modules whose weight [v, h] is the untied output matrix (forward never runs)
    output_bias     a per-vocabulary-row bias parameter [v] added to the logits, or None
    logits          the parameter-free module computing x @ W^T (+ bias): its input becomes a DTensor
    """

    embedding: str = "embedding"
    word_embedding: str = "embedding.word"
    final_norm: str = "final_norm"
    untied_outputs: tuple[str, ...] = ()
    output_bias: str | None = None
    logits: str = "logits"


@dataclass(frozen=True)
class DataSpec:
    """What the data loader needs to know to feed the family.

    corpus          how the raw text is preprocessed, and the embedded corpus' cache name:
                    "sentences" (one sentence per item, BERT's sentence pairs) or "eod" (documents
                    closed by an end-of-document token, GPT's packed stream)
    dataset         which dataset class builds the samples: "masked-lm" (BertDataset) or "causal-lm"
                    (GPTDataset)
    tokenizer_vocab whether token ids must be the tokenizer's (BERT draws [MASK] and random
                    replacements from it) rather than anything the model's vocabulary embeds
    label_keys      the batch keys the loss reads
    """

    corpus: str
    dataset: str
    tokenizer_vocab: bool
    label_keys: tuple[str, ...]

    @property
    def split_sentences(self) -> bool:
        return self.corpus == "sentences"

    @property
    def append_eod(self) -> bool:
        return self.corpus == "eod"


@dataclass(frozen=True)
class HFMapping:
    """The Hugging Face `transformers` equivalent of the family (functions in models/<family>/hf.py).

    model_type      HF's config.model_type ("gpt2", "bert")
    hf_class        the transformers class exported to / imported from
    unsupported     cfg -> reasons the model has no equivalent (empty: it has one)
    to_hf           (model, cfg) -> a transformers model holding the model's weights
    overrides       HF config -> the model.* settings describing it
    vocab_keys      our state-dict keys whose first dim is the padded vocabulary (import fills only the
                    HF vocabulary's rows)
    """

    model_type: str
    hf_class: str
    unsupported: Callable[[ModelConfig], list[str]]
    to_hf: Callable[[nn.Module, ModelConfig], Any]
    overrides: Callable[[Any], dict[str, Any]]
    vocab_keys: tuple[str, ...]


@dataclass(frozen=True)
class PipelineSpec:
    """How torch.distributed.pipelining feeds and scores stages of the family.

    first_stage_keys  batch keys given to the first stage only, as positional args in this order
                      (the model's leading forward args; later stages get hidden states x [b, s, h])
    every_stage_kwargs (batch key, forward keyword) pairs given to every stage (e.g. BERT's mask)
    last_stage_outputs cfg, b -> the shapes of the last stage's output tensors (float, in order)
    pack_target       batch -> the one tensor the schedule splits into micro-batches for the loss
    unpack_target     that tensor -> the label batch the loss reads
    outputs_from_stage the last stage's output (its None outputs dropped, pipelining sends tensors
                      only) -> the model's outputs as the loss takes them
    """

    first_stage_keys: tuple[str, ...]
    every_stage_kwargs: tuple[tuple[str, str], ...]
    last_stage_outputs: Callable[[ModelConfig, int], tuple[tuple[int, ...], ...]]
    pack_target: Callable[[Batch], torch.Tensor]
    unpack_target: Callable[[torch.Tensor], Batch]
    outputs_from_stage: Callable[[Any], Any] = lambda output: output


@dataclass(frozen=True)
class ModelSpec:
    """One model family (`model.type` = name): how to build, feed, score, shard, pipeline, export,
    load data for it (its parameter counts and FLOPs shape are torch-free, in config/model_shapes.py,
    for the planner). See models/registry.py for how to add one.

    build(cfg)            the model, initialised; construction is meta-device safe (under
                          `torch.device("meta")` nothing is computed; `model.init_weights()` fills it)
    input_keys            batch keys -> the model's positional forward args, in order
    loss(outputs, batch, normalizers, ops) -> (scalar loss to backprop, detached fp32 scalar metrics)
    metric_names(cfg)     the keys `loss` returns for cfg, known without running it
    lm_metric             the language-model loss metric that perplexity is computed from
    tensor_parallel       names for the tensor-parallel plan
    embedding_parts / head_parts  top-level children that only the first / last pipeline stage holds
    pipeline              stage inputs, outputs and target packing
    hf                    the Hugging Face mappings, in order of preference: a model exports to the
                          first whose `unsupported` finds nothing (none: no equivalent)
    data                  what the data loader needs
    batch_shapes(cfg, b)  key -> shape of a collated micro-batch of b samples (int64), as the data
                          loader makes it (default: every input and label key [b, seq_length]); a
                          dry run (dryrun/dry_run.py) feeds such batches without data
    optional_inputs       (batch key, forward keyword) pairs passed when the batch has the key (GPT's
                          document ids of packed samples)
    """

    name: str
    build: Callable[[ModelConfig], nn.Module]
    input_keys: tuple[str, ...]
    loss: LossFn
    metric_names: Callable[[ModelConfig], tuple[str, ...]]
    lm_metric: str
    tensor_parallel: TensorParallelNames
    embedding_parts: tuple[str, ...]
    head_parts: tuple[str, ...]
    pipeline: PipelineSpec
    data: DataSpec
    hf: tuple[HFMapping, ...] = ()
    batch_shapes: Callable[[ModelConfig, int], dict[str, tuple[int, ...]]] | None = None
    optional_inputs: tuple[tuple[str, str], ...] = ()

    def micro_batch_shapes(self, cfg: ModelConfig, micro_batch: int) -> dict[str, tuple[int, ...]]:
        """Shapes of a collated micro-batch (see `batch_shapes`)."""
        if self.batch_shapes is not None:
            return self.batch_shapes(cfg, micro_batch)
        keys = (*self.input_keys, *self.data.label_keys)
        return dict.fromkeys(keys, (micro_batch, cfg.seq_length))

    def inputs(self, batch: Batch) -> tuple[torch.Tensor, ...]:
        """The positional arguments of the model's forward, taken from a batch dict."""
        missing = [key for key in self.input_keys if key not in batch]
        if missing:
            raise KeyError(f"{self.name} batch lacks {missing}; it has {sorted(batch)}")
        return tuple(batch[key] for key in self.input_keys)

    def optional_kwargs(self, batch: Batch) -> dict[str, torch.Tensor]:
        """The keyword arguments of the model's forward that this batch carries (`optional_inputs`)."""
        return {kw: batch[key] for key, kw in self.optional_inputs if key in batch}

    def stage(self, model: nn.Module, layer_ids: Sequence[int], *, first: bool, last: bool) -> nn.Module:
        """`model` with the parts a pipeline stage does not hold removed: layers `layer_ids` only (an
        nn.ModuleDict keyed by global index), the embedding if `first`, the head if `last` (plus the
        tied word-embedding copy when tied and not first). Parameter names stay the full model's.
        Shares `model`'s submodules; see models/stage.py."""
        return make_stage(
            model,
            layer_ids,
            first=first,
            last=last,
            embedding_parts=self.embedding_parts,
            head_parts=self.head_parts,
            word_embedding=self.tensor_parallel.word_embedding,
        )
