"""Initialise our model from a local Hugging Face model directory (GPT2LMHeadModel, LlamaForCausalLM,
MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, MixtralForCausalLM, OlmoeForCausalLM,
Qwen3MoeForCausalLM, GPTNeoXForCausalLM, BertForPreTraining,
MegatronBertForPreTraining: `checkpoint.init_from_hf`), the reverse of `stx export --format hf`; and
`stx config from-hf`.

The weight mapping is not written a second time: it is the family's export mapping (`ModelSpec.hf`,
models/<family>/hf.py) run backwards. A float64 copy of our model whose every element holds its own index is
exported; each exported Hugging Face tensor then says, element by element, which of our elements it
came from. Run twice with indices shifted by a constant, the tensors that shift by exactly that
constant are the mapped ones (the exporter keeps Hugging Face's own values where we have no
weight). Hugging Face vocabularies that are not a multiple of make_vocab_size_divisible_by fill the
first rows of our padded embedding; the padding rows keep their initialisation.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from ..config.model_shapes import is_moe_layer
from ..config.schema import ModelConfig
from ..errors import CheckpointError
from ..models import build_model
from ..models.registry import hf_mapping_for_type, hf_mappings
from ..parallel.init import canonical_name, copy_full_into
from .export import hf_mapping

_SHIFT = float(2**40)


# Hugging Face families whose architecture has no equivalent here yet, with the settings that make it so.
_NO_EQUIVALENT = {
    "olmo2": "OLMo-2 normalizes the attention and MLP outputs inside the residual (post_attention_layernorm "
    "and post_feedforward_layernorm after each sublayer, none before); blocks here normalize their inputs "
    "(its q/k norms over all heads are model.qk_norm = full)",
    # ALiBi models: the engine's ALiBi (model.position_embedding_type: alibi) is BLOOM's and GPT-NeoX's,
    # but neither family's block is one of ours
    "bloom": "BLOOM normalizes the word embeddings before the first block (word_embeddings_layernorm); "
    "pre-LN models here have no embedding norm (its ALiBi is model.position_embedding_type = alibi)",
    "mpt": "MPT's LayerNorms have no bias (norm_1, norm_2, norm_f: bias None); LayerNorm here has one "
    "(its ALiBi is model.position_embedding_type = alibi; MPT orders the slopes of a non-power-of-two "
    "head count its own way)",
}


def _hf_classes() -> dict[str, str]:
    """Hugging Face config.model_type -> transformers class, for every family with a mapping."""
    return {m.model_type: m.hf_class for m in hf_mappings()}


def _hf_config(hf_dir: Path) -> Any:
    try:  # optional dependency (the bench extra)
        from transformers import AutoConfig
    except ImportError as e:
        raise CheckpointError(
            "checkpoint.init_from_hf needs the `transformers` package (pip install -e '.[bench]')"
        ) from e
    if not (hf_dir / "config.json").is_file():
        raise CheckpointError(
            f"checkpoint.init_from_hf = {hf_dir}: no config.json there (not a Hugging Face model dir)"
        )
    hf_cfg = AutoConfig.from_pretrained(hf_dir)
    classes = _hf_classes()
    if hf_cfg.model_type in _NO_EQUIVALENT:
        raise CheckpointError(
            f"{hf_dir}: model_type {hf_cfg.model_type!r}: {_NO_EQUIVALENT[hf_cfg.model_type]}"
        )
    if hf_cfg.model_type not in classes:
        raise CheckpointError(
            f"{hf_dir}: model_type {hf_cfg.model_type!r} has no equivalent here; supported: "
            f"{', '.join(f'{k} ({v})' for k, v in classes.items())}"
        )
    return hf_cfg


def model_overrides_from_hf(hf_dir: str | Path) -> dict[str, Any]:
    """The model.* settings (as `key: value`) that describe the Hugging Face model in `hf_dir`."""
    hf = _hf_config(Path(hf_dir))
    mapping = hf_mapping_for_type(hf.model_type)
    assert mapping is not None  # _hf_config accepted only mapped types
    return mapping.overrides(hf)


def _check_shape(cfg: ModelConfig, hf_dir: Path) -> None:
    want = model_overrides_from_hf(hf_dir)
    wrong = [
        f"model.{key} = {getattr(cfg, key)!r} (the Hugging Face model has {value!r})"
        for key, value in want.items()
        # the padding of the vocabulary is ours to choose (import fills the file's rows), and so is the
        # weight of the router's load-balancing loss (a training setting, not a shape)
        if key not in ("vocab_size", "bert_binary_head", "make_vocab_size_divisible_by", "moe_aux_loss_coeff")
        and getattr(cfg, key) != value
    ]
    assert cfg.vocab_size is not None
    if cfg.vocab_size != want["vocab_size"]:
        wrong.append(f"model.vocab_size = {cfg.vocab_size} (the Hugging Face model has {want['vocab_size']})")
    if wrong:
        raise CheckpointError(
            f"checkpoint.init_from_hf = {hf_dir}: the model config does not match: "
            + "; ".join(wrong)
            + f" (`stx config from-hf {hf_dir}` prints matching settings)"
        )


@dataclass(frozen=True)
class _Source:
    """Where a Hugging Face tensor's elements go: `ours` (our key) at local flat indices `index`
    (shape of the HF tensor) for the proxy's layer `layer` / its vocabulary; `layer`: the keys name that
    layer of the proxy and the map holds for every layer of its kind (dense or MoE), None: no layer;
    `vocab_row`: the map is row-periodic in the vocabulary (row r of the HF tensor goes to row r of
    ours), so it extends to any vocabulary size."""

    ours: str
    index: torch.Tensor
    layer: int | None
    vocab_row: int  # elements per vocabulary row of ours (0: not a vocabulary key)


def _proxy_config(cfg: ModelConfig) -> ModelConfig:
    """cfg with the fewest layers holding one of each kind it has (one layer, or up to its first MoE layer
    and its first dense one when it mixes them) and the smallest padded vocabulary: the element maps of
    the export mapping are the same for every layer of a kind and row-periodic over the vocabulary, so
    this proxy (a few blocks and the non-vocabulary tensors: bounded by the widest parameter, not the
    model) gives them all."""
    kinds = [is_moe_layer(cfg, i) for i in range(cfg.num_layers)]
    layers = max(kinds.index(kind) for kind in set(kinds)) + 1
    return dataclasses.replace(cfg, num_layers=layers, vocab_size=cfg.make_vocab_size_divisible_by)


def _representative(cfg: ModelConfig, i: int) -> int:
    """The first layer of layer i's kind (dense or MoE): the proxy layer whose map layer i follows."""
    return next(j for j in range(cfg.num_layers) if is_moe_layer(cfg, j) == is_moe_layer(cfg, i))


def _sources(cfg: ModelConfig) -> dict[str, _Source]:
    """Hugging Face key -> `_Source`, found by running the family's export mapping on an index-valued
    float64 proxy model (see the module docstring)."""
    mapping = hf_mapping(cfg)
    proxy = _proxy_config(cfg)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # indices up to 2**53 stay exact, in our model and in HF's
    try:
        model = build_model(proxy)
        layout: dict[str, tuple[int, int]] = {}  # our key -> (offset, numel)
        offset = 0
        for key, tensor in model.state_dict().items():
            layout[key] = (offset, tensor.numel())
            offset += tensor.numel()
        exported = []
        for shift in (0.0, _SHIFT):
            with torch.no_grad():
                for key, tensor in model.state_dict().items():
                    start = layout[key][0]
                    tensor.copy_(
                        torch.arange(start, start + tensor.numel(), dtype=torch.float64).view_as(tensor)
                        + shift
                    )
            hf = mapping.to_hf(model, proxy)
            exported.append({k: v.detach().clone() for k, v in hf.state_dict().items()})
            del hf
    finally:
        torch.set_default_dtype(previous)
    starts = sorted((start, key) for key, (start, _) in layout.items())
    sources: dict[str, _Source] = {}
    for hf_key, first in exported[0].items():
        if not first.is_floating_point() or not torch.equal(
            exported[1][hf_key] - first, torch.full_like(first, _SHIFT)
        ):
            continue  # a value Hugging Face keeps (no weight of ours maps to it)
        index = first.long()
        lo = int(index.min())
        ours = max((s, k) for s, k in starts if s <= lo)[1]
        start, numel = layout[ours]
        if int(index.max()) >= start + numel:
            raise CheckpointError(f"{hf_key} draws on more than one of our tensors ({ours} and others)")
        vocab_row = 0
        if ours in mapping.vocab_keys:
            shape = model.state_dict()[ours].shape
            vocab_row = shape[1:].numel()
            rows = torch.arange(index.shape[0]).view(-1, *([1] * (index.dim() - 1)))
            if index.shape[0] != shape[0] or not torch.equal(
                index - rows * vocab_row, index[:1].expand_as(index)
            ):
                raise CheckpointError(f"{hf_key} is not row-for-row our {ours}: cannot stream its vocabulary")
        layer = int(ours.split(".")[1]) if ours.startswith("layers.") else None
        if layer is not None and _representative(proxy, layer) != layer:
            continue  # the first layer of its kind maps the others
        sources[hf_key] = _Source(ours, index - start, layer, vocab_row)
    return sources


def _layer_key(key: str, i: int, layer_part: str, j: int = 0) -> str:
    """`key` of layer j renamed to layer i: the first `.j.` after `layer_part` (e.g. `.h`, `.layer`)."""
    head, sep, tail = key.partition(f"{layer_part}.{j}.")
    return f"{head}{layer_part}.{i}.{tail}" if sep else key


# Names transformers writes to files for a tensor its model holds under another name (its save-time
# renaming for older checkpoints): GPT-NeoX's output matrix is `lm_head` in the model, `embed_out` on disk.
_SAVED_AS = {"lm_head.weight": ("embed_out.weight",)}
# transformers 5 holds a layer's experts fused (experts.gate_up_proj [E, 2f, h]: gate rows, then up rows;
# experts.down_proj [E, h, f]) and writes them to files one matrix per expert, as the Hub's checkpoints
# are: Mixtral's block_sparse_moe.experts.{e}.w1 (gate), w3 (up), w2 (down) and router
# block_sparse_moe.gate; OLMoE's mlp.experts.{e}.gate_proj, up_proj, down_proj. Fused key suffix -> the
# per-expert forms of its parts on disk (concatenated along dim 0, then stacked over e = 0, 1, ...).
_PER_EXPERT = {
    "mlp.experts.gate_up_proj": (
        ("block_sparse_moe.experts.{e}.w1.weight", "block_sparse_moe.experts.{e}.w3.weight"),
        ("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight"),
    ),
    "mlp.experts.down_proj": (
        ("block_sparse_moe.experts.{e}.w2.weight",),
        ("mlp.experts.{e}.down_proj.weight",),
    ),
    "mlp.gate.weight": (("block_sparse_moe.gate.weight",),),
}


class _HFTensors:
    """The tensors of a Hugging Face model directory, read one at a time (safetensors `safe_open`;
    a PyTorch .bin is memory-mapped). Keys with or without the base-model prefix are accepted."""

    def __init__(self, hf_dir: Path, prefix: str) -> None:
        self.prefix = prefix
        self.where: dict[str, Any] = {}
        files = sorted(hf_dir.glob("*.safetensors"))
        if files:
            from safetensors import safe_open  # optional: comes with transformers (the bench extra)

            for file in files:
                handle = safe_open(str(file), framework="pt")
                for key in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    self.where[key] = handle
            return
        bins = sorted(hf_dir.glob("pytorch_model*.bin"))
        if not bins:
            raise CheckpointError(f"{hf_dir}: no *.safetensors or pytorch_model*.bin weights")
        for file in bins:
            state = torch.load(file, map_location="cpu", mmap=True, weights_only=True)
            for key in state:
                self.where[key] = state

    def get(self, key: str) -> torch.Tensor | None:
        names = (key, key.removeprefix(self.prefix), self.prefix + key, *_SAVED_AS.get(key, ()))
        for name in names:
            if name in self.where:
                return self._read(name)
        suffix = next((s for s in _PER_EXPERT if key.endswith(s)), None)
        if suffix is None:
            return None
        for name in names[:3]:
            stem = name.removesuffix(suffix)
            for parts in _PER_EXPERT[suffix]:
                if stem + parts[0].format(e=0) in self.where:
                    return self._experts(stem, parts)
        return None

    def _read(self, name: str) -> torch.Tensor:
        source = self.where[name]
        return source.get_tensor(name) if hasattr(source, "get_tensor") else source[name]

    def _experts(self, stem: str, parts: tuple[str, ...]) -> torch.Tensor:
        """A fused experts tensor from its per-expert matrices on disk (see `_PER_EXPERT`); a form
        without `{e}` (the router) is the one matrix itself."""
        if "{e}" not in parts[0]:
            return self._read(stem + parts[0])
        experts: list[torch.Tensor] = []
        while stem + parts[0].format(e=len(experts)) in self.where:
            e = len(experts)
            experts.append(torch.cat([self._read(stem + part.format(e=e)) for part in parts], dim=0))
        return torch.stack(experts)


def load_hf_weights(model: torch.nn.Module, cfg: ModelConfig, hf_dir: str | Path) -> None:
    """Overwrite `model`'s weights (a whole model, or this rank's parallelized stage: plain tensors or
    DTensor shards of any layout) with those of the Hugging Face model in `hf_dir`.

    Streams: for each of our parameters, the Hugging Face tensors it draws on are read one at a time
    from the files, its full value is assembled, and only this rank's shard is kept
    (`parallel.init.copy_full_into`). A vocabulary padded beyond Hugging Face's keeps its padding rows.
    """
    if isinstance(model, DistributedDataParallel):
        model = model.module
    path = Path(hf_dir)
    hf_cfg = _hf_config(path)
    _check_shape(cfg, path)
    assert cfg.vocab_size is not None
    sources = _sources(cfg)
    layer_part = _layer_part(sources)
    by_ours: dict[str, list[tuple[str, _Source]]] = {}
    for hf_key, source in sources.items():
        j = source.layer
        if j is None:
            by_ours.setdefault(source.ours, []).append((hf_key, source))
            continue
        for i in (i for i in range(cfg.num_layers) if _representative(cfg, i) == j):
            ours = source.ours.replace(f"layers.{j}.", f"layers.{i}.", 1)
            by_ours.setdefault(ours, []).append((_layer_key(hf_key, i, layer_part, j), source))
    import transformers  # optional dependency (the bench extra); _hf_config said so if missing

    prefix = getattr(transformers, _hf_classes()[hf_cfg.model_type]).base_model_prefix + "."
    files = _HFTensors(path, prefix)
    missing = []
    for name, param in model.named_parameters():
        key = canonical_name(name)
        full = torch.empty(param.shape, dtype=torch.float32)
        assigned = torch.zeros(param.shape, dtype=torch.bool)
        flat, done = full.view(-1), assigned.view(-1)
        for hf_name, source in by_ours.get(key, []):
            value = files.get(hf_name)
            if value is None:
                continue
            index = source.index
            if source.vocab_row:
                rows = value.shape[0]
                if rows > param.shape[0]:
                    raise CheckpointError(
                        f"{hf_dir}: {hf_name} has {rows} vocabulary rows, more than our {param.shape[0]}"
                    )
                step = torch.arange(rows).view(-1, *([1] * (index.dim() - 1))) * source.vocab_row
                index = index[:1] + step
            if tuple(index.shape) != tuple(value.shape):
                raise CheckpointError(
                    f"{hf_dir}: {hf_name} has shape {tuple(value.shape)}, expected {tuple(index.shape)}"
                )
            flat[index.reshape(-1)] = value.reshape(-1).float()
            done[index.reshape(-1)] = True
            del value, index
        if not bool(assigned.all()) and not _only_padding_rows(key, assigned, cfg):
            missing.append(key)
            continue
        copy_full_into(param, full.to(param.dtype), assigned)
        del full, assigned
    if missing:
        raise CheckpointError(f"{hf_dir}: no Hugging Face weights for {', '.join(missing)}")


def _layer_part(sources: dict[str, _Source]) -> str:
    """The HF key part that precedes the layer index (`transformer.h` -> `.h`), from a layer-0 key."""
    for hf_key, source in sources.items():
        if source.layer is not None:
            head, sep, _ = hf_key.partition(f".{source.layer}.")
            if sep:
                return "." + head.rsplit(".", 1)[-1] if "." in head else head
    return ".0"


def _only_padding_rows(key: str, done: torch.Tensor, cfg: ModelConfig) -> bool:
    """True when the unassigned elements of `key` are exactly the vocabulary padding rows."""
    assert cfg.vocab_size is not None
    return key in hf_mapping(cfg).vocab_keys and bool(done[: cfg.vocab_size].all())
