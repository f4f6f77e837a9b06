"""Sleep and weight updates cover a mixture-of-experts model's experts like any other weight: level 1
offloads them, level 2 discards them, and update_weights (from a folder or from tensors) accepts the
checkpoint's per-expert names, the stacked names (vLLM's experts.w13_weight / w2_weight) and transformers
5's (experts.gate_up_proj / down_proj, what a trainer's in-memory model holds). Names, shapes and dtypes are
checked before the first byte lands: an expert of the wrong shape is refused by name, nothing written (over
HTTP: tests/http/test_http_moe.py)."""
from __future__ import annotations

import pytest
import torch
from testkit.moe_models import NEW_TOKENS, PROMPTS, hf_greedy, hf_model, write_checkpoint
from safetensors.torch import load_file

from server import LLM, SamplingParams
from server.model.loader import WeightLoadError

pytestmark = pytest.mark.timeout(600)
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
FAMILY = "qwen3_moe"  # dense and sparse layers (mlp_only_layers); Mixtral's names are covered below


def tokens(llm) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe-weights")
    return {seed: write_checkpoint(FAMILY, root, seed) for seed in (0, 1)}


@pytest.fixture(scope="module")
def refs(folders):
    refs = {seed: hf_greedy(folder) for seed, folder in folders.items()}
    assert refs[0] != refs[1]
    return refs


@pytest.fixture(scope="module")
def llm(folders):
    engine = LLM(model=str(folders[0]), device="cpu", kv_cache_memory="32MiB", max_model_len=512)
    yield engine
    engine.close()


def stacked(named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpoint's per-expert tensors stacked under vLLM's names (experts.w13_weight, w2_weight)."""
    out = {n: t for n, t in named.items() if ".experts." not in n}
    layers = sorted({n.split(".experts.")[0] for n in named if ".experts." in n})
    for prefix in layers:
        E = len({n.split(".experts.")[1].split(".")[0] for n in named if n.startswith(prefix + ".experts.")})
        out[f"{prefix}.experts.w13_weight"] = torch.stack([
            torch.cat([named[f"{prefix}.experts.{e}.gate_proj.weight"], named[f"{prefix}.experts.{e}.up_proj.weight"]])
            for e in range(E)])
        out[f"{prefix}.experts.w2_weight"] = torch.stack([named[f"{prefix}.experts.{e}.down_proj.weight"]
                                                         for e in range(E)])
    return out


def test_sleep_levels_and_reloads_keep_the_outputs(llm, folders, refs):
    assert tokens(llm) == refs[0]
    llm.sleep(level=1)  # experts offloaded with every other weight
    llm.wake_up()
    assert tokens(llm) == refs[0]
    llm.sleep(level=2)  # discarded: a reload of the served checkpoint brings them back
    llm.wake_up()
    assert not llm.engine.sleep_state.weights_valid
    llm.update_weights()
    assert llm.engine.sleep_state.weights_valid and tokens(llm) == refs[0]
    # Level 2, then the weights pushed as tensors with the checkpoint's per-expert names.
    named = load_file(str(folders[0] / "model.safetensors"))
    llm.sleep(level=2)
    llm.wake_up()
    llm.update_weights(named_tensors=named.items())
    assert llm.engine.sleep_state.weights_valid and tokens(llm) == refs[0]


def test_updates_by_every_naming_serve_the_new_weights(llm, folders, refs):
    try:
        llm.update_weights(str(folders[1]))  # a folder, per-expert names
        assert tokens(llm) == refs[1]
        llm.update_weights(named_tensors=stacked(load_file(str(folders[0] / "model.safetensors"))).items())
        assert tokens(llm) == refs[0]
        # transformers 5's in-memory names (gate_up_proj / down_proj stacked), as a trainer's model sends them.
        trained = dict(hf_model(FAMILY, seed=1).named_parameters())
        assert any(n.endswith("experts.gate_up_proj") for n in trained)
        report = llm.update_weights(named_tensors=((n, t.detach()) for n, t in trained.items()))
        assert report["weights_valid"] and tokens(llm) == refs[1]
        # Level 2 and a complete update in stacked names: the weights are whole again.
        llm.sleep(level=2)
        llm.wake_up()
        llm.update_weights(named_tensors=stacked(load_file(str(folders[0] / "model.safetensors"))).items())
        assert llm.engine.sleep_state.weights_valid and tokens(llm) == refs[0]
    finally:
        llm.update_weights()


def test_an_expert_of_the_wrong_shape_is_refused_before_any_byte_lands(llm, folders, refs):
    named = load_file(str(folders[1] / "model.safetensors"))  # other weights: a partial write would show
    bad = "model.layers.2.mlp.experts.5.up_proj.weight"
    named[bad] = named[bad][:, :-1].contiguous()
    w13 = dict(llm.engine.model.named_parameters())["model.layers.0.mlp.experts.w13_weight"].clone()
    with pytest.raises(WeightLoadError, match=bad.replace(".", r"\.") + r": shape \[32, 63\]"):
        llm.update_weights(named_tensors=named.items())
    assert torch.equal(w13, dict(llm.engine.model.named_parameters())["model.layers.0.mlp.experts.w13_weight"])
    assert llm.engine.sleep_state.weights_valid and tokens(llm) == refs[0]
    packed = stacked(load_file(str(folders[1] / "model.safetensors")))
    name = "model.layers.0.mlp.experts.w13_weight"
    packed[name] = packed[name][:7]
    with pytest.raises(WeightLoadError, match=rf"{name.replace('.', chr(92) + '.')}: shape \[7, 64, 64\]"):
        llm.update_weights(named_tensors=packed.items())
    assert tokens(llm) == refs[0]


def test_mixtral_names_load_too(tmp_path):
    folder = write_checkpoint("mixtral", tmp_path)
    ref = hf_greedy(folder, PROMPTS[:1])
    with LLM(model=str(folder), device="cpu", kv_cache_memory="16MiB", max_model_len=256) as llm:
        named = load_file(str(folder / "model.safetensors"))
        assert any(".block_sparse_moe.experts.0.w1.weight" in n for n in named)
        llm.sleep(level=2)
        llm.wake_up()
        # transformers 5 holds Mixtral's experts under `mlp` (gate_up_proj / down_proj, mlp.gate): stacked names.
        live = dict(hf_model("mixtral").named_parameters())
        assert "model.layers.0.mlp.gate.weight" in live
        llm.update_weights(named_tensors=((n, t.detach()) for n, t in live.items()))
        assert llm.engine.sleep_state.weights_valid
        assert llm.generate(PROMPTS[0], GREEDY)[0].outputs[0].token_ids == ref[0]
