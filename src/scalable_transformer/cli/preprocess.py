"""`stx preprocess`: tokenize a corpus into a Megatron mmap indexed dataset (.bin/.idx)."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from ..data.preprocess import PreprocessOptions, run_preprocess
from ..data.tokenizers import TokenizerSource
from ..errors import PreprocessError

if TYPE_CHECKING:
    from ..data.preprocess import PreprocessOptions
    from ..data.tokenizers import TokenizerSource


def tokenizer_source(args: argparse.Namespace) -> TokenizerSource:

    return TokenizerSource(
        args.tokenizer,
        args.tokenizer_vocab_size,
        vocab_file=args.vocab_file,
        merge_file=args.merge_file,
        tokenizer_type=args.tokenizer_type,
    )


def preprocess_options(args: argparse.Namespace) -> PreprocessOptions:
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


def run(args: argparse.Namespace) -> int:
    """`stx preprocess`: 0 on success, 2 (message on stderr) on bad input or a bad tokenizer."""
    opts = preprocess_options(args)
    try:
        summary = run_preprocess(opts)
    except (PreprocessError, FileNotFoundError, ValueError) as e:
        print(f"stx preprocess: error: {e}", file=sys.stderr)
        return 2
    if opts.progress:
        print(summary.format())
    return 0
