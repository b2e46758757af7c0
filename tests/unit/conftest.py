import pytest
import torch


@pytest.fixture(scope="module")
def one_torch_thread():
    """The models in tests are tiny: extra threads only add spin-wait stalls on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def needs_nixl() -> None:
    """NIXL with a UCX backend: the test fails without it under CI and skips elsewhere."""
    from tests.requirements import require_nixl

    require_nixl()
