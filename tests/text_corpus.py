"""A small synthetic corpus for the preprocessing tests: documents of 1-6 capitalised sentences of 3-12
words drawn from a dozen, reproducible from a seed, and a WordPiece tokenizer trained on it."""

from __future__ import annotations

import random

from scalable_transformer.data.tokenizers import Tokenizer, train_wordpiece

WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "epsilon",
    "zeta",
    "eta",
    "theta",
    "iota",
    "kappa",
    "lambda",
    "mu",
]


def documents(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    docs = []
    for _ in range(n):
        sentences = [
            " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))).capitalize() + "."
            for _ in range(rng.randint(1, 6))
        ]
        docs.append(" ".join(sentences))
    return docs


def tiny_tokenizer() -> Tokenizer:
    """A 120-token WordPiece vocabulary trained on 200 documents of the corpus (seed 99)."""
    return Tokenizer(train_wordpiece(documents(200, seed=99), 120), name="tiny")
