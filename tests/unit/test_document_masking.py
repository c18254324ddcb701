"""Packed documents (model.reset_position_ids, model.reset_attention_mask, data.eod_mask_loss): the
data loader marks each token's document and masks the loss at document ends, and the model run on a
packed sample gives each document's logits and loss as if it ran alone. Under every layout:
tests/distributed/test_equivalence.py (ARCH_MODELS "packed-documents")."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from scalable_transformer.config.load import load_config
from scalable_transformer.config.validate import resolve
from scalable_transformer.data.gpt_dataset import GPTDataset
from scalable_transformer.data.indexed import IndexedDataset, IndexedDatasetBuilder
from scalable_transformer.errors import ConfigError
from scalable_transformer.models.gpt.model import gpt_loss
from scalable_transformer.models.layers import document_positions
from scalable_transformer.models.registry import build_model

EOD = 0
BASE = [
    "model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4", "model.seq_length=24",
    "model.vocab_size=100",
]  # fmt: skip
PACKED = ["model.reset_position_ids=true", "model.reset_attention_mask=true"]


def test_positions_restart_at_each_document():
    docs = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2], [0, 1, 1, 1, 1, 1, 1, 1, 1]])
    want = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3], [0, 0, 1, 2, 3, 4, 5, 6, 7]])
    assert torch.equal(document_positions(docs), want)


@pytest.mark.parametrize(
    "shape",
    [
        ["model.position_embedding_type=rotary"],
        ["model.position_embedding_type=learned"],
        ["model.position_embedding_type=rotary", "model.rotary_percent=0.5", "model.parallel_residual=true"],
        ["model.position_embedding_type=alibi", "model.sliding_window=5"],
        ["model.position_embedding_type=rotary", "model.sliding_window=5"],
    ],
    ids=["rotary", "learned", "neox", "alibi-window", "rotary-window"],
)
def test_a_packed_sample_gives_each_documents_logits_and_loss_as_run_alone(shape):
    cfg = resolve(load_config("tiny-gpt", [*BASE, *shape, *PACKED])).model
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    lengths = [7, 11, 6]  # 24 tokens, three documents
    docs = [torch.randint(1, 100, (n,)) for n in lengths]
    packed_ids = torch.cat(docs).unsqueeze(0)
    document_ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]).unsqueeze(0)
    labels = torch.randint(1, 100, (1, 24))
    with torch.no_grad():
        packed = model(packed_ids, document_ids)
        alone = [model(d.unsqueeze(0)) for d in docs]
        packed_loss, _ = gpt_loss(packed, {"labels": labels})
        sums = [
            gpt_loss(out, {"labels": lab})[0] * lab.numel()
            for out, lab in zip(alone, labels.split(lengths, 1), strict=True)
        ]
    torch.testing.assert_close(packed, torch.cat(alone, dim=1), rtol=0, atol=2e-6)
    torch.testing.assert_close(packed_loss, sum(sums) / 24, rtol=1e-6, atol=0)
    # without the resets the same packed sample is one long document: different logits
    plain = build_model(resolve(load_config("tiny-gpt", [*BASE, *shape])).model).eval()
    plain.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert not torch.allclose(plain(packed_ids)[:, 7:], packed[:, 7:], atol=1e-3)


@pytest.fixture
def packed_corpus(tmp_path):
    """Documents of 5, 9 and 4 tokens, each ended by EOD, as `stx preprocess --append-eod` writes."""
    prefix = tmp_path / "docs"
    with IndexedDatasetBuilder(f"{prefix}.bin", np.int32) as builder:
        for n, start in ((5, 10), (9, 20), (4, 40)):
            builder.add_item(np.array([*range(start, start + n - 1), EOD]))
            builder.end_document()
        builder.finalize(f"{prefix}.idx")
    return IndexedDataset(str(prefix))


def test_the_loader_marks_documents_and_masks_the_loss_at_their_ends(packed_corpus):
    ds = GPTDataset(packed_corpus, 12, seed=0, eod_id=EOD, document_ids=True, mask_eod_loss=True)
    plain = GPTDataset(packed_corpus, 12, seed=0)
    for i in range(len(ds)):
        item, base = ds[i], plain[i]
        assert torch.equal(item["input_ids"], base["input_ids"])
        ends = base["input_ids"] == EOD
        assert torch.equal(item["labels"], base["labels"].masked_fill(ends, -100))
        # a document starts after every EOD input: ids count the EODs before each position
        want = torch.tensor([int(ends[:j].sum()) for j in range(12)])
        assert torch.equal(item["document_ids"], want)
        assert ends.any() or item["document_ids"].max() == 0


def test_megatron_and_neox_names_are_carried_and_a_bert_is_refused():
    cfg = load_config(
        "tiny-gpt", ["reset-position-ids=true", "reset-attention-mask=true", "eod-mask-loss=true"]
    )
    assert (cfg.model.reset_position_ids, cfg.model.reset_attention_mask, cfg.data.eod_mask_loss) == (
        True,
    ) * 3
    with pytest.raises(ConfigError, match=r"model\.reset_attention_mask = True is built for causal GPT"):
        resolve(load_config("tiny-bert", ["model.reset_attention_mask=true"]))
    with pytest.raises(ConfigError, match=r"data\.eod_mask_loss masks a GPT"):
        resolve(load_config("tiny-bert", ["data.eod_mask_loss=true"]))
