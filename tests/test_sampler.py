"""The sampler: penalties, filters, greedy, seeded draws and logprobs."""

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shared.engine.sampler import (
    SamplerOutput,
    SamplingRow,
    _apply_penalties,
    row_seed,
    sample,
)
from shared.engine.sampling_params import SamplingParams

REPO = Path(__file__).resolve().parents[1]


def row(seed=0, prompt=(), output=(), **params) -> SamplingRow:
    return SamplingRow(
        params=SamplingParams(**params), seed=seed, prompt_token_ids=list(prompt), output_token_ids=list(output)
    )


def rand_logits(batch, vocab, seed, dtype=torch.float32, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, vocab, generator=g) * scale).to(dtype)


def counts_of(logits_row, rows):
    """How often each token comes out when the same logits row is sampled by every row of rows."""
    out = sample(logits_row.expand(len(rows), -1), rows)
    return torch.bincount(torch.tensor(out.token_ids), minlength=logits_row.shape[-1])


def chi_square(observed, probs):
    expected = probs * observed.sum()
    keep = expected > 0
    return float(((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum())


# --- greedy -----------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_greedy_equals_argmax(dtype):
    logits = rand_logits(16, 300, 1, dtype)
    logits[3, 10] = logits[3, 200] = logits[3].max() + 1  # a tie: argmax takes the first
    logits[5] = 0.0  # all tied
    expected = torch.argmax(logits, dim=-1).tolist()
    assert expected[3] == 10 and expected[5] == 0
    rows = [row(seed=i, temperature=0.0) for i in range(16)]
    assert sample(logits, rows).token_ids == expected  # fast path
    # Mixed batch (slow path): the greedy rows still match argmax exactly.
    rows[0] = row(seed=0, temperature=1.0, top_p=0.9)
    rows[1] = row(seed=1, temperature=0.0, logprobs=2)
    rows[2] = row(seed=2, temperature=0.0, repetition_penalty=1.3, prompt=[7])
    out = sample(logits, rows)
    assert out.token_ids[1] == expected[1]
    assert out.token_ids[3:] == expected[3:]


def test_top_k_one_and_tiny_top_p_and_min_p_one_are_greedy():
    logits = rand_logits(12, 500, 2)
    expected = torch.argmax(logits, dim=-1).tolist()
    for step in range(5):
        for params in (dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0), dict(top_k=1, top_p=0.5, min_p=0.3)):
            rows = [row(seed=100 * i + step, output=[0] * step, temperature=1.0, **params) for i in range(12)]
            assert sample(logits, rows).token_ids == expected, params
    # Even at a high temperature.
    rows = [row(seed=i, temperature=5.0, top_k=1) for i in range(12)]
    assert sample(logits, rows).token_ids == expected


def test_empty_batch_and_shape_mismatch():
    assert sample(torch.zeros(0, 10), []) == SamplerOutput(token_ids=[], logprobs=[])
    with pytest.raises(ValueError):
        sample(torch.zeros(2, 10), [row()])
    with pytest.raises(ValueError):
        sample(torch.zeros(10), [row()])


# --- filters ----------------------------------------------------------------

PROBS = torch.tensor([0.05, 0.30, 0.15, 0.50])  # sorted: 3 (.5), 1 (.3), 2 (.15), 0 (.05)
LOGITS = PROBS.log()


def support(n=600, **params):
    rows = [row(seed=s, temperature=1.0, **params) for s in range(n)]
    return set(torch.nonzero(counts_of(LOGITS, rows)).flatten().tolist())


def test_top_k():
    assert support(top_k=2) == {3, 1}
    assert support(top_k=3) == {3, 1, 2}
    assert support(top_k=0) == support(top_k=4) == support(top_k=99) == {0, 1, 2, 3}


def test_top_p():
    assert support(top_p=0.5) == {3}  # 0.5 already reached by the top token
    assert support(top_p=0.79) == {3, 1}
    assert support(top_p=0.81) == {3, 1, 2}
    assert support(top_p=0.96) == {0, 1, 2, 3}
    # top-p applies to the top-k-renormalised distribution: within {3, 1},
    # 3 has 0.625 of the mass, so p = 0.6 keeps it alone and 0.7 keeps both.
    assert support(top_k=2, top_p=0.6) == {3}
    assert support(top_k=2, top_p=0.7) == {3, 1}


def test_min_p():
    assert support(min_p=0.2) == {3, 1, 2}  # floor 0.1 drops token 0 (0.05)
    assert support(min_p=0.5) == {3, 1}  # floor 0.25 drops 2 too
    assert support(min_p=0.7) == {3}
    assert support(min_p=0.09) == {0, 1, 2, 3}


def test_filtered_distribution_is_renormalised():
    rows = [row(seed=s, temperature=1.0, top_k=3) for s in range(4000)]
    observed = counts_of(LOGITS, rows)
    kept = torch.tensor([0.0, 0.30, 0.15, 0.50])
    assert observed[0] == 0
    assert chi_square(observed.double(), (kept / kept.sum()).double()) < 25  # df = 2


def test_temperature_applies_before_top_p_and_the_kept_tokens_keep_their_odds():
    assert support(top_p=0.7) == {3, 1}  # at T = 1 token 2 starts at mass 0.8
    # At T = 2 the probabilities go as sqrt(PROBS): token 2 starts at mass 0.673 < 0.7 and stays.
    rows = [row(seed=s, temperature=2.0, top_p=0.7) for s in range(4000)]
    observed = counts_of(LOGITS, rows)
    hot = torch.softmax(LOGITS.double() / 2.0, dim=-1)
    kept = hot * torch.tensor([0.0, 1.0, 1.0, 1.0], dtype=torch.float64)
    assert observed[0] == 0
    assert chi_square(observed.double(), kept / kept.sum()) < 25  # df = 2
    # The untempered odds of the same tokens fail the same bound.
    untempered = PROBS.double() * torch.tensor([0.0, 1.0, 1.0, 1.0], dtype=torch.float64)
    assert chi_square(observed.double(), untempered / untempered.sum()) > 100


# --- penalties --------------------------------------------------------------


def test_repetition_penalty_hand_computed():
    x = torch.tensor([[2.0, -1.0, 0.5, 3.0, 0.0, -4.0]])
    r = row(prompt=[0, 1, 1], output=[4, 5], repetition_penalty=2.0)
    got = _apply_penalties(x, [r])
    # Seen ids 0, 1, 4, 5 once each however often they occur: positive halved, negative doubled.
    assert got.tolist() == [[1.0, -2.0, 0.5, 3.0, 0.0, -8.0]]


def test_frequency_and_presence_penalties_hand_computed():
    x = torch.tensor([[2.0, -1.0, 0.5, 3.0, 0.0]])
    r = row(prompt=[0, 1], output=[3, 3, 2, 3], frequency_penalty=0.5, presence_penalty=1.0)
    got = _apply_penalties(x, [r])
    # Prompt ids are not penalised; 3 seen 3 times: 3 - (1.5 + 1); 2 once: 0.5 - (0.5 + 1).
    assert got.tolist() == [[2.0, -1.0, -1.0, 0.5, 0.0]]
    # Negative penalties encourage.
    r = row(output=[1], frequency_penalty=-2.0, presence_penalty=-0.5)
    assert _apply_penalties(x, [r]).tolist() == [[2.0, 1.5, 0.5, 3.0, 0.0]]


def test_repetition_then_frequency_order_and_batched_rows():
    x = torch.tensor([[2.0, -1.0, 0.5, 3.0], [1.0, 1.0, 1.0, 1.0], [4.0, -2.0, 0.0, 1.0]])
    rows = [
        row(prompt=[3], output=[3], repetition_penalty=2.0, frequency_penalty=1.0),
        row(prompt=[0], output=[1, 1]),  # no penalties: unchanged
        row(prompt=[1, 99], output=[0, -1], presence_penalty=0.25, repetition_penalty=0.5),  # out-of-vocab ids ignored
    ]
    got = _apply_penalties(x, rows)
    assert got.tolist() == [
        [2.0, -1.0, 0.5, 3.0 / 2 - 1.0],
        [1.0, 1.0, 1.0, 1.0],
        [4.0 / 0.5 - 0.25, -2.0 * 0.5, 0.0, 1.0],
    ]


def test_repetition_penalty_matches_transformers():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    logits = rand_logits(3, 64, 3)
    histories = [([1, 5, 9, 5], [12, 1, 40]), ([0, 63], []), ([2] * 10, [3, 3, 3])]
    for penalty in (1.3, 0.7, 2.0):
        rows = [row(prompt=p, output=o, repetition_penalty=penalty) for p, o in histories]
        processor = RepetitionPenaltyLogitsProcessor(penalty=penalty)
        for i, (p, o) in enumerate(histories):
            expected = processor(torch.tensor([p + o]), logits[i : i + 1].clone())
            assert torch.equal(_apply_penalties(logits[i : i + 1], rows[i : i + 1]), expected)
        # Batched, with the ids of each row only affecting that row.
        got = _apply_penalties(logits, rows)
        for i, (p, o) in enumerate(histories):
            expected = processor(torch.tensor([p + o]), logits[i : i + 1].clone())
            assert torch.equal(got[i : i + 1], expected)


def test_penalties_steer_greedy_and_sampling():
    logits = torch.tensor([[3.0, 2.5, 0.0, -1.0]])
    assert sample(logits, [row(temperature=0.0)]).token_ids == [0]
    assert sample(logits, [row(temperature=0.0, prompt=[0], repetition_penalty=1.5)]).token_ids == [1]
    assert sample(logits, [row(temperature=0.0, prompt=[0], frequency_penalty=1.0)]).token_ids == [0]  # prompt only
    assert sample(logits, [row(temperature=0.0, output=[0], presence_penalty=0.6)]).token_ids == [1]
    assert sample(logits, [row(temperature=0.0, output=[0, 0, 1], frequency_penalty=1.0)]).token_ids == [1]
    # Sampling sees the penalised logits too: a huge penalty on 0 and 1 leaves 2 on top.
    rows = [row(seed=s, output=[0, 1], presence_penalty=2.0, frequency_penalty=2.0, top_k=1) for s in range(20)]
    assert set(sample(logits.expand(20, -1), rows).token_ids) == {2}


def test_input_logits_untouched():
    logits = rand_logits(4, 50, 4, torch.float32)
    before = logits.clone()
    rows = [
        row(seed=0, prompt=[1, 2], output=[3], repetition_penalty=1.5, frequency_penalty=1.0, temperature=0.0),
        row(seed=1, output=[3], presence_penalty=1.0, temperature=0.7, top_p=0.9, min_p=0.05, top_k=5),
        row(seed=2, logprobs=3),
        row(seed=3, temperature=0.0),
    ]
    sample(logits, rows)
    assert torch.equal(logits, before)


# --- seeded draws -----------------------------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
def test_empirical_distribution_matches_softmax(temperature):
    logits = torch.tensor([1.0, 0.2, -0.5, 2.0, 0.0, -3.0])
    n = 6000
    rows = [row(seed=s, output=[0] * (s % 7), temperature=temperature) for s in range(n)]
    observed = counts_of(logits, rows).double()
    expected = torch.softmax(logits.double() / temperature, dim=-1)
    # df = 5: the 99.999th percentile is about 28; the seeds are fixed, so this cannot flake.
    assert chi_square(observed, expected) < 28
    # And a distribution far from it fails the same bound.
    assert chi_square(observed, torch.full((6,), 1 / 6, dtype=torch.float64)) > 100


def test_low_precision_logits_sample_the_float32_distribution():
    logits = torch.tensor([1.0, 0.2, -0.5, 2.0], dtype=torch.bfloat16)
    rows = [row(seed=s, temperature=1.0) for s in range(4000)]
    observed = counts_of(logits, rows).double()
    assert chi_square(observed, torch.softmax(logits.double(), dim=-1)) < 25


def run_sequence(target: SamplingRow, steps: int, vocab: int, batch_with: int, position: int, noise_seed: int):
    """Sample `steps` tokens for target, optionally amid batch_with other random rows, with fresh logits each step."""
    tokens = []
    others = [
        row(
            seed=1000 + j,
            prompt=[j, j + 1],
            temperature=[0.0, 0.8, 1.2, 1.0][j % 4],
            top_p=[1.0, 0.9, 0.5, 1.0][j % 4],
            top_k=[0, 5, 0, 40][j % 4],
            min_p=[0.0, 0.0, 0.1, 0.02][j % 4],
            repetition_penalty=[1.0, 1.2, 1.0, 0.9][j % 4],
            frequency_penalty=[0.0, 0.5, -0.3, 0.0][j % 4],
            logprobs=[None, 2, None, 0][j % 4],
        )
        for j in range(batch_with)
    ]
    g_other = torch.Generator().manual_seed(noise_seed)
    for step in range(steps):
        target_logits = rand_logits(1, vocab, 10_000 + step)  # the "model": same logits per step in every run
        other_logits = torch.randn(batch_with, vocab, generator=g_other) * 3
        logits = torch.cat([other_logits[:position], target_logits, other_logits[position:]])
        batch = others[:position] + [target] + others[position:]
        torch.manual_seed(step * 7919 + noise_seed)  # global RNG state must not matter
        token = sample(logits, batch).token_ids[position]
        target.output_token_ids.append(token)
        tokens.append(token)
        for j, o in enumerate(others):
            o.output_token_ids.append(j)
    return tokens


TARGETS = [
    dict(temperature=1.0),
    dict(temperature=0.8, top_p=0.9, top_k=50),
    dict(temperature=1.3, min_p=0.05, repetition_penalty=1.2, frequency_penalty=0.4, presence_penalty=0.3),
]


@pytest.mark.parametrize("params", TARGETS)
def test_seeded_sampling_is_batch_invariant(params):
    vocab, steps = 257, 30
    alone = run_sequence(row(seed=42, prompt=[1, 2, 3], **params), steps, vocab, 0, 0, 1)
    for batch_with, position, noise_seed in ((8, 0, 2), (8, 5, 3), (8, 8, 4)):
        amid = run_sequence(row(seed=42, prompt=[1, 2, 3], **params), steps, vocab, batch_with, position, noise_seed)
        assert amid == alone
    other_seed = run_sequence(row(seed=43, prompt=[1, 2, 3], **params), steps, vocab, 0, 0, 1)
    assert other_seed != alone
    assert len(set(alone)) > 5  # really sampling, not stuck on one token


def test_row_seed_mixes():
    seeds = {row_seed(s, t) for s in range(50) for t in range(50)}
    assert len(seeds) == 2500
    assert all(0 <= s < 2**64 for s in seeds)
    assert len({s & 0xFFFFFFFF for s in seeds}) == 2500  # the CPU generator uses only the low 32 bits
    assert row_seed(-1, 0) == row_seed(2**64 - 1, 0)
    assert row_seed(2**70 + 5, 3) == row_seed(5, 3)


def test_global_rng_untouched():
    logits = rand_logits(4, 100, 5)
    rows = [row(seed=i, temperature=1.0, top_p=0.9) for i in range(4)]
    state = torch.get_rng_state()
    sample(logits, rows)
    assert torch.equal(torch.get_rng_state(), state)


_CHILD = """
import torch
from shared.engine.sampler import SamplingRow, sample
from shared.engine.sampling_params import SamplingParams
g = torch.Generator().manual_seed(11)
logits = torch.randn(3, 1000, generator=g) * 2
rows = [SamplingRow(SamplingParams(temperature=1.0, top_p=0.95), seed=s, prompt_token_ids=[], output_token_ids=[0] * s)
        for s in (5, 6, 7)]
print(sample(logits, rows).token_ids)
"""


def test_same_tokens_in_another_process():
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(3, 1000, generator=g) * 2
    rows = [row(seed=s, output=[0] * s, temperature=1.0, top_p=0.95) for s in (5, 6, 7)]
    here = sample(logits, rows).token_ids
    child = subprocess.run(
        [sys.executable, "-c", _CHILD], cwd=REPO, capture_output=True, text=True, timeout=60, check=True
    )
    assert child.stdout.strip() == str(here)


# --- logprobs ---------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_are_raw_log_softmax(dtype):
    logits = rand_logits(5, 80, 6, dtype)
    rows = [
        row(seed=0, logprobs=5, temperature=0.0),
        row(seed=1, logprobs=None, temperature=1.0),
        row(seed=2, logprobs=0, temperature=0.5, top_k=3),
        row(seed=3, logprobs=20, temperature=1.0, repetition_penalty=1.5, prompt=list(range(40)), output=[50]),
        row(seed=4, logprobs=3, temperature=0.0, frequency_penalty=2.0, presence_penalty=2.0, output=[int(logits[4].argmax())]),
    ]
    out = sample(logits, rows)
    reference = torch.log_softmax(logits.float(), dim=-1)
    assert out.logprobs[1] is None
    for i, n in ((0, 5), (2, 0), (3, 20), (4, 3)):
        lp = out.logprobs[i]
        token = out.token_ids[i]
        assert lp.token_id == token
        assert lp.logprob == pytest.approx(reference[i, token].item(), abs=1e-6)
        assert len(lp.top) == n
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True)
        expected_top = torch.topk(reference[i], n).values.tolist() if n else []
        assert values == pytest.approx(expected_top, abs=1e-6)
        for token_id, value in lp.top:
            assert value == pytest.approx(reference[i, token_id].item(), abs=1e-6)
    # Greedy without penalties: the sampled token is the best one.
    assert out.logprobs[0].top[0] == (out.token_ids[0], out.logprobs[0].logprob)
    # Penalised greedy picked something other than the raw best, reported with its raw logprob.
    assert out.token_ids[4] != int(logits[4].argmax())
    assert math.isclose(sum(math.exp(v) for v in reference[3].tolist()), 1.0, rel_tol=1e-5)


def test_logprobs_larger_than_vocab():
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    out = sample(logits, [row(logprobs=20, temperature=0.0)])
    assert [t for t, _ in out.logprobs[0].top] == [2, 1, 0]


def test_logit_bias_is_added_before_greedy_and_sampled_choices_and_logprobs_stay_the_models():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    assert sample(logits, [row(temperature=0.0)]).token_ids == [0]
    assert sample(logits, [row(temperature=0.0, logit_bias={1: 1.5})]).token_ids == [1]
    assert sample(logits, [row(temperature=0.0, logit_bias={0: -100.0, 1: -100.0})]).token_ids == [2]
    draws = sample(logits.expand(200, -1), [row(seed=i, temperature=1.0, logit_bias={3: -100.0}) for i in range(200)])
    assert 3 not in draws.token_ids and len(set(draws.token_ids)) == 3
    out = sample(logits, [row(temperature=0.0, logit_bias={1: 1.5}, logprobs=1)])
    assert out.logprobs[0].logprob == pytest.approx(torch.log_softmax(logits[0], -1)[1].item())


def test_suppressed_tokens_are_never_drawn_and_a_row_leaves_the_others_alone():
    logits = rand_logits(3, 50, seed=4)
    favourite = int(logits[1].argmax())
    rows = [row(temperature=0.0), row(temperature=0.0), row(seed=9, temperature=1.0)]
    rows[1].suppressed = (favourite,)
    rows[2].suppressed = tuple(range(49))  # everything but the last token
    out = sample(logits, rows)
    assert out.token_ids[0] == int(logits[0].argmax())
    assert out.token_ids[1] != favourite and out.token_ids[1] == int(logits[1].clone().index_fill_(0, torch.tensor(
        [favourite]), float("-inf")).argmax())
    assert out.token_ids[2] == 49


def test_min_tokens_suppresses_eos_and_stop_tokens_until_enough_are_out():
    params = SamplingParams(min_tokens=3, stop_token_ids=[7])
    assert params.suppressed_token_ids(0, {2}) == (2, 7)
    assert params.suppressed_token_ids(2, {2}) == (2, 7)
    assert params.suppressed_token_ids(3, {2}) == ()
    assert SamplingParams(min_tokens=3, ignore_eos=True).suppressed_token_ids(0, {2}) == ()


def test_bench_sampler_runs_at_tiny_size(tmp_path):
    import json

    from loadtest.bench_sampler import main

    output = tmp_path / "sampler.json"
    assert main(["--vocab", "500", "--batches", "1,4", "--repeats", "2", "--output", str(output)]) == 0
    batches = json.loads(output.read_text())["batches"]
    assert [b["batch"] for b in batches] == [1, 4] and all(b["noise_uniform_log_ms"] > 0 for b in batches)


def test_a_sure_token_is_drawn_even_where_the_uniform_draw_is_zero():
    """The race's noise is -log(1 - U): finite for every U in [0, 1). (As -log(U), a U of exactly 0, drawn here at
    seed 2, made the sure token's score 0 and argmax picked token 0.)"""
    probs = torch.zeros(1, 49152)
    probs[0, 569] = 1.0
    for seed in range(4):
        row = SamplingRow(SamplingParams(temperature=1.0), seed, [1], [])
        assert sample(torch.log(probs), [row]).token_ids == [569]
