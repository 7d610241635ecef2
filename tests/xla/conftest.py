"""tests/xla run where torch-xla is installed (the XLA CI step, ``.ci/xla``); elsewhere every module skips itself
(``pytest.importorskip`` at its top).

torch-xla runs on its CPU device here (``PJRT_DEVICE=CPU``), the device every test moves its tensors to.
"""
import os

import pytest

os.environ.setdefault("PJRT_DEVICE", "CPU")


@pytest.fixture(scope="session")
def xla_device():
    import torch_xla
    return torch_xla.device()
