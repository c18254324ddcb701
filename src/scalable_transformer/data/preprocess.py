"""Tokenize a corpus into a Megatron mmap indexed dataset (PREFIX.bin + PREFIX.idx).

Inputs, picked by file name (compression first, then format):
  * `.gz`, `.zst`/`.zstd`: decompressed while streaming (zstd needs the `zstandard` package);
  * `.jsonl`, `.json`, `.ndjson`: JSON lines, one object per line, the text under `json_key`
    (a string, or a list of strings = the document's sentences, as Megatron accepts);
    `.json` is JSON lines too (Megatron's "loose json"); a single JSON array is not read;
  * anything else (`.txt`, ...): plain text, ONE DOCUMENT PER LINE. Megatron reads only JSON
    lines; GPT-NeoX (lm_dataformat) reads a whole .txt file as one document, which cannot stream a
    multi-GB file in bounded memory, so we use the line convention of JSON lines and of HF
    `datasets`' text loader. Blank lines are skipped (counted as "blank line").
  * directories: every file with one of the suffixes above, recursively, sorted by path;
  * globs (`*`, `?`, `[`, `**`): the sorted matches. A file named twice is read once.

Output: one sequence per document, or with `split_sentences` one per sentence (what BERT's
sentence pairs need), documents closed with end_document. `append_eod` appends the tokenizer's
end-of-document id to each document's last sequence, as Megatron's and NeoX's preprocess do.
Documents (and sentences) that tokenize to nothing are skipped and counted, as in Megatron.

Work is streamed in blocks of whole lines (~1 MiB); with `workers` > 1 the blocks are tokenized
by that many processes and written back in input order, so the output is byte-identical for any
number of workers. At most 2 blocks per worker are in flight: memory stays bounded whatever the
corpus size (a single line must fit in memory). Each worker tokenizes single-threaded.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import gzip
import io
import json
import multiprocessing
import os
import signal
import sys
import time
import zlib
from collections import Counter, deque
from collections.abc import Generator, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path
from typing import IO, Any

import numpy as np

from scalable_transformer.data.corpus import split_sentences as _split_sentences
from scalable_transformer.data.indexed import IndexedDatasetBuilder, best_dtype, bin_path, idx_path
from scalable_transformer.data.tokenizers import Tokenizer, TokenizerSource

from ..errors import PreprocessError

BLOCK_BYTES = 1 << 20
_COMPRESSION = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd"}
_JSON_SUFFIXES = frozenset({".jsonl", ".json", ".ndjson"})
_TEXT_SUFFIXES = frozenset({".txt", ".text"})
_GLOB_CHARS = frozenset("*?[")


# -- inputs ---------------------------------------------------------------------------------------


def input_format(path: str | os.PathLike[str]) -> tuple[str, str | None]:
    """("json" | "text", compression or None) of an input file, from its name."""
    suffixes = [s.lower() for s in Path(path).suffixes]
    compression = _COMPRESSION.get(suffixes[-1]) if suffixes else None
    if compression:
        suffixes = suffixes[:-1]
    kind = "json" if suffixes and suffixes[-1] in _JSON_SUFFIXES else "text"
    return kind, compression


def _readable_in_directory(path: Path) -> bool:
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] in _COMPRESSION:
        suffixes = suffixes[:-1]
    return bool(suffixes) and (suffixes[-1] in _JSON_SUFFIXES or suffixes[-1] in _TEXT_SUFFIXES)


def _directory_files(root: Path) -> list[Path]:
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        found += [Path(dirpath) / f for f in filenames if not f.startswith(".")]
    return sorted(p for p in found if _readable_in_directory(p))


def expand_inputs(inputs: Iterable[str | os.PathLike[str]]) -> list[Path]:
    """The input files named by paths, directories and globs, in order; each file once."""
    files: list[Path] = []
    for spec in inputs:
        text = os.fspath(spec)
        path = Path(text).expanduser()
        if path.is_file():
            found = [path]
        elif path.is_dir():
            found = _directory_files(path)
            if not found:
                raise PreprocessError(
                    f"input directory {path} holds no readable file "
                    "(.jsonl, .json, .ndjson, .txt, .text, optionally .gz or .zst)"
                )
        elif _GLOB_CHARS & set(text):
            found = []
            for match in sorted(glob.glob(os.path.expanduser(text), recursive=True)):
                m = Path(match)
                found += [m] if m.is_file() else _directory_files(m) if m.is_dir() else []
            if not found:
                raise PreprocessError(f"input pattern {text!r} matches no file")
        else:
            raise PreprocessError(f"input not found: {path}")
        files += found
    if not files:
        raise PreprocessError("no input given")
    seen: set[Path] = set()
    unique = []
    for f in files:
        key = f.resolve()
        if key not in seen:
            seen.add(key)
            unique.append(f)
    return unique


# -- reading --------------------------------------------------------------------------------------


@dataclass
class _Block:
    """Whole lines of one input file: `data` starts at line `first_line` (1-based), at byte
    `offset` of the (decompressed) stream. `last` marks the file's final block."""

    file_index: int
    path: str
    kind: str
    compressed: bool
    data: bytes
    first_line: int
    offset: int
    last: bool
    disk_position: int  # bytes of the on-disk file consumed so far, for the progress bar


@contextlib.contextmanager
def _open_stream(path: Path, compression: str | None) -> Iterator[tuple[Any, IO[bytes]]]:
    """(decompressed stream, raw file) of an input."""
    with path.open("rb") as raw:
        if compression == "gzip":
            with gzip.GzipFile(fileobj=raw, mode="rb") as gz:
                yield gz, raw
        elif compression == "zstd":
            try:
                import zstandard
            except ImportError as e:
                raise PreprocessError(
                    f"{path}: reading .zst files needs the zstandard package (pip install zstandard)"
                ) from e
            with io.BufferedReader(
                _ZstdFrames(raw, zstandard.ZstdDecompressor(), path), BLOCK_BYTES
            ) as stream:
                yield stream, raw
        else:
            yield raw, raw


class TruncatedStreamError(PreprocessError):
    """A compressed input that ends inside a frame: the file is incomplete. Never skippable: the lines
    it would have held are unknown, so --skip-bad-lines cannot count them."""


class _ZstdFrames(io.RawIOBase):
    """The decompressed bytes of every frame of a .zst file, raising TruncatedStreamError when the file
    ends inside a frame (zstandard's stream_reader returns the partial data as if it were complete)."""

    def __init__(self, raw: IO[bytes], decompressor: Any, path: Path) -> None:
        self._raw, self._d, self._path = raw, decompressor, path
        self._obj = decompressor.decompressobj()
        self._out = bytearray()
        self._in_frame = False
        self._produced = 0

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        while not self._out:
            chunk = self._raw.read(BLOCK_BYTES)
            if not chunk:
                if self._in_frame:
                    raise TruncatedStreamError(
                        f"{self._path}: truncated compressed stream: the file ends inside a zstd frame, "
                        f"after {self._produced} decompressed bytes; the file is incomplete (copy or "
                        "compress it again). --skip-bad-lines does not skip this"
                    )
                return 0
            self._feed(chunk)
        n = min(len(b), len(self._out))
        b[:n] = self._out[:n]
        del self._out[:n]
        self._produced += n
        return n

    def _feed(self, chunk: bytes) -> None:
        while chunk:
            self._in_frame = True
            self._out += self._obj.decompress(chunk)
            if not self._obj.eof:
                return
            chunk = self._obj.unused_data  # the next frame (pzstd writes several)
            self._obj = self._d.decompressobj()
            self._in_frame = False


def _check_output_prefix(prefix: str) -> None:
    """PREFIX's folder can be made: no part of it is an existing file (else a raw [Errno 17/20])."""
    for parent in Path(prefix).absolute().parents:
        if parent.exists():
            if not parent.is_dir():
                raise PreprocessError(
                    f"output prefix {prefix!r}: '{parent}' is a file, not a folder; give a prefix in a "
                    "folder, e.g. data/corpus (PREFIX.bin and PREFIX.idx are written)"
                )
            if not os.access(parent, os.W_OK | os.X_OK):
                raise PreprocessError(
                    f"output prefix {prefix!r}: cannot write in '{parent}' (permission denied)"
                )
            return


def _read_errors() -> tuple[type[BaseException], ...]:
    errors: tuple[type[BaseException], ...] = (OSError, EOFError, zlib.error)
    with contextlib.suppress(ImportError):
        import zstandard

        errors += (zstandard.ZstdError,)
    return errors


def _iter_blocks(file_index: int, path: Path, block_bytes: int | None = None) -> Iterator[_Block]:
    """Blocks of whole lines of one file (about `block_bytes`, default BLOCK_BYTES); always at
    least one, possibly empty, block."""
    block_bytes = block_bytes or BLOCK_BYTES
    kind, compression = input_format(path)
    errors = _read_errors()
    line, offset = 1, 0
    pending: list[bytes] = []  # a line longer than a block is gathered here, without quadratic copies
    with _open_stream(path, compression) as (stream, raw):

        def read() -> bytes:
            try:
                return stream.read(block_bytes)
            except EOFError:  # gzip's "ended before the end-of-stream marker": never skippable
                raise TruncatedStreamError(
                    f"{path}: truncated compressed stream: the file ends before its end-of-stream marker; "
                    "the file is incomplete (copy or compress it again). --skip-bad-lines does not skip this"
                ) from None
            except errors as e:
                raise PreprocessError(
                    f"{path}: cannot read {compression or 'file'} data after byte {offset}"
                    f"{' of the decompressed stream' if compression else ''}: {e}"
                ) from e

        buf = read()
        while True:
            nxt = read() if buf else b""
            if buf:
                cut = buf.rfind(b"\n")
                if cut < 0 and nxt:
                    pending.append(buf)
                    buf = nxt
                    continue
                if cut < 0:  # the final line has no newline
                    cut = len(buf) - 1
                data = b"".join([*pending, buf[: cut + 1]])
                pending = [buf[cut + 1 :]] if cut + 1 < len(buf) else []
            else:
                data = b"".join(pending)
                pending = []
            last = not nxt and not pending
            yield _Block(file_index, str(path), kind, bool(compression), data, line, offset, last, raw.tell())
            if last:
                return
            line += data.count(b"\n")
            offset += len(data)
            buf = nxt


def _decode_lines(block: _Block, skip_bad_lines: bool, skipped: Counter[str]) -> list[str | None]:
    """Lines of a block; a line that is not UTF-8 raises, or is None when skipped."""
    raw_lines = block.data.split(b"\n") if block.data else []
    if block.data.endswith(b"\n"):
        raw_lines.pop()
    out: list[str | None] = []
    offset = block.offset
    for i, raw in enumerate(raw_lines):
        try:
            out.append(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            if not skip_bad_lines:
                where = " of the decompressed stream" if block.compressed else ""
                raise PreprocessError(
                    f"{block.path}:{block.first_line + i}: invalid UTF-8 at byte offset {offset + e.start}"
                    f"{where} (byte 0x{raw[e.start]:02x}: {e.reason}); fix the file or pass "
                    "--skip-bad-lines (skip_bad_lines=True) to skip such lines"
                ) from None
            skipped["invalid utf-8"] += 1
            out.append(None)
        offset += len(raw) + 1
    return out


def _describe(value: Any) -> str:
    return {dict: "object", list: "list", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number"
    )


def _parse_block(
    block: _Block, json_key: str, skip_bad_lines: bool, skipped: Counter[str]
) -> list[str | list[str]]:
    """Documents of a block: a text, or a JSON list of sentences. Bad lines raise or are counted."""
    try:
        text = block.data.decode("utf-8")
        lines: list[str | None] = list(text.split("\n")) if text else []
        if text.endswith("\n"):
            lines.pop()
    except UnicodeDecodeError:
        lines = _decode_lines(block, skip_bad_lines, skipped)
    if block.first_line == 1 and lines and lines[0] is not None and lines[0].startswith("\ufeff"):
        lines[0] = lines[0][1:]  # a UTF-8 byte-order mark is not text

    def bad(i: int, reason: str, message: str) -> None:
        if not skip_bad_lines:
            raise PreprocessError(
                f"{block.path}:{block.first_line + i}: {message}; fix the file or pass --skip-bad-lines "
                "(skip_bad_lines=True) to skip such lines"
            )
        skipped[reason] += 1

    docs: list[str | list[str]] = []
    for i, line in enumerate(lines):
        if line is None:
            continue
        if not line.strip():
            skipped["blank line"] += 1
            continue
        if block.kind == "text":
            docs.append(line[:-1] if line.endswith("\r") else line)
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            hint = ""
            if block.first_line + i == 1 and line.lstrip().startswith("["):
                hint = " (a JSON array? inputs are JSON lines: one object per line)"
            bad(i, "malformed json", f"malformed JSON: {e.msg} at column {e.colno}{hint}")
            continue
        if not isinstance(obj, dict):
            bad(i, "not an object", f"the line is a JSON {_describe(obj)}, expected an object")
            continue
        if json_key not in obj:
            keys = ", ".join(repr(k) for k in list(obj)[:20]) or "none"
            bad(i, "missing key", f"no key {json_key!r} in the JSON object (keys present: {keys})")
            continue
        value = obj[json_key]
        if isinstance(value, str) or (isinstance(value, list) and all(isinstance(s, str) for s in value)):
            docs.append(value)
        else:
            bad(
                i,
                "not text",
                f"{json_key!r} holds a JSON {_describe(value)}, expected a string or a list of strings",
            )
    return docs


def iter_texts(
    inputs: Iterable[str | os.PathLike[str]], json_key: str = "text", skip_bad_lines: bool = False
) -> Iterator[str]:
    """Stream the document texts of `inputs` (same formats and errors as `preprocess`); a JSON list
    of sentences is joined with blank lines."""
    skipped: Counter[str] = Counter()
    for fi, path in enumerate(expand_inputs(inputs)):
        for block in _iter_blocks(fi, path):
            for doc in _parse_block(block, json_key, skip_bad_lines, skipped):
                yield doc if isinstance(doc, str) else "\n\n".join(doc)


# -- tokenizing -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Settings:
    json_key: str
    split_sentences: bool
    eod_id: int | None
    skip_bad_lines: bool
    dtype: str


@dataclass
class _Encoded:
    tokens: np.ndarray  # all tokens of the block, dataset dtype
    lengths: np.ndarray  # tokens per sequence, int32
    sequences_per_document: np.ndarray  # int64
    skipped: Counter[str]
    data_bytes: int
    lines: int


class _Encoder:
    """Parses and tokenizes blocks; one per worker process (or the caller's process)."""

    def __init__(self, tokenizer: Tokenizer, settings: _Settings) -> None:
        self.settings = settings
        self.dtype = np.dtype(settings.dtype)
        hf = tokenizer.hf
        # encode_batch_fast skips character offsets we do not need (tokenizers >= 0.20).
        self._encode_batch = getattr(hf, "encode_batch_fast", hf.encode_batch)

    def encode(self, block: _Block) -> _Encoded:
        s = self.settings
        skipped: Counter[str] = Counter()
        docs = _parse_block(block, s.json_key, s.skip_bad_lines, skipped)
        texts: list[str] = []
        counts: list[int] = []
        for doc in docs:
            if s.split_sentences:
                sentences = doc if isinstance(doc, list) else _split_sentences(doc)
            else:
                sentences = [doc if isinstance(doc, str) else "\n\n".join(doc)]
            texts += sentences
            counts.append(len(sentences))
        ids = [e.ids for e in self._encode_batch(texts, add_special_tokens=False)] if texts else []
        parts: list[list[int]] = []
        lengths: list[int] = []
        per_doc: list[int] = []
        pos = 0
        for count in counts:
            doc_lengths = []
            for sentence in ids[pos : pos + count]:
                if sentence:  # a sentence without tokens is dropped, as in Megatron
                    parts.append(sentence)
                    doc_lengths.append(len(sentence))
            pos += count
            if not doc_lengths:
                skipped["empty document"] += 1
                continue
            if s.eod_id is not None:
                parts.append([s.eod_id])
                doc_lengths[-1] += 1
            lengths += doc_lengths
            per_doc.append(len(doc_lengths))
        n = sum(lengths)
        return _Encoded(
            tokens=np.fromiter(chain.from_iterable(parts), dtype=self.dtype, count=n),
            lengths=np.asarray(lengths, dtype=np.int32),
            sequences_per_document=np.asarray(per_doc, dtype=np.int64),
            skipped=skipped,
            data_bytes=len(block.data),
            lines=block.data.count(b"\n") + (0 if not block.data or block.data.endswith(b"\n") else 1),
        )


_WORKER: _Encoder | None = None


def _init_worker(tokenizer_json: str, name: str, settings: _Settings) -> None:
    from tokenizers import Tokenizer as HFTokenizer

    global _WORKER
    # The parent stops the workers on Ctrl-C; their own KeyboardInterrupt tracebacks would be noise.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _WORKER = _Encoder(Tokenizer(HFTokenizer.from_str(tokenizer_json), name), settings)


def _encode_in_worker(block: _Block) -> _Encoded:
    assert _WORKER is not None, "worker not initialized"
    return _WORKER.encode(block)


def _mp_context() -> Any:
    # fork: workers start in milliseconds and inherit the imported modules; spawn would re-import
    # torch in each worker (seconds). Platforms without fork use their default.
    methods = multiprocessing.get_all_start_methods()
    return multiprocessing.get_context("fork" if "fork" in methods else None)


@contextlib.contextmanager
def _single_threaded_tokenizers() -> Iterator[None]:
    """Each worker tokenizes on one thread (`workers` is the parallelism). Set before forking, the
    variable also stops HF tokenizers' warning about forking after its thread pool was used."""
    old = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = old


def _encode_ordered(
    blocks: Iterator[_Block], tokenizer: Tokenizer, settings: _Settings, workers: int
) -> Generator[tuple[_Block, _Encoded], None, None]:
    """(block, encoded) in input order; the block's `data` is dropped to free memory."""
    if workers <= 1:
        encoder = _Encoder(tokenizer, settings)
        for block in blocks:
            encoded = encoder.encode(block)
            block.data = b""
            yield block, encoded
        return
    pool = ProcessPoolExecutor(
        max_workers=workers,
        mp_context=_mp_context(),
        initializer=_init_worker,
        initargs=(tokenizer.hf.to_str(), tokenizer.name, settings),
    )
    pending: deque[tuple[_Block, Future[_Encoded]]] = deque()

    def died(block: _Block, e: BaseException) -> RuntimeError:
        error = RuntimeError(
            f"a preprocess worker process died (killed, or out of memory?) while tokenizing "
            f"{block.path} from line {block.first_line} on"
        )
        error.__cause__ = e
        return error

    def first_result() -> tuple[_Block, _Encoded]:
        block, future = pending.popleft()
        try:
            return block, future.result()
        except BrokenProcessPool as e:
            raise died(block, e) from e

    try:
        for block in blocks:
            try:
                future = pool.submit(_encode_in_worker, block)
            except BrokenProcessPool as e:  # a worker died before we collected its result
                raise died(pending[0][0] if pending else block, e) from e
            # The block is pickled later, by the pool's feeder thread: keep a copy without the data.
            pending.append((dataclasses.replace(block, data=b""), future))
            if len(pending) >= 2 * workers:
                yield first_result()
        while pending:
            yield first_result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


# -- the run --------------------------------------------------------------------------------------


@dataclass
class InputCounts:
    """What one input file contributed."""

    documents: int = 0
    sentences: int = 0
    tokens: int = 0
    lines: int = 0
    bytes: int = 0  # decompressed bytes read
    skipped: dict[str, int] = field(default_factory=dict)


@dataclass
class PreprocessSummary:
    """Counts of a preprocess run. `sentences` = sequences written (= documents without
    split_sentences); `tokens` includes the appended EOD ids; `skipped` maps reason -> count."""

    output_prefix: str
    dtype: str
    documents: int = 0
    sentences: int = 0
    tokens: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    inputs: dict[str, InputCounts] = field(default_factory=dict)
    workers: int = 1

    def format(self) -> str:
        """A human-readable report (several lines)."""
        rate = self.seconds if self.seconds > 0 else float("nan")
        mb = sum(c.bytes for c in self.inputs.values()) / 1e6
        lines = [
            f"wrote {self.output_prefix}.bin/.idx ({self.dtype}): {self.documents:,} documents, "
            f"{self.sentences:,} sequences, {self.tokens:,} tokens from {len(self.inputs)} input file(s), "
            f"{mb:,.1f} MB",
            f"{self.seconds:.1f} s with {self.workers} worker(s): {self.documents / rate:,.0f} documents/s, "
            f"{self.tokens / rate:,.0f} tokens/s, {mb / rate:,.2f} MB/s",
        ]
        if self.skipped:
            why = ", ".join(f"{n:,} {reason}" for reason, n in sorted(self.skipped.items()))
            lines.append(f"skipped: {why}")
        return "\n".join(lines)


class _Progress:
    """A rich progress bar on stderr: bytes read of all inputs, documents/s, tokens/s."""

    def __init__(self, total_bytes: int, enabled: bool) -> None:
        self.enabled = enabled and sys.stderr.isatty()
        self._bar: Any = None
        if not self.enabled:
            return
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self._bar = Progress(
            TextColumn("preprocess"),
            BarColumn(bar_width=20),
            DownloadColumn(),
            TextColumn("{task.fields[stats]}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=Console(stderr=True),
        )
        self._task = self._bar.add_task("preprocess", total=max(total_bytes, 1), stats="")

    def __enter__(self) -> _Progress:
        if self._bar is not None:
            self._bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.stop()

    def update(self, done_bytes: int, documents: int, tokens: int, seconds: float) -> None:
        if self._bar is None:
            return
        s = max(seconds, 1e-9)
        stats = f"{documents:,} docs  {documents / s:,.0f} docs/s  {tokens / s:,.0f} tok/s"
        self._bar.update(self._task, completed=done_bytes, stats=stats)


def preprocess(
    inputs: list[str],
    output_prefix: str,
    tokenizer: Tokenizer,
    *,
    json_key: str = "text",
    split_sentences: bool = False,
    append_eod: bool = False,
    workers: int = 1,
    skip_bad_lines: bool = False,
    progress: bool = True,
) -> PreprocessSummary:
    """Tokenize `inputs` (files, directories, globs) into OUTPUT_PREFIX.bin + OUTPUT_PREFIX.idx.

    The token dtype is `best_dtype(tokenizer.vocab_size)`. Both files appear only when the run
    completed; any error or interrupt leaves nothing under those names. Bad input raises
    PreprocessError naming the file and line (and byte offset for bad UTF-8), unless
    `skip_bad_lines`, which skips and counts undecodable, malformed or key-less lines. An input
    file without any document is an error (skipped and counted with `skip_bad_lines`); no document
    at all is always an error. `progress` shows a bar (when stderr is a terminal); the caller
    prints the summary (`PreprocessSummary.format`) if it wants to.
    """
    if workers < 1:
        raise PreprocessError(f"workers must be at least 1, got {workers}")
    if os.fspath(output_prefix).endswith((".bin", ".idx")):
        raise PreprocessError(
            f"output prefix {output_prefix!r} ends with .bin/.idx: give the prefix, PREFIX.bin and "
            "PREFIX.idx are written"
        )
    _check_output_prefix(os.fspath(output_prefix))
    made = [d for d in Path(output_prefix).absolute().parents if not d.exists()]  # deepest first
    try:
        return _preprocess(
            inputs,
            output_prefix,
            tokenizer,
            json_key,
            split_sentences,
            append_eod,
            workers,
            skip_bad_lines,
            progress,
        )
    except BaseException:
        for folder in made:  # a failed run leaves no folders it made (the builder removed its files)
            try:
                folder.rmdir()
            except OSError:
                break
        raise


def _preprocess(
    inputs: list[str],
    output_prefix: str,
    tokenizer: Tokenizer,
    json_key: str,
    split_sentences: bool,
    append_eod: bool,
    workers: int,
    skip_bad_lines: bool,
    progress: bool,
) -> PreprocessSummary:
    start = time.perf_counter()
    files = expand_inputs(inputs)
    eod_id = None
    if append_eod:
        try:
            eod_id = tokenizer.eod_id
        except ValueError as e:
            raise PreprocessError(f"append_eod: {e}") from e
    dtype = best_dtype(tokenizer.vocab_size)
    settings = _Settings(json_key, split_sentences, eod_id, skip_bad_lines, dtype.str)
    prefix = os.fspath(output_prefix)
    summary = PreprocessSummary(output_prefix=prefix, dtype=str(dtype), workers=workers)
    sizes = [f.stat().st_size for f in files]
    done_before = [sum(sizes[:i]) for i in range(len(files))]
    skipped: Counter[str] = Counter()

    def blocks() -> Iterator[_Block]:
        for i, path in enumerate(files):
            yield from _iter_blocks(i, path)

    with (
        _single_threaded_tokenizers(),
        IndexedDatasetBuilder(bin_path(prefix), dtype) as builder,
        _Progress(sum(sizes), progress) as bar,
        contextlib.ExitStack() as stack,  # stops the workers before the builder removes its files
    ):
        counts = InputCounts()
        results = contextlib.closing(_encode_ordered(blocks(), tokenizer, settings, workers))
        for block, enc in stack.enter_context(results):
            builder._add_documents(enc.tokens, enc.lengths, enc.sequences_per_document)
            counts.documents += len(enc.sequences_per_document)
            counts.sentences += len(enc.lengths)
            counts.tokens += len(enc.tokens)
            counts.lines += enc.lines
            counts.bytes += enc.data_bytes
            for reason, n in enc.skipped.items():
                counts.skipped[reason] = counts.skipped.get(reason, 0) + n
            summary.documents += len(enc.sequences_per_document)
            summary.tokens += len(enc.tokens)
            bar.update(
                done_before[block.file_index] + block.disk_position,
                summary.documents,
                summary.tokens,
                time.perf_counter() - start,
            )
            if not block.last:
                continue
            if counts.documents == 0:
                what = ", ".join(f"{n} {r}" for r, n in sorted(counts.skipped.items())) or "an empty file"
                if not skip_bad_lines:
                    raise PreprocessError(
                        f"input {block.path} holds no document ({counts.lines} lines: {what})"
                    )
                counts.skipped["empty input"] = 1
            skipped.update(counts.skipped)
            summary.sentences += counts.sentences
            summary.inputs[block.path] = counts
            counts = InputCounts()
        if summary.documents == 0:
            names = ", ".join(str(f) for f in files[:5]) + (" ..." if len(files) > 5 else "")
            raise PreprocessError(f"no document in the inputs ({names}); skipped: {dict(skipped)}")
        builder.finalize(idx_path(prefix))
    summary.skipped = dict(skipped)
    summary.seconds = time.perf_counter() - start
    return summary


# -- options --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PreprocessOptions:
    """`stx preprocess`: the inputs (files, directories, globs), PREFIX of PREFIX.bin/.idx, the
    tokenizer, and the keyword arguments of `preprocess`."""

    inputs: tuple[str, ...]
    output_prefix: str
    tokenizer: TokenizerSource = field(default_factory=TokenizerSource)
    json_key: str = "text"
    split_sentences: bool = False
    append_eod: bool = False
    workers: int = 1
    skip_bad_lines: bool = False
    progress: bool = True


def run_preprocess(opts: PreprocessOptions) -> PreprocessSummary:
    """Load opts.tokenizer and run `preprocess` with opts."""
    return preprocess(
        list(opts.inputs),
        opts.output_prefix,
        opts.tokenizer.load(),
        json_key=opts.json_key,
        split_sentences=opts.split_sentences,
        append_eod=opts.append_eod,
        workers=opts.workers,
        skip_bad_lines=opts.skip_bad_lines,
        progress=opts.progress,
    )
