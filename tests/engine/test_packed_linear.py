"""Linear layers in both float32 layouts: the same products either way, and the layout choice made per CPU."""

import pytest
import torch

from shared.engine.packed_linear import (FLOAT32_PACKED_MIN_ROWS, PACKED_MIN_ROWS_ENV, PackedLinear, packs_on_cpu,
                                         tune_float32_layouts)

pytestmark = pytest.mark.skipif(not packs_on_cpu(torch.float32), reason="no oneDNN packing on this CPU")


def _linears(seed: int = 0) -> list[PackedLinear]:
    generator = torch.Generator().manual_seed(seed)
    shapes = [(96, 64, True), (64, 96, False), (200, 64, False)]
    return [PackedLinear(torch.randn(out, inp, generator=generator),
                         torch.randn(out, generator=generator) if bias else None) for out, inp, bias in shapes]


@pytest.mark.parametrize("forced", ["1", "2", "4"])
def test_every_layout_choice_computes_the_same_products(monkeypatch, forced):
    monkeypatch.setenv(PACKED_MIN_ROWS_ENV, forced)
    linears = _linears()
    references = [(lin.plain.t().clone(), lin.bias) for lin in linears]
    assert tune_float32_layouts(linears) == int(forced)
    for lin, (weight, bias) in zip(linears, references):
        assert (lin.plain is None) == (forced == "1")  # one row packed: the plain copy is not kept
        for rows in (1, 2, 3, 4, 9):
            x = torch.randn(rows, lin.in_features)
            expected = x @ weight.t() + (bias if bias is not None else 0)
            torch.testing.assert_close(lin(x), expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("packed_ms, expected", [
    ({1: 5.0, 2: 5.0, 3: 5.0}, 1),  # packed faster from one row: the plain copy goes
    ({1: 11.0, 2: 10.0, 3: 9.0}, 3),  # plain faster below 3 rows
    ({1: 10.0, 2: 9.8, 3: 9.7}, FLOAT32_PACKED_MIN_ROWS),  # within the margin: a tie keeps plain
    ({1: 20.0, 2: 20.0, 3: 20.0}, FLOAT32_PACKED_MIN_ROWS),
])
def test_the_fewest_rows_from_which_packed_is_faster_are_chosen_for_every_linear(monkeypatch, packed_ms, expected):
    import shared.engine.packed_linear as packed_linear

    monkeypatch.delenv(PACKED_MIN_ROWS_ENV, raising=False)
    timed_rows = []

    def best_time(linears, inputs, packed, repeats=3):  # plain takes 10 ms at every row count
        rows = next(iter(inputs.values())).shape[0]
        timed_rows.append(rows)
        return (packed_ms[rows] if packed else 10.0) / 1e3

    monkeypatch.setattr(packed_linear, "_best_time", best_time)
    linears = _linears()
    assert tune_float32_layouts(linears) == expected
    assert {lin.packed_min_rows for lin in linears} == {0 if expected == 1 else expected}
    assert all((lin.plain is None) == (expected == 1) for lin in linears)
    assert timed_rows[:2] == [1, 1]


def test_the_timing_runs_on_this_cpu(monkeypatch):
    monkeypatch.delenv(PACKED_MIN_ROWS_ENV, raising=False)
    assert tune_float32_layouts(_linears()) in (1, 2, 3, FLOAT32_PACKED_MIN_ROWS)


def test_a_bad_forced_value_is_a_clear_error(monkeypatch):
    monkeypatch.setenv(PACKED_MIN_ROWS_ENV, "auto")
    with pytest.raises(ValueError, match=PACKED_MIN_ROWS_ENV):
        tune_float32_layouts(_linears())


def test_linears_without_both_layouts_are_left_alone():
    bf16 = PackedLinear(torch.randn(8, 8, dtype=torch.bfloat16))
    assert tune_float32_layouts([bf16]) is None and tune_float32_layouts([]) is None
