import pytest
import torch


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Small tensors on a loaded 2-core machine: torch's intra-op threads only wait on each other (measured 100x
    slower for the mask checks here). The spawned ranks get one thread each from run_local."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
