import pytest
import torch


@pytest.fixture
def torch_threads(request):
    """torch's thread count set to the test's parameter (`indirect=True`) for the test, and restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.fixture
def one_torch_thread():
    """Torch on one thread: beside other busy processes, two threads per process on a small machine ran the
    real-model tests ten times slower (100 s instead of 10 s); one thread is as exact and fast enough for 135M
    parameters."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
