"""`stx export CHECKPOINT --format hf --output DIR`: a checkpoint as a Hugging Face `transformers` model.

The weight mappings belong to the model family (`ModelSpec.hf`, models/<family>/hf.py), tried in order:
GPTs become `GPT2LMHeadModel` (learned positions, LayerNorm, GELU), `LlamaForCausalLM` (rotary, RMSNorm,
SwiGLU, grouped-query attention) or `GPTNeoXForCausalLM` (rotary, LayerNorm, GELU); BERTs with learned
positions, GELU and tied embeddings become `BertForPreTraining` (post-LN) or
`MegatronBertForPreTraining` (pre-LN). The vocabulary is exported padded, as trained. Other
architectures get an error that says, per class, which settings have no equivalent. The reverse,
initialising from a Hugging Face model, is `hf_import.py` (`checkpoint.init_from_hf`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import yaml

from ..config.schema import ModelConfig
from ..data.tokenizers import load_tokenizer
from ..models import build_model, spec_for
from ..models.bert.hf import bert_unsupported, to_bert
from ..models.gpt.hf import gpt2_unsupported, to_gpt2
from ..models.registry import hf_unsupported
from ..models.spec import HFMapping
from .manager import CheckpointError, _quiet_single_process, find_checkpoint, read_metadata

# the mapping functions moved to the families; named here too for callers of the old location
__all__ = [
    "bert_unsupported",
    "export_hf",
    "gpt2_unsupported",
    "hf_mapping",
    "load_model",
    "to_bert",
    "to_gpt2",
]


def load_model(checkpoint: str) -> tuple[torch.nn.Module, ModelConfig, dict[str, Any]]:
    """The plain model of a checkpoint (any layout it was written with), in this process."""
    path = find_checkpoint(checkpoint, None, label=f"'{checkpoint}'")
    if path is None:
        raise CheckpointError(f"{checkpoint}: no checkpoint")
    meta = read_metadata(path)
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    cfg = ModelConfig(**{k: v for k, v in meta["model"].items() if k in names})
    model = build_model(cfg)
    sd = model.state_dict()
    with _quiet_single_process():
        dcp.load({"model": sd}, checkpoint_id=str(path))
    model.load_state_dict(sd)
    return model.eval(), cfg, meta


def hf_mapping(cfg: ModelConfig) -> HFMapping:
    """The first Hugging Face mapping of cfg's family that holds its shape, or CheckpointError naming,
    per candidate class, the settings that prevent it."""
    for mapping in spec_for(cfg).hf:
        if not mapping.unsupported(cfg):
            return mapping
    raise CheckpointError("no Hugging Face equivalent for this model: " + " | ".join(hf_unsupported(cfg)))


def export_hf(checkpoint: str, output: str) -> Path:
    """Write `output/` (config.json, model.safetensors and, when the tokenizer is a HF one, its files)."""
    model, cfg, meta = load_model(checkpoint)
    hf = hf_mapping(cfg).to_hf(model, cfg)
    out = Path(output)
    if out.exists() and any(out.iterdir()):
        raise CheckpointError(f"--output {output} exists and is not empty; choose a new directory")
    hf.save_pretrained(out)
    _save_tokenizer(meta, out)
    return out


def _save_tokenizer(meta: dict[str, Any], out: Path) -> None:
    """The training tokenizer as a PreTrainedTokenizerFast, when it can be rebuilt here."""
    from transformers import PreTrainedTokenizerFast  # optional dependency (the bench extra)

    try:
        d = yaml.safe_load(meta["config_yaml"])["data"]
        tok = load_tokenizer(
            d["tokenizer"],
            d["tokenizer_vocab_size"],
            vocab_file=d.get("vocab_file"),
            merge_file=d.get("merge_file"),
            tokenizer_type=d.get("tokenizer_type"),
        )
    except Exception as e:  # the model is exported either way; say why the tokenizer is not
        (out / "TOKENIZER-NOT-EXPORTED.txt").write_text(f"the training tokenizer could not be loaded: {e}\n")
        return
    # name the special tokens the tokenizer has, so transformers' pipelines (fill-mask) find them
    roles = ("pad", "unk", "cls", "sep", "mask")
    special = {f"{role}_token": token for role, token in tok.role_tokens().items() if role in roles}
    PreTrainedTokenizerFast(tokenizer_object=tok.hf, **special).save_pretrained(out)
