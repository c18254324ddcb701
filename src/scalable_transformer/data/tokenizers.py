"""Tokenizers behind one thin wrapper: the embedded BERT-style WordPiece, a HF `tokenizer.json`,
a BERT `vocab.txt` (WordPiece, cased or lower-cased) or GPT-2 `vocab.json` + `merges.txt`
(byte-level BPE); and training new ones on a corpus (`stx tokenizer train`).

The embedded tokenizer is trained on the embedded corpus at first use (~1-3 s) and cached as
tokenizer.json in the user cache directory, keyed by vocabulary size and corpus fingerprint.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import os
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers

from scalable_transformer.cache import cache_dir
from scalable_transformer.data.corpus import _atomic_write, corpus_fingerprint, embedded_documents
from scalable_transformer.data.text_readers import iter_texts
from scalable_transformer.errors import PreprocessError
from scalable_transformer.files import write_once

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

    def role_tokens(self) -> dict[str, str]:
        """The special tokens this tokenizer has, by role (pad, unk, cls, sep, mask, eod)."""
        tokens = {role: self.hf.id_to_token(i) for role, i in self._ids.items() if i is not None}
        return {role: token for role, token in tokens.items() if token is not None}

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
    return _train_wordpiece(texts, vocab_size, lowercase=True, length=len(texts))


def _add_bert_post_processor(tok: HFTokenizer) -> None:
    """[CLS] A [SEP] (B [SEP]) on encode, so the saved file is a complete BERT tokenizer for other tools."""
    cls_id, sep_id = tok.token_to_id(CLS), tok.token_to_id(SEP)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{CLS} $A {SEP}",
        pair=f"{CLS} $A {SEP} $B:1 {SEP}:1",
        special_tokens=[(CLS, cls_id), (SEP, sep_id)],
    )


def _train_wordpiece(
    texts: Iterable[str], vocab_size: int, lowercase: bool, length: int | None = None
) -> HFTokenizer:
    tok = HFTokenizer(models.WordPiece(unk_token=UNK, continuing_subword_prefix="##"))
    tok.normalizer = normalizers.BertNormalizer(
        lowercase=lowercase, clean_text=True, handle_chinese_chars=True
    )
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
    tok.train_from_iterator(texts, trainer=trainer, length=length)
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
    _add_bert_post_processor(tok)
    return tok


def _embedded_name(vocab_size: int) -> str:
    """The cache file name of the embedded tokenizer of `vocab_size` tokens (recipe and corpus keyed)."""
    return f"tokenizer-wordpiece-v{TOKENIZER_VERSION}-{vocab_size}-{corpus_fingerprint()[:16]}.json"


def _embedded(vocab_size: int) -> Tokenizer:
    if vocab_size < 64:
        raise ValueError(f"tokenizer_vocab_size must be at least 64, got {vocab_size}")
    path = cache_dir() / _embedded_name(vocab_size)
    if path.is_file():
        try:
            return Tokenizer(HFTokenizer.from_file(str(path)), name=f"embedded-{vocab_size}")
        except Exception:  # corrupt cache (the Rust side raises plain Exception): retrain
            pass
    hf = train_wordpiece(embedded_documents(), vocab_size)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if not write_once(path, hf.to_str(pretty=True).encode("utf-8")):
            # another process cached its own first (training is not deterministic): use that one, so
            # that every run on this cache has the same vocabulary
            hf = HFTokenizer.from_file(str(path))
    except OSError:  # unwritable cache: still usable, just retrained next time
        pass
    return Tokenizer(hf, name=f"embedded-{vocab_size}")


BERT_SPECIAL_TOKENS = (PAD, UNK, CLS, SEP, MASK)
_TRAINED_FILES = frozenset({"tokenizer.json", "vocab.txt", "vocab.json", "merges.txt"})
TOKENIZER_TYPES = ("BertWordPieceLowerCase", "BertWordPieceCase", "GPT2BPETokenizer", "HFTokenizer")


def _is_special_looking(token: str) -> bool:
    return (token.startswith("[") and token.endswith("]")) or (token.startswith("<") and token.endswith(">"))


def vocab_is_lowercase(vocab_file: str | os.PathLike[str]) -> bool:
    """True when no token of a BERT vocab.txt has an upper-case letter ([CLS]-style specials aside)."""
    with open(vocab_file, encoding="utf-8") as f:
        for line in f:
            token = line.rstrip("\r\n")
            if not _is_special_looking(token) and any(c.isupper() for c in token):
                return False
    return True


def _require_tokens(tok: HFTokenizer, names: Sequence[str], path: Path, what: str) -> None:
    missing = [t for t in names if tok.token_to_id(t) is None]
    if missing:
        raise ValueError(f"{path}: {what} lacks the special token(s) {', '.join(missing)}")


def bert_wordpiece_from_vocab(vocab_file: str | os.PathLike[str], lowercase: bool) -> HFTokenizer:
    """BERT's WordPiece tokenizer from a vocab.txt (one token per line, id = line number), as
    Google BERT / Megatron's BertWordPieceLowerCase (lowercase=True: lower-case, strip accents)
    or BertWordPieceCase (lowercase=False). Raises ValueError if [PAD]/[UNK]/[CLS]/[SEP]/[MASK] is missing."""
    path = Path(vocab_file)
    try:
        model = models.WordPiece.from_file(str(path), unk_token=UNK)
    except Exception as e:  # the Rust side raises plain Exception
        raise ValueError(f"{path} is not a WordPiece vocab.txt: {e}") from e
    tok = HFTokenizer(model)
    _require_tokens(tok, BERT_SPECIAL_TOKENS, path, "BERT vocab")
    tok.normalizer = normalizers.BertNormalizer(
        lowercase=lowercase, clean_text=True, handle_chinese_chars=True
    )
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.add_special_tokens(list(BERT_SPECIAL_TOKENS))  # never split or normalized; ids unchanged
    _add_bert_post_processor(tok)
    return tok


def gpt2_bpe_from_files(
    vocab_file: str | os.PathLike[str], merge_file: str | os.PathLike[str]
) -> HFTokenizer:
    """GPT-2's byte-level BPE from vocab.json + merges.txt; EOD = <|endoftext|> (required)."""
    vocab, merges = Path(vocab_file), Path(merge_file)
    if not merges.is_file():
        raise FileNotFoundError(f"GPT-2 merges file not found: {merges} (give merge_file / --merge-file)")
    try:
        model = models.BPE.from_file(str(vocab), str(merges))
    except Exception as e:  # the Rust side raises plain Exception
        raise ValueError(f"{vocab} + {merges} are not a GPT-2 vocab.json + merges.txt: {e}") from e
    tok = HFTokenizer(model)
    _require_tokens(tok, (EOD,), vocab, "GPT-2 vocab")
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens([EOD])
    return tok


def _json_kind(path: Path) -> str:
    """'HFTokenizer' for a tokenizer.json, 'GPT2BPETokenizer' for a GPT-2 vocab.json."""
    try:
        with path.open(encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} is not a JSON tokenizer file: {e}") from e
    if isinstance(data, dict) and "model" in data:
        return "HFTokenizer"
    if isinstance(data, dict) and data and all(isinstance(v, int) for v in data.values()):
        return "GPT2BPETokenizer"
    raise ValueError(f"{path} is neither a HF tokenizer.json nor a GPT-2 vocab.json")


def _resolve_directory(path: Path, tokenizer_type: str | None) -> Path:
    wanted = {
        None: ("tokenizer.json", "vocab.json", "vocab.txt"),
        "HFTokenizer": ("tokenizer.json",),
        "GPT2BPETokenizer": ("vocab.json",),
        "BertWordPieceLowerCase": ("vocab.txt",),
        "BertWordPieceCase": ("vocab.txt",),
    }[tokenizer_type]
    for name in wanted:
        if (path / name).is_file():
            return path / name
    raise FileNotFoundError(f"tokenizer directory {path} holds none of {', '.join(wanted)}")


def _from_file(path: Path, merge_file: str | None, tokenizer_type: str | None) -> Tokenizer:
    if tokenizer_type is not None and tokenizer_type not in TOKENIZER_TYPES:
        raise ValueError(f"unknown tokenizer_type {tokenizer_type!r}; one of {', '.join(TOKENIZER_TYPES)}")
    if path.is_dir():
        path = _resolve_directory(path, tokenizer_type)
    if not path.is_file():
        raise FileNotFoundError(
            f"tokenizer file not found: {path} (data.tokenizer must be 'embedded', a tokenizer.json, "
            "a BERT vocab.txt, a GPT-2 vocab.json or a directory holding one)"
        )
    kind = tokenizer_type
    if kind is None:
        kind = _json_kind(path) if path.suffix.lower() == ".json" else "BertWordPiece"
    if kind == "HFTokenizer":
        try:
            hf = HFTokenizer.from_file(str(path))
        except Exception as e:  # the Rust side raises plain Exception for any parse error
            raise ValueError(f"{path} is not a valid HF tokenizer.json: {e}") from e
        return Tokenizer(hf, name=str(path))
    if kind == "GPT2BPETokenizer":
        merges = Path(merge_file) if merge_file else path.parent / "merges.txt"
        return Tokenizer(gpt2_bpe_from_files(path, merges), name=f"{path} (GPT2BPETokenizer)")
    if kind == "BertWordPiece":
        kind = "BertWordPieceLowerCase" if vocab_is_lowercase(path) else "BertWordPieceCase"
    hf = bert_wordpiece_from_vocab(path, lowercase=kind == "BertWordPieceLowerCase")
    return Tokenizer(hf, name=f"{path} ({kind})")


def load_tokenizer(
    spec: str | None,
    vocab_size: int = 8192,
    *,
    vocab_file: str | None = None,
    merge_file: str | None = None,
    tokenizer_type: str | None = None,
) -> Tokenizer:
    """The tokenizer named by the config (`data.tokenizer`, `data.vocab_file`, ...).

    spec "embedded": WordPiece trained on the embedded corpus with `vocab_size` tokens (cached).
    Otherwise `spec` (or `vocab_file`, Megatron's way, which then sets the tokenizer) is a path to:
      * a HF tokenizer.json;
      * a BERT vocab.txt: WordPiece, lower-cased for BertWordPieceLowerCase, cased for
        BertWordPieceCase; without `tokenizer_type`, lower-cased iff no token has an upper-case letter;
      * a GPT-2 vocab.json, with `merge_file` (default: merges.txt beside it): byte-level BPE;
      * a directory holding tokenizer.json, else vocab.json + merges.txt, else vocab.txt.
    `tokenizer_type` (Megatron's names, see TOKENIZER_TYPES) forces the kind. Raises
    FileNotFoundError / ValueError naming the path when it is missing or not a tokenizer, or when
    a special token the kind requires is missing.
    """
    if vocab_file is not None:
        if spec not in (None, "", "embedded") and Path(spec) != Path(vocab_file):
            raise ValueError(
                f"both a tokenizer ({spec}) and a vocab file ({vocab_file}) are given; give one of them"
            )
        return _from_file(Path(vocab_file).expanduser(), merge_file, tokenizer_type)
    if spec in (None, "", "embedded"):
        if tokenizer_type is not None:
            raise ValueError(
                f"tokenizer_type {tokenizer_type} needs a tokenizer file (data.tokenizer or data.vocab_file)"
            )
        return _embedded(vocab_size)
    return _from_file(Path(spec).expanduser(), merge_file, tokenizer_type)


# -- training ------------------------------------------------------------------------------------


def _train_bpe(texts: Iterable[str], vocab_size: int, lowercase: bool) -> HFTokenizer:
    """Byte-level BPE as GPT-2's (no unknown tokens), <|endoftext|> at id 0."""
    tok = HFTokenizer(models.BPE())
    if lowercase:
        tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def train_tokenizer(
    inputs: list[str],
    kind: str,
    vocab_size: int,
    output_dir: str,
    json_key: str = "text",
    lowercase: bool = True,
) -> Path:
    """Train a tokenizer on `inputs` (the formats `stx preprocess` reads, streamed) and write it.

    kind "wordpiece": BERT-style WordPiece with [PAD] [UNK] [CLS] [SEP] [MASK] <|endoftext|> at
    ids 0..5; writes tokenizer.json and vocab.txt. kind "bpe": GPT-2-style byte-level BPE with
    <|endoftext|> at id 0; writes tokenizer.json, vocab.json and merges.txt (the GPT-2 files carry
    no normalizer: with `lowercase`, only tokenizer.json lower-cases the input). Each file is
    written atomically. Returns the path of tokenizer.json.
    """
    if kind not in ("wordpiece", "bpe"):
        raise ValueError(f"tokenizer kind must be 'wordpiece' or 'bpe', got {kind!r}")
    minimum = len(SPECIAL_TOKENS) + 1 if kind == "wordpiece" else 257
    if vocab_size < minimum:
        raise ValueError(f"vocab_size must be at least {minimum} for {kind}, got {vocab_size}")
    texts: Iterator[str] = iter_texts(inputs, json_key=json_key)
    first = next(texts, None)
    if first is None:
        raise PreprocessError(f"no document in the inputs: {', '.join(map(str, inputs))}")
    texts = itertools.chain([first], texts)
    out = Path(output_dir).expanduser()
    files: dict[str, bytes] = {}
    if kind == "wordpiece":
        hf = _train_wordpiece(texts, vocab_size, lowercase=lowercase)
        vocab = hf.get_vocab(with_added_tokens=True)
        by_id = sorted(vocab, key=vocab.__getitem__)
        files["vocab.txt"] = "".join(t + "\n" for t in by_id).encode("utf-8")
    else:
        hf = _train_bpe(texts, vocab_size, lowercase=lowercase)
        with tempfile.TemporaryDirectory() as tmp:
            for saved in hf.model.save(tmp):
                files[Path(saved).name] = Path(saved).read_bytes()
    files["tokenizer.json"] = hf.to_str(pretty=True).encode("utf-8")
    for name, data in files.items():  # tokenizer.json last: load_tokenizer(dir) prefers it
        _atomic_write(out / name, data)
    return out / "tokenizer.json"


@dataclasses.dataclass(frozen=True)
class TokenizerSource:
    """Which tokenizer to load, as `load_tokenizer` takes it (`stx preprocess --tokenizer ...`)."""

    tokenizer: str | None = "embedded"
    vocab_size: int = 8192  # of the embedded tokenizer
    vocab_file: str | None = None
    merge_file: str | None = None
    tokenizer_type: str | None = None  # one of TOKENIZER_TYPES, or None: inferred from the files

    def load(self) -> Tokenizer:
        return load_tokenizer(
            self.tokenizer,
            self.vocab_size,
            vocab_file=self.vocab_file,
            merge_file=self.merge_file,
            tokenizer_type=self.tokenizer_type,
        )


@dataclasses.dataclass(frozen=True)
class TokenizerTrainOptions:
    """`stx tokenizer train`: see `train_tokenizer` for the meaning of each field."""

    inputs: tuple[str, ...]
    kind: str  # "wordpiece" or "bpe"
    vocab_size: int
    output_dir: str
    json_key: str = "text"
    lowercase: bool = True


@dataclasses.dataclass(frozen=True)
class TrainedTokenizer:
    """What `train_tokenizer_files` wrote: the directory, the file names in it, the vocabulary size."""

    directory: Path
    files: tuple[str, ...]
    kind: str
    vocab_size: int


def train_tokenizer_files(opts: TokenizerTrainOptions) -> TrainedTokenizer:
    """`train_tokenizer` with opts, and what it wrote (read back from the output directory)."""
    path = train_tokenizer(
        list(opts.inputs),
        opts.kind,
        opts.vocab_size,
        opts.output_dir,
        json_key=opts.json_key,
        lowercase=opts.lowercase,
    )
    tok = Tokenizer(HFTokenizer.from_file(str(path)), name=str(path))
    written = tuple(sorted(p.name for p in path.parent.iterdir() if p.name in _TRAINED_FILES))
    return TrainedTokenizer(path.parent, written, opts.kind, tok.vocab_size)
