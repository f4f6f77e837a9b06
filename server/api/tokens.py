"""Tokenizing, chat templating and detokenizing for the routes: on one worker thread of the API
layer, with its own copy of the tokenizer, never on the engine thread or the event loop.

Before this, a 30 MB prompt was tokenized on the engine thread before any length check: 50.8 s and
+3.9 GiB, while every other request waited. Now a prompt is measured in characters first: a text
longer than the context times MAX_CHARS_PER_TOKEN cannot fit (no tokenizer's tokens average that
many characters), so it is refused before the tokenizer sees it; token ids are bounded by the
context the same way, before they travel to the engine.
"""
from __future__ import annotations

import asyncio
import copy
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, TypeVar

from server.wire.detokenizer import prefix_stable
from server.wire.errors import InvalidRequestError
from server.model.tokenizer import import_tokenizer_code, load_tokenizer, render_chat

T = TypeVar("T")

MAX_CHARS_PER_TOKEN = 32


def _chars(node: Any) -> int:
    """Characters of every string inside a JSON-like value (message contents, names, kwargs)."""
    total, stack = 0, [node]
    while stack:
        n = stack.pop()
        if isinstance(n, str):
            total += len(n)
        elif isinstance(n, dict):
            stack.extend(n.keys())
            stack.extend(n.values())
        elif isinstance(n, (list, tuple)):
            stack.extend(n)
    return total


class TokenizerPreload:
    """The API process's tokenizer, loaded on a thread while the engine process loads the model (this process
    only waits meanwhile): a first load is ~1.5 s of the 2-core CI host's time, most of it transformers'
    imports. Only from a folder known without converting anything (loader.cached_model_folder); otherwise the
    thread imports the tokenizer's code alone. Tokens takes the tokenizer if the engine's folder is that one, and
    the copy streamed text is made with (stream_copy), also made here, off the start-up's critical path."""

    def __init__(self, model: str | None):
        self._loaded: tuple[Path, Any, Any] | None = None
        self._thread = threading.Thread(target=self._load, args=(model,), name="sleepserve-tokenizer", daemon=True)
        self._thread.start()

    def _load(self, model: str | None) -> None:
        from server.model.source import cached_model_folder

        folder = cached_model_folder(model)
        if folder is None:
            import_tokenizer_code()
            return
        try:
            tokenizer = load_tokenizer(folder)
            self._loaded = (folder.resolve(), tokenizer, stream_copy(tokenizer))
        except Exception:  # noqa: BLE001 - Tokens loads it again, and that load reports the error
            pass

    def take(self, folder: Path) -> tuple[Any, Any] | None:
        """The tokenizer loaded from `folder` and its stream_copy, or None (another folder, or the load failed)."""
        self._thread.join()
        if self._loaded is not None and self._loaded[0] == folder.resolve():
            return self._loaded[1:]
        return None


def stream_copy(tokenizer: Any) -> Any:
    """A copy of the tokenizer for the text of streams (EngineClient.set_stream_tokenizer), which decodes on the
    event loop while the worker thread encodes with the other; None where streamed text is the engine's
    (not prefix_stable). ~0.2 s for a 49k vocabulary (CPU host)."""
    return copy.deepcopy(tokenizer) if prefix_stable(tokenizer) else None


class Tokens:
    def __init__(self, folder: Path, max_model_len: int, preload: TokenizerPreload | None = None):
        # A tokenizer of our own: the engine thread decodes with its copy while this one encodes,
        # and a fast tokenizer shared across threads can fail with "Already borrowed" (one made on the preload's
        # thread is used on this one's worker thread only, never on two at once).
        loaded = preload.take(folder) if preload is not None else None
        if loaded is not None:
            self.tokenizer, self.stream_tokenizer = loaded
        else:
            self.tokenizer = load_tokenizer(folder)
            self.stream_tokenizer = stream_copy(self.tokenizer)
        self.max_model_len = max_model_len
        self.max_chars = max_model_len * MAX_CHARS_PER_TOKEN
        # One thread: requests tokenize one after another, each bounded by max_chars.
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="sleepserve-tokenizer")

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def check_chars(self, n: int, param: str) -> None:
        if n > self.max_chars:
            raise InvalidRequestError(
                f"the prompt has {n} characters; this model's context is {self.max_model_len} tokens, which "
                f"never hold more than {self.max_chars} characters ({MAX_CHARS_PER_TOKEN} per token); "
                "shorten the prompt", param=param, code="context_length_exceeded")

    def check_ids(self, ids: list, param: str = "prompt") -> None:
        self.check_count(len(ids), param, "tokens")

    def check_count(self, n: int, param: str, what: str = "messages") -> None:
        """n tokens (or n messages, each at least a token) must leave room for one generated token."""
        if n >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {n} {what}, but this model's context is {self.max_model_len} tokens "
                "(prompt plus at least one generated token); shorten the prompt", param=param,
                code="context_length_exceeded")

    async def encode(self, text: str, add_special_tokens: bool = True, param: str = "prompt") -> list[int]:
        self.check_chars(len(text), param)
        return await self._run(lambda: self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids)

    async def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                          **kwargs: Any) -> list[int]:
        self.check_chars(_chars(messages) + _chars(kwargs), "messages")

        def work() -> list[int]:
            text = render_chat(self.tokenizer, messages, add_generation_prompt, **kwargs)
            self.check_chars(len(text), "messages")  # a template can repeat what it is given
            # The template already wrote the special tokens (BOS and turn markers): add none twice.
            return self.tokenizer(text, add_special_tokens=False).input_ids

        return await self._run(work)

    async def token_strs(self, ids: list[int]) -> list[str]:
        """Each id's token as the vocabulary spells it (vLLM's /tokenize `token_strs`)."""
        return await self._run(lambda: self.tokenizer.convert_ids_to_tokens(ids))

    async def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return await self._run(lambda: self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
