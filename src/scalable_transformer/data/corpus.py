"""The embedded default corpus: English text that ships with Python itself.

Two sources, both read without importing any standard-library module other than `pydoc_data`
(importing `antigravity` opens a browser, `this` prints, others start threads or touch the network):
  * `pydoc_data.topics.topics`: the language-reference topics behind `help("assert")` (~465 KB);
  * module, class and function docstrings of the standard library, read with `ast` from the source
    files (test packages, idlelib, lib2to3 and site-packages skipped; docstrings shorter than
    `MIN_DOCSTRING_CHARS` dropped, they are mostly one-liners).
One document = one topic or one module's docstrings, in sorted order. Building parses ~600 files
(a few seconds), so the result is cached as JSONL in the user cache directory, keyed by the Python
version and a hash of the inputs.
"""

from __future__ import annotations

import ast
import functools
import gc
import hashlib
import json
import os
import re
import sys
import sysconfig
import warnings
from pathlib import Path

from scalable_transformer.cache import cache_dir
from scalable_transformer.files import write_atomic

# Bump when the way documents are built changes, so stale caches are not reused.
CORPUS_VERSION = 1
MIN_DOCSTRING_CHARS = 200
_SKIP_DIRS = frozenset({"idlelib", "lib2to3", "site-packages", "dist-packages", "__pycache__", "pydoc_data"})


def _atomic_write(path: Path, data: bytes) -> None:
    """Write `data` to `path` atomically, so a reader (or another rank building the same file
    concurrently) never sees a partial file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, data)


def _topics() -> dict[str, str]:
    try:
        from pydoc_data.topics import topics
    except ImportError:  # some distributions strip pydoc_data
        return {}
    return dict(topics)


def _stdlib_sources() -> list[tuple[str, Path]]:
    """(dotted module name, path) of the standard library's .py files, sorted, tests excluded."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(
            d for d in dirnames if d not in _SKIP_DIRS and not d.startswith("test") and "-" not in d
        )
        rel = Path(dirpath).relative_to(root)
        for name in sorted(filenames):
            if not name.endswith(".py") or name.startswith(("test_", "_test")):
                continue
            parts = [*rel.parts, name[:-3]]
            if parts[-1] == "__init__":
                parts.pop()
            if parts:
                found.append((".".join(parts), Path(dirpath) / name))
    found.sort()
    return found


@functools.lru_cache(maxsize=1)
def corpus_fingerprint() -> str:
    """Hex hash of everything the corpus is built from (builder version, Python version, topics,
    stdlib source bytes). Equal fingerprints mean equal corpora; reading the sources takes ~50 ms."""
    h = hashlib.sha256(f"corpus-v{CORPUS_VERSION}|{sys.implementation.name}|{sys.version}".encode())
    for key, text in sorted(_topics().items()):
        h.update(f"\0topic:{key}\0{text}".encode())
    for name, path in _stdlib_sources():
        h.update(f"\0module:{name}\0".encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def _module_docstrings(source: bytes, filename: str) -> list[str]:
    """Docstrings of a module, its classes and functions (nested too), in source order."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # invalid escape sequences in old stdlib strings
        tree = ast.parse(source, filename=filename)
    docs: list[str] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node)
            if doc and len(doc) >= MIN_DOCSTRING_CHARS:
                docs.append(doc)
        # Only statement bodies can hold definitions; skipping expressions keeps this fast.
        for field in ("body", "orelse", "finalbody", "handlers"):
            for child in getattr(node, field, ()):
                if isinstance(child, ast.stmt | ast.excepthandler):
                    visit(child)

    visit(tree)
    return docs


def _build() -> list[tuple[str, str]]:
    docs = [(f"topic:{key}", text.strip()) for key, text in _topics().items() if text.strip()]
    # Millions of short-lived AST nodes trigger many useless collections.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for name, path in _stdlib_sources():
            try:
                found = _module_docstrings(path.read_bytes(), str(path))
            except (SyntaxError, ValueError, OSError):
                continue
            if found:
                docs.append((f"module:{name}", "\n\n".join(found)))
    finally:
        if gc_was_enabled:
            gc.enable()
    docs.sort()
    return docs


def _cache_path() -> Path:
    v = sys.version_info
    tag = f"{sys.implementation.name}{v.major}.{v.minor}.{v.micro}"
    return cache_dir() / f"corpus-{tag}-{corpus_fingerprint()[:16]}.jsonl"


def embedded_corpus() -> list[tuple[str, str]]:
    """(name, text) of every document of the embedded corpus, sorted by name.

    Names are "topic:<pydoc topic>" or "module:<dotted module>". Built once per Python install
    (a few seconds) and cached; later calls read the cache (~20 ms).
    """
    path = _cache_path()
    if path.is_file():
        try:
            with path.open(encoding="utf-8") as f:
                return [(rec["name"], rec["text"]) for rec in map(json.loads, f)]
        except (OSError, ValueError, KeyError, TypeError):
            pass  # corrupt or foreign file: rebuild and overwrite it
    docs = _build()
    payload = "".join(json.dumps({"name": n, "text": t}, ensure_ascii=False) + "\n" for n, t in docs)
    try:
        _atomic_write(path, payload.encode("utf-8"))
    except OSError as e:  # read-only home etc.: still usable, just not cached
        warnings.warn(f"could not cache the embedded corpus at {path}: {e}", stacklevel=2)
    return docs


def embedded_documents() -> list[str]:
    """The texts of the embedded corpus (~1.7 MB, ~400 documents), in a deterministic order."""
    return [text for _, text in embedded_corpus()]


# Words that end with a period but rarely end a sentence.
_ABBREVIATIONS = frozenset(
    {"e.g", "i.e", "etc", "vs", "cf", "al", "mr", "mrs", "ms", "dr", "prof", "st", "jr", "sr", "no", "fig"}
    | {"eq", "sec", "ch", "vol", "approx", "ca", "resp", "viz", "incl", "esp", "dept", "est"}
)
_PARAGRAPH = re.compile(r"\n[ \t]*\n\s*")
_WHITESPACE = re.compile(r"\s+")
# A sentence end: terminal punctuation, optional closing quotes/brackets, whitespace, then
# something that can start a sentence (capital letter, digit, opening quote/bracket, '>>>').
_BOUNDARY = re.compile(r"[.!?][\"')\]]*(\s+)(?=[\"'(\[]?[A-Z0-9]|>>>)")


def split_sentences(text: str) -> list[str]:
    """Split English prose into sentences with a regex (no model download).

    Paragraphs (blank-line separated) always end a sentence; inside a paragraph, line breaks are
    collapsed and a sentence ends at . ! or ? followed by whitespace and a capital, a digit or an
    opening quote, unless the word before the period is a known abbreviation or a single letter
    (an initial). Every non-whitespace character of `text` ends up in exactly one sentence, so
    tokenizing the sentences separately gives the tokens of the whole text.
    """
    sentences: list[str] = []
    for paragraph in _PARAGRAPH.split(text):
        paragraph = _WHITESPACE.sub(" ", paragraph).strip()
        start = 0
        for m in _BOUNDARY.finditer(paragraph):
            before = paragraph[start : m.start()]
            last_word = before.rsplit(" ", 1)[-1].lstrip("(\"'[").lower()
            if last_word in _ABBREVIATIONS or (len(last_word) == 1 and last_word.isalpha()):
                continue
            sentences.append(paragraph[start : m.start(1)])
            start = m.end(1)
        if start < len(paragraph):
            sentences.append(paragraph[start:])
    return [s for s in sentences if s]
