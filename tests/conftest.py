"""Shared fixtures. The default model is converted once per cache folder (about 40 s the first time).

tests/ follows the source: allocator/, model/, engine/, wire/, api/ (the API process's modules on their own),
http/ (through the real server), weight_transfer/, bench/ and docker/ (the benchmarks' and the image's
checks), gpu/ (`-m gpu`, run by `make gpu-check`). Helpers that bench/ and scripts/ use too live in testkit/.
Checks of the whole repository (layers, docs, testkit imports) sit at the top. No folder has an __init__.py:
pytest imports each test file by its name, so names stay unique across folders."""
from __future__ import annotations

import os

import pytest
import torch

torch.set_num_threads(max(1, os.cpu_count() or 1))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run `make gpu-check` on a GPU host)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def default_model_folder():
    from server.model.source import resolve_model

    return resolve_model(None).folder


@pytest.fixture(scope="session")
def llm(default_model_folder):
    """One CPU engine on the default model, shared by tests that leave it as they found it."""
    from server import LLM

    engine = LLM(model=str(default_model_folder), device="cpu")
    yield engine
    engine.close()


PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "List three primary colors:",
    "Translate to French: Good morning, how are you?",
    "The quick brown fox",
    "Explain photosynthesis in one sentence.",
    "1, 2, 3, 4, 5,",
]
