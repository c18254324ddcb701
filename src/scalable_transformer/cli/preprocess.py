"""`stx preprocess`: tokenize a corpus into a Megatron mmap indexed dataset (.bin/.idx)."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..data.preprocess import PreprocessOptions
    from ..data.tokenizers import TokenizerSource

# Megatron's tokenizer types (data/tokenizers.py TOKENIZER_TYPES), spelled out so that building the
# parser does not import the tokenizers library.
TOKENIZER_TYPES = ("BertWordPieceLowerCase", "BertWordPieceCase", "GPT2BPETokenizer", "HFTokenizer")


def add_tokenizer_arguments(parser: argparse.ArgumentParser) -> None:
    """--tokenizer, --vocab-file, --merge-file, --tokenizer-type, --tokenizer-vocab-size."""
    parser.add_argument(
        "--tokenizer",
        default="embedded",
        help="'embedded', a tokenizer.json, a BERT vocab.txt, a GPT-2 vocab.json, or a directory holding one",
    )
    parser.add_argument("--vocab-file", help="Megatron-style vocab file (BERT vocab.txt or GPT-2 vocab.json)")
    parser.add_argument("--merge-file", help="GPT-2 merges.txt that goes with --vocab-file")
    parser.add_argument(
        "--tokenizer-type",
        choices=TOKENIZER_TYPES,
        help="Megatron tokenizer type; default: inferred from the files",
    )
    parser.add_argument(
        "--tokenizer-vocab-size", type=int, default=8192, help="vocab size of the 'embedded' tokenizer"
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `stx preprocess`."""
    parser.add_argument(
        "--input", nargs="+", required=True, metavar="PATH", help="files, directories or globs"
    )
    parser.add_argument(
        "--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx (give PREFIX as data.path)"
    )
    add_tokenizer_arguments(parser)
    parser.add_argument("--json-key", default="text", help="key of the text in JSON lines (default: text)")
    parser.add_argument(
        "--split-sentences", action="store_true", help="one sequence per sentence (BERT); else per document"
    )
    parser.add_argument("--append-eod", action="store_true", help="end each document with the EOD token")
    parser.add_argument("--workers", type=int, default=1, help="tokenizing processes (default 1)")
    parser.add_argument(
        "--skip-bad-lines",
        action="store_true",
        help="skip and count lines that are not UTF-8, not JSON or lack the key, instead of stopping",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar and summary")


def tokenizer_source(args: argparse.Namespace) -> TokenizerSource:
    from ..data.tokenizers import TokenizerSource

    return TokenizerSource(
        args.tokenizer,
        args.tokenizer_vocab_size,
        vocab_file=args.vocab_file,
        merge_file=args.merge_file,
        tokenizer_type=args.tokenizer_type,
    )


def preprocess_options(args: argparse.Namespace) -> PreprocessOptions:
    from ..data.preprocess import PreprocessOptions

    return PreprocessOptions(
        inputs=tuple(args.input),
        output_prefix=args.output_prefix,
        tokenizer=tokenizer_source(args),
        json_key=args.json_key,
        split_sentences=args.split_sentences,
        append_eod=args.append_eod,
        workers=args.workers,
        skip_bad_lines=args.skip_bad_lines,
        progress=not getattr(args, "no_progress", False),
    )


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "preprocess", help="tokenize a corpus into a Megatron mmap indexed dataset (.bin/.idx)"
    )
    add_arguments(p)
    p.set_defaults(fn=run)


def run(args: argparse.Namespace) -> int:
    """`stx preprocess`: 0 on success, 2 (message on stderr) on bad input or a bad tokenizer."""
    from ..data.preprocess import run_preprocess
    from ..errors import PreprocessError

    opts = preprocess_options(args)
    try:
        summary = run_preprocess(opts)
    except (PreprocessError, FileNotFoundError, ValueError) as e:
        print(f"stx preprocess: error: {e}", file=sys.stderr)
        return 2
    if opts.progress:
        print(summary.format())
    return 0
