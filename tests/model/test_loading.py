"""Model sources: the embedded default, folders, dummy weights, and clear errors for bad ones."""
from __future__ import annotations

import json
import shutil

import pytest

from server import LLM, SamplingParams
from server.model.default_model import ModelNotFoundError
from server.model.loader import WeightLoadError
from server.model.source import resolve_model


def test_unknown_model_path_is_a_clear_error(tmp_path):
    with pytest.raises(ModelNotFoundError, match="neither a local folder nor a .gguf"):
        resolve_model(str(tmp_path / "nope"))
    with pytest.raises(ModelNotFoundError, match="config.json"):
        resolve_model(str(tmp_path))


def _copy_model(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, dst / f.name)
    return dst


def test_corrupt_safetensors_is_a_clear_error(default_model_folder, tmp_path):
    bad = _copy_model(default_model_folder, tmp_path / "bad")
    (bad / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all" + b"\0" * 64)
    with pytest.raises(WeightLoadError, match="could not read"):
        LLM(model=str(bad), device="cpu", kv_cache_memory="16MiB")


def test_truncated_safetensors_is_a_clear_error(default_model_folder, tmp_path):
    bad = _copy_model(default_model_folder, tmp_path / "short")
    data = (default_model_folder / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(WeightLoadError):
        LLM(model=str(bad), device="cpu", kv_cache_memory="16MiB")


def test_unsupported_architecture_is_a_clear_error(default_model_folder, tmp_path):
    other = _copy_model(default_model_folder, tmp_path / "gpt")
    cfg = json.loads((other / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="not supported"):
        LLM(model=str(other), device="cpu", kv_cache_memory="16MiB")


def test_dummy_weights_for_a_given_config(default_model_folder, tmp_path):
    small = _copy_model(default_model_folder, tmp_path / "tiny")
    cfg = json.loads((small / "config.json").read_text())
    cfg.update(num_hidden_layers=2, hidden_size=128, intermediate_size=256, num_attention_heads=4,
               num_key_value_heads=2, head_dim=32, model_type="qwen3", tie_word_embeddings=False)
    (small / "config.json").write_text(json.dumps(cfg))
    llm = LLM(model=str(small), device="cpu", load_format="dummy", kv_cache_memory="16MiB")
    try:
        out = llm.generate("hello", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
        assert len(out.outputs[0].token_ids) == 8
        assert llm.engine.model.model.layers[0].self_attn.q_norm is not None
    finally:
        llm.close()


def test_weights_are_views_of_a_few_slabs(default_model_folder, tmp_path, monkeypatch):
    """materialize packs every parameter and buffer into slabs (one pool allocation each, one physical
    handle on CUDA, which a level-2 sleep releases one by one), without overlap, aligned, in the pool."""
    import torch

    from allocator import MemoryPool
    from allocator.host import HostBackend
    from server.model import loader
    from server.model.config import ModelConfig

    small = _copy_model(default_model_folder, tmp_path / "tiny")
    cfg = json.loads((small / "config.json").read_text())
    cfg.update(num_hidden_layers=4, hidden_size=128, intermediate_size=256, num_attention_heads=4,
               num_key_value_heads=2, head_dim=32, tie_word_embeddings=False)
    (small / "config.json").write_text(json.dumps(cfg))
    monkeypatch.setattr(loader, "SLAB_BYTES", 1 << 20)  # several slabs for a tiny model
    pool = MemoryPool(HostBackend(tmp_path / "pool"))
    try:
        model = loader.build_model(ModelConfig.from_folder(small), pool, torch.float32, 64)
        tensors = [*model.parameters(), *model.buffers()]
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        slabs = pool.stats().tags["weights"].allocations
        assert nbytes > 2 * loader.SLAB_BYTES and 2 < slabs < len(tensors) // 4
        spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors)
        assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))  # no overlap
        assert all(pool.tag_of(t) == "weights" and t.data_ptr() % loader.ALIGN == 0 for t in tensors)
        attn = model.model.layers[0].self_attn  # a fused group is still one tensor, its projections views
        assert attn.q_proj.weight.data_ptr() == attn.qkv_weight.data_ptr()
        assert attn.v_proj.weight.data_ptr() + attn.v_proj.weight.nbytes == \
            attn.qkv_weight.data_ptr() + attn.qkv_weight.nbytes
    finally:
        pool.close()
