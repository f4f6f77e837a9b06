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
