"""Requests for the kv-store and KV-routing tests: completions checked against transformers, and a conversation."""

import httpx
import torch

from reference import MIN_TOP2_MARGIN, reference_greedy, safe_prompts
from support.waiting import wait_until  # noqa: F401 (the kv tests import it from here)

MODEL = "splitserve-default-llama"


def complete(base_url: str, prompt, max_tokens: int = 16) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    response = httpx.post(f"{base_url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def conversation(model_dir: str):
    """Three requests and their transformers outputs: a first turn, the next turn (the first turn, its answer and
    a new message) and a request sharing only the first turn's first 320 tokens."""
    (first, first_out), = safe_prompts(model_dir, 2048, [392], 16, seed=11)
    generator = torch.Generator().manual_seed(12)
    requests = [(first, first_out)]
    for prompt in (first + first_out + torch.randint(0, 2048, (40,), generator=generator).tolist(),
                   first[:320] + torch.randint(0, 2048, (64,), generator=generator).tolist()):
        tokens, margin = reference_greedy(model_dir, prompt, 16)
        assert margin > MIN_TOP2_MARGIN, "pick another seed: this prompt's greedy path has a near-tie"
        requests.append((prompt, tokens))
    return requests


def run_conversation(deployment, requests, tokenizer, before_each=lambda i: None) -> list[int]:
    """Send the requests in turn; each output must be transformers' token for token (and its text the
    tokens' text). Returns each request's cached tokens."""
    cached = []
    for i, (prompt, expected) in enumerate(requests):
        before_each(i)
        body = complete(deployment.base_url, prompt)
        assert deployment.token_ids(body) == expected, f"request {i}"
        assert body["choices"][0]["text"] == tokenizer.decode(expected, skip_special_tokens=True), f"request {i}"
        cached.append(body["usage"]["prompt_tokens_details"]["cached_tokens"])
    return cached
