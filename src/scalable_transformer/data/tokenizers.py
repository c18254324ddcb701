"""Tokenizers: the embedded BERT-style WordPiece, or any HF `tokenizer.json`, behind one thin wrapper.

The embedded tokenizer is trained on the embedded corpus at first use (~1-3 s) and cached as
tokenizer.json in the user cache directory, keyed by vocabulary size and corpus fingerprint.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers

from scalable_transformer.data.corpus import _atomic_write, corpus_fingerprint, embedded_documents
from scalable_transformer.metrics.hardware import cache_dir

# Bump when the embedded tokenizer's recipe changes, so stale caches are not reused.
TOKENIZER_VERSION = 1
PAD, UNK, CLS, SEP, MASK, EOD = "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "<|endoftext|>"
SPECIAL_TOKENS = (PAD, UNK, CLS, SEP, MASK, EOD)  # ids 0..5 in the embedded tokenizer

# Spellings of the special tokens in other tokenizer families, first match wins.
_CANDIDATES = {
    "pad": (PAD, "<pad>", "<|pad|>", "<|padding|>"),
    "unk": (UNK, "<unk>", "<|unk|>"),
    "cls": (CLS, "<s>", "<cls>"),
    "sep": (SEP, "</s>", "<sep>"),
    "mask": (MASK, "<mask>"),
    "eod": (EOD, "</s>", "<eos>", "<|end_of_text|>"),
}


class Tokenizer:
    """A `tokenizers.Tokenizer` with the ids our datasets need.

    Special-token ids are looked up by name (BERT spellings first, then common alternatives);
    reading one the tokenizer does not have raises ValueError. `eod_id` falls back to `sep_id`.
    """

    def __init__(self, hf: HFTokenizer, name: str = "") -> None:
        self.hf = hf
        self.name = name
        self._ids: dict[str, int | None] = {}
        for role, spellings in _CANDIDATES.items():
            self._ids[role] = next((i for t in spellings if (i := hf.token_to_id(t)) is not None), None)
        if self._ids["eod"] is None:
            self._ids["eod"] = self._ids["sep"]
        self.fingerprint = hashlib.sha256(hf.to_str().encode()).hexdigest()[:16]
        """Hash of the tokenizer's JSON: identifies it in run records and cache keys."""

    def __repr__(self) -> str:
        return f"Tokenizer({self.name!r}, vocab_size={self.vocab_size}, fingerprint={self.fingerprint})"

    @property
    def vocab_size(self) -> int:
        """Number of ids, added (special) tokens included."""
        return self.hf.get_vocab_size(with_added_tokens=True)

    def _id(self, role: str) -> int:
        i = self._ids[role]
        if i is None:
            names = " or ".join(_CANDIDATES[role])
            raise ValueError(f"tokenizer {self.name!r} has no {role} token ({names})")
        return i

    @property
    def pad_id(self) -> int:
        return self._id("pad")

    @property
    def unk_id(self) -> int:
        return self._id("unk")

    @property
    def cls_id(self) -> int:
        return self._id("cls")

    @property
    def sep_id(self) -> int:
        return self._id("sep")

    @property
    def mask_id(self) -> int:
        return self._id("mask")

    @property
    def eod_id(self) -> int:
        return self._id("eod")

    @property
    def special_ids(self) -> frozenset[int]:
        """Ids of all special (added) tokens, which masking never selects or draws."""
        return frozenset(i for i in self._ids.values() if i is not None) | frozenset(
            i for i, tok in self.hf.get_added_tokens_decoder().items() if tok.special
        )

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text, without special tokens ([CLS], [SEP], ...)."""
        return [e.ids for e in self.hf.encode_batch(list(texts), add_special_tokens=False)]

    def encode(self, text: str) -> list[int]:
        """Token ids of one text, without special tokens."""
        return self.hf.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; WordPiece '##' continuations are joined back into words."""
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)


def train_wordpiece(texts: Sequence[str], vocab_size: int) -> HFTokenizer:
    """A lower-cased BERT-style WordPiece tokenizer trained on `texts`, special tokens at ids 0..5."""
    tok = HFTokenizer(models.WordPiece(unk_token=UNK, continuing_subword_prefix="##"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True, clean_text=True, handle_chinese_chars=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##")
    trainer = trainers.WordPieceTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        limit_alphabet=1000,
        continuing_subword_prefix="##",
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    # The trainer breaks ties between equally frequent merges in hash-map order, so ids differ from
    # run to run while the vocabulary does not. WordPiece encodes by longest match in the vocabulary,
    # not by id order, so renumbering (special tokens first, then words, then ## pieces, each sorted)
    # changes nothing but makes the file, its fingerprint and every token id reproducible.
    spec = json.loads(tok.to_str())
    vocab: dict[str, int] = spec["model"]["vocab"]
    rest = sorted((t for t in vocab if t not in SPECIAL_TOKENS), key=lambda t: (t.startswith("##"), t))
    spec["model"]["vocab"] = {t: i for i, t in enumerate([*SPECIAL_TOKENS, *rest])}
    tok = HFTokenizer.from_str(json.dumps(spec))
    # So the saved file is a complete BERT tokenizer for other tools; our wrapper never adds them.
    cls_id, sep_id = tok.token_to_id(CLS), tok.token_to_id(SEP)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{CLS} $A {SEP}",
        pair=f"{CLS} $A {SEP} $B:1 {SEP}:1",
        special_tokens=[(CLS, cls_id), (SEP, sep_id)],
    )
    return tok


def _embedded(vocab_size: int) -> Tokenizer:
    if vocab_size < 64:
        raise ValueError(f"tokenizer_vocab_size must be at least 64, got {vocab_size}")
    path = (
        cache_dir()
        / f"tokenizer-wordpiece-v{TOKENIZER_VERSION}-{vocab_size}-{corpus_fingerprint()[:16]}.json"
    )
    if path.is_file():
        try:
            return Tokenizer(HFTokenizer.from_file(str(path)), name=f"embedded-{vocab_size}")
        except Exception:  # corrupt cache (the Rust side raises plain Exception): retrain
            pass
    hf = train_wordpiece(embedded_documents(), vocab_size)
    with contextlib.suppress(OSError):  # unwritable cache: still usable, just retrained next time
        _atomic_write(path, hf.to_str(pretty=True).encode("utf-8"))
    return Tokenizer(hf, name=f"embedded-{vocab_size}")


def load_tokenizer(spec: str, vocab_size: int = 8192) -> Tokenizer:
    """The tokenizer named by `spec` (config `data.tokenizer`).

    "embedded": WordPiece trained on the embedded corpus with `vocab_size` tokens (cached).
    Otherwise a path to a HF `tokenizer.json` (or a directory holding one); `vocab_size` is ignored.
    Raises FileNotFoundError / ValueError naming the path when it is missing or not a tokenizer.
    """
    if spec == "embedded":
        return _embedded(vocab_size)
    path = Path(spec).expanduser()
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"tokenizer file not found: {path} "
            "(data.tokenizer must be 'embedded' or a path to a tokenizer.json)"
        )
    try:
        hf = HFTokenizer.from_file(str(path))
    except Exception as e:  # the Rust side raises plain Exception for any parse error
        raise ValueError(f"{path} is not a valid HF tokenizer.json: {e}") from e
    return Tokenizer(hf, name=str(path))
