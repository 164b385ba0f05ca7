"""A grammar's token mask in the sampler: what it allows is all a row may draw; the rest of the batch, and the
logprobs, are as without it."""

import torch

from shared.engine.sampler import SamplingRow, sample
from shared.engine.sampling_params import SamplingParams
from shared.engine.structured_output import unpack_mask


def packed(allowed: list[int], vocab: int) -> torch.Tensor:
    words = torch.zeros((vocab + 31) // 32, dtype=torch.int64)
    for token in allowed:
        words[token // 32] |= 1 << (token % 32)
    return ((words + 2**31) % 2**32 - 2**31).to(torch.int32)  # the bits as int32 words, as llguidance fills them


def test_unpack_reads_bit_i_of_word_w_as_token_32w_plus_i_and_fits_the_vocabulary():
    mask = packed([0, 31, 32, 63, 69], 70)
    assert unpack_mask(mask.unsqueeze(0), 70)[0].nonzero().flatten().tolist() == [0, 31, 32, 63, 69]
    assert unpack_mask(mask.unsqueeze(0), 100)[0].nonzero().flatten().tolist() == [0, 31, 32, 63, 69]  # padded: no
    assert unpack_mask(mask.unsqueeze(0), 40)[0].nonzero().flatten().tolist() == [0, 31, 32]


def test_a_constrained_row_draws_only_what_its_grammar_allows_and_its_neighbours_are_untouched():
    vocab = 64
    torch.manual_seed(0)
    logits = torch.randn(3, vocab)
    allowed = [5, 17, 40]
    greedy, sampled = SamplingParams(temperature=0.0, logprobs=2), SamplingParams(temperature=1.0, seed=3)
    rows = [SamplingRow(greedy, 1, [1], [], allowed=packed(allowed, vocab)),
            SamplingRow(sampled, 2, [1], [], allowed=packed(allowed, vocab)),
            SamplingRow(greedy, 3, [1], [])]
    out = sample(logits, rows)
    assert out.token_ids[0] == max(allowed, key=lambda t: logits[0, t].item())
    assert out.token_ids[1] in allowed
    assert out.token_ids[2] == int(logits[2].argmax())
    raw = torch.log_softmax(logits[0], dim=-1)  # logprobs are the model's own, not the masked distribution's
    assert abs(out.logprobs[0].logprob - raw[out.token_ids[0]].item()) < 1e-6
    for seed in range(20):
        draw = sample(logits[1:2], [SamplingRow(sampled, seed, [1], [], allowed=packed(allowed, vocab))])
        assert draw.token_ids[0] in allowed


def test_suppression_gives_way_where_it_would_leave_the_grammar_nothing():
    vocab = 40
    logits = torch.zeros(2, vocab)
    params = SamplingParams(temperature=0.0)
    # EOS (token 2) suppressed by min_tokens: where the grammar allows more, it is not drawn; where EOS is all the
    # grammar allows, the grammar wins.
    rows = [SamplingRow(params, 1, [1], [], suppressed=(2,), allowed=packed([2, 9], vocab)),
            SamplingRow(params, 1, [1], [], suppressed=(2,), allowed=packed([2], vocab))]
    logits[:, 2] = 5.0
    assert sample(logits, rows).token_ids == [9, 2]


def test_a_request_arriving_with_its_grammar_complete_ends_at_the_next_token_without_error(default_model):
    """A prefill worker's first token may complete the grammar (a one-token choice): the decode worker, which
    judges that token without it, goes on; the grammar then allows only EOS, and that EOS ends the request."""
    import json

    from shared.engine.config import EngineConfig
    from shared.engine.continuation import Continuation
    from shared.engine.engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=default_model, dtype="float32", device="cpu", num_kv_blocks=32))
    token = next(t for t in range(200, 2000) if engine.tokenizer.decode([t]).strip().isalpha())
    params = SamplingParams(max_tokens=5, temperature=0.0, structured_kind="choice",
                            structured_spec=json.dumps([engine.tokenizer.decode([token])]))
    engine.add_request("r", [5, 6, 7], params, Continuation(output_token_ids=[token]))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert [(o.finish_reason, o.error) for o in outputs] == [("stop", None)]
    assert outputs[0].new_token_ids[0] in engine.eos_token_ids
