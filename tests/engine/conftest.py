import pytest
import torch


@pytest.fixture
def torch_threads(request):
    """torch's thread count set to the test's parameter (`indirect=True`) for the test, and restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)
