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
  * `.parquet`: the text column (`json_key`, default "text"; `--text-column`) of a Parquet file;
  * a directory written by HF `datasets`' `Dataset.save_to_disk` (state.json + dataset_info.json):
    the same column of its rows, in order (a DatasetDict's directory: name one split's directory).
    Both are read with pyarrow (the `parquet` extra), see data/columnar_readers.py; a row's value is
    read as a JSON line's value under the key is (a string, or a list of sentences);
  * directories: every file with one of the suffixes above and every saved dataset, recursively,
    sorted by path;
  * globs (`*`, `?`, `[`, `**`): the sorted matches. A file named twice is read once.

Output: one sequence per document, or with `split_sentences` one per sentence (what BERT's
sentence pairs need), documents closed with end_document. `append_eod` appends the tokenizer's
end-of-document id to each document's last sequence, as Megatron's and NeoX's preprocess do.
Documents (and sentences) that tokenize to nothing are skipped and counted, as in Megatron.

The inputs are found and read (decompressed, cut into blocks, parsed into documents) by
data/text_readers.py, which `stx tokenizer` shares. Work is streamed in blocks of whole lines
(~1 MiB); with `workers` > 1 the blocks are tokenized by that many processes and written back in
input order, so the output is byte-identical for any number of workers. At most 2 blocks per
worker are in flight: memory stays bounded whatever the corpus size (a single line must fit in
memory). Each worker tokenizes single-threaded.
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import os
import signal
import sys
import time
from collections import Counter, deque
from collections.abc import Generator, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from tokenizers import Tokenizer as HFTokenizer

from scalable_transformer.data.corpus import split_sentences as _split_sentences
from scalable_transformer.data.indexed import IndexedDatasetBuilder, best_dtype, bin_path, idx_path
from scalable_transformer.data.text_readers import Block, expand_inputs, input_size, iter_blocks, parse_block
from scalable_transformer.data.tokenizers import Tokenizer, TokenizerSource

from ..errors import PreprocessError

# -- output ---------------------------------------------------------------------------------------


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

    def encode(self, block: Block) -> _Encoded:
        s = self.settings
        skipped: Counter[str] = Counter()
        docs = parse_block(block, s.json_key, s.skip_bad_lines, skipped)
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
            data_bytes=block.row_bytes if block.rows is not None else len(block.data),
            lines=block.lines,
        )


_WORKER: _Encoder | None = None


def _init_worker(tokenizer_json: str, name: str, settings: _Settings) -> None:
    global _WORKER
    # The parent stops the workers on Ctrl-C; their own KeyboardInterrupt tracebacks would be noise.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _WORKER = _Encoder(Tokenizer(HFTokenizer.from_str(tokenizer_json), name), settings)


def _encode_in_worker(block: Block) -> _Encoded:
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
    blocks: Iterator[Block], tokenizer: Tokenizer, settings: _Settings, workers: int
) -> Generator[tuple[Block, _Encoded], None, None]:
    """(block, encoded) in input order; the block's `data` is dropped to free memory."""
    if workers <= 1:
        encoder = _Encoder(tokenizer, settings)
        for block in blocks:
            encoded = encoder.encode(block)
            block.data, block.rows = b"", None
            yield block, encoded
        return
    pool = ProcessPoolExecutor(
        max_workers=workers,
        mp_context=_mp_context(),
        initializer=_init_worker,
        initargs=(tokenizer.hf.to_str(), tokenizer.name, settings),
    )
    pending: deque[tuple[Block, Future[_Encoded]]] = deque()

    def died(block: Block, e: BaseException) -> RuntimeError:
        error = RuntimeError(
            f"a preprocess worker process died (killed, or out of memory?) while tokenizing "
            f"{block.path} from line {block.first_line} on"
        )
        error.__cause__ = e
        return error

    def first_result() -> tuple[Block, _Encoded]:
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
            pending.append((dataclasses.replace(block, data=b"", rows=None), future))
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
    sizes = [input_size(f) for f in files]
    done_before = [sum(sizes[:i]) for i in range(len(files))]
    skipped: Counter[str] = Counter()

    def blocks() -> Iterator[Block]:
        for i, path in enumerate(files):
            yield from iter_blocks(i, path, column=json_key)

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
