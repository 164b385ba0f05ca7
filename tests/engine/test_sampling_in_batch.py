"""Seeded sampling gives the same tokens alone and inside a busy batch."""

import torch

from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.engine.sampling_params import SamplingParams


def test_seeded_request_is_batch_invariant(default_model):
    engine = LLMEngine(EngineConfig(model=default_model, dtype="float32", num_kv_blocks=256, max_num_batched_tokens=64))
    prompt = engine.tokenizer("The river carried small boats past the old mill").input_ids
    seeded = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=42, max_tokens=32, ignore_eos=True)
    alone = engine.generate([prompt], seeded)[0].token_ids

    generator = torch.Generator().manual_seed(0)
    noise = [torch.randint(0, engine.vocab_size, (int(n),), generator=generator).tolist() for n in (5, 90, 17, 300, 2)]
    others = [SamplingParams(temperature=t, max_tokens=m, ignore_eos=True, presence_penalty=0.5)
              for t, m in [(0.7, 40), (0.0, 10), (1.3, 25), (1.0, 50), (0.5, 5)]]
    busy = engine.generate(noise[:3] + [prompt] + noise[3:], others[:3] + [seeded] + others[3:])
    assert busy[3].token_ids == alone

    different_seed = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=43, max_tokens=32, ignore_eos=True)
    assert engine.generate([prompt], different_seed)[0].token_ids != alone
    assert len(set(alone)) > 8  # it really sampled varied tokens
