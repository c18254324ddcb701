"""Initialise our model from a local Hugging Face GPT2LMHeadModel / BertForPreTraining directory
(`checkpoint.init_from_hf`), the reverse of `stx export --format hf`; and `stx config from-hf`.

The weight mapping is not written a second time: it is the family's export mapping (`ModelSpec.hf`,
models/<family>/hf.py) run backwards. A float64 copy of our model whose every element holds its own index is
exported; each exported Hugging Face tensor then says, element by element, which of our elements it
came from. Run twice with indices shifted by a constant, the tensors that shift by exactly that
constant are the mapped ones (the exporter keeps Hugging Face's own values where we have no
weight). Hugging Face vocabularies that are not a multiple of make_vocab_size_divisible_by fill the
first rows of our padded embedding; the padding rows keep their initialisation.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..config.schema import ModelConfig
from ..errors import CheckpointError

_SHIFT = float(2**40)


def _hf_classes() -> dict[str, str]:
    """Hugging Face config.model_type -> transformers class, for every family with a mapping."""
    from ..models import SPECS

    return {s.hf.model_type: s.hf.hf_class for s in SPECS.values() if s.hf is not None}


def _hf_config(hf_dir: Path) -> Any:
    try:
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
    if hf_cfg.model_type not in classes:
        raise CheckpointError(
            f"{hf_dir}: model_type {hf_cfg.model_type!r} has no equivalent here; supported: "
            f"{', '.join(f'{k} ({v})' for k, v in classes.items())}"
        )
    return hf_cfg


def model_overrides_from_hf(hf_dir: str | Path) -> dict[str, Any]:
    """The model.* settings (as `key: value`) that describe the Hugging Face model in `hf_dir`."""
    from ..models.registry import spec_for_hf

    hf = _hf_config(Path(hf_dir))
    spec = spec_for_hf(hf.model_type)
    assert spec is not None and spec.hf is not None  # _hf_config accepted only mapped types
    return spec.hf.overrides(hf)


def _check_shape(cfg: ModelConfig, hf_dir: Path) -> None:
    want = model_overrides_from_hf(hf_dir)
    wrong = [
        f"model.{key} = {getattr(cfg, key)!r} (the Hugging Face model has {value!r})"
        for key, value in want.items()
        if key not in ("vocab_size", "bert_binary_head") and getattr(cfg, key) != value
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


def _index_maps(cfg: ModelConfig) -> tuple[dict[str, torch.Tensor], dict[str, tuple[int, torch.Size]]]:
    """Hugging Face key -> int64 tensor of our flat element indices; our key -> (offset, shape)."""
    from ..models import build_model
    from .export import hf_mapping

    mapping = hf_mapping(cfg)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # indices up to 2**53 stay exact, in our model and in HF's
    try:
        model = build_model(cfg)
        layout: dict[str, tuple[int, torch.Size]] = {}
        offset = 0
        for key, tensor in model.state_dict().items():
            layout[key] = (offset, tensor.shape)
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
            hf = mapping.to_hf(model, cfg)
            exported.append({k: v.detach().clone() for k, v in hf.state_dict().items()})
    finally:
        torch.set_default_dtype(previous)
    maps = {
        key: first.long()
        for key, first in exported[0].items()
        if first.is_floating_point() and torch.equal(exported[1][key] - first, torch.full_like(first, _SHIFT))
    }
    return maps, layout


def load_hf_weights(model: torch.nn.Module, cfg: ModelConfig, hf_dir: str | Path) -> None:
    """Fill the plain (not yet parallelized) `model` with the weights of the Hugging Face model in
    `hf_dir`."""
    import transformers

    path = Path(hf_dir)
    hf_cfg = _hf_config(path)
    _check_shape(cfg, path)
    hf_model = getattr(transformers, _hf_classes()[hf_cfg.model_type]).from_pretrained(path)
    hf_sd = hf_model.state_dict()
    maps, layout = _index_maps(cfg)
    ours = model.state_dict()
    flat = torch.cat([t.detach().reshape(-1).float().cpu() for t in ours.values()])
    assigned = torch.zeros(flat.numel(), dtype=torch.bool)
    for key, index in maps.items():
        if key not in hf_sd:
            continue
        value = hf_sd[key]
        if index.shape != value.shape:
            # a vocabulary padded here beyond the Hugging Face one: its first rows
            if index.shape[1:] != value.shape[1:] or index.shape[0] < value.shape[0]:
                raise CheckpointError(
                    f"{hf_dir}: {key} has shape {tuple(value.shape)}, expected {tuple(index.shape)}"
                )
            index = index[: value.shape[0]]
        flat[index.reshape(-1)] = value.detach().reshape(-1).float()
        assigned[index.reshape(-1)] = True
    missing = []
    for key, (start, shape) in layout.items():
        done = assigned[start : start + shape.numel()].view(shape)
        if not bool(done.all()) and not _only_padding_rows(key, done, cfg):
            missing.append(key)
    if missing:
        raise CheckpointError(f"{hf_dir}: no Hugging Face weights for {', '.join(missing)}")
    with torch.no_grad():
        for key, tensor in ours.items():
            start, shape = layout[key]
            tensor.copy_(flat[start : start + shape.numel()].view(shape).to(tensor.dtype))


def _only_padding_rows(key: str, done: torch.Tensor, cfg: ModelConfig) -> bool:
    """True when the unassigned elements of `key` are exactly the vocabulary padding rows."""
    from .export import hf_mapping

    assert cfg.vocab_size is not None
    return key in hf_mapping(cfg).vocab_keys and bool(done[: cfg.vocab_size].all())
