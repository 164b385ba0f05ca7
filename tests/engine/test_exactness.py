"""Greedy float32 output is token-identical to transformers' generate(); seeded sampling to the same draws on
transformers' logits."""

import os

import pytest
import torch

from reference import reference_greedy, reference_sampled, safe_prompts, safe_seed
from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.engine.model_loader import LayerRange, read_config
from shared.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
LENGTHS = [1, 7, 16, 33, 150, 1000]


def engine_for(model_dir: str, **overrides) -> LLMEngine:
    # SPLITSERVE_TEST_DEVICE=cuda runs the engine on a GPU against the CPU reference.
    device = os.environ.get("SPLITSERVE_TEST_DEVICE", "cpu")
    config = dict(model=model_dir, dtype="float32", device=device, num_kv_blocks=512, load_tokenizer=False)
    load_tokenizer = config.pop("load_tokenizer")
    config.update(overrides)
    return LLMEngine(EngineConfig(**config), load_tokenizer=load_tokenizer)


@pytest.fixture(scope="module")
def cases(default_model, model_zoo):
    """{model name: (model dir, [(prompt, reference tokens)])}, references computed once."""
    models = {"default": default_model, **model_zoo}
    out = {}
    for name, path in models.items():
        out[name] = (path, safe_prompts(path, read_config(path).vocab_size, LENGTHS, GREEDY.max_tokens))
    return out


@pytest.mark.parametrize("name", ["default", "qwen2-bias", "qwen3-qknorm", "llama-1kv", "mistral"])
def test_alone_and_batched_with_chunked_prefill(cases, name):
    path, prompts = cases[name]
    # Alone: one request at a time, whole prompts in one step.
    engine = engine_for(path, max_num_batched_tokens=4096, enable_prefix_caching=False)
    for prompt, expected in prompts:
        assert engine.generate([prompt], GREEDY)[0].token_ids == expected
    # Batched: all lengths at once, prompts chunked to a 96-token budget mixed with decodes.
    engine = engine_for(path, max_num_batched_tokens=96, enable_prefix_caching=False)
    results = engine.generate([p for p, _ in prompts], GREEDY)
    assert [r.token_ids for r in results] == [e for _, e in prompts]


@pytest.mark.parametrize("name", ["default", "qwen3-qknorm"])
def test_seeded_sampling_draws_what_temperature_top_p_and_seed_say(cases, name):
    path, prompts = cases[name]
    prompt, greedy = prompts[3]
    n = 12
    hot_seed, hot = safe_seed(path, prompt, n, temperature=1.5)
    other_seed, other = safe_seed(path, prompt, n, temperature=1.5, first=hot_seed + 1)
    nucleus_seed, nucleus = safe_seed(path, prompt, n, temperature=0.7, top_p=0.8)
    cool, _ = reference_sampled(path, prompt, n, temperature=0.7, seed=nucleus_seed)
    # The references tell every setting apart, so a sampler that ignored one of them would fail below.
    assert len({tuple(greedy[:n]), tuple(hot), tuple(other), tuple(nucleus), tuple(cool)}) == 5
    engine = engine_for(path, max_num_batched_tokens=64)  # chunked prompts in one batch: draws are per row
    params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=1.5, seed=hot_seed),
              SamplingParams(max_tokens=n, ignore_eos=True, temperature=1.5, seed=other_seed),
              SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.7, top_p=0.8, seed=nucleus_seed),
              SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0, seed=hot_seed)]
    results = engine.generate([prompt] * 4, params)
    assert [r.token_ids for r in results] == [hot, other, nucleus, greedy[:n]]


def test_many_mixed_requests_with_prefix_hits_and_preemption(cases):
    path, prompts = cases["default"]
    # 3 copies of every prompt: the copies hit the prefix cache; 24 blocks of 16
    # tokens cannot hold them all, so the scheduler must preempt and recompute.
    engine = engine_for(path, num_kv_blocks=72, max_num_batched_tokens=128)
    requests = [p for p, _ in prompts] * 3
    results = engine.generate(requests, GREEDY)
    assert [r.token_ids for r in results] == [e for _, e in prompts] * 3
    assert any(r.num_cached_tokens > 0 for r in results)
    assert engine.num_preemptions > 0
    assert engine.block_manager.num_used_blocks == 0


def test_prefix_cache_hit_computes_only_the_suffix(cases):
    path, prompts = cases["qwen3-qknorm"]
    long_prompt, expected = prompts[-2]  # 150 tokens
    engine = engine_for(path)
    first = engine.generate([long_prompt], GREEDY)[0]
    second = engine.generate([long_prompt], GREEDY)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == (len(long_prompt) - 1) // 16 * 16
    assert first.token_ids == second.token_ids == expected
    # A different continuation of the same prefix shares only the common blocks.
    branched = long_prompt[:100] + [3, 1, 4]
    result = engine.generate([branched], GREEDY)[0]
    assert result.num_cached_tokens == 96
    assert result.token_ids == reference_greedy(path, branched, GREEDY.max_tokens)[0]


@pytest.mark.parametrize("bounds", [(0, 2, 4), (0, 1, 3, 4), (0, 1, 2, 3, 4)])
def test_chained_layer_ranges_match_whole_model(cases, bounds):
    path, prompts = cases["default"]  # 4 layers
    ranges = [LayerRange(a, b) for a, b in zip(bounds, bounds[1:])]
    engine = engine_for(path, layer_ranges=ranges, max_num_batched_tokens=256)
    results = engine.generate([p for p, _ in prompts], GREEDY)
    assert [r.token_ids for r in results] == [e for _, e in prompts]


@pytest.mark.parametrize("name", ["default", "llama-1kv"])  # untied and tied embeddings
def test_layer_range_holds_only_its_weights(default_model, model_zoo, name):
    from shared.engine.model_loader import load_model

    path = default_model if name == "default" else model_zoo[name]
    whole = load_model(path, "float32")
    num_layers = whole.num_total_layers
    sizes = {n: p.numel() * p.element_size() for n, p in whole.model.named_parameters(remove_duplicate=False)}

    def expected(start: int, end: int) -> int:
        total = 0
        for n, size in sizes.items():
            if ".layers." in n:
                index = int(n.split(".layers.")[1].split(".")[0])
                total += size if start <= index < end else 0
            elif "embed_tokens" in n:
                total += size if start == 0 else 0
            else:  # final norm and LM head
                total += size if end == num_layers else 0
        return total

    bounds = [0, 1, num_layers - 1, num_layers]
    for start, end in zip(bounds, bounds[1:]):
        part = load_model(path, "float32", layer_range=LayerRange(start, end))
        assert part.parameter_bytes == expected(start, end)
        assert part.parameter_bytes < whole.parameter_bytes


@pytest.mark.parametrize("packed_min_rows,native_max_rows", [("1", "0"), ("4", "0"), ("4", "3")])
def test_every_float32_linear_kernel_is_exact(cases, monkeypatch, packed_min_rows, native_max_rows):
    """Whichever kernels start-up timing picks on a CPU (packed from 1 row; plain below 4 rows; the native
    kernel for 1-3 rows, which a batch-1 decode and the batch's last sequences run)."""
    from shared.engine.packed_linear import NATIVE_MAX_ROWS_ENV, PACKED_MIN_ROWS_ENV, LinearLayouts
    from support.kernels import require_native

    if native_max_rows != "0":
        require_native("small_linear")
    monkeypatch.setenv(PACKED_MIN_ROWS_ENV, packed_min_rows)
    monkeypatch.setenv(NATIVE_MAX_ROWS_ENV, native_max_rows)
    path, prompts = cases["default"]
    engine = engine_for(path, enable_prefix_caching=False)
    assert engine.executor.runners[0].linear_layouts in (None, LinearLayouts(int(native_max_rows),
                                                                             int(packed_min_rows)))
    for prompt, expected in prompts:
        assert engine.generate([prompt], GREEDY)[0].token_ids == expected
    assert [r.token_ids for r in engine.generate([p for p, _ in prompts], GREEDY)] == [e for _, e in prompts]


@pytest.mark.parametrize("fresh_attention", ["native", "sdpa"])
def test_both_fresh_prompt_attentions_are_exact(cases, monkeypatch, fresh_attention):
    """Whichever kernel start-up timing picks for prompt chunks with no cached prefix, cached prefixes included."""
    from shared.engine.prefill_attention_choice import FRESH_PREFILL_ENV

    monkeypatch.setenv(FRESH_PREFILL_ENV, fresh_attention)
    path, prompts = cases["default"]
    engine = engine_for(path, enable_prefix_caching=True)
    runner = engine.executor.runners[0]
    assert runner.sdpa_fresh_prefills is (fresh_attention == "sdpa" or runner.native_prefill is None)
    first, expected_first = prompts[0]
    assert engine.generate([first], GREEDY)[0].token_ids == expected_first
    # One step now holds the first prompt continuing its cached prefix (the native kernel) beside fresh ones.
    assert [r.token_ids for r in engine.generate([p for p, _ in prompts], GREEDY)] == [e for _, e in prompts]


def test_prompts_paced_beside_decodes_are_exact_and_never_stall_the_decodes(cases):
    """Stall-free chunking (a tiny target: every chunk at the pacer's floor) changes what each step holds, not
    what any request gets; a request that is decoding gets a token in every step."""
    path, prompts = cases["default"]
    engine = engine_for(path, enable_prefix_caching=False, prefill_beside_decodes_ms=0.001)
    (first, first_expected), rest = prompts[0], prompts[1:]
    got = {"first": []}
    engine.add_request("first", first, GREEDY)
    for out in engine.step():  # its whole prompt (nothing decodes yet), then its first token
        got["first"].extend(out.new_token_ids)
    for i, (prompt, _) in enumerate(rest):
        engine.add_request(f"r{i}", prompt, GREEDY)
        got[f"r{i}"] = []
    paced_steps = 0
    while engine.has_unfinished_requests():
        decoding = any(s.num_computed_tokens >= s.num_prompt_tokens for s in engine.scheduler.running)
        computed, cap = engine.num_prompt_tokens_computed, engine.prefill_pacer.cap(torch.get_num_threads())
        outputs = engine.step()
        if decoding:  # beside decodes, at most the pacer's cap of prompt tokens
            assert engine.num_prompt_tokens_computed - computed <= cap
            paced_steps += cap == 16 and engine.num_prompt_tokens_computed > computed  # learnt: the floor
        if len(got["first"]) < len(first_expected):
            assert "first" in {o.request_id for o in outputs}  # never left waiting for a prompt chunk
        for out in outputs:
            got[out.request_id].extend(out.new_token_ids)
    assert paced_steps >= 5
    assert got["first"] == first_expected
    assert [got[f"r{i}"] for i in range(len(rest))] == [expected for _, expected in rest]
    assert engine.prefill_pacer.costs[torch.get_num_threads()].token_s is not None
