"""Linear layers in both float32 layouts and the native small-rows kernel: the same products every way, and the
choice of kernel per number of rows made per CPU."""

import pytest
import torch

from shared.engine.packed_linear import (FLOAT32_PACKED_MIN_ROWS, NATIVE_MAX_ROWS_ENV, PACKED_MIN_ROWS_ENV, LinearLayouts,
                                         PackedLinear, packs_on_cpu, tune_linear_layouts)
from support.kernels import needs_native, require_native

pytestmark = pytest.mark.skipif(not packs_on_cpu(torch.float32), reason="no oneDNN packing on this CPU")


def _linears(seed: int = 0) -> list[PackedLinear]:
    generator = torch.Generator().manual_seed(seed)
    shapes = [(96, 64, True), (64, 96, False), (200, 64, False)]
    return [PackedLinear(torch.randn(out, inp, generator=generator),
                         torch.randn(out, generator=generator) if bias else None) for out, inp, bias in shapes]


@pytest.mark.parametrize("forced,native", [("1", "0"), ("2", "0"), ("4", "0"), ("4", "3"), ("2", "1"), ("1", "9")])
def test_every_layout_choice_computes_the_same_products(monkeypatch, forced, native):
    if native != "0":
        require_native("small_linear")
    monkeypatch.setenv(PACKED_MIN_ROWS_ENV, forced)
    monkeypatch.setenv(NATIVE_MAX_ROWS_ENV, native)
    linears = _linears()
    references = [(lin.plain.t().clone(), lin.bias) for lin in linears]
    assert tune_linear_layouts(linears) == LinearLayouts(int(native), int(forced))
    for lin, (weight, bias) in zip(linears, references):
        assert (lin.plain is None) == (forced == "1" and native == "0")  # the plain copy only serves some rows
        for rows in (0, 1, 2, 3, 4, 9, 17):  # 0: a pipeline stage's step that samples nothing
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
    monkeypatch.setenv(NATIVE_MAX_ROWS_ENV, "0")
    timed_rows = []

    def best_time(linears, inputs, layout, repeats=3, native=None):  # plain takes 10 ms at every row count
        rows = next(iter(inputs.values())).shape[0]
        timed_rows.append(rows)
        return (packed_ms[rows] if layout == "packed" else 10.0) / 1e3

    monkeypatch.setattr(packed_linear, "_best_time", best_time)
    linears = _linears()
    assert tune_linear_layouts(linears) == LinearLayouts(0, expected)
    assert {lin.packed_min_rows for lin in linears} == {0 if expected == 1 else expected}
    assert all((lin.plain is None) == (expected == 1) for lin in linears)
    assert timed_rows[:2] == [1, 1]


@pytest.mark.parametrize("native_ms, expected_native, expected_packed", [
    ({1: 5.0, 2: 5.0, 3: 12.0, 4: 12.0}, 2, 3),  # faster for 1-2 rows (plain kept for it), packed from the next
    ({1: 5.0, 2: 12.0, 3: 5.0, 4: 5.0}, 1, 2),   # the first loss ends it
    ({1: 9.8, 2: 5.0, 3: 5.0, 4: 5.0}, 0, 1),    # within the margin at one row: never (and plain dropped)
    ({1: 5.0, 2: 5.0, 3: 5.0, 4: 5.0, 6: 5.0, 8: 5.0}, 8, 9),  # every count tried: packed past them
    ({1: 5.0, 2: 5.0, 3: 5.0, 4: 5.0, 6: 5.0, 8: 12.0}, 6, 7),  # up to 6, and 7 with them (not timed)
])
def test_the_native_kernel_serves_the_rows_up_to_its_first_loss(monkeypatch, native_ms, expected_native,
                                                                expected_packed):
    import shared.engine.packed_linear as packed_linear

    require_native("small_linear")
    monkeypatch.delenv(PACKED_MIN_ROWS_ENV, raising=False)
    monkeypatch.delenv(NATIVE_MAX_ROWS_ENV, raising=False)

    def best_time(linears, inputs, layout, repeats=3, native=None):  # packed 10 ms, plain 20 ms at every count
        # (packed faster than plain at every count: it serves from the first row the native kernel does not)
        rows = next(iter(inputs.values())).shape[0]
        return {"packed": 10.0, "plain": 20.0, "native": native_ms.get(rows)}[layout] / 1e3

    monkeypatch.setattr(packed_linear, "_best_time", best_time)
    linears = _linears()
    assert tune_linear_layouts(linears) == LinearLayouts(expected_native, expected_packed)
    for lin in linears:
        assert lin.native_max_rows == expected_native
        assert (lin.plain is not None) == (expected_native > 0)


def test_the_timing_runs_on_this_cpu(monkeypatch):
    monkeypatch.delenv(PACKED_MIN_ROWS_ENV, raising=False)
    monkeypatch.delenv(NATIVE_MAX_ROWS_ENV, raising=False)
    layouts = tune_linear_layouts(_linears())
    assert layouts.native_max_rows in (0, 1, 2, 3, 4, 6, 8)
    assert layouts.packed_min_rows in (1, 2, 3, 4, 5, 7, 9) and layouts.packed_min_rows > layouts.native_max_rows


@pytest.mark.parametrize("variable", [PACKED_MIN_ROWS_ENV, NATIVE_MAX_ROWS_ENV])
def test_a_bad_forced_value_is_a_clear_error(monkeypatch, variable):
    monkeypatch.setenv(variable, "auto")
    with pytest.raises(ValueError, match=variable):
        tune_linear_layouts(_linears())


def test_linears_without_both_layouts_are_left_alone(monkeypatch):
    monkeypatch.setenv(PACKED_MIN_ROWS_ENV, "1")
    monkeypatch.setenv(NATIVE_MAX_ROWS_ENV, "0")
    packed_only = _linears()
    tune_linear_layouts(packed_only)  # one row packed, no native rows: the plain copies are dropped
    assert tune_linear_layouts(packed_only) is None and tune_linear_layouts([]) is None


@pytest.mark.skipif(not packs_on_cpu(torch.bfloat16), reason="torch cannot pack bfloat16 weights on this CPU")
@needs_native("small_linear")
@pytest.mark.parametrize("native", ["0", "2", None])
def test_bfloat16_linears_are_packed_but_for_the_native_kernels_rows(monkeypatch, native):
    monkeypatch.delenv(PACKED_MIN_ROWS_ENV, raising=False)
    if native is None:
        monkeypatch.delenv(NATIVE_MAX_ROWS_ENV, raising=False)  # timed on this CPU
    else:
        monkeypatch.setenv(NATIVE_MAX_ROWS_ENV, native)
    generator = torch.Generator().manual_seed(3)
    linears = [PackedLinear(torch.randn(out, inp, generator=generator).bfloat16(),
                            torch.randn(out, generator=generator).bfloat16() if bias else None)
               for out, inp, bias in [(96, 64, True), (64, 96, False)]]
    references = [(lin.plain.t().clone(), lin.bias) for lin in linears]
    layouts = tune_linear_layouts(linears)
    assert layouts.packed_min_rows == layouts.native_max_rows + 1  # no plain GEMM rows in bfloat16
    if native is not None:
        assert layouts.native_max_rows == int(native)
    for lin, (weight, bias) in zip(linears, references):
        assert (lin.plain is None) == (layouts.native_max_rows == 0)
        for rows in (1, 2, 3, 9):
            x = torch.randn(rows, lin.in_features).bfloat16()
            expected = x.float() @ weight.float().t() + (bias.float() if bias is not None else 0)
            torch.testing.assert_close(lin(x).float(), expected, rtol=2e-2, atol=5e-2)
