"""Which folder a --model names: the embedded default, a Hugging Face folder, or a .gguf file's converted
folder. No torch: the API process resolves the folder to load its tokenizer while the engine loads."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from server.model.default_model import DEFAULT_NAME, ModelNotFoundError, converted_folder, default_gguf_path


@dataclass(frozen=True)
class ModelSource:
    folder: Path | None   # a Hugging Face folder: config.json, safetensors, tokenizer (None: resolve_model's
                          # convert=False, a GGUF file not converted yet)
    name: str             # the default served-model name


def cached_model_folder(model: str | None) -> Path | None:
    """The folder resolve_model(model) would return, when that needs no conversion; None otherwise (a GGUF
    file not converted yet, or no such model: resolve_model says why)."""
    try:
        return resolve_model(model, convert=False).folder
    except (ModelNotFoundError, OSError):
        return None


def resolve_model(model: str | None, convert: bool = True) -> ModelSource:
    """None -> the embedded default; a folder -> itself; a .gguf file -> its converted cache (convert=False: the
    folder is None while the file is not converted yet)."""
    if model is None or model == "" or model == DEFAULT_NAME:
        return ModelSource(converted_folder(default_gguf_path(), convert), DEFAULT_NAME)
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(converted_folder(path, convert), path.stem)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"{path} has no config.json; pass a Hugging Face model folder or a .gguf file")
        return ModelSource(path, path.name)
    raise ModelNotFoundError(
        f"model {model!r} is neither a local folder nor a .gguf file (sleepserve never downloads from a hub)")


__all__ = ["ModelSource", "cached_model_folder", "resolve_model"]
