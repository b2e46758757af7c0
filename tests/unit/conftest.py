import pytest
import torch


@pytest.fixture(scope="module")
def one_torch_thread():
    """The models in tests are tiny: extra threads only add spin-wait stalls on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
