"""Loading the tokenizer that sits beside the weights (never from a hub)."""
from __future__ import annotations

from pathlib import Path

from server.model.default_model import ModelNotFoundError


def load_tokenizer(folder: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError) as e:
        raise ModelNotFoundError(
            f"no usable tokenizer in {folder} ({e}); the folder needs tokenizer.json or the files "
            "of a Hugging Face tokenizer") from None


def import_tokenizer_code() -> None:
    """Import ahead what load_tokenizer's first call imports, e.g. on a thread while the process waits for
    something else: transformers' tokenizer classes, and the config code from_pretrained reads the model's
    config with (transformers.activations and what it pulls in, torch.distributed.tensor among them: ~0.8 s of
    the ~1.5 s a first load took on the CI host). Only a warm-up: what fails here fails again, reported, later."""
    import importlib

    for name in ("transformers", "transformers.tokenization_utils_fast", "transformers.activations"):
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - load_tokenizer reports it
            return


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
    """The chat template's text for these messages; a template error is the client's to fix."""
    from server.wire.errors import InvalidRequestError

    if not getattr(tokenizer, "chat_template", None) and not kwargs.get("chat_template"):
        raise InvalidRequestError("this model's tokenizer has no chat template; use /v1/completions",
                                  param="messages")
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             **kwargs)
    except Exception as e:  # template errors are the client's messages not fitting the template
        raise InvalidRequestError(f"the chat template could not render these messages: {e}",
                                  param="messages") from None
