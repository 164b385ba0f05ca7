"""--gpu-memory-utilization: the KV cache takes what a share of the GPU's memory leaves after the weights and a
full step, measured at start-up on a small cache that is then replaced. On the CPU the measure is a stand-in
(`MeasuredMemory`); CUDA's own (`CudaMemory`) needs a GPU."""

import os

import pytest
import torch

from reference import safe_prompts
from shared.engine.config import EngineConfig
from shared.engine.engine import LLMEngine
from shared.engine.kv_cache import PagedKVCache
from shared.engine.memory_budget import kv_cache_bytes_within, memory_of
from shared.engine.sampling_params import SamplingParams

MiB = 1 << 20


class MeasuredMemory:
    """A device of `total` bytes on which the weights and a full step take `used` bytes beside the cache the
    engine measures with (whose size it learns when the peak is read)."""

    def __init__(self, total: int, used: int, per_block: int):
        self.total, self.used, self.per_block = total, used, per_block
        self.resets, self.reads = 0, 0
        self.profile_blocks = None

    def total_bytes(self) -> int:
        return self.total

    def reset_peak(self) -> None:
        self.resets += 1

    def peak_bytes(self) -> int:
        self.reads += 1
        return self.used + self.profile_blocks * self.per_block


def bytes_per_block(model_dir: str, block_size: int) -> int:
    probe = LLMEngine(EngineConfig(model=model_dir, dtype="float32", num_kv_blocks=1), load_tokenizer=False)
    cache = probe.executor.runners[0].kv_cache
    return PagedKVCache.bytes_per_block(probe.local_layers_end, block_size, cache.num_kv_heads, cache.head_dim,
                                        torch.float32)


def test_the_kv_cache_takes_what_the_share_leaves():
    assert kv_cache_bytes_within(1000 * MiB, 0.9, 100 * MiB) == 800 * MiB
    with pytest.raises(ValueError, match="nothing is left for the KV cache"):
        kv_cache_bytes_within(1000 * MiB, 0.1, 100 * MiB)
    with pytest.raises(ValueError, match=r"in \(0, 1\]"):
        kv_cache_bytes_within(1000 * MiB, 1.5, 0)
    with pytest.raises(ValueError, match="runs on cpu"):
        memory_of(torch.device("cpu"))
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineConfig(model="m", gpu_memory_utilization=0)


def test_an_engine_sized_by_memory_measures_a_full_step_then_serves_exactly(default_model):
    config = EngineConfig(model=default_model, dtype="float32", max_num_batched_tokens=256, max_num_seqs=8,
                          gpu_memory_utilization=0.5)
    per_block = bytes_per_block(default_model, config.block_size)
    memory = MeasuredMemory(total=64 * MiB, used=8 * MiB, per_block=per_block)
    # The engine builds its measuring cache before it reads the peak: that cache holds the step's 256 tokens.
    memory.profile_blocks = 256 // config.block_size
    engine = LLMEngine(config, load_tokenizer=False, device_memory=memory)
    assert memory.resets == 1 and memory.reads == 1
    expected_blocks = (32 * MiB - 8 * MiB) // per_block
    assert engine.block_manager.num_blocks == expected_blocks
    assert engine.executor.runners[0].kv_cache.tensor.shape[2] == expected_blocks  # (layers, k/v, blocks, ...)
    assert engine.memory_sizing["kv_cache_bytes"] == expected_blocks * per_block
    # The cache it serves from is the resized one: greedy output is transformers'.
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for prompt, reference in safe_prompts(default_model, engine.vocab_size, [5, 40, 300], greedy.max_tokens):
        assert engine.generate([prompt], greedy)[0].token_ids == reference


def test_a_share_too_small_for_the_weights_is_refused_by_name(default_model):
    config = EngineConfig(model=default_model, dtype="float32", max_num_batched_tokens=64, max_num_seqs=4,
                          gpu_memory_utilization=0.1)
    memory = MeasuredMemory(total=64 * MiB, used=8 * MiB, per_block=bytes_per_block(default_model, 16))
    memory.profile_blocks = 64 // 16
    with pytest.raises(ValueError, match="raise the share, or lower --max-num-batched-tokens"):
        LLMEngine(config, load_tokenizer=False, device_memory=memory)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA's memory measure needs a GPU")
def test_on_a_gpu_the_cache_fits_the_share(default_model):
    device = os.environ.get("SPLITSERVE_TEST_DEVICE", "cuda")
    engine = LLMEngine(EngineConfig(model=default_model, dtype="float32", device=device,
                                    gpu_memory_utilization=0.3), load_tokenizer=False)
    total = torch.cuda.mem_get_info(torch.device(device))[1]
    assert 0 < engine.memory_sizing["kv_cache_bytes"] <= 0.3 * total - engine.memory_sizing["used_bytes"]
