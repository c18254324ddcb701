"""Invariants every BERT sample must hold, shared by the embedded-corpus and the indexed-dataset tests."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

BERT_KEYS = {"input_ids", "token_type_ids", "attention_mask", "labels", "nsp_labels"}


def original_ids(x: dict[str, torch.Tensor]) -> torch.Tensor:
    """The sample's tokens before masking (labels hold the original id wherever one was masked)."""
    return torch.where(x["labels"] != -100, x["labels"], x["input_ids"])


@dataclass
class MaskTally:
    """Counts over many samples, for the 15% / 80-10-10 masking proportions."""

    candidates: int = 0  # non-special real tokens
    selected: int = 0  # positions with a label
    replaced_by_mask: int = 0
    kept: int = 0
    lengths: list[int] = field(default_factory=list)
    nsp: list[int] = field(default_factory=list)


def check_bert_sample(x: dict[str, torch.Tensor], tok, seq_length: int, tally: MaskTally) -> None:
    """[CLS] A [SEP] B [SEP] [PAD]..., token types 0/1/0, labels only at masked non-special positions."""
    assert set(x) == BERT_KEYS
    assert all(v.dtype == torch.long for v in x.values())
    ids, types, att, labels = x["input_ids"], x["token_type_ids"], x["attention_mask"], x["labels"]
    assert ids.shape == types.shape == att.shape == labels.shape == (seq_length,)
    n = int(att.sum())
    assert att.tolist() == [1] * n + [0] * (seq_length - n)
    assert (ids[n:] == tok.pad_id).all() and ids[0] == tok.cls_id and ids[n - 1] == tok.sep_id
    seps = (ids == tok.sep_id).nonzero().flatten().tolist()
    assert len(seps) == 2 and 1 < seps[0] < n - 2  # both segments non-empty
    assert types.tolist() == [0] * (seps[0] + 1) + [1] * (n - seps[0] - 1) + [0] * (seq_length - n)
    special = torch.tensor(sorted(tok.special_ids))
    masked = labels != -100
    assert masked.any() and not torch.isin(labels[masked], special).any()
    assert not ((ids == tok.mask_id) & ~masked).any()  # [MASK] only where a label is
    tally.candidates += int((~torch.isin(original_ids(x)[:n], special)).sum())
    tally.selected += int(masked.sum())
    tally.replaced_by_mask += int((ids[masked] == tok.mask_id).sum())
    tally.kept += int((ids[masked] == labels[masked]).sum())
    tally.lengths.append(n)
    tally.nsp.append(int(x["nsp_labels"]))
