"""Tests for the locally built random-weight default model."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from shared.engine import default_model as dm


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """The default model, built once into a private cache dir."""
    cache = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPLITSERVE_CACHE_DIR", str(cache))
        path = dm.default_model_dir()
    assert path == cache / "models" / "default-llama-v1"
    return path


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def model(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir).eval()


def test_cached_dir_is_reused_without_leftovers(model_dir, monkeypatch):
    monkeypatch.setenv("SPLITSERVE_CACHE_DIR", str(model_dir.parent.parent))
    before = (model_dir / "model.safetensors").stat().st_mtime_ns
    assert dm.default_model_dir() == model_dir
    assert (model_dir / "model.safetensors").stat().st_mtime_ns == before
    # Only the finished dir and the lock file are left in models/.
    names = sorted(p.name for p in model_dir.parent.iterdir())
    assert names == [".default-llama-v1.lock", "default-llama-v1"]


def test_config_is_small_gqa_llama(model_dir, tokenizer):
    config = AutoConfig.from_pretrained(model_dir)
    assert config.model_type == "llama"
    assert config.num_key_value_heads < config.num_attention_heads
    assert config.head_dim * config.num_attention_heads == config.hidden_size
    assert config.vocab_size == len(tokenizer)
    assert config.max_position_embeddings >= 4096
    assert getattr(config, "sliding_window", None) is None
    assert config.bos_token_id == tokenizer.bos_token_id
    assert config.eos_token_id == tokenizer.eos_token_id
    assert config.pad_token_id == tokenizer.pad_token_id


def test_model_loads_in_float32_with_eos_generation_config(model, tokenizer):
    assert next(model.parameters()).dtype == torch.float32
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
    assert model.generation_config.pad_token_id == tokenizer.pad_token_id


def test_special_tokens_and_no_automatic_bos(tokenizer):
    assert tokenizer.bos_token == "<|begin_of_text|>"
    assert tokenizer.eos_token == "<|end_of_text|>"
    assert tokenizer.pad_token == "<|pad|>"
    ids = tokenizer.encode("hello")
    assert tokenizer.bos_token_id not in ids
    # Special tokens written in text encode as one token each.
    im = tokenizer.encode("<|im_start|><|im_end|>")
    assert im == tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])


@pytest.mark.parametrize("text", ["héllo wörld ✓ 日本語 🙂", "  two  spaces\n\ttab", "The lighthouse keeper."])
def test_utf8_round_trip(tokenizer, text):
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_chat_template(tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi!"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi!<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_prompt = tokenizer.apply_chat_template(messages, tokenize=False)
    assert not no_prompt.endswith("assistant\n")


def test_greedy_generation_is_varied(model, tokenizer):
    for prompt in ["Once upon a time", "def fib(n):"]:
        inputs = tokenizer(prompt, return_tensors="pt")
        out = model.generate(**inputs, do_sample=False, max_new_tokens=48)
        new = out[0, inputs.input_ids.shape[1] :].tolist()
        assert len(new) == 48
        assert len(set(new)) >= 10, new


def test_build_is_deterministic(model_dir, tmp_path):
    a = dm.build_random_model(tmp_path / "a", seed=0, **dm.DEFAULT_MODEL_CONFIG)
    b = dm.build_random_model(tmp_path / "b", seed=0, **dm.DEFAULT_MODEL_CONFIG)
    for name in ["model.safetensors", "config.json", "tokenizer.json", "generation_config.json"]:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    # Same arguments as the cached default, so the same bytes.
    assert (a / "model.safetensors").read_bytes() == (model_dir / "model.safetensors").read_bytes()


def test_different_seed_gives_different_weights(tmp_path):
    a = dm.build_random_model(tmp_path / "a", seed=0, num_hidden_layers=1)
    b = dm.build_random_model(tmp_path / "b", seed=1, num_hidden_layers=1)
    assert (a / "model.safetensors").read_bytes() != (b / "model.safetensors").read_bytes()


def _load_and_run(path: Path):
    """Load a built model and check a short greedy generation works."""
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    inputs = tok("Hello there", return_tensors="pt")
    out = model.generate(**inputs, do_sample=False, max_new_tokens=8)
    assert out.shape[1] == inputs.input_ids.shape[1] + 8
    return model


def test_qwen2_with_attention_bias(tmp_path):
    model = _load_and_run(dm.build_random_model(tmp_path, model_type="qwen2", num_hidden_layers=2))
    assert model.config.model_type == "qwen2"
    assert not model.config.use_sliding_window
    bias = model.model.layers[0].self_attn.q_proj.bias
    assert bias is not None and bias.abs().sum() > 0


def test_qwen3_with_qk_norm(tmp_path):
    model = _load_and_run(dm.build_random_model(tmp_path, model_type="qwen3", num_hidden_layers=2))
    assert model.config.model_type == "qwen3"
    assert model.config.head_dim == 32
    assert hasattr(model.model.layers[0].self_attn, "q_norm")


def test_mistral_without_sliding_window(tmp_path):
    model = _load_and_run(dm.build_random_model(tmp_path, model_type="mistral", num_hidden_layers=2))
    assert model.config.model_type == "mistral"
    assert model.config.sliding_window is None


def test_llama_mqa_with_tied_embeddings(tmp_path):
    path = dm.build_random_model(tmp_path, num_key_value_heads=1, tie_word_embeddings=True, num_hidden_layers=2)
    model = _load_and_run(path)
    assert model.config.num_key_value_heads == 1
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_concurrent_first_use_builds_once(tmp_path, monkeypatch):
    monkeypatch.setenv("SPLITSERVE_CACHE_DIR", str(tmp_path))
    builds = []
    real_build = dm._build_atomically

    def counting_build(final, build):
        builds.append(final)
        real_build(final, build)

    monkeypatch.setattr(dm, "_build_atomically", counting_build)
    results = []
    threads = [threading.Thread(target=lambda: results.append(dm.default_model_dir())) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(builds) == 1
    assert results == [tmp_path / "models" / "default-llama-v1"] * 2
