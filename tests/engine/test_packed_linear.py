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


def test_the_choice_is_timed_on_this_cpu_and_applies_to_every_linear(monkeypatch):
    monkeypatch.delenv(PACKED_MIN_ROWS_ENV, raising=False)
    linears = _linears()
    chosen = tune_float32_layouts(linears)
    assert chosen in (1, 2, 3, FLOAT32_PACKED_MIN_ROWS)
    assert {lin.packed_min_rows for lin in linears} == {0 if chosen == 1 else chosen}


def test_linears_without_both_layouts_are_left_alone():
    bf16 = PackedLinear(torch.randn(8, 8, dtype=torch.bfloat16))
    assert tune_float32_layouts([bf16]) is None and tune_float32_layouts([]) is None
