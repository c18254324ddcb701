"""Shared fixtures: one cache directory per test session (tokenizer, corpus, CPU peak), never ~/.cache."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session", autouse=True)
def stx_cache_dir(tmp_path_factory):
    if "STX_CACHE_DIR" in os.environ:  # CI points it at a directory that survives between steps
        yield os.environ["STX_CACHE_DIR"]
        return
    path = tmp_path_factory.mktemp("stx-cache")
    os.environ["STX_CACHE_DIR"] = str(path)
    yield str(path)
    del os.environ["STX_CACHE_DIR"]
