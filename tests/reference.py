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


def reference_greedy(model_dir: str, prompt: list[int], max_new_tokens: int, ignore_eos: bool = True):
    """(generated ids, smallest top-2 logit margin along the trajectory)."""
    tokens, margin = _greedy(model_dir, tuple(prompt), max_new_tokens, ignore_eos)
    return list(tokens), margin


# Many tests ask for the same prompts' references (the same seeds): each is generated once a session. A model
# directory's weights never change under it (`reference_model` keeps them by directory already).
@functools.lru_cache(maxsize=512)
@torch.inference_mode()
def _greedy(model_dir: str, prompt: tuple[int, ...], max_new_tokens: int, ignore_eos: bool):
    model = reference_model(model_dir)
    kwargs = {"min_new_tokens": max_new_tokens} if ignore_eos else {}
    out = model.generate(
        torch.tensor([list(prompt)]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=model.generation_config.pad_token_id or 0,
        **kwargs,
    )
    margins = [float(torch.topk(step[0].float(), 2).values.diff().abs()) for step in out.logits]
    return tuple(out.sequences[0, len(prompt):].tolist()), min(margins)


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


# A seeded draw's winner must beat the runner-up by this share of its score (and, under top-p, lie this far
# inside the threshold), so float noise between the engine's and transformers' logits cannot change the token.
MIN_DRAW_MARGIN = 1e-3


@torch.inference_mode()
def reference_sampled(model_dir: str, prompt: list[int], max_new_tokens: int, *, temperature: float, seed: int,
                      top_p: float = 1.0):
    """(generated ids, smallest margin of a draw) of seeded sampling as the sampler documents it, on
    transformers' logits: softmax(logits / temperature), top-p on the sorted distribution, then the
    exponential race argmax(p / E) with E = -log(1 - U), U uniform from a generator seeded `row_seed(seed, step)`."""
    from shared.engine.sampler import row_seed

    model = reference_model(model_dir)
    tokens, margins, past = [], [], None
    step_input = torch.tensor([prompt])
    for step in range(max_new_tokens):
        out = model(step_input, past_key_values=past, use_cache=True)
        past = out.past_key_values
        probs = torch.softmax(out.logits[0, -1].float() / temperature, dim=-1)
        sorted_probs, order = probs.sort(descending=True, stable=True)
        mass_before = sorted_probs.cumsum(0) - sorted_probs
        if top_p < 1.0:  # keep what might be kept; the winner must be kept for sure
            probs[order[1:][mass_before[1:] >= top_p + MIN_DRAW_MARGIN]] = 0.0
        uniform = torch.empty_like(probs).uniform_(generator=torch.Generator().manual_seed(row_seed(seed, step)))
        noise = -torch.log1p(-uniform)  # Exp(1), by the inverse CDF
        race = probs / noise
        best, second = race.topk(2).values.tolist()
        tokens.append(int(race.argmax()))
        rank = int((order == tokens[-1]).nonzero())
        near_top_p = top_p < 1.0 and rank > 0 and mass_before[rank] >= top_p - MIN_DRAW_MARGIN
        margins.append(0.0 if near_top_p else (best - second) / best)
        step_input = torch.tensor([[tokens[-1]]])
    return tokens, min(margins)


def safe_seed(model_dir: str, prompt: list[int], max_new_tokens: int, *, temperature: float, top_p: float = 1.0,
              first: int = 0) -> tuple[int, list[int]]:
    """The first seed from `first` whose sampled trajectory has no near-tie, and that trajectory."""
    for seed in range(first, first + 20):
        tokens, margin = reference_sampled(model_dir, prompt, max_new_tokens, temperature=temperature, seed=seed,
                                           top_p=top_p)
        if margin > MIN_DRAW_MARGIN:
            return seed, tokens
    raise AssertionError("no seed without near-ties")


@torch.inference_mode()
def reference_logprobs(model_dir: str, prompt: list[int], continuation: list[int]) -> torch.Tensor:
    """(len(continuation), vocab): log_softmax of transformers' logits where each continuation token was chosen."""
    logits = reference_model(model_dir)(torch.tensor([prompt + continuation])).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1 : len(prompt) + len(continuation) - 1], dim=-1)
