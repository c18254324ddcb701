"""scalable-transformer: pretrain BERT- and GPT-style transformers with any parallel layout."""

__version__ = "0.1.0"
