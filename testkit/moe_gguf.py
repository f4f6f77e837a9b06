"""A small Qwen3-MoE GGUF file written from a transformers model, as llama.cpp's converter lays one out (the
`qwen3moe` architecture: per-layer stacked experts ffn_{gate,up,down}_exps, the router ffn_gate_inp, no q/k
permutation), fp32, with the embedded model's tokenizer copied from its own GGUF. Nothing is downloaded; the
file is what a user's `--model x.gguf` hands the server's converter (server/model/default_model.py)."""
from __future__ import annotations

from pathlib import Path

import numpy as np


def write_qwen3_moe_gguf(model, path: Path) -> Path:
    """model: a transformers Qwen3MoeForCausalLM whose layers are all sparse (llama.cpp's qwen3moe has no
    dense layers) and whose vocabulary is the embedded model's."""
    import gguf

    from server.model.default_model import default_gguf_path

    cfg = model.config
    arch = "qwen3moe"
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"] if getattr(cfg, "rope_parameters", None)
                                    else cfg.rope_theta))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_expert_count(cfg.num_experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    _copy_tokenizer(gguf.GGUFReader(str(default_gguf_path())), writer)
    for name, array in _tensors(model):
        writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _tensors(model):
    """llama.cpp's names for the model's tensors, in its layout (numpy, the checkpoint's own shapes)."""
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    yield "token_embd.weight", sd["model.embed_tokens.weight"]
    yield "output_norm.weight", sd["model.norm.weight"]
    yield "output.weight", sd["lm_head.weight"]
    inter = model.config.moe_intermediate_size
    for i in range(model.config.num_hidden_layers):
        p = f"model.layers.{i}."
        for ours, theirs in (("attn_norm", "input_layernorm"), ("ffn_norm", "post_attention_layernorm"),
                             ("attn_q", "self_attn.q_proj"), ("attn_k", "self_attn.k_proj"),
                             ("attn_v", "self_attn.v_proj"), ("attn_output", "self_attn.o_proj"),
                             ("attn_q_norm", "self_attn.q_norm"), ("attn_k_norm", "self_attn.k_norm"),
                             ("ffn_gate_inp", "mlp.gate")):
            yield f"blk.{i}.{ours}.weight", sd[p + theirs + ".weight"]
        gate_up = sd[p + "mlp.experts.gate_up_proj"]  # [E, 2I, H]: gate rows, then up rows
        yield f"blk.{i}.ffn_gate_exps.weight", gate_up[:, :inter]
        yield f"blk.{i}.ffn_up_exps.weight", gate_up[:, inter:]
        yield f"blk.{i}.ffn_down_exps.weight", sd[p + "mlp.experts.down_proj"]  # [E, H, I]


def _copy_tokenizer(reader, writer) -> None:
    """Every tokenizer.* key of the embedded model's GGUF, with its type."""
    import gguf

    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(key, field.contents(), kind, sub_type=field.types[-1])
        else:
            writer.add_key_value(key, field.contents(), kind)
