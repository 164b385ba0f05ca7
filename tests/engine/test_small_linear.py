"""The native small-rows linear (`kernels/small_linear.c`) against torch: every row count, odd widths (the masked
tail of a row), with and without bias, on 1-3 threads, float32 and bfloat16, both the AVX-512 path (where built)
and the portable one."""

import pytest
import torch

from shared.engine.kernels import bf16_flag, native_library
from support.kernels import needs_native

pytestmark = needs_native("small_linear")


def _small_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, threads: int,
                  portable: bool) -> torch.Tensor:
    library = native_library("small_linear")
    function = library.small_linear_portable if portable else library.small_linear
    y = torch.full((x.shape[0], weight.shape[0]), float("nan"), dtype=x.dtype)
    function(x.data_ptr(), x.shape[0], x.shape[1], weight.data_ptr(), None if bias is None else bias.data_ptr(),
             y.data_ptr(), weight.shape[0], bf16_flag(x), threads)
    return y


SHAPES = [(1, 576, 960), (2, 64, 200), (3, 17, 33), (4, 1536, 576), (5, 15, 7), (9, 48, 100), (1, 1, 1), (7, 100, 16),
          (2, 33, 40)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("portable", [False, True])
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("rows,in_features,out_features", SHAPES)
def test_small_linear_matches_torch(dtype, portable, threads, rows, in_features, out_features):
    generator = torch.Generator().manual_seed(rows * 1000 + in_features)
    x = torch.randn(rows, in_features, generator=generator).to(dtype)
    weight = torch.randn(out_features, in_features, generator=generator).to(dtype)
    bias = torch.randn(out_features, generator=generator).to(dtype)
    exact = x.double() @ weight.double().t()  # of the stored values; the kernel sums in float32
    # float32: the summation order's last bits; bfloat16: the output's rounding (one unit in the last place)
    tolerance = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=8e-3, atol=1e-2)
    torch.testing.assert_close(_small_linear(x, weight, None, threads, portable).double(), exact, **tolerance)
    torch.testing.assert_close(_small_linear(x, weight, bias, threads, portable).double(), exact + bias.double(),
                               **tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_both_paths_give_the_same_bits_on_any_number_of_threads(dtype):
    """Each output is one thread's dot product: the split over threads never changes a result."""
    generator = torch.Generator().manual_seed(7)
    x, weight = torch.randn(3, 577, generator=generator).to(dtype), torch.randn(130, 577, generator=generator).to(dtype)
    for portable in (False, True):
        one = _small_linear(x, weight, None, 1, portable)
        for threads in (2, 3, 5):
            assert torch.equal(_small_linear(x, weight, None, threads, portable), one)
