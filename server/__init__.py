"""sleepserve: an OpenAI-compatible inference server whose GPU memory can sleep and wake."""
from __future__ import annotations

__version__ = "0.1.0"
__all__ = ["LLM", "RequestOutputKind", "SamplingParams", "StructuredOutputs", "__version__"]


def __getattr__(name: str):
    # Lazy, so `sleepserve --help` does not pay for importing torch and transformers.
    if name == "LLM":
        from server.llm import LLM
        return LLM
    if name in ("RequestOutputKind", "SamplingParams", "StructuredOutputs"):
        from server.wire import params
        return getattr(params, name)
    raise AttributeError(name)
