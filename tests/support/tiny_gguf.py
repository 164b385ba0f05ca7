"""Write a small Llama model directory as a GGUF file, the way llama.cpp's converter lays one out.

Tests use it to check the GGUF path of `--model` without downloading a real
model: `write_gguf(build_random_model(...), path)` gives a float32 GGUF whose
conversion back must reproduce the original weights exactly.
"""

import json
from pathlib import Path

import numpy as np

# Hugging Face Llama parameter names -> llama.cpp tensor names (per layer: "blk.N.").
LAYER_TENSORS = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
TOP_TENSORS = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}

CONTROL, NORMAL = 3, 1  # llama.cpp token types


def gguf_tensor_name(hf_name: str) -> str:
    stem = hf_name.removesuffix(".weight")
    if stem in TOP_TENSORS:
        return TOP_TENSORS[stem] + ".weight"
    _, _, layer, rest = stem.split(".", 3)  # model.layers.N.rest
    return f"blk.{layer}.{LAYER_TENSORS[rest]}.weight"


def permute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's q/k row order: each head's two rotary halves interleaved (transformers undoes it)."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _tokenizer_fields(model_dir: Path) -> dict:
    spec = json.loads((model_dir / "tokenizer.json").read_text())
    by_id = {index: token for token, index in spec["model"]["vocab"].items()}
    by_id.update({added["id"]: added["content"] for added in spec["added_tokens"]})
    special = {added["content"] for added in spec["added_tokens"] if added["special"]}
    tokens = [by_id[index] for index in range(len(by_id))]
    merges = [" ".join(pair) if isinstance(pair, list) else pair for pair in spec["model"]["merges"]]
    return {"tokens": tokens, "types": [CONTROL if t in special else NORMAL for t in tokens], "merges": merges}


def write_gguf(model_dir: Path, out: Path) -> Path:
    """Write the Llama in `model_dir` (config, safetensors weights, byte-level BPE tokenizer) to `out` as F32 GGUF."""
    import gguf
    from safetensors.numpy import load_file

    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_name("tiny test llama")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(config["head_dim"])
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)

    fields = _tokenizer_fields(model_dir)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(fields["tokens"])
    writer.add_token_types(fields["types"])
    writer.add_token_merges(fields["merges"])
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_pad_token_id(config["pad_token_id"])
    writer.add_add_bos_token(False)
    template = model_dir / "chat_template.jinja"
    writer.add_chat_template(template.read_text() if template.exists() else tokenizer_config["chat_template"])

    for name, weight in sorted(load_file(str(model_dir / "model.safetensors")).items()):
        if name.endswith("q_proj.weight"):
            weight = permute_rows(weight, heads)
        elif name.endswith("k_proj.weight"):
            weight = permute_rows(weight, kv_heads)
        writer.add_tensor(gguf_tensor_name(name), np.ascontiguousarray(weight, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
