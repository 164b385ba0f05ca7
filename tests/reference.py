"""transformers' own generate() as the reference every topology must match."""

import functools

import torch
from transformers import AutoModelForCausalLM

# Random models sometimes put the top two logits within float noise of each
# other; a different (correct) summation order may then flip the argmax. The
# prompts used for exactness checks keep every step's top-2 margin above this.
MIN_TOP2_MARGIN = 1e-3


@functools.lru_cache(maxsize=8)
def reference_model(model_dir: str):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@torch.inference_mode()
def reference_greedy(model_dir: str, prompt: list[int], max_new_tokens: int, ignore_eos: bool = True):
    """(generated ids, smallest top-2 logit margin along the trajectory)."""
    model = reference_model(model_dir)
    kwargs = {"min_new_tokens": max_new_tokens} if ignore_eos else {}
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=model.generation_config.pad_token_id or 0,
        **kwargs,
    )
    margins = [float(torch.topk(step[0].float(), 2).values.diff().abs()) for step in out.logits]
    return out.sequences[0, len(prompt):].tolist(), min(margins)


def safe_prompts(model_dir: str, vocab_size: int, lengths: list[int], max_new_tokens: int, seed: int = 0):
    """For each length, a random prompt whose greedy trajectory has no near-ties.

    Returns [(prompt, reference_tokens)]. Tries a few seeds per length and fails
    loudly if none is safe, rather than comparing on a coin flip.
    """
    chosen = []
    for length in lengths:
        for attempt in range(20):
            generator = torch.Generator().manual_seed(seed * 1000 + length * 31 + attempt)
            prompt = torch.randint(0, vocab_size, (length,), generator=generator).tolist()
            tokens, margin = reference_greedy(model_dir, prompt, max_new_tokens)
            if margin > MIN_TOP2_MARGIN:
                chosen.append((prompt, tokens))
                break
        else:
            raise AssertionError(f"no prompt of length {length} without near-ties")
    return chosen
